"""The Redis role table (`contracts.access`): every key has a rule, each rule's globs match its
keys, and no worker glob reaches a key that is not the worker's to touch."""

import inspect
import types
from fnmatch import fnmatchcase

import pytest

from services.contracts import access, keys
from services.infra.redis_users import credential_url, role_url

RUN = "r20260101-120000-abcdef"
OTHER_RUN = "r20260102-120000-012345"


def sample_keys(name: str, worker_id: str = "w-other") -> list[str]:
    """Real keys of a key name: a run, steps and versions, shards 0 and 2, worker `worker_id`."""
    value = getattr(keys, name)
    if isinstance(value, str):
        return [value]
    made: list[str] = []
    args = {"run_id": RUN, "worker_id": worker_id, "step": 7, "version": 3}
    params = list(inspect.signature(value).parameters)
    for shard in (0, 2):
        got = value(*[args.get(p, shard) for p in params])
        made.extend([got] if isinstance(got, str) else got)
    return list(dict.fromkeys(made))


def test_every_key_has_a_rule():
    assert access.unruled_keys() == []
    assert {rule.name for rule in access.RULES} == set(access.key_names())


def test_a_new_key_without_a_rule_is_reported(monkeypatch):
    def run_secrets(run_id: str) -> str:
        return f"{keys.PREFIX}:run:{run_id}:secrets"

    run_secrets.__module__ = keys.__name__
    monkeypatch.setattr(keys, "run_secrets", run_secrets, raising=False)
    monkeypatch.setattr(keys, "BACKUPS", f"{keys.PREFIX}:backups", raising=False)
    monkeypatch.setattr(keys, "AUDIT_GROUP", "audit", raising=False)  # a group name: no key
    assert sorted(access.unruled_keys()) == ["BACKUPS", "run_secrets"]


def test_a_copied_module_is_read_the_same_way():
    copy = types.ModuleType(keys.__name__)
    copy.__dict__.update({k: v for k, v in vars(keys).items() if k != "__dict__"})
    copy.shard_log = lambda run_id: f"{keys.PREFIX}:run:{run_id}:shard_log"  # type: ignore[attr-defined]
    copy.shard_log.__module__ = keys.__name__  # type: ignore[attr-defined]
    assert access.unruled_keys(copy) == ["shard_log"]


def test_patterns_come_from_the_key_functions():
    by_name = {rule.name: rule.patterns for rule in access.RULES}
    assert by_name["run_step"] == ("spotrl:run:*:step:*",)
    assert by_name["step_requests"] == (
        "spotrl:run:*:step:*:requests",
        "spotrl:run:*:step:*:requests:shard:*",
    )
    assert by_name["ACTIVE_RUN"] == (keys.ACTIVE_RUN,)
    for rule in access.RULES:  # each glob set matches every real key of its name
        for key in sample_keys(rule.name):
            assert any(fnmatchcase(key, p) for p in rule.patterns), (rule.name, key)


def worker_grants(worker_id: str) -> list[tuple[str, str]]:
    """(access, glob) of every key token of a worker's Redis 7 rules."""
    found = []
    for token in access.worker_rules(worker_id):
        for part in token.strip("()").split():
            for prefix, kind in (("%R~", "r"), ("%W~", "w"), ("~", "rw")):
                if part.startswith(prefix):
                    found.append((kind, part[len(prefix) :]))
                    break
    return found


def test_worker_globs_reach_only_its_keys():
    """A worker's globs match no key of a name the worker may not touch, and no other worker's
    own keys; those it may only read (or only write), it reaches only so."""
    grants = worker_grants("w1")
    for rule in access.RULES:
        allowed = rule.access("worker")
        for worker in ("w1", "w2", "w1x", "x-w1"):
            for key in sample_keys(rule.name, worker):
                reached = {kind for kind, glob in grants if fnmatchcase(key, glob)}
                mine = allowed is not None and (not rule.own or worker == "w1")
                if not mine:
                    assert not reached, (rule.name, key, reached)
                else:
                    assert reached <= {allowed, "rw"} and reached, (rule.name, key, reached)
                    if allowed != "rw":
                        assert "rw" not in reached, (rule.name, key)


