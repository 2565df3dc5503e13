"""What the read model serves (services.coordinator.api.read_model): a run's answers from what
Redis holds, timeline pages from the held entries, the worker list, the fleet's figures; and
the run a release order to a worker names (api.routes)."""

import json

import pytest
from fastapi import HTTPException

from services.contracts.messages import RunLoad
from services.contracts.records import RunRecord, WorkerRecord
from services.contracts.runspec import RunSpec
from services.coordinator.api.read_model import (
    FINAL_SETTLE_S,
    Entries,
    RunInputs,
    fleet_doc,
    run_docs,
    run_list,
    settled,
    timeline_body,
    worker_docs,
    worker_list,
)
from services.coordinator.api.routes import release_run
from services.state.step_metrics import StepRow
from tests import factories

SPEC = RunSpec(model="/models/m", steps=5)
# one engine serving two runs: a at version 3 holding 2 requests, b at version 5 holding 4
BOTH = factories.beat(
    "w1", version=3, run_id="a", active=6,
    runs={"a": RunLoad(version=3, active=2), "b": RunLoad(version=5, active=4)},
)  # fmt: skip


def inputs(state: str = "running", **record) -> RunInputs:
    base = {"id": "r1", "spec": SPEC.model_dump_json(), "state": state, "created_at": 100.5}
    rows = (
        StepRow(step=0, reward_mean=0.25, tokens_per_s=10.0, reward_errors=1),
        StepRow(step=1, reward_mean=0.5, tokens_per_s=20.0, reward_errors=2),
        StepRow(step=2, policy_loss=0.1),  # its rollout is not done
    )
    return RunInputs(record=RunRecord(**(base | record)), version=2, groups_incomplete=1, rows=rows)


def test_a_runs_public_record_and_metrics_as_the_api_shows_them():
    docs = run_docs("r1", inputs(n_prem_recommended=3.5, started_at=101.0), SPEC, now=200.0)
    public = json.loads(docs.public.body)
    assert public["id"] == "r1" and public["state"] == "running"
    assert public["step"] == 2 and public["weight_version"] == 2 and public["steps"] == 5
    assert public["reward_mean"] == 0.5 and public["tokens_per_s"] == 20.0  # newest rollout
    assert public["reward_errors"] == 3 and public["groups_incomplete"] == 1
    assert public["n_prem_recommended"] == 3.5 and public["started_at"] == 101.0
    assert public["finished_at"] is None and public["stall_reason"] == ""
    unlimited = run_docs("r1", inputs(n_prem_recommended=float("inf")), SPEC, now=200.0)
    assert json.loads(unlimited.public.body)["n_prem_recommended"] is None
    metrics = json.loads(docs.metrics.body)
    assert [row["step"] for row in metrics["steps"]] == [0, 1, 2]
    assert metrics["steps"][2] == {"step": 2, "policy_loss": 0.1}
    assert not docs.final


def test_a_run_is_final_once_it_ended_long_enough_ago():
    ended = inputs("succeeded", finished_at=1000.0).record
    assert not settled(ended, 1000 + FINAL_SETTLE_S - 1)
    assert settled(ended, 1000 + FINAL_SETTLE_S + 1)
    assert not settled(inputs("running").record, 10**10)


def test_equal_answers_have_equal_etags_and_a_change_changes_it():
    a = run_docs("r1", inputs(), SPEC, 0.0)
    b = run_docs("r1", inputs(), SPEC, 0.0)
    c = run_docs("r1", inputs(state="stalled", stall_reason="no workers"), SPEC, 0.0)
    assert a.public.etag == b.public.etag != c.public.etag
    assert json.loads(c.public.body)["stall_reason"] == "no workers"
    listed = json.loads(run_list([a, c]).body)
    assert [run["state"] for run in listed] == ["running", "stalled"]


def test_timeline_pages_after_an_entry_id_and_the_cap_keeps_the_newest():
    entries = Entries(cap=3)
    entries.extend([(f"5-{i}", json.dumps({"at": i, "kind": "k"}).encode()) for i in range(4)])
    assert entries.last_id == "5-3"
    assert [json.loads(b)["id"] for b in entries.page(None, 10)] == ["5-1", "5-2", "5-3"]
    assert [json.loads(b)["id"] for b in entries.page("5-1", 10)] == ["5-2", "5-3"]
    assert [json.loads(b)["id"] for b in entries.page("5-1", 1)] == ["5-2"]
    assert entries.page("9-0", 10) == []
    body = json.loads(timeline_body("r1", entries.page(None, 2), []))
    assert body == {
        "run_id": "r1",
        "events": [{"id": "5-1", "at": 1, "kind": "k"}, {"id": "5-2", "at": 2, "kind": "k"}],
        "pool": [],
    }


