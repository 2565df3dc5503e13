"""`spotrl secrets OUT`: the credentials of a Docker Compose or Swarm deployment, one file per
service, so that each container gets its own and nothing more (issue 41, least privilege).

OUT (0700, every file in it 0600) holds:
- `redis/users.acl`: Redis's users (a user per role, the default user off), hashed. Compose
  mounts `redis/` read-write: the coordinator mints a user per rollout worker and ACL SAVE
  rewrites the file by a rename in that folder.
- `<service>.env` for coordinator, trainer, weightstore, rollout (Compose's `env_file:`): the
  token the service sends, the tokens it accepts (by SHA-256), its Redis URL with its role's
  user (none for rollout: a worker gets a user of its own when it registers), and with TLS the
  certificate paths as the containers see them. A rollout worker's file holds no admin or
  trainer token and no Redis password.
- `redis.env`: the read-only user and password Redis's healthcheck logs in with.
- `admin.env`: for the CLI (`set -a; . OUT/admin.env; set +a`): SPOTRL_API_TOKEN, the admin
  token it sends ($SPOTRL_API_TOKEN's own when that is set), and with TLS SPOTRL_TLS_CA_FILE.
- with `--tls`, `tls/ca.crt`, `tls/tls.crt`, `tls/tls.key`: a throwaway CA and a certificate for
  the hosts given (services.cli.certs); the Swarm stack hands them to the containers as secrets.

It writes files and starts nothing; it never overwrites an earlier folder without `--force`.
"""

import argparse
import os
import re
import shutil
import sys
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from services.cli.environment import TOKEN_VARIABLE
from services.infra.settings import CommonSettings, env_name
from services.infra.tls import TlsFiles

if TYPE_CHECKING:  # the parser imports this module: credentials only when a command runs
    from services.cli.credentials import Credentials

SERVICES = ("coordinator", "trainer", "weightstore", "rollout")
DEFAULT_REDIS_URL = "redis://redis:6379/0"  # Redis on Compose's network
ACL_FILE = Path("redis") / "users.acl"
ENV_FILES = (*(f"{s}.env" for s in SERVICES), "redis.env", "admin.env")
TLS_DIR = Path("tls")
TLS_NAMES = {"ca": "ca.crt", "cert": "tls.crt", "key": "tls.key"}
# where the containers find the TLS files: docker-compose.swarm.yml mounts them there as secrets
TLS_MOUNT = TlsFiles(
    cert=Path("/run/secrets/spotrl-tls.crt"),
    key=Path("/run/secrets/spotrl-tls.key"),
    ca=Path("/run/secrets/spotrl-ca.crt"),
)
CA_VARIABLE = env_name(CommonSettings, "tls_ca_file")  # the CLI's clients read it too
HEALTH_ROLE = "reader"  # Redis's healthcheck logs in as the read-only role
# characters an env file value may hold: read the same by Compose (which would expand a `$`),
# `docker run --env-file` (which keeps quotes) and a shell's `.`
PLAIN_VALUE = re.compile(r"[A-Za-z0-9_.:/@,%+=~-]*")
FILE_MODE = 0o600
DIR_MODE = 0o700


class SecretsExist(RuntimeError):
    """OUT already holds secrets (the message names one); `--force` replaces them."""


def env_files(
    credentials: "Credentials", redis_url: str, host_ca: Path | None = None
) -> dict[str, dict[str, str]]:
    """Each env file's name and variables: pure, nothing written. `host_ca`: TLS is on, and
    the CLI on this host checks the services against this CA file."""
    from services.cli.credentials import tls_env, with_scheme
    from services.contracts.access import USER_PREFIX

    parts = urlsplit(redis_url)
    if parts.scheme not in ("redis", "rediss") or not parts.hostname:
        raise ValueError(f"--redis-url: not a redis:// URL: {redis_url}")
    if parts.username or parts.password:
        raise ValueError("--redis-url: no credentials in it: each service gets its own user")
    if host_ca is not None:
        redis_url = with_scheme(redis_url, "rediss")
    files = {}
    for service in SERVICES:
        env = credentials.service_env(service, redis_url)
        files[f"{service}.env"] = env | (tls_env(TLS_MOUNT) if host_ca else {})
    files["redis.env"] = {
        "REDIS_HEALTH_USER": f"{USER_PREFIX}{HEALTH_ROLE}",
        "REDISCLI_AUTH": credentials.redis_passwords[HEALTH_ROLE],  # redis-cli reads it
    }
    files["admin.env"] = {TOKEN_VARIABLE: credentials.admin_token}
    if host_ca is not None:
        files["admin.env"][CA_VARIABLE] = str(host_ca)
    return files


