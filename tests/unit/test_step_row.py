"""The step metrics row (services/state/step_metrics.py) as a typed contract: only `StepRow`'s
fields can be written, a row read back is the row written, unknown or mistyped fields in Redis
are ignored, infinity is null on the wire, and the REST API's row keeps its keys."""

import json
import math

import pytest

from services.state.step_metrics import (
    FIELDS,
    StepRow,
    from_hash,
    row_dict,
    row_from_values,
    to_hash,
)


def as_redis(fields: dict) -> dict[bytes, bytes]:
    return {str(k).encode(): str(v).encode() for k, v in fields.items()}


def test_a_field_that_is_not_in_the_row_cannot_be_written():
    with pytest.raises(TypeError, match="rewrd_mean"):
        StepRow(rewrd_mean=1.0)  # type: ignore[call-arg]


def test_only_the_fields_set_are_written_and_read_back_the_same():
    row = StepRow(
        version=3,
        reward_mean=0.5,
        migrations={"preemption": 2},
        stream_lengths={"deltas": 0, "groups": 4},
        trainer_resumed=True,
    )
    written = to_hash(row)
    assert set(written) == {
        "version",
        "reward_mean",
        "migrations",
        "stream_lengths",
        "trainer_resumed",
    }
    assert json.loads(written["migrations"]) == {"preemption": 2}
    back = from_hash(as_redis(written), step=7)
    assert back == StepRow(step=7, **{f: getattr(row, f) for f in FIELDS})
    assert back.train_s is None  # not written yet


def test_infinity_is_null_in_redis_and_in_the_api():
    row = StepRow(t_seed_s=math.inf, n_prem_recommended=math.inf, seed_s=1.5)
    written = to_hash(row)
    assert written["t_seed_s"] == "null" and written["n_prem_recommended"] == "null"
    back = from_hash(as_redis(written), step=0)
    assert back.t_seed_s == math.inf and back.n_prem_recommended == math.inf
    assert row_dict(back) == {
        "step": 0,
        "seed_s": 1.5,
        "t_seed_s": None,
        "n_prem_recommended": None,
    }
    assert row_from_values(row_dict(back), 0) == back  # the API's JSON parses back the same


def test_unknown_and_mistyped_fields_are_ignored_not_fatal():
    raw = as_redis(
        {
            "reward_mean": "0.25",
            "from_a_newer_service": "1",
            "version": '"three"',
            "kl": "not json",
            "rollout_s": "null",  # null of a bounded field: as if not written
        }
    )
    row = from_hash(raw, step=2)
    assert row == StepRow(step=2, reward_mean=0.25)


def test_the_api_row_has_step_first_then_the_fields_written():
    row = StepRow(step=4, train_s=2.0, groups_incomplete=0, policy_loss=0.0)
    assert row_dict(row) == {"step": 4, "policy_loss": 0.0, "train_s": 2.0, "groups_incomplete": 0}
    assert next(iter(row_dict(row))) == "step"