def test_the_worker_list_with_liveness_and_errors():
    records = {
        "w2": WorkerRecord(id="w2", pool="preemptible", engine="hf", slots=4),
        "w1": WorkerRecord(id="w1", pool="reserved", engine="hf", slots=8, url="http://x"),
        "gone": WorkerRecord(id="gone", gone_since=5.0),  # forgotten: no registration left
    }
    beat = factories.beat("w1", "reserved", 3, run_id="r1", active=2, tokens_generated=7, at=1.0)
    workers = worker_list(records, {"w1": beat}, {"w2": {"error": "OOM"}})
    assert [w.id for w in workers] == ["w1", "w2"]
    assert workers[0].alive and workers[0].version == 3 and workers[0].active == 2
    assert not workers[1].alive and workers[1].last_error == "OOM"
    docs = worker_docs(workers)
    assert [w["id"] for w in json.loads(docs[True].body)] == ["w1"]
    assert [w["id"] for w in json.loads(docs[False].body)] == ["w2"]
    assert len(json.loads(docs[None].body)) == 2


def test_the_fleet_is_the_live_runs_and_the_pool_they_want():
    def record(run_id: str, state: str, wanted: int | None) -> RunRecord:
        return RunRecord(id=run_id, state=state, preemptible_wanted=wanted)

    assert json.loads(fleet_doc([]).body) == {
        "runs_active": 0,
        "preemptible_wanted": 0,
        "active_runs": [],
        "runs": [],
    }
    ended = [record("a", "succeeded", 5), record("b", "failed", 3), record("c", "queued", None)]
    assert json.loads(fleet_doc(ended).body)["runs_active"] == 0  # a kept figure counts not
    live = [record("d", "running", 4), *ended, record("e", "stalled", 2)]
    unused = {"id": "d", "share": 1.0, "workers": 0, "slots": 0, "active": 0}
    assert json.loads(fleet_doc(live).body) == {
        "runs_active": 2,
        "preemptible_wanted": 6,
        "active_runs": ["d", "e"],
        "runs": [unused, unused | {"id": "e"}],
    }
    fresh = json.loads(fleet_doc([record("f", "running", None)]).body)
    assert (fresh["runs_active"], fresh["preemptible_wanted"]) == (1, 0)  # no figure yet


def test_the_fleet_says_each_live_runs_share_and_the_workers_serving_it():
    heavy = RunRecord(
        id="d", state="running", spec=RunSpec(model="/m", share=2.5).model_dump_json()
    )
    light = RunRecord(id="e", state="running")
    beats = {
        "w1": factories.beat("w1", run_id="d", slots=8, active=3),
        "w2": factories.beat("w2", run_id="d", slots=16, active=5),
        "w3": factories.beat("w3", run_id="e", slots=8, active=1),
        "w4": factories.beat("w4", run_id=None),
    }
    runs = json.loads(fleet_doc([heavy, light], beats).body)["runs"]
    assert runs == [
        {"id": "d", "share": 2.5, "workers": 2, "slots": 24, "active": 8},
        {"id": "e", "share": 1.0, "workers": 1, "slots": 8, "active": 1},
    ]


def test_a_worker_serving_several_runs_is_listed_and_counted_with_each_runs_load():
    records = {"w1": WorkerRecord(id="w1", pool="preemptible", engine="vllm", slots=8)}
    (listed,) = json.loads(worker_docs(worker_list(records, {"w1": BOTH}, {}))[True].body)
    assert (listed["run_id"], listed["version"], listed["active"]) == ("a", 3, 6)
    assert listed["runs"] == {
        "a": {"version": 3, "active": 2, "paused": False},
        "b": {"version": 5, "active": 4, "paused": False},
    }
    one = worker_list(records, {"w1": factories.beat("w1", version=2, run_id="a", active=1)}, {})
    assert one[0].runs["a"].version == 2 and list(one[0].runs) == ["a"]
    live = [RunRecord(id="a", state="running"), RunRecord(id="b", state="running")]
    runs = json.loads(fleet_doc(live, {"w1": BOTH}).body)["runs"]
    assert [(r["id"], r["workers"], r["active"]) for r in runs] == [("a", 1, 2), ("b", 1, 4)]


def test_a_release_order_names_the_run_where_the_worker_serves_several():
    assert release_run("w1", BOTH, "b") == "b"
    assert release_run("w1", factories.beat("w1", run_id="a"), None) == "a"
    for named in (None, "c"):
        with pytest.raises(HTTPException) as refused:
            release_run("w1", BOTH, named)
        assert refused.value.status_code == 400
    with pytest.raises(HTTPException) as idle:
        release_run("w1", factories.beat("w1", run_id=None), None)
    assert idle.value.status_code == 409