def env_text(env: dict[str, str]) -> str:
    """`KEY=VALUE` lines; ValueError for a value that one of the readers would change."""
    for key, value in env.items():
        if not PLAIN_VALUE.fullmatch(value):
            raise ValueError(f"{key}: the value has a character an env file cannot hold as is")
    return "".join(f"{key}={value}\n" for key, value in env.items())


def existing(out: Path) -> list[Path]:
    """The secrets of an earlier `spotrl secrets` in `out`."""
    names: list[str | Path] = [*ENV_FILES, ACL_FILE.parent, TLS_DIR]
    return [out / n for n in names if (out / n).exists() or (out / n).is_symlink()]


def write_secrets(
    out: Path,
    credentials: "Credentials",
    redis_url: str = DEFAULT_REDIS_URL,
    hosts: tuple[str, ...] = (),
    force: bool = False,
) -> list[Path]:
    """Write the folder (TLS files too when `hosts` are given); the paths written.
    SecretsExist when `out` holds secrets already and not `force`."""
    host_ca = (out / TLS_DIR / TLS_NAMES["ca"]).absolute() if hosts else None
    files = env_files(credentials, redis_url, host_ca)
    texts = {name: env_text(env) for name, env in files.items()}  # refused before any change
    found = existing(out)
    if found and not force:
        raise SecretsExist(f"{found[0]} exists (--force replaces the secrets in {out})")
    for path in found:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
    make_private_dir(out)
    written = [write_private(out / name, text) for name, text in texts.items()]
    make_private_dir(out / ACL_FILE.parent)
    credentials.write_acl_file(out / ACL_FILE)
    written.append(private(out / ACL_FILE))
    if hosts:
        written += write_tls(out / TLS_DIR, hosts)
    return written


def write_tls(folder: Path, hosts: tuple[str, ...]) -> list[Path]:
    """A throwaway CA and a certificate for `hosts`, under the names the stack mounts. The CA's
    key is not kept: nothing else can be signed with it."""
    from services.cli.certs import make_certs  # cryptography: only when asked for TLS

    make_private_dir(folder)
    made = make_certs(folder, hosts)
    (folder / "ca.key").unlink(missing_ok=True)
    written = []
    for field, name in TLS_NAMES.items():
        target = folder / name
        getattr(made, field).replace(target)
        written.append(private(target))
    return written


def make_private_dir(path: Path) -> None:
    path.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
    path.chmod(DIR_MODE)  # an existing folder, or a umask that took bits away


def write_private(path: Path, text: str) -> Path:
    """`text` into a new file that only its owner can read, from its creation on."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    return path


def private(path: Path) -> Path:
    path.chmod(FILE_MODE)
    return path


def parse_hosts(text: str) -> tuple[str, ...]:
    hosts = tuple(h.strip() for h in text.split(",") if h.strip())
    if not hosts:
        raise argparse.ArgumentTypeError("no host: give a comma list, e.g. 10.0.0.10,spot1")
    return hosts


def cmd_secrets(args: argparse.Namespace) -> int:
    if args.tls != bool(args.hosts):
        print("spotrl secrets: --tls and --hosts go together", file=sys.stderr)
        return 2
    from services.cli.credentials import Credentials

    admin = os.environ.get(TOKEN_VARIABLE) or None  # a token the CLI already sends stays valid
    credentials = Credentials.make(admin)
    try:
        write_secrets(args.out, credentials, args.redis_url, args.hosts or (), args.force)
    except SecretsExist as exc:
        print(f"spotrl secrets: {exc}", file=sys.stderr)
        return 1
    except ValueError as exc:
        print(f"spotrl secrets: {exc}", file=sys.stderr)
        return 2
    origin = f"${TOKEN_VARIABLE}" if admin else "new"
    print(
        f"spotrl secrets: wrote {args.out} (admin token: {origin}; "
        f"{'TLS for ' + ','.join(args.hosts) if args.tls else 'no TLS'}). The CLI: "
        f"set -a; . {args.out / 'admin.env'}; set +a",
        file=sys.stderr,
    )
    return 0
