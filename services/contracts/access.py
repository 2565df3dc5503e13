"""Who may touch which Redis key: the Redis ACL users of spotrl's roles, generated from the key
names in `contracts.keys` (issue 41, least privilege).

Every key of `keys` has one rule here: its glob patterns (made by calling the key's function
with "*" for every argument, so a pattern cannot drift from the key it stands for) and which
roles read it and which write it. A new key without a rule fails `tests/unit/test_access.py`,
and a rule naming a key that is gone fails at import.

Roles:
- coordinator (its API, data plane and shard processes): every key; also mints the workers'
  users (`acl|setuser`, `acl|deluser`, `acl|save`).
- trainer: the run, its versions and groups, its training rows, ledger and counters. The glob
  of the run's hash (`spotrl:run:*`) covers every key of a run, so the trainer, which ends a
  run, may write all of them: it is trusted with the model already.
- reader (CLI status, audit, recovery): reads every key but the workers' signing keys.
- worker: one user per rollout worker (`spotrl-worker-<id>`, minted at registration): it reads
  its jobs with its consumer group, adds deltas, writes its own presence keys, reads the run
  pointers and versions, and adds its crash to the run's events; each key only through the
  commands it needs on that key. Not the run's hash (its spec holds the prompts).
- certs (`spotrl-certs`): what reloads Redis's own TLS files when they are renewed (the
  chart's Redis pod): PING and CONFIG SET, no key, no other command. CONFIG SET reaches every
  setting of the server, so its password stays with Redis (`redis.env`), never in a service.
- replica (`spotrl-replica`): what a Redis replica logs in to its primary as (PSYNC, REPLCONF,
  PING), where a replica and Sentinel run (docs/reliability.md, "Redis failover"); no key.
- sentinel (`spotrl-sentinel`): what Sentinel logs in to the Redis nodes as: the commands it
  watches and fails over with (INFO, ROLE, REPLICAOF, CONFIG REWRITE, CLIENT KILL...) and its
  hello channel; no key. It can turn any node into a replica of another: like the certs
  password, it stays with Redis and Sentinel, never in a service.
The weight store has no role: it does not use Redis.

Redis 7 renders a worker's grants as selectors (commands bound to keys) and read-only or
write-only keys as %R~ / %W~; Redis 6.2 has neither, so there (`redis_major=6`) a role's
commands apply to all of its keys and every key pattern is read-write: the worker can then,
for one, SET a version it may only read. This module only decides: writing the file and minting
users is `services.infra.redis_users`'.
"""

import hashlib
import inspect
import itertools
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from fnmatch import fnmatchcase
from types import ModuleType
from typing import Literal

from services.contracts import keys

Role = Literal["coordinator", "trainer", "reader", "worker", "certs", "replica", "sentinel"]
ROLES: tuple[Role, ...] = (
    "coordinator", "trainer", "reader", "worker", "certs", "replica", "sentinel"
)  # fmt: skip
# in the ACL file
USER_ROLES: tuple[Role, ...] = ("coordinator", "trainer", "reader", "certs", "replica", "sentinel")
# their COMMANDS only: no key, no KEYLESS
KEYLESS_ROLES: frozenset[Role] = frozenset({"certs", "replica", "sentinel"})
USER_PREFIX = "spotrl-"
WORKER_ID = re.compile(r"[A-Za-z0-9._-]{1,128}")  # no glob character, no colon: see worker_rules

# Every role: a health check's PING, SELECT of the URL's database (key patterns hold in every
# database), and transactions. Nothing else runs without keys.
KEYLESS = ("+ping", "+select", "+multi", "+exec", "+discard")
# The services' own commands, by category. -@dangerous takes out FLUSHALL, FLUSHDB, KEYS,
# CONFIG, DEBUG, SHUTDOWN, MONITOR, MODULE, SORT, MIGRATE, RESTORE, CLIENT KILL and the like;
# @scripting (SCRIPT, EVALSHA, FUNCTION) and @admin (ACL) are never granted whole. EVAL is: the
# run's state changes in one script (services.state.run_record), and Redis checks every command
# a script calls against the caller's own rules.
_SERVICE = ("-@all", "+@read", "+@write", "+@connection", "+@transaction", "-@dangerous")
COMMANDS: dict[Role, tuple[str, ...]] = {
    "coordinator": (
        *_SERVICE,
        "+info",  # redis memory watch (INFO memory)
        "+eval",
        "+acl|setuser",  # the workers' users, minted at registration
        "+acl|getuser",  # made again on a new primary where missing (redis_users)
        "+acl|deluser",
        "+acl|save",
    ),
    "trainer": (*_SERVICE, "+eval"),
    "reader": ("-@all", "+@read", "+@connection", "-@dangerous"),
    "worker": ("-@all",),  # its commands come with its keys (WORKER_COMMANDS)
    "certs": ("-@all", "+ping", "+config|set"),  # CONFIG SET tls-cert-file ... (a reload)
    "replica": ("-@all", "+psync", "+replconf", "+ping"),  # Redis's own list for a replica
    # Redis's own list for Sentinel (its ACL docs), and its hello channel
    "sentinel": (
        "-@all",
        "+multi",
        "+exec",
        "+slaveof",
        "+replicaof",
        "+ping",
        "+subscribe",
        "+config|rewrite",
        "+role",
        "+publish",
        "+info",
        "+client|setname",
        "+client|kill",
        "+script|kill",
        "&__sentinel__:hello",
    ),
}

