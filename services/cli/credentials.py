"""The secrets of one deployment, each service given only its own (issue 41, least privilege).

A deployment made by `spotrl up` (or the tests' `Deployment` with `secure=True`) has:
- a Redis user per role, with the rules of `contracts.access`, in an ACL file Redis loads; the
  default user is off. Rollout workers get no Redis password here: each gets a user of its own
  from the coordinator when it registers.
- an API token per scope (admin, worker, trainer, read). Every service accepts the four by their
  SHA-256 (`SPOTRL_ACCEPT_TOKENS`) and holds the one token it sends (`SPOTRL_TOKEN`): a worker's
  environment holds no admin or trainer secret.
- optionally TLS (`tls_env`): a throwaway CA and one certificate (services.cli.certs), every
  hop over it.
"""

import secrets
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from services.infra import redis_users
from services.infra.scopes import accept_list
from services.infra.tls import TlsFiles

SCOPES = ("admin", "worker", "trainer", "read")
# which API token each service sends, and which Redis role it connects as (None: its own user,
# minted at registration)
SERVICE_SCOPE = {"coordinator": "admin", "trainer": "trainer", "weightstore": "read"}
SERVICE_ROLE = {"coordinator": "coordinator", "trainer": "trainer"}


@dataclass(frozen=True)
class Credentials:
    tokens: dict[str, str]  # scope -> token
    redis_passwords: dict[str, str]  # role -> password

    @classmethod
    def make(cls, admin_token: str | None = None) -> "Credentials":
        """New tokens (the admin one given, if it is) and Redis passwords, in memory: the ACL
        file keeps only the passwords' hashes."""
        tokens = {scope: secrets.token_urlsafe(24) for scope in SCOPES}
        if admin_token:
            tokens["admin"] = admin_token
        return cls(tokens, redis_users.make_passwords())

    @property
    def admin_token(self) -> str:
        return self.tokens["admin"]

    def write_acl_file(self, path: Path, redis_major: int = 7) -> Path:
        """The role users for a Redis of that major version (6.2 has no selectors)."""
        return redis_users.write_acl_file(path, self.redis_passwords, redis_major)

    def redis_url(self, base_url: str, role: str | None) -> str:
        """`base_url` (no credentials) as `role` connects to it; None: as it is (a worker)."""
        if role is None:
            return base_url
        return redis_users.role_url(base_url, role, self.redis_passwords[role])

    def service_env(self, service: str, base_redis_url: str) -> dict[str, str]:
        """The security settings of `service` (coordinator, trainer, weightstore, rollout): its
        Redis user (none for a worker: it gets its own at registration), the token it sends,
        the tokens it accepts (reads stay open unless SPOTRL_PROTECT_READS says otherwise)."""
        env = {
            "SPOTRL_ACCEPT_TOKENS": accept_list(self.tokens),
            "SPOTRL_REDIS_URL": self.redis_url(base_redis_url, SERVICE_ROLE.get(service)),
            "SPOTRL_TOKEN": self.tokens[SERVICE_SCOPE.get(service, "worker")],
        }
        if service == "coordinator":
            env["SPOTRL_WORKER_REDIS_USERS"] = "true"
        return env


def tls_env(tls: TlsFiles) -> dict[str, str]:
    """A service's certificate, key, and the CA it checks every peer against."""
    return {
        "SPOTRL_TLS_CERT_FILE": str(tls.cert),
        "SPOTRL_TLS_KEY_FILE": str(tls.key),
        "SPOTRL_TLS_CA_FILE": str(tls.ca),
    }


def with_scheme(url: str, scheme: str) -> str:
    """`url` with another scheme (http -> https, redis -> rediss)."""
    parts = urlsplit(url)
    return urlunsplit((scheme, *parts[1:]))
