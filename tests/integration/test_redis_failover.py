"""A Redis failover mid-step (issue 53, part 5), with real processes: a primary, a replica and
one Sentinel (`tests.harness.sentinel`), and a deployment with least privilege on that reaches
Redis through Sentinel (redis+sentinel://) with the trainer waiting for the replica before a
version's weights go to the store (SPOTRL_REDIS_WAIT_REPLICAS=1). The replica replicates as
spotrl-replica, Sentinel watches as spotrl-sentinel, each worker logs in as the user the
coordinator minted for it.

While a step's tokens are being collected, the replication link is held for a moment (what the
primary acknowledges meanwhile never reaches the replica, as when a host dies with writes in
flight) and the primary is SIGKILLed. Sentinel promotes the replica, which lacks those writes:
token deltas, step-log records, jobs handed out, maybe groups. The run goes on: the coordinator
and the trainer start again from what the new primary holds (their fence), the step's
unfinished requests move to new leases from the tokens it kept (a "migrated" event of cause
"failover"), the coordinator makes the workers' users again on the new primary (Redis does
not replicate users), and every group is trained once with every response whole: lost 0,
duplicated 0.
"""

import time

import pytest

from services.cli.audit import audit_run
from services.cli.client import CoordinatorClient
from services.contracts import keys
from services.contracts.runspec import RunSpec
from tests.harness.deploy import Deployment
from tests.harness.sentinel import NodeUsers, SentinelRedis
from tests.integration.conftest import (
    collected,
    deploy_config,
    read_groups,
    run_events,
    short_heartbeat_env,
    small_spec,
    wait_final,
    wait_until,
)

PROMPTS, GROUP, TOKENS, STEPS = 6, 3, 16, 4
HOLD_S = 0.3  # the replication link held this long before the kill: writes the replica lacks

pytestmark = pytest.mark.slow


ADMIN = ("test-admin", "admin-pw")  # the test's own Redis user: reads every key


@pytest.fixture(scope="module")
def nodes(tmp_path_factory):
    """The deployment (least privilege: a Redis user per role and per worker, signed deltas,
    scoped tokens) and the Redis nodes it runs on: two preemptible workers of 4 slots, slowed
    so that a step can be caught in the middle. The nodes load the deployment's ACL file, the
    replica and Sentinel logging in as their roles."""
    folder = tmp_path_factory.mktemp("failover")
    env = short_heartbeat_env() | {"SPOTRL_REDIS_WAIT_REPLICAS": "1"}
    config = deploy_config(
        folder, reserved=0, preemptible=2, worker_slots=4, secure=True, extra_env=env
    )
    dep = Deployment(config)
    assert dep.credentials is not None
    aclfile = dep.credentials.write_acl_file(folder / "users.acl")
    with aclfile.open("a") as f:
        f.write(f"user {ADMIN[0]} on >{ADMIN[1]} ~* &* +@all\n")
    passwords = dep.credentials.redis_passwords
    users = NodeUsers(aclfile, passwords["replica"], passwords["sentinel"], ADMIN)
    with SentinelRedis(folder / "redis", users=users) as sentinel:
        dep.redis_url = sentinel.url
        with dep:
            yield dep, sentinel


@pytest.fixture(scope="module")
def deployment(nodes):
    return nodes[0]


@pytest.fixture(scope="module")
def sentinel(nodes):
    return nodes[1]


@pytest.fixture(scope="module")
def client(deployment):
    with CoordinatorClient(deployment.coordinator_url, deployment.admin_token) as c:
        yield c


@pytest.fixture(scope="module")
def rdb(sentinel):
    """The test's client of whichever node is the primary."""
    r = sentinel.open()
    yield r
    r.close()


def mid_step(rdb, run_id: str):
    """A step >= 1 whose tokens are being collected, with most of its groups to come (the
    trainer waits for them: no version is being committed)."""
    version = int(rdb.get(keys.run_version(run_id)) or 0)
    if not 1 <= version < STEPS:
        return None
    published = rdb.scard(keys.step_published(run_id, version))
    if published <= PROMPTS // 3 and sum(collected(rdb, run_id, version).values()) > 0:
        return version
    return None


def test_a_failover_mid_step_loses_nothing(deployment, client, rdb, sentinel, tiny_model):
    started = time.monotonic()
    body = small_spec(
        tiny_model,
        ignore_eos=True,
        group_size=GROUP,
        prompts_per_step=PROMPTS,
        steps=STEPS,
        max_new_tokens=TOKENS,
    )
    run_id = client.submit(body)
    step = wait_until(lambda: mid_step(rdb, run_id), "no step was caught mid-way", 120, 0.005)
    written = sentinel.kill_primary(HOLD_S)
    killed = time.monotonic()
    promotion_s = sentinel.wait_promoted()
    lost_bytes = written - sentinel.promoted_at()
    assert lost_bytes > 0  # the new primary lacks writes the old one acknowledged

    run = wait_final(client, deployment, run_id)
    assert run["state"] == "succeeded", run
    audit = audit_run(deployment.reader_redis_url, run_id, RunSpec.model_validate(body))
    assert audit["lost"] == 0 and audit["duplicated"] == 0, audit
    assert audit["max_staleness"] == 0, audit
    groups = read_groups(deployment, run_id)
    assert sorted((g.step, g.prompt_index) for g in groups) == [
        (s, p) for s in range(STEPS) for p in range(PROMPTS)
    ]
    for g in groups:
        assert len(g.responses) == GROUP
        assert all(len(r.token_ids) == TOKENS for r in g.responses)
    # the workers' users, made again on the new primary: the workers logged in as them again
    assert rdb.get(keys.WORKER_USERS_ON) == f"127.0.0.1:{sentinel.ports['replica']}".encode()
    for worker in ("rollout-preemptible-1", "rollout-preemptible-2"):
        assert rdb.execute_command("ACL", "GETUSER", f"spotrl-worker-{worker}") is not None
    moved = [e for e in run_events(rdb, run_id, "migrated") if e.get("cause") == "failover"]
    assert moved and moved[0]["step"] == step, moved  # the step's requests moved on
    after_s, test_s = time.monotonic() - killed, time.monotonic() - started
    print(
        f"\nfailover at step {step}: {lost_bytes} bytes of writes lost, promoted after "
        f"{promotion_s:.1f}s, run over {after_s:.1f}s after the kill, "
        f"{sum(e['count'] for e in moved)} requests moved on; test {test_s:.1f}s"
    )