Access = Literal["r", "w", "rw"]
_KEY_PREFIX: dict[Access, str] = {"r": "%R~", "w": "%W~", "rw": "~"}

# The commands a worker runs on each of its keys (services/rollout): on Redis 7 each is bound
# to those keys only. No XRANGE, XREAD, XREVRANGE, XCLAIM, XAUTOCLAIM on a jobs stream: a worker
# sees the jobs given to it (by XREADGROUP), not its peers' grants; XADD only to deltas (and
# parked) streams, which it cannot read.
WORKER_COMMANDS: dict[str, tuple[str, ...]] = {
    "ACTIVE_RUN": ("get",),
    "ACTIVE_RUNS": ("zrange",),
    "run_version": ("get",),
    "run_staleness": ("get",),
    "run_drafts": ("get",),
    "run_base": ("get",),
    "FLEET_ALLOT": ("get",),
    "version_announced": ("xrevrange", "xread"),  # waiting for a version (run_state)
    "run_manifests": ("hget",),
    "run_digests": ("hget",),
    "read_cap": ("get",),
    "jobs_stream": ("xreadgroup", "xack", "exists"),
    "deltas_stream": ("xadd",),
    "all_deltas_streams": ("xadd",),
    "parked_stream": ("xadd",),  # a malformed job, set aside
    "run_events": ("xadd",),  # its crash, on the run's timeline
    "weight_holders": ("hgetall", "hset", "hdel", "expire"),  # its peers (rollout.peers)
    "worker_loads": ("sadd",),
    "worker_heartbeat": ("set", "del"),
    "worker_crash": ("set",),
    "worker_leaving": ("set",),
    "worker_control": ("xrevrange", "xread"),
}


@dataclass(frozen=True)
class KeyRule:
    """One name of `keys`: the globs of its keys and the roles that read and write them.
    `own`: a worker keys by its own id; the worker role gets only its own (worker_rules)."""

    name: str
    read: frozenset[Role]
    write: frozenset[Role]
    own: bool = False
    patterns: tuple[str, ...] = ()

    def access(self, role: Role) -> Access | None:
        r, w = role in self.read, role in self.write
        return "rw" if r and w else "r" if r else "w" if w else None


def _roles(spec: str) -> frozenset[Role]:
    short = {"c": "coordinator", "t": "trainer", "R": "reader", "w": "worker"}
    return frozenset(short[ch] for ch in spec)  # type: ignore[misc]


