"""Redis users, carried out: the ACL file a deployment's Redis loads, and the user of each
rollout worker, minted by the coordinator when the worker registers and dropped when it goes.

Redis replicates data, not users: a replica promoted by a failover knows the users of its own
ACL file (the roles', the same file as the primary's) and none minted on the old primary. Each
worker user's password hash is kept in Redis data too (`keys.WORKER_USERS`, replicated), and
`restore_worker_users` makes the users again from it on a new primary.

What each user may do is decided in `services.contracts.access`; this module only writes it
down (a file, ACL SETUSER / DELUSER, ACL SAVE) and puts credentials into Redis URLs.
"""

import logging
import re
import secrets
import subprocess
from pathlib import Path
from typing import cast
from urllib.parse import quote, urlsplit, urlunsplit

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from services.contracts import access, keys
from services.infra.redis_streams import text

log = logging.getLogger(__name__)
PASSWORD_BYTES = 32
_VERSION = re.compile(rb"v=(\d+)\.")  # `redis-server --version`: "Redis server v=7.0.15 ..."


def make_passwords() -> dict[str, str]:
    """A new password for each role that has a user in the ACL file (workers get theirs at
    registration)."""
    return {role: secrets.token_hex(PASSWORD_BYTES) for role in access.USER_ROLES}


def write_acl_file(path: Path, passwords: dict[str, str], redis_major: int = 7) -> Path:
    """Write the ACL file of `passwords` (role -> password; the file holds their SHA-256 only),
    readable by its owner alone, in the syntax of Redis `redis_major` (6: 6.2)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.touch(mode=0o600, exist_ok=True)
    path.chmod(0o600)
    path.write_text(access.acl_file(passwords, redis_major))
    return path


def binary_major(binary: str) -> int:
    """The major version of a redis-server binary (`--version`), for `write_acl_file`."""
    out = subprocess.run([binary, "--version"], capture_output=True, check=True, timeout=10)
    found = _VERSION.search(out.stdout)
    if found is None:
        raise ValueError(f"{binary} --version says no version: {out.stdout[:200]!r}")
    return int(found.group(1))


async def server_major(r: aioredis.Redis) -> int:
    """The major version of the Redis server `r` talks to (INFO server)."""
    info = await r.info("server")
    return int(str(info["redis_version"]).split(".")[0])


async def _save(r: aioredis.Redis) -> None:
    """ACL SAVE, where the server loaded its users from a file (so that a restart keeps the
    workers' users); a server configured without one has nothing to save to."""
    try:
        await r.execute_command("ACL", "SAVE")
    except ResponseError as exc:
        if "ACL file" not in str(exc):
            raise


async def mint_worker_user(r: aioredis.Redis, worker_id: str) -> tuple[str, str]:
    """Create (or renew, with a new password) the Redis user of worker `worker_id`, with the
    worker role's rules and its own keys; (username, password). ValueError for a worker id
    that cannot have one (`access.check_worker_id`)."""
    username = access.worker_user(worker_id)
    password = secrets.token_hex(PASSWORD_BYTES)
    rules = access.worker_rules(worker_id, await server_major(r))
    await r.execute_command("ACL", "SETUSER", username, "reset", "on", f">{password}", *rules)
    await r.hset(keys.WORKER_USERS, worker_id, access.password_hash(password))
    await _save(r)
    log.info("redis user %s minted", username)
    return username, password


async def drop_worker_user(r: aioredis.Redis, worker_id: str) -> bool:
    """Delete worker `worker_id`'s user (Redis closes its connections); whether it had one."""
    username = access.worker_user(worker_id)
    deleted = await r.execute_command("ACL", "DELUSER", username)
    await r.hdel(keys.WORKER_USERS, worker_id)
    await _save(r)
    if deleted:
        log.info("redis user %s dropped", username)
    return bool(deleted)


async def restore_worker_users(r: aioredis.Redis, primary: str) -> int | None:
    """Make the workers' users of `keys.WORKER_USERS` that `primary` (the one `r` writes to)
    lacks, unless they were made there last (`keys.WORKER_USERS_ON`): after a failover, a
    worker logs in again with the password it was given. A user there already (minted since) is
    left as it is. How many it made, or None when it was done on that primary."""
    if text(await r.get(keys.WORKER_USERS_ON)) == primary:
        return None
    users = cast(dict[bytes, bytes], await r.hgetall(keys.WORKER_USERS))
    major = await server_major(r)
    made = 0
    for raw_id, digest in users.items():
        worker_id = raw_id.decode()
        username = access.worker_user(worker_id)
        if await r.execute_command("ACL", "GETUSER", username) is not None:
            continue
        rules = access.worker_rules(worker_id, major)
        await r.execute_command(
            "ACL", "SETUSER", username, "reset", "on", f"#{digest.decode()}", *rules
        )
        made += 1
    if made:
        await _save(r)
    await r.set(keys.WORKER_USERS_ON, primary)
    return made


def credential_url(base_url: str, username: str, password: str) -> str:
    """`base_url` (redis:// or rediss://, its own credentials dropped) with these."""
    parts = urlsplit(base_url)
    host = parts.netloc.rpartition("@")[2]
    netloc = f"{quote(username, safe='')}:{quote(password, safe='')}@{host}"
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


def role_url(base_url: str, role: str, password: str) -> str:
    """`base_url` as the user of `role` connects to it."""
    if role not in access.ROLES:
        raise ValueError(f"no role {role!r}: one of {', '.join(access.ROLES)}")
    return credential_url(base_url, f"{access.USER_PREFIX}{role}", password)
