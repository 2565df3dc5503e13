"""The step metrics rows against a real redis-server: two writers fill different fields of one
row, only the fields set are written, a field an older or newer service wrote is ignored by the
readers, and the rows come back by step."""

import asyncio
import json
import math

import pytest

from services.contracts import keys
from services.infra.redis_streams import connect
from services.state.step_metrics import StepRow, read_step, read_steps, record_step, row_dict

RUN = "run-metrics"


def test_two_writers_fill_one_row_and_readers_ignore_what_they_do_not_know(empty_redis_url):
    async def scenario():
        r = connect(empty_redis_url)
        rollout = StepRow(version=1, reward_mean=0.5, t_seed_s=math.inf, migrations={"seed": 1})
        await record_step(r, RUN, 1, rollout)
        await record_step(r, RUN, 1, StepRow(train_s=2.0, policy_loss=0.1))
        await record_step(r, RUN, 0, StepRow(trainer_resumed=True))
        raw = await r.hgetall(keys.run_step(RUN, 1))
        assert {k.decode(): json.loads(v) for k, v in raw.items()} == {
            "version": 1,
            "reward_mean": 0.5,
            "t_seed_s": None,
            "migrations": {"seed": 1},
            "train_s": 2.0,
            "policy_loss": 0.1,
        }
        await r.hset(keys.run_step(RUN, 1), "written_by_a_newer_service", "[1, 2]")
        row = await read_step(r, RUN, 1)
        assert row.reward_mean == 0.5 and row.train_s == 2.0 and row.t_seed_s == math.inf
        rows = await read_steps(r, RUN)
        assert [x.step for x in rows] == [0, 1] and rows[1] == row
        assert row_dict(rows[0]) == {"step": 0, "trainer_resumed": True}
        assert await read_step(r, RUN, 9) == StepRow(step=9)
        with pytest.raises(TypeError, match="rewrd"):
            StepRow(rewrd=1.0)  # type: ignore[call-arg]
        await r.aclose()

    asyncio.run(scenario())