# name: (roles reading, roles writing, own). c coordinator, t trainer, R reader, w worker.
_TABLE: dict[str, tuple[str, str, bool]] = {
    "RUN_QUEUE": ("cR", "c", False),
    "RUN_INDEX": ("cR", "c", False),
    "ACTIVE_RUN": ("ctRw", "c", False),
    "ACTIVE_RUNS": ("ctRw", "c", False),
    "TRAINERS": ("ctR", "t", False),
    "FLEET_DEMAND": ("cR", "c", False),
    "FLEET_ALLOT": ("cRw", "c", False),
    "trainer_heartbeat": ("ctR", "t", False),
    "run": ("ctR", "ct", False),  # the trainer fails a run (run_record.finish)
    "run_version": ("ctRw", "ct", False),
    "run_staleness": ("cRw", "c", False),
    "run_drafts": ("cRw", "c", False),
    "run_base": ("cRw", "c", False),
    "version_announced": ("cRw", "ct", False),
    "run_manifests": ("cRw", "ct", False),
    "run_digests": ("ctRw", "ct", False),
    "run_step": ("ctR", "ct", False),
    "run_steps_done": ("ctR", "ct", False),
    "step_meta": ("cR", "c", False),
    "step_requests": ("cR", "c", False),
    "step_shards": ("cR", "c", False),
    "step_episodes": ("cR", "c", False),
    "step_log": ("cR", "c", False),
    "step_published": ("cR", "c", False),
    "step_quarantined": ("cR", "c", False),
    "seed_done": ("ctR", "c", False),
    "seeding_over": ("ctR", "c", False),
    "draft_history": ("cR", "c", False),
    "draft_history_order": ("cR", "c", False),
    "read_cap": ("cRw", "c", False),
    "jobs_stream": ("cRw", "cw", False),  # XREADGROUP and XACK read and write
    "deltas_stream": ("cR", "cw", False),
    "all_deltas_streams": ("cR", "cw", False),
    "shard_metrics": ("cR", "c", False),
    "groups_stream": ("ctR", "ct", False),
    "weight_holders": ("cRw", "cw", False),
    "worker_loads": ("cR", "cw", True),
    "run_trained": ("ctR", "ct", False),
    "trainer_state": ("ctR", "ct", False),
    "run_trainer_lease": ("ctR", "ct", False),  # the coordinator clears it with the run
    "run_demand": ("cR", "c", False),
    "run_events": ("cR", "ctw", False),  # a worker says it crashed (rollout.crash)
    "run_pool": ("cR", "c", False),
    "parked_stream": ("cR", "ctw", False),
    "WORKER_INDEX": ("cR", "c", False),
    "worker": ("cR", "c", False),
    "worker_control": ("cRw", "c", True),
    "worker_heartbeat": ("cR", "cw", True),
    "worker_crash": ("cR", "cw", True),
    "worker_leaving": ("cR", "cw", True),
    "WORKER_KEYS": ("c", "c", False),  # the workers' signing keys: no reader sees them
    "WORKER_USERS": ("c", "c", False),  # their users' password hashes: the coordinator's alone
    "WORKER_USERS_ON": ("c", "c", False),
}


def key_names(module: ModuleType = keys) -> list[str]:
    """The public names of `module` that stand for keys: str constants under PREFIX (not the
    prefix, not the consumer-group names) and the functions defined there."""
    names = []
    for name, value in vars(module).items():
        if name.startswith("_"):
            continue
        is_key = isinstance(value, str) and value.startswith(f"{module.PREFIX}:")
        is_key_function = inspect.isfunction(value) and value.__module__ == module.__name__
        if is_key or is_key_function:
            names.append(name)
    return names


def patterns_of(value: str | Callable[..., str | list[str]], own: str = "*") -> tuple[str, ...]:
    """The globs of a key name's keys: a constant is its own; a function is called with "*" for
    every argument (`own` for a worker id), and once more with "*" for each argument that has a
    default (shard 0 has no suffix, shard k one)."""
    if isinstance(value, str):
        return (value,)
    choices = []
    for param in inspect.signature(value).parameters.values():
        fill = own if param.name == "worker_id" else "*"
        choices.append(
            [fill] if param.default is inspect.Parameter.empty else [param.default, fill]
        )
    found: list[str] = []
    for args in itertools.product(*choices):
        made = value(*args)
        for pattern in [made] if isinstance(made, str) else made:
            if pattern not in found:
                found.append(pattern)
    return tuple(found)


def _rule(name: str, spec: tuple[str, str, bool]) -> KeyRule:
    read, write, own = spec
    return KeyRule(name, _roles(read), _roles(write), own, patterns_of(getattr(keys, name)))


RULES: tuple[KeyRule, ...] = tuple(_rule(name, spec) for name, spec in _TABLE.items())


def unruled_keys(module: ModuleType = keys) -> list[str]:
    """The key names of `module` with no rule (a new key nobody decided the roles of)."""
    ruled = {rule.name for rule in RULES}
    return [name for name in key_names(module) if name not in ruled]


def _fewest(pairs: Iterable[tuple[Access, str]]) -> list[tuple[Access, str]]:
    """The (access, glob) pairs less those another pair covers: one of the same access or a
    read-write one whose glob matches every key of theirs."""
    unique = list(dict.fromkeys(pairs))

    def covers(wide: tuple[Access, str], narrow: tuple[Access, str]) -> bool:
        return wide != narrow and wide[0] in (narrow[0], "rw") and fnmatchcase(narrow[1], wide[1])

    return [pair for pair in unique if not any(covers(other, pair) for other in unique)]


