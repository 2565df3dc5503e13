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
- with `--tls`, `tls/ca.crt`, `tls/tls.crt`, `tls/tls.key`: the deployment's CA certificate and
  a certificate for the hosts given, valid `--valid-days`; the Swarm stack hands them to the
  containers as secrets. The CA itself (`ca/ca.crt`, `ca/ca.key`) is kept apart, mounted by no
  service: `--renew` signs a new certificate with it (services.cli.tls_folder).
- `redis.env` also holds the password of `spotrl-certs` (SPOTRL_CERTS_REDIS_AUTH), the user whose
  one right is CONFIG SET: what reloads Redis's TLS files; and those of `spotrl-replica` and
  `spotrl-sentinel` (SPOTRL_REPLICA_REDIS_AUTH, SPOTRL_SENTINEL_REDIS_AUTH), what a replica
  and Sentinel log in to the Redis nodes as (docker-compose.sentinel.yml).

It writes files and starts nothing; it never overwrites an earlier folder without `--force`.
"""

import argparse
import os
import re
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from services.cli.environment import TOKEN_VARIABLE
from services.cli.private_files import make_private_dir, private, write_private
from services.cli.tls_folder import (
    CA_DIR,
    CA_VALID_DAYS,
    SERVER_VALID_DAYS,
    TLS_DIR,
    TLS_NAMES,
)
from services.infra.sentinel_url import parse_sentinel_url
from services.infra.settings import CommonSettings, env_name
from services.infra.tls import TlsFiles

if TYPE_CHECKING:  # the parser imports this module: credentials only when a command runs
    from services.cli.credentials import Credentials

SERVICES = ("coordinator", "trainer", "weightstore", "rollout")
DEFAULT_REDIS_URL = "redis://redis:6379/0"  # Redis on Compose's network
ACL_FILE = Path("redis") / "users.acl"
ENV_FILES = (*(f"{s}.env" for s in SERVICES), "redis.env", "admin.env")
# where the containers find the TLS files: docker-compose.swarm.yml mounts them there as secrets
TLS_MOUNT = TlsFiles(
    cert=Path("/run/secrets/spotrl-tls.crt"),
    key=Path("/run/secrets/spotrl-tls.key"),
    ca=Path("/run/secrets/spotrl-ca.crt"),
)
CA_VARIABLE = env_name(CommonSettings, "tls_ca_file")  # the CLI's clients read it too
HEALTH_ROLE = "reader"  # Redis's healthcheck logs in as the read-only role
CERTS_ROLE = "certs"  # Redis's TLS reloader logs in as it (CONFIG SET only)
CERTS_AUTH_VARIABLE = "SPOTRL_CERTS_REDIS_AUTH"
CERTS_USER_VARIABLE = "SPOTRL_CERTS_REDIS_USER"
REPLICA_USER_VARIABLE, REPLICA_AUTH_VARIABLE = (
    "SPOTRL_REPLICA_REDIS_USER",
    "SPOTRL_REPLICA_REDIS_AUTH",
)
SENTINEL_USER_VARIABLE = "SPOTRL_SENTINEL_REDIS_USER"
SENTINEL_AUTH_VARIABLE = "SPOTRL_SENTINEL_REDIS_AUTH"
# characters an env file value may hold: read the same by Compose (which would expand a `$`),
# `docker run --env-file` (which keeps quotes) and a shell's `.`
PLAIN_VALUE = re.compile(r"[A-Za-z0-9_.:/@,%+=~-]*")


class SecretsExist(RuntimeError):
    """OUT already holds secrets (the message names one); `--force` replaces them."""


def env_files(
    credentials: "Credentials", redis_url: str, host_ca: Path | None = None
) -> dict[str, dict[str, str]]:
    """Each env file's name and variables: pure, nothing written. `host_ca`: TLS is on, and
    the CLI on this host checks the services against this CA file."""
    from services.cli.credentials import tls_env, with_scheme
    from services.contracts.access import USER_PREFIX

    try:
        sentinel = parse_sentinel_url(redis_url)
    except ValueError as exc:
        raise ValueError(f"--redis-url: {exc}") from None
    parts = urlsplit(redis_url)
    if sentinel is None and (parts.scheme not in ("redis", "rediss") or not parts.hostname):
        raise ValueError(f"--redis-url: not a redis:// or redis+sentinel:// URL: {redis_url}")
    if parts.username or parts.password:
        raise ValueError("--redis-url: no credentials in it: each service gets its own user")
    if host_ca is not None:
        redis_url = with_scheme(redis_url, "rediss+sentinel" if sentinel else "rediss")
    files = {}
    for service in SERVICES:
        env = credentials.service_env(service, redis_url)
        files[f"{service}.env"] = env | (tls_env(TLS_MOUNT) if host_ca else {})
    files["redis.env"] = {
        "REDIS_HEALTH_USER": f"{USER_PREFIX}{HEALTH_ROLE}",
        "REDISCLI_AUTH": credentials.redis_passwords[HEALTH_ROLE],  # redis-cli reads it
        CERTS_USER_VARIABLE: f"{USER_PREFIX}{CERTS_ROLE}",
        CERTS_AUTH_VARIABLE: credentials.redis_passwords[CERTS_ROLE],
        # with a replica and Sentinel: what a node logs in to its primary as, and Sentinel
        # to the nodes (docker-compose.sentinel.yml)
        REPLICA_USER_VARIABLE: f"{USER_PREFIX}replica",
        REPLICA_AUTH_VARIABLE: credentials.redis_passwords["replica"],
        SENTINEL_USER_VARIABLE: f"{USER_PREFIX}sentinel",
        SENTINEL_AUTH_VARIABLE: credentials.redis_passwords["sentinel"],
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
    names: list[str | Path] = [*ENV_FILES, ACL_FILE.parent, TLS_DIR, CA_DIR]
    return [out / n for n in names if (out / n).exists() or (out / n).is_symlink()]


def write_secrets(
    out: Path,
    credentials: "Credentials",
    redis_url: str = DEFAULT_REDIS_URL,
    hosts: tuple[str, ...] = (),
    force: bool = False,
    valid_days: int | None = None,
    ca_valid_days: int | None = None,
) -> list[Path]:
    """Write the folder (TLS files too when `hosts` are given: the certificate valid
    `valid_days`, by default a year, its CA `ca_valid_days`, ten); the paths written.
    SecretsExist when `out` holds secrets already and not `force`."""
    host_ca = (out / TLS_DIR / TLS_NAMES["ca"]).absolute() if hosts else None
    files = env_files(credentials, redis_url, host_ca)
    texts = {name: env_text(env) for name, env in files.items()}  # refused before any change
    days, ca_days = valid_days or SERVER_VALID_DAYS, ca_valid_days or CA_VALID_DAYS
    if hosts and days > ca_days:
        raise ValueError("--valid-days: longer than the CA's own life (--ca-valid-days)")
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
        from services.cli import tls_folder  # cryptography: only when asked for TLS

        written += tls_folder.write_tls(out, hosts, days, ca_days)
    return written


def bounded_days(most: int) -> Callable[[str], int]:
    """An argparse type: a whole number of days, 1 to `most`."""

    def parse(text: str) -> int:
        try:
            days = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number of days: {text!r}") from None
        if not 1 <= days <= most:
            raise argparse.ArgumentTypeError(f"{days}: from 1 to {most} days")
        return days

    return parse


def parse_hosts(text: str) -> tuple[str, ...]:
    hosts = tuple(h.strip() for h in text.split(",") if h.strip())
    if not hosts:
        raise argparse.ArgumentTypeError("no host: give a comma list, e.g. 10.0.0.10,spot1")
    return hosts


def cmd_secrets(args: argparse.Namespace) -> int:
    if args.renew:
        return cmd_renew(args)
    if args.tls != bool(args.hosts):
        print("spotrl secrets: --tls and --hosts go together", file=sys.stderr)
        return 2
    if not args.tls and (args.valid_days or args.ca_valid_days):
        print("spotrl secrets: --valid-days and --ca-valid-days need --tls", file=sys.stderr)
        return 2
    from services.cli.credentials import Credentials

    admin = os.environ.get(TOKEN_VARIABLE) or None  # a token the CLI already sends stays valid
    credentials = Credentials.make(admin)
    try:
        write_secrets(
            args.out,
            credentials,
            args.redis_url,
            args.hosts or (),
            args.force,
            args.valid_days,
            args.ca_valid_days,
        )
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


RENEW_NEXT = """next, by platform (docs/security.md, "Rotating the certificate"):
  Compose, hosts: nothing: the services re-read tls/ within SPOTRL_TLS_RELOAD_INTERVAL_S
  Swarm (secrets are immutable): docker secret create spotrl-tls.crt.2 {crt}; the same for the
    key; docker service update --secret-rm spotrl-tls.crt --secret-add \\
    source=spotrl-tls.crt.2,target=spotrl-tls.crt (and the key) on each service: rolling
  Kubernetes: kubectl -n NS create secret generic SECRET --from-file={ca} --from-file={crt} \\
    --from-file={key} --dry-run=client -o yaml | kubectl -n NS apply -f - (pods re-read it)"""


def cmd_renew(args: argparse.Namespace) -> int:
    """`spotrl secrets OUT --renew`: a new certificate for the same hosts from the kept CA."""
    if args.tls or args.hosts or args.force or args.ca_valid_days:
        print(
            "spotrl secrets: --renew keeps the hosts and the CA: no --tls, --hosts, --force "
            "or --ca-valid-days",
            file=sys.stderr,
        )
        return 2
    from services.cli import tls_folder

    try:
        done = tls_folder.renew_tls(args.out, args.valid_days or SERVER_VALID_DAYS)
    except tls_folder.RenewRefused as exc:
        print(f"spotrl secrets: cannot renew: {exc}", file=sys.stderr)
        return 1
    key = done.cert.with_name(TLS_NAMES["key"])
    print(
        f"spotrl secrets: renewed {done.cert} for {','.join(done.hosts)} (serial "
        f"{done.serial:x}), valid until {done.not_after:%Y-%m-%d %H:%M} UTC; tokens, passwords "
        f"and the CA unchanged\n"
        + RENEW_NEXT.format(ca=done.cert.with_name(TLS_NAMES["ca"]), crt=done.cert, key=key),
        file=sys.stderr,
    )
    return 0
