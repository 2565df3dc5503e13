"""End to end with real processes: Redis, weight store, coordinator, trainer, two workers."""

import json

import httpx

from services.contracts import keys
from tests.integration.conftest import read_groups, small_spec, wait_final, wait_until


def test_run_completes_with_exact_groups_versions_and_loads(deployment, client, rdb, tiny_model):
    spec = small_spec(tiny_model)
    run_id = client.submit(spec)
    rdb.xadd(keys.deltas_stream(run_id), {b"m": b"\xc1 not msgpack"})  # parked, not fatal
    run = wait_final(client, deployment, run_id)
    assert run["state"] == "succeeded", run
    assert run["step"] == spec["steps"] and run["weight_version"] == spec["steps"]
    assert run["groups_incomplete"] == 0

    groups = read_groups(deployment, run_id)
    assert len(groups) == spec["steps"] * spec["prompts_per_step"]
    assert len({(g.step, g.prompt_index) for g in groups}) == len(groups)  # none twice
    for g in groups:
        assert len(g.responses) == spec["group_size"]
        for resp in g.responses:
            assert {v for _, v in resp.version_runs} == {g.step}  # synchronous: its own weights
            assert 1 <= len(resp.token_ids) <= spec["max_new_tokens"]
            assert len(resp.logprobs) == len(resp.token_ids)
            assert resp.finish_reason in ("stop", "length")
            assert resp.reward in (0.0, 1.0)

    parked = rdb.xrange(keys.parked_stream(run_id))
    assert len(parked) == 1 and b"DeltaBatch" in parked[0][1][b"reason"]

    trainer = {k.decode(): int(v) for k, v in rdb.hgetall(keys.trainer_state(run_id)).items()}
    assert trainer["steps_trained"] == spec["steps"]
    assert trainer["groups_trained"] == len(groups)

    rows = client.metrics(run_id)
    assert [row["step"] for row in rows] == list(range(spec["steps"]))
    for row in rows:  # one optimizer step per RL step, each with rollout and training fields
        assert row["trained_sequences"] == spec["prompts_per_step"] * spec["group_size"]
        assert 0.0 <= row["reward_mean"] <= 1.0 and row["tokens_per_s"] > 0

    versions = httpx.get(f"{deployment.weightstore_urls[0]}/v1/models/{run_id}/versions").json()
    assert versions["versions"][-spec["steps"] :] == list(range(1, spec["steps"] + 1))
    loads = {
        worker: {int(v) for v in rdb.smembers(keys.worker_loads(run_id, worker))}
        for worker in ("rollout-reserved-1", "rollout-preemptible-2")
    }
    # every version that generated a step was loaded (the last one trains nothing more); a
    # worker slow to load may skip versions its peer served alone, even all of a short run's
    assert set().union(*loads.values()) >= set(range(spec["steps"])), loads
    assert all(loaded <= set(range(spec["steps"] + 1)) for loaded in loads.values())


def test_workers_are_listed_with_pool_and_liveness(client):
    workers = {w["id"]: w for w in client.workers()}
    assert workers["rollout-reserved-1"]["pool"] == "reserved"
    assert workers["rollout-preemptible-2"]["pool"] == "preemptible"
    assert all(w["alive"] for w in workers.values())


def test_bad_input_is_refused_and_leaves_no_run(deployment, rdb, tiny_model, tmp_path):
    before = (rdb.zcard(keys.RUN_INDEX), rdb.llen(keys.RUN_QUEUE))
    url = f"{deployment.coordinator_url}/v1/runs"

    resp = httpx.post(url, json=small_spec(tiny_model, group_size=0))
    assert resp.status_code == 422
    assert any(err["loc"][-1] == "group_size" for err in resp.json()["detail"])

    resp = httpx.post(url, json=small_spec(tiny_model, bogus_field=1))
    assert resp.status_code == 422 and "bogus_field" in resp.text

    resp = httpx.post(url, json=small_spec(tmp_path / "no-such-model"))
    assert resp.status_code == 400
    assert "does not exist" in resp.json()["detail"]

    resp = httpx.post(url, content=b"{not json", headers={"content-type": "application/json"})
    assert resp.status_code == 422

    assert (rdb.zcard(keys.RUN_INDEX), rdb.llen(keys.RUN_QUEUE)) == before
    assert httpx.get(f"{url}/nope").status_code == 404
    assert httpx.post(f"{url}/nope/cancel").status_code == 404


def test_runs_wait_in_fifo_order_and_a_queued_run_can_be_cancelled(
    deployment, client, rdb, tiny_model
):
    spec = small_spec(tiny_model, steps=1, prompts_per_step=2, group_size=2)
    first, second, third = (client.submit(spec) for _ in range(3))
    assert client.run(third)["state"] == "queued"
    assert client.cancel(third)["state"] == "cancelled"
    a = wait_final(client, deployment, first)
    b = wait_final(client, deployment, second)
    assert a["state"] == b["state"] == "succeeded"
    assert b["started_at"] >= a["finished_at"]  # one active run at a time, in order
    assert client.run(third)["state"] == "cancelled"
    assert rdb.get(keys.run_version(third)) is None  # never started
    resp = httpx.post(f"{deployment.coordinator_url}/v1/runs/{first}/cancel")
    assert resp.status_code == 409


def test_a_worker_that_cannot_bind_its_port_is_unhealthy(deployment, tmp_path):
    """The healthcheck probes the port its own process bound and only that process: a replica
    told a port another holds exits, and is unhealthy even though that port answers."""
    from services.infra import healthcheck

    mine, theirs = tmp_path / "a.port", tmp_path / "b.port"
    a = deployment.add_worker("preemptible", wait=False, port="0", port_file=str(mine))
    env_a = {"SPOTRL_PORT_FILE": str(mine)}
    wait_until(lambda: healthcheck.check(env_a) == "", lambda: healthcheck.check(env_a))
    taken = json.loads(mine.read_text())["port"]
    theirs.write_text(mine.read_text())  # what an earlier start left: a port that answers
    b = deployment.add_worker("preemptible", wait=False, port=str(taken), port_file=str(theirs))
    assert b.popen.wait(60) != 0, b.log_tail()  # uvicorn: 3, could not start
    assert "address already in use" in b.log_tail().lower()
    problem = healthcheck.check({"SPOTRL_PORT_FILE": str(theirs)})
    assert "no port file" in problem, problem
    assert healthcheck.check({"SPOTRL_PORT": str(taken)}) == ""  # a port alone: fooled by a

    theirs.write_text(json.dumps({"port": taken, "instance": "another"}))
    assert "another process" in healthcheck.check({"SPOTRL_PORT_FILE": str(theirs)})
    a.stop()
    assert not mine.exists() or healthcheck.check(env_a) != ""
