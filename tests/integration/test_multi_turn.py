"""Multi-turn episodes end to end (issue 40), with real processes: Redis, weight store,
coordinator (and its environment processes), trainer, three preemptible workers. Runs with the
built-in `retry_arithmetic` environment: a wrong answer is told " no" and asked again, up to
max_turns. Each response is an episode whose observation tokens are marked as not generated;
the groups, the step rows and the trainer's counts agree on which tokens the model generated,
and every run ends exact (lost 0, duplicated 0) while a worker is SIGKILLed mid-turn or leaves
with notice, the environment's process crashes or hangs on an episode, or the coordinator is
killed mid-step."""

import signal
from pathlib import Path

import pytest
import redis
from tokenizers import Tokenizer

from services.cli.audit import audit_run
from services.contracts import keys
from services.contracts.messages import Job
from services.contracts.runspec import RunSpec
from tests.integration.conftest import (
    deploy_config,
    read_groups,
    short_heartbeat_env,
    small_spec,
    wait_final,
    wait_until,
)

MAX_TURNS = 3
REPO = Path(__file__).resolve().parents[2]
MISBEHAVING = "tests.data.multi_turn_envs:Misbehaving"
RETURNS_DICT = "tests.data.multi_turn_envs:ReturnsDict"
SOMETIMES_RAISES = "tests.data.multi_turn_envs:SometimesRaises"


@pytest.fixture(scope="module")
def env_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("env-markers")


@pytest.fixture(scope="module")
def deployment_config(tmp_path_factory, env_dir):
    """Three preemptible workers with a short heartbeat, slowed decode steps (a worker is
    caught mid-turn), and the tests' own environment module allowed."""
    extra = short_heartbeat_env() | {
        "PYTHONPATH": str(REPO),
        "SPOTRL_ENVIRONMENT_MODULES": "tests.data.multi_turn_envs",
        "MULTI_TURN_TEST_DIR": str(env_dir),
    }
    return deploy_config(
        tmp_path_factory.mktemp("multi-turn"),
        reserved=0,
        preemptible=3,
        worker_slots=8,
        extra_env=extra,
    )


def episode_spec(model, **over) -> dict:
    fields = {"environment": "retry_arithmetic", "max_turns": MAX_TURNS, "max_new_tokens": 40}
    return small_spec(model, **(fields | over))


def check_exact(deployment, client, run_id: str, body: dict, tokenizer) -> list:
    """The run succeeded with every group once and every response an episode whose observed
    spans are the environment's words; the trainer trained the generated tokens only. The
    step rows."""
    run = wait_final(client, deployment, run_id)
    assert run["state"] == "succeeded", run
    audit = audit_run(deployment.redis_url, run_id, RunSpec.model_validate(body))
    assert audit["lost"] == 0 and audit["duplicated"] == 0, audit
    groups = read_groups(deployment, run_id)
    assert len(groups) == body["steps"] * body["prompts_per_step"]
    generated = 0
    for g in groups:
        prompt = tokenizer.decode(g.prompt_ids)
        for resp in g.responses:
            assert len(resp.observed) <= MAX_TURNS - 1
            for offset, length in resp.observed:  # the environment's words: the sum again
                said = tokenizer.decode(resp.token_ids[offset : offset + length])
                assert said == f" no\n{prompt}", (said, prompt)
                assert resp.logprobs[offset : offset + length] == [0.0] * length
            generated += len(resp.token_ids) - sum(n for _, n in resp.observed)
    rows = client.metrics(run_id)
    # every generated token trained once (the trainer's ledger), and no observation token
    assert audit["tokens"] == generated, (audit, generated)
    assert sum(row["trained_tokens"] for row in rows) == generated
    assert sum(row["observed_tokens"] for row in rows) == sum(
        n for g in groups for resp in g.responses for _, n in resp.observed
    )
    assert all(1.0 <= row["turns_mean"] <= MAX_TURNS for row in rows)
    return rows


