"""The coordinator's reward runner with real reward processes: a user function that raises,
hangs, returns NaN or no number, or kills its process scores 0 and is counted by kind; a hang
costs the spec's timeout, and the runner goes on scoring after it."""

import asyncio
import time

import pytest
from prometheus_client import REGISTRY

from services.coordinator.scoring.rewards import (
    ProcessRewards,
    ThreadRewards,
    check_loads,
    open_runner,
)
from services.tasks import Example, RewardChoice
from services.tasks.reward_choice import RewardLoadError

MISBEHAVES = RewardChoice("tests.data.user_reward:misbehaves")
TIMEOUT_S = 0.5


def errors(kind: str) -> float:
    value = REGISTRY.get_sample_value("spotrl_coordinator_reward_errors_total", {"kind": kind})
    return value or 0.0


def rows(*kinds: str) -> list[tuple[Example, str]]:
    return [(Example("p", "", {"kind": kind}), "response") for kind in kinds]


def test_failures_score_zero_are_counted_and_a_hang_costs_the_timeout():
    async def main():
        runner = await open_runner(MISBEHAVES, TIMEOUT_S, processes=1)
        assert isinstance(runner, ProcessRewards)
        try:
            before = {k: errors(k) for k in ("raised", "timeout", "not_finite", "not_number")}
            started = time.monotonic()
            outcomes = await runner.score(rows("ok", "raise", "hang", "nan", "text", "ok"))
            took = time.monotonic() - started
            assert [o.error for o in outcomes] == [
                "",
                "raised",
                "timeout",
                "not_finite",
                "not_number",
                "",
            ]
            assert [o.value for o in outcomes] == [1.0, 0.0, 0.0, 0.0, 0.0, 1.0]
            assert outcomes[1].detail == "ValueError: the reward raised on purpose"
            assert TIMEOUT_S <= took < TIMEOUT_S + 3.0, took  # one timeout and one restart
            for kind in before:
                assert errors(kind) == before[kind] + 1, kind
            # the hung process was replaced: the runner still scores
            assert [o.value for o in await runner.score(rows("ok", "ok"))] == [1.0, 1.0]
            assert runner.pool[0].restarts == 1
        finally:
            await runner.close()

    asyncio.run(main())


def test_a_call_that_kills_its_process_is_counted_and_the_rest_are_scored():
    async def main():
        runner = await open_runner(MISBEHAVES, 5.0, processes=2)
        try:
            before = errors("crashed")
            outcomes = await runner.score(rows("ok", "exit", "ok", "ok", "exit", "ok"))
            assert [o.error for o in outcomes] == ["", "crashed", "", "", "crashed", ""]
            assert errors("crashed") == before + 2
        finally:
            await runner.close()
        assert not any(p.running for p in runner.pool)

    asyncio.run(main())


def test_reward_code_gets_none_of_the_services_credentials(monkeypatch):
    monkeypatch.setenv("SPOTRL_API_TOKEN", "admin-secret")

    async def main():
        runner = await open_runner(MISBEHAVES, 5.0, processes=1)
        try:
            assert [o.value for o in await runner.score(rows("secret"))] == [1.0]
        finally:
            await runner.close()

    asyncio.run(main())


def test_linear_built_ins_run_in_a_thread_others_in_processes():
    async def main():
        exact = await open_runner(RewardChoice("exact_match"), 1.0, processes=1)
        assert isinstance(exact, ThreadRewards)
        example = Example("1+1=", "2")
        assert [o.value for o in await exact.score([(example, "2"), (example, "3")])] == [1, 0]
        boxed = await open_runner(RewardChoice("boxed_match"), 30.0, processes=1)
        try:
            assert [o.value for o in await boxed.score([(example, "\\boxed{2}")])] == [1.0]
        finally:
            await boxed.close()

    asyncio.run(main())


def test_a_reward_that_does_not_load_is_an_error_at_once():
    async def main():
        await check_loads(MISBEHAVES)
        with pytest.raises(RewardLoadError, match="No module named"):
            await check_loads(RewardChoice("tests.data.no_such_module:f"))
        with pytest.raises(RewardLoadError, match="has no function 'nope'"):
            await open_runner(RewardChoice("tests.data.user_reward:nope"), 1.0, processes=2)

    asyncio.run(main())