def test_worker_commands_are_bound_to_their_keys():
    rules = access.worker_rules("w1")
    jobs = next(t for t in rules if ":jobs:" in t)
    assert jobs == "(+xreadgroup +xack +exists ~spotrl:run:*:jobs:v*)"
    assert not any("xrange" in t or "xautoclaim" in t or "xclaim" in t for t in rules)
    deltas = next(t for t in rules if ":deltas" in t)
    assert deltas.startswith("(+xadd ") and "%W~spotrl:run:*:deltas " in deltas
    assert "(+set +del %W~spotrl:worker:w1:hb)" in rules
    # keyless commands only outside the selectors: nothing there reaches a key
    root = [t for t in rules if not t.startswith("(")]
    assert not any("~" in t for t in root)
    assert set(root) >= {"-@all", "+ping", "+multi", "+exec"}


def test_role_tables_never_grant_the_dangerous_commands():
    banned = {"+flushall", "+flushdb", "+config", "+keys", "+debug", "+script", "+shutdown"}
    banned |= {"+monitor", "+module", "+acl", "+@all", "+@dangerous", "+@admin", "+@scripting"}
    for role in access.ROLES:
        tokens = set(" ".join(access.role_rules(role)).replace("(", " ").replace(")", " ").split())
        assert not tokens & banned, role
        if role != "coordinator":
            assert not any(t.startswith("+acl") for t in tokens), role
        if role not in ("certs", "sentinel"):
            assert not any(t.startswith("+config") for t in tokens), role
    assert "-@dangerous" in access.role_rules("reader")


def test_the_certs_role_reloads_tls_files_and_reaches_no_key():
    """CONFIG SET (Redis's TLS files, reloaded), PING, nothing else: no key, no SELECT."""
    for major in (6, 7):
        rules = access.role_rules("certs", redis_major=major)
        assert rules == ["resetkeys", "resetchannels", "-@all", "+ping", "+config|set"]
    assert "certs" in access.USER_ROLES
    assert not any(rule.access("certs") for rule in access.RULES)


def test_the_replica_and_sentinel_roles_reach_no_key():
    """What a replica and Sentinel log in to the Redis nodes as: their commands (Sentinel's
    CONFIG REWRITE, never CONFIG SET) and Sentinel's hello channel; no key, no other channel."""
    for role in ("replica", "sentinel"):
        assert role in access.USER_ROLES
        assert not any(rule.access(role) for rule in access.RULES)
        rules = access.role_rules(role)
        assert not any("~" in t for t in rules), role
    assert access.role_rules("replica")[2:] == ["-@all", "+psync", "+replconf", "+ping"]
    sentinel = access.role_rules("sentinel")
    assert "+config|rewrite" in sentinel and "+config|set" not in sentinel
    assert [t for t in sentinel if t.startswith("&")] == ["&__sentinel__:hello"]


def test_worker_signing_keys_are_the_coordinators_alone():
    rule = next(r for r in access.RULES if r.name == "WORKER_KEYS")
    assert rule.read == rule.write == {"coordinator"}
    for role in ("trainer", "reader"):
        globs = [t.split("~", 1)[1] for t in access.role_rules(role) if "~" in t]
        assert not any(fnmatchcase(keys.WORKER_KEYS, g) for g in globs), role


@pytest.mark.parametrize("bad", ["w*", "a:b", "w[1]", "", "w 1", "x" * 129, "w?"])
def test_a_worker_id_that_would_widen_a_glob_gets_no_user(bad):
    with pytest.raises(ValueError):
        access.worker_rules(bad)


def test_redis_6_rules_have_no_selectors_or_split_keys():
    for role in access.ROLES:
        for token in access.role_rules(role, redis_major=6):
            assert not token.startswith(("(", "%")), (role, token)
    tokens = access.worker_rules("w1", redis_major=6)
    assert "+xadd" in tokens and "~spotrl:worker:w1:hb" in tokens


def test_acl_file_hashes_passwords_and_turns_the_default_user_off():
    text = access.acl_file({"coordinator": "pw-c", "reader": "pw-r"})
    lines = text.splitlines()
    assert lines[0].startswith("user default off")
    assert lines[1].startswith(f"user spotrl-coordinator on #{access.password_hash('pw-c')} ")
    assert "pw-c" not in text and "pw-r" not in text
    with pytest.raises(ValueError):
        access.acl_file({"admin": "x"})


def test_urls_carry_the_users_credentials():
    url = role_url("rediss://127.0.0.1:6380/0", "trainer", "p/w")
    assert url == "rediss://spotrl-trainer:p%2Fw@127.0.0.1:6380/0"
    assert credential_url("redis://old:x@h:1/2", "u", "p") == "redis://u:p@h:1/2"
    with pytest.raises(ValueError):
        role_url("redis://h:1/0", "admin", "x")