@pytest.fixture(scope="module")
def tokenizer(tiny_model) -> Tokenizer:
    return Tokenizer.from_file(str(tiny_model / "tokenizer.json"))


def test_a_multi_turn_run_ends_exact_with_observations_never_generated(
    deployment, client, tiny_model, tokenizer
):
    body = episode_spec(tiny_model)
    run_id = client.submit(body)
    rows = check_exact(deployment, client, run_id, body, tokenizer)
    groups = read_groups(deployment, run_id)
    rewards = {resp.reward for g in groups for resp in g.responses}
    assert rewards <= {0.0, 1.0, 0.5, 0.25}  # a right answer at turn t: 1 / 2**(t-1)
    assert any(resp.observed for g in groups for resp in g.responses), "never a second turn"
    assert all(row["environment_errors"] == 0 for row in rows)


def later_turns_held(rdb, run_id: str) -> list[str]:
    """Workers holding a job of step 0 that continues an episode past its first turn (a
    prefix that holds an observation: longer than any first answer)."""
    stream = keys.jobs_stream(run_id, 0)
    out: list[str] = []
    try:
        consumers = rdb.xinfo_consumers(stream, keys.WORKERS_GROUP)
    except redis.ResponseError:  # not queued yet
        return out
    for c in consumers:
        if not c["pending"]:
            continue
        name = c["name"].decode() if isinstance(c["name"], bytes) else c["name"]
        for entry in rdb.xpending_range(stream, keys.WORKERS_GROUP, "-", "+", 100, name):
            found = rdb.xrange(stream, entry["message_id"], entry["message_id"])
            if found and len(Job.from_fields(found[0][1]).prefix_ids) > 4:
                out.append(name)
                break
    return out


@pytest.mark.parametrize("how", ["sigkill", "notice"])
def test_a_worker_lost_mid_episode_loses_nothing(
    deployment, client, rdb, tiny_model, tokenizer, how
):
    """(a) SIGKILL mid-turn: its requests are reclaimed and continue elsewhere from what was
    flushed; (b) SIGTERM, the notice: it flushes and releases what it holds. Either way the
    episodes go on where they were."""
    body = episode_spec(tiny_model, steps=2, prompts_per_step=6)
    run_id = client.submit(body)

    def busy_mid_episode() -> str | None:
        held = later_turns_held(rdb, run_id)
        episodes = rdb.hlen(keys.step_episodes(run_id, 0))
        return held[0] if held and episodes else None

    victim = wait_until(busy_mid_episode, "no worker caught holding a later turn", 120, 0.01)
    proc = deployment.procs[victim]
    proc.popen.send_signal(signal.SIGKILL if how == "sigkill" else signal.SIGTERM)
    rows = check_exact(deployment, client, run_id, body, tokenizer)
    assert sum(rows[0]["migrations"].values()) >= 1, rows[0]
    deployment.procs.pop(victim).popen.wait(30)
    deployment.add_worker("preemptible")  # three again for the next test


def test_an_environment_that_crashes_or_hangs_ends_its_episode_and_is_counted(
    deployment, client, tiny_model, tokenizer, env_dir
):
    """(c) The environment's process dies on one call and hangs on another (killed at the
    spec's environment_timeout_s): both episodes end with the rewards so far, the errors are
    counted, and the run goes on."""
    body = episode_spec(tiny_model, environment=MISBEHAVING, environment_timeout_s=2.0)
    run_id = client.submit(body)
    rows = check_exact(deployment, client, run_id, body, tokenizer)
    assert (env_dir / "crash").exists() and (env_dir / "hang").exists()
    assert sum(row["environment_errors"] for row in rows) == 2, rows
    run = client.run(run_id)  # under faults.max_error_share: it goes on, degraded
    assert run["health"] == "degraded" and run["errors"]["environment"]["failed"] == 2, run