def _key_tokens(grants: Iterable[tuple[Access, str]], split: bool) -> list[str]:
    """ACL key tokens: %R~ / %W~ / ~ with `split` (Redis 7), else ~ for all (Redis 6.2)."""
    return [(_KEY_PREFIX[access] if split else "~") + p for access, p in _fewest(grants)]


def _grants(role: Role, worker_id: str | None) -> list[tuple[KeyRule, Access, tuple[str, ...]]]:
    """(rule, access, patterns) of every rule granting `role` something; a worker's own keys
    only with its id (none without one)."""
    found = []
    for rule in RULES:
        access = rule.access(role)
        if access is None:
            continue
        if role == "worker" and rule.own:
            if worker_id is None:
                continue
            patterns = patterns_of(getattr(keys, rule.name), own=worker_id)
        else:
            patterns = rule.patterns
        found.append((rule, access, patterns))
    return found


def _rules(role: Role, worker_id: str | None, redis_major: int) -> list[str]:
    split = redis_major >= 7
    tokens = ["resetkeys", "resetchannels", *COMMANDS[role]]
    if role in KEYLESS_ROLES:
        return tokens
    grants = _grants(role, worker_id)
    if role != "worker":
        pairs = [(access, p) for _, access, patterns in grants for p in patterns]
        return [*tokens, *KEYLESS, *_key_tokens(pairs, split)]
    # a worker: each key only through its commands (a selector per command set, Redis 7)
    by_commands: dict[tuple[str, ...], list[tuple[Access, str]]] = {}
    for rule, access, patterns in grants:
        by_commands.setdefault(WORKER_COMMANDS[rule.name], []).extend((access, p) for p in patterns)
    tokens.extend(KEYLESS)
    if not split:  # Redis 6.2: no selectors, one set of commands over all the keys
        every = sorted({c for cs in by_commands for c in cs})
        pairs = [pair for ps in by_commands.values() for pair in ps]
        return [*tokens, *(f"+{c}" for c in every), *_key_tokens(pairs, split)]
    for commands, pairs in by_commands.items():
        inner = [*(f"+{c}" for c in commands), *_key_tokens(pairs, split)]
        tokens.append(f"({' '.join(inner)})")
    return tokens


def role_rules(role: Role, redis_major: int = 7) -> list[str]:
    """The ACL rule tokens of `role` (a worker's without its own keys: see worker_rules)."""
    if role not in ROLES:
        raise ValueError(f"no role {role!r}: one of {', '.join(ROLES)}")
    return _rules(role, None, redis_major)


def check_worker_id(worker_id: str) -> str:
    """A worker id that can go into a glob as it is: letters, digits, '.', '_', '-'. A glob
    character would reach other workers' keys, a colon would let `*:loads:<id>` match the
    loads key of a worker named `x:loads:<id>`."""
    if not WORKER_ID.fullmatch(worker_id):
        raise ValueError(
            f"worker id {worker_id!r} cannot have a Redis user: only letters, digits, '.', '_' "
            "and '-', at most 128"
        )
    return worker_id


def worker_user(worker_id: str) -> str:
    return f"{USER_PREFIX}worker-{check_worker_id(worker_id)}"


def worker_rules(worker_id: str, redis_major: int = 7) -> list[str]:
    """The ACL rule tokens of one worker's user: the worker role, with its own keys."""
    return _rules("worker", check_worker_id(worker_id), redis_major)


def password_hash(password: str) -> str:
    """What an ACL file holds of a password (`#<sha256 hex>`)."""
    return hashlib.sha256(password.encode()).hexdigest()


def acl_file(passwords: dict[str, str], redis_major: int = 7) -> str:
    """An ACL file: a user `spotrl-<role>` per role in `passwords` (role -> password, stored
    hashed), and the default user off (a connection without credentials can do nothing)."""
    lines = ["user default off resetkeys resetchannels -@all"]
    for role, password in passwords.items():
        if role not in ROLES:
            raise ValueError(f"no role {role!r}: one of {', '.join(ROLES)}")
        rules = _rules(role, None, redis_major)  # type: ignore[arg-type]
        hashed = password_hash(password)
        lines.append(f"user {USER_PREFIX}{role} on #{hashed} {' '.join(rules)}")
    return "\n".join(lines) + "\n"
