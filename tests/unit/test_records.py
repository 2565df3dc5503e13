"""The typed records of the Redis hashes (services/contracts/records.py) as a contract: a record
written is the record read back, a name that is not a field cannot be written, unknown or
mistyped fields in Redis are ignored on read; and no module outside the record modules of
services/state reads or writes the run, trainer-state or worker hashes by a field's name."""

import math
import re
from pathlib import Path

import pytest

from services.contracts.records import RunRecord, StepMeta, TrainerState, WorkerRecord

# Modules the lead engineer is converting to the record modules: allowed to touch the hashes
# directly until then. Remove a file from here once it is converted.
LEAD_CONVERTS: set[str] = set()
# The modules that read and write the hashes (each one record's, and their shared reader).
RECORD_MODULES = {
    "services/state/hashes.py",
    "services/state/run_record.py",
    "services/state/trainer_state.py",
    "services/state/worker_record.py",
}
ROOT = Path(__file__).resolve().parents[2]
HASH_CALL = re.compile(
    r"\.(hget|hgetall|hmget|hset|hsetnx|hincrby|hdel)\(\s*keys\.(run|trainer_state|worker)\("
)


def as_redis(fields: dict[str, str]) -> dict[bytes, bytes]:
    return {k.encode(): v.encode() for k, v in fields.items()}


RECORDS = [
    RunRecord(
        id="r1",
        spec='{"model": "m"}',
        state="stalled",
        created_at=1.5,
        started_at=2.25,
        error="",
        stall_reason="no worker serves version 3",
        stalled_since=1e9 + 0.125,
        t_seed_s=12.0,
        n_prem_recommended=math.inf,
        preemptible_wanted=4,
        groups_quarantined=2,
    ),
    RunRecord(id="r2", state="failed", finished_at=3.0, error="boom", n_prem_recommended=6.5),
    TrainerState(steps_trained=7, groups_trained=56, groups_incomplete=1),
    WorkerRecord(
        id="w1", pool="preemptible", engine="hf", slots=8, url="http://h:1", registered_at=9.5
    ),
    WorkerRecord(id="w2", pool="reserved", engine="vllm", slots=1, gone_since=10.0),
    StepMeta(queued=1, started_at=11.75),
]


@pytest.mark.parametrize("record", RECORDS, ids=lambda r: type(r).__name__)
def test_a_record_written_is_the_record_read_back(record):
    fields = record.fields()
    assert all(isinstance(v, str) for v in fields.values())
    assert type(record).from_hash(as_redis(fields)) == record
    assert type(record).from_hash(fields) == record  # str replies read the same


def test_the_encodings_stay_those_of_the_existing_hashes():
    fields = RunRecord.to_fields(
        created_at=1.5, n_prem_recommended=math.inf, preemptible_wanted=None, state="running"
    )
    # numbers as HSET writes them, the seeding figures as JSON (null: no limit, no wish)
    assert fields == {
        "created_at": "1.5",
        "n_prem_recommended": "null",
        "preemptible_wanted": "null",
        "state": "running",
    }
    assert RunRecord.from_hash({b"n_prem_recommended": b"null"}).n_prem_recommended == math.inf
    assert RunRecord.from_hash({b"preemptible_wanted": b"null"}).preemptible_wanted is None
    assert RunRecord.from_hash({b"t_seed_s": b"inf"}).t_seed_s == math.inf


@pytest.mark.parametrize(
    ("record", "changes"),
    [
        (RunRecord, {"stat": "failed"}),
        (RunRecord, {"state": "failed", "finshed_at": 1.0}),
        (TrainerState, {"steps_traned": 1}),
        (WorkerRecord, {"gone": 1.0}),
        (StepMeta, {"started": 1.0}),
    ],
)
def test_a_name_that_is_not_a_field_cannot_be_written(record, changes):
    with pytest.raises(TypeError, match="has no field"):
        record.to_fields(**changes)
    with pytest.raises(TypeError, match="has no field"):
        record.check_names(*changes)


@pytest.mark.parametrize(
    ("record", "changes"),
    [
        (RunRecord, {"state": "finished"}),
        (RunRecord, {"created_at": "now"}),
        (RunRecord, {"error": None}),
        (TrainerState, {"steps_trained": True}),
        (WorkerRecord, {"pool": "spot"}),
    ],
)
def test_a_value_of_the_wrong_type_cannot_be_written(record, changes):
    with pytest.raises(ValueError):
        record.to_fields(**changes)


def test_unknown_fields_and_values_of_the_wrong_type_are_ignored_on_read(caplog):
    raw = {
        b"state": b"running",
        b"created_at": b"yesterday",
        b"groups_quarantined": b"3",
        b"n_prem_recommended": b"{not json",
        b"preemptible_wanted": b'"many"',
        b"written_by_a_newer_version": b"1",
    }
    record = RunRecord.from_hash(raw, "spotrl:run:r1")
    assert record == RunRecord(state="running", groups_quarantined=3)
    ignored = {m for m in caplog.messages if "ignoring field" in m}
    assert len(ignored) == 3
    assert all("spotrl:run:r1" in m for m in ignored)
    assert WorkerRecord.from_hash({b"pool": b"spot", b"slots": b"2"}) == WorkerRecord(slots=2)
    assert TrainerState.from_hash({b"steps_trained": b"x"}) == TrainerState()


def test_fields_not_written_are_left_at_their_defaults():
    assert RunRecord.from_hash({b"state": b"queued", b"error": None}) == RunRecord(state="queued")
    assert WorkerRecord.from_hash({b"gone_since": b"5"}).pool is None


def test_no_module_reads_or_writes_a_record_hash_by_field_name():
    found = []
    for path in sorted((ROOT / "services").rglob("*.py")):
        name = path.relative_to(ROOT).as_posix()
        if name in RECORD_MODULES | LEAD_CONVERTS:
            continue
        text = path.read_text()
        for match in HASH_CALL.finditer(text):
            line = text.count("\n", 0, match.start()) + 1
            found.append(f"{name}:{line}: {match.group(0)}")
    assert not found, "use the record modules of services/state:\n" + "\n".join(found)


def test_the_scan_finds_a_call_spread_over_lines():
    assert HASH_CALL.search('pipe.hset(\n    keys.run(run_id),\n    mapping={"state": "x"})')
    assert HASH_CALL.search('await r.hget(keys.trainer_state(run_id), "steps_trained")')
    assert not HASH_CALL.search("r.hget(keys.run_digests(run_id), version)")