def test_an_environment_whose_step_returns_a_dict_fails_the_run_saying_why(
    deployment, client, tiny_model
):
    """Every call fails (a run that would train on zero rewards only): the run fails after
    its first step, its error names the count, the error and the user's method; the first
    failure is on the run's timeline."""
    body = episode_spec(tiny_model, environment=RETURNS_DICT, steps=3)
    run = wait_final(client, deployment, client.submit(body))
    assert run["state"] == "failed" and run["health"] == "failed", run
    calls = run["errors"]["environment"]["calls"]
    assert calls >= body["prompts_per_step"] * body["group_size"], run
    assert run["error"].startswith(f"environment failed on {calls} of {calls} calls in step 0"), run
    assert "step returned dict, not a Feedback" in run["error"], run
    assert "multi_turn_envs.py:" in run["error"] and "ReturnsDict.step" in run["error"], run
    assert run["step"] <= 1, run  # no step after the first
    events = client.timeline(run["id"])["events"]
    told = [e for e in events if e["kind"] == "user_code_failed"]
    assert [e["source"] for e in told] == ["environment"], events


def test_an_environment_failing_some_calls_leaves_the_run_degraded_with_its_share(
    deployment, client, tiny_model
):
    """A fifth of the calls raise: the run succeeds, its health says degraded with the share;
    the first failure's traceback (the user's frame) is on the run's timeline. The spec sets
    no max_turns: the environment's own 4 holds."""
    body = episode_spec(tiny_model, environment=SOMETIMES_RAISES, max_turns=None, steps=2)
    run = wait_final(client, deployment, client.submit(body))
    assert run["state"] == "succeeded" and run["health"] == "degraded", run
    env = run["errors"]["environment"]
    assert env["failed"] > 0 and 0 < env["share"] <= 0.5, run
    assert env["share"] == round(env["failed"] / env["calls"], 4), run
    assert (
        env["first"].startswith("raised: ValueError: call")
        and "multi_turn_envs.py:" in env["first"]
    )
    assert f"environment failed on {env['failed']} of {env['calls']} calls" in run["health_reason"]
    assert run["max_turns"] == 4, run
    rows = client.metrics(run["id"])
    assert [row["max_turns"] for row in rows] == [4, 4], rows
    assert sum(row["environment_calls"] for row in rows) == env["calls"], rows
    events = client.timeline(run["id"])["events"]
    (told,) = [e for e in events if e["kind"] == "user_code_failed"]
    assert "Traceback" in told["trace"] and "failed on purpose" in told["trace"], told


def test_a_coordinator_killed_mid_step_resumes_the_episodes(
    deployment, client, rdb, tiny_model, tokenizer
):
    """(d) The coordinator SIGKILLed while episodes are between turns and mid-turn: its step's
    durable copy holds each episode, and a turn that waited for the environment is answered
    again after the restart."""
    body = episode_spec(tiny_model, steps=2, prompts_per_step=6)
    run_id = client.submit(body)
    wait_until(
        lambda: rdb.hlen(keys.step_episodes(run_id, 0)) >= 3,
        "no episode stored a turn",
        120,
        0.01,
    )
    deployment.restart("coordinator", kill=True)
    check_exact(deployment, client, run_id, body, tokenizer)


def test_asynchronous_multi_turn_steps_end_exact_within_their_staleness(
    deployment, client, tiny_model, tokenizer
):
    """Asynchronous RL (max_staleness 1): the episodes of step s + 1 go on while step s trains;
    each token within the bound, every step exact."""
    body = episode_spec(tiny_model, steps=3, max_staleness=1)
    run_id = client.submit(body)
    check_exact(deployment, client, run_id, body, tokenizer)
    audit = audit_run(deployment.redis_url, run_id, RunSpec.model_validate(body))
    assert audit["max_staleness"] is not None and audit["max_staleness"] <= 1, audit
