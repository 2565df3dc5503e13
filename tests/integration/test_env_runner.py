"""The environment runner with real environment processes: a normal episode; an environment
that hangs (killed at the time limit, counted, the next call works), crashes its process
(os._exit, SIGKILL), allocates past the memory limit, returns a bad feedback, or opens a socket
to a port this test listens on (refused without network, connected with allow_network); calls in
parallel; a module off the allow list refused before any process imports it.

`Misbehaves` below is the environment under test: its processes import this module (importable
from the repository root, where the tests run)."""

import asyncio
import os
import signal
import socket
import time

import pytest
from prometheus_client import REGISTRY

from services.environments.choice import EnvironmentChoice, EnvironmentNotAllowed
from services.environments.protocol import Feedback, Turn, episode_over, trajectory_reward
from services.environments.runner import EnvRunner

pytestmark = pytest.mark.slow
MISBEHAVES = EnvironmentChoice(f"{__name__}:Misbehaves")
TIMEOUT_S = 1.0
MEET_TIMEOUT_S = 20.0


class Misbehaves:
    """Does what the row's `kind` says; `ok` answers "fine" and ends the episode."""

    tools = ()
    max_turns = 2

    def opening(self, row):
        return f"kind {row['kind']}"

    def step(self, row, turns, feedback):
        kind = row["kind"]
        if kind == "hang":
            time.sleep(3600)
        if kind == "exit":
            os._exit(3)
        if kind == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        if kind == "allocate":
            return Feedback(str(len(bytearray(row["bytes"]))))
        if kind == "nan":
            return Feedback("", float("nan"))
        if kind == "connect":
            with socket.create_connection(("127.0.0.1", row["port"]), timeout=5):
                return Feedback("connected")
        if kind == "environ":  # what of its parent's environment the process was given
            return Feedback(" ".join(f"{k}={os.environ.get(k, '-')}" for k in row["names"]))
        if kind == "meet":  # opening one end of a FIFO waits until the other call opens the other
            with open(row["fifo"], row["mode"]):
                return Feedback("met")
        return Feedback("fine", 1.0, done=True)


def errors(kind: str) -> float:
    value = REGISTRY.get_sample_value("spotrl_coordinator_environment_errors_total", {"kind": kind})
    return value or 0.0


async def open_runner(**options) -> EnvRunner:
    options.setdefault("allowed_modules", [__name__])
    options.setdefault("call_timeout_s", TIMEOUT_S)
    runner = EnvRunner(options.pop("choice", MISBEHAVES), **options)
    await runner.start()
    return runner


async def step(runner: EnvRunner, row: dict):
    return await runner.step(row, [Turn("")], [])


def test_a_normal_episode_of_retry_arithmetic():
    async def main():
        runner = await open_runner(choice=EnvironmentChoice("retry_arithmetic"), processes=2)
        try:
            assert runner.tools == [] and runner.max_turns == 3
            row = {"prompt": "37+58=", "answer": "95"}
            assert (await runner.opening(row)).text == "37+58="
            turns, feedback = [], []
            for text in ("94", "95"):
                turns.append(Turn(text))
                result = await runner.step(row, turns, feedback)
                assert result.error == ""
                feedback.append(result.feedback)
                if episode_over(runner.max_turns, len(turns), result.feedback):
                    break
            assert [f.observation for f in feedback] == [" no\n37+58=", ""]
            assert trajectory_reward(feedback) == 0.5
        finally:
            await runner.close()

    asyncio.run(main())


def test_environment_code_gets_none_of_the_services_credentials(monkeypatch):
    """The coordinator's Redis URL and tokens are not in an environment process's environment;
    the user's own variables are (a tool's API key)."""
    monkeypatch.setenv("SPOTRL_REDIS_URL", "rediss://spotrl-coordinator:secret@redis:6379/0")
    monkeypatch.setenv("SPOTRL_API_TOKEN", "admin-secret")
    monkeypatch.setenv("REDISCLI_AUTH", "redis-secret")
    monkeypatch.setenv("MY_TOOL_KEY", "kept")
    names = ["SPOTRL_REDIS_URL", "SPOTRL_API_TOKEN", "REDISCLI_AUTH", "MY_TOOL_KEY"]

    async def main():
        runner = await open_runner(processes=1)
        try:
            seen = await step(runner, {"kind": "environ", "names": names})
            assert seen.error == "", seen
            assert seen.feedback.observation == (
                "SPOTRL_REDIS_URL=- SPOTRL_API_TOKEN=- REDISCLI_AUTH=- MY_TOOL_KEY=kept"
            )
        finally:
            await runner.close()

    asyncio.run(main())


def test_a_hang_is_killed_at_the_time_limit_counted_and_the_next_call_works():
    async def main():
        runner = await open_runner(processes=1)
        try:
            before = errors("timeout")
            started = time.monotonic()
            hung = await step(runner, {"kind": "hang"})
            took = time.monotonic() - started
            assert hung.error == "timeout" and hung.feedback == Feedback("", 0.0, done=True)
            assert TIMEOUT_S <= took < TIMEOUT_S + 5.0, took
            assert errors("timeout") == before + 1
            assert not runner.pool[0].running  # killed; started again by the next call
            assert (await step(runner, {"kind": "ok"})).feedback.observation == "fine"
            assert runner.pool[0].starts == 2
        finally:
            await runner.close()

    asyncio.run(main())


def test_a_call_that_kills_its_process_is_counted_and_the_next_call_works():
    async def main():
        runner = await open_runner(processes=1)
        try:
            before = errors("crashed")
            for kind in ("exit", "sigkill"):
                crashed = await step(runner, {"kind": kind})
                assert crashed.error == "crashed" and crashed.feedback.done, kind
                assert (await step(runner, {"kind": "ok"})).error == ""
            assert errors("crashed") == before + 2
            assert runner.pool[0].starts == 3
        finally:
            await runner.close()
        assert not any(p.running for p in runner.pool)

    asyncio.run(main())


def test_an_allocation_past_the_memory_limit_fails_and_a_bad_feedback_is_counted():
    async def main():
        runner = await open_runner(processes=1, memory_limit_mb=256)
        try:
            small = await step(runner, {"kind": "allocate", "bytes": 16 << 20})
            assert small.feedback.observation == str(16 << 20)
            before = errors("raised"), errors("bad_feedback")
            big = await step(runner, {"kind": "allocate", "bytes": 512 << 20})
            assert (big.error, big.detail) == ("raised", "MemoryError: ")
            assert (await step(runner, {"kind": "nan"})).error == "bad_feedback"
            assert (errors("raised"), errors("bad_feedback")) == (before[0] + 1, before[1] + 1)
            assert (await step(runner, {"kind": "ok"})).error == ""
        finally:
            await runner.close()

    asyncio.run(main())


@pytest.fixture
def listener():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(8)
        server.setblocking(False)
        yield server


def test_no_network_by_default_and_network_with_allow_network(listener):
    row = {"kind": "connect", "port": listener.getsockname()[1]}

    async def main():
        sealed = await open_runner(processes=1)
        try:
            refused = await step(sealed, row)
            assert refused.error == "raised" and "OSError" in refused.detail, refused
        finally:
            await sealed.close()
        with pytest.raises(BlockingIOError):
            listener.accept()  # nothing reached the port
        open_ = await open_runner(processes=1, allow_network=True)
        try:
            assert (await step(open_, row)).feedback.observation == "connected"
        finally:
            await open_.close()
        conn, _ = listener.accept()
        conn.close()

    asyncio.run(main())


def test_calls_run_in_parallel_one_per_process(tmp_path):
    fifo = tmp_path / "meet"
    os.mkfifo(fifo)

    async def main():
        # one call after the other would time out: each waits until the other has started
        runner = await open_runner(processes=2, call_timeout_s=MEET_TIMEOUT_S)
        try:
            rows = [{"kind": "meet", "fifo": str(fifo), "mode": mode} for mode in ("rb", "wb")]
            met = await asyncio.gather(*(step(runner, row) for row in rows))
            assert [(r.error, r.feedback.observation) for r in met] == [("", "met")] * 2
        finally:
            await runner.close()

    asyncio.run(main())


def test_a_module_off_the_allow_list_is_refused_before_any_process_starts():
    async def main():
        runner = EnvRunner(MISBEHAVES, allowed_modules=["some.other.module"])
        with pytest.raises(EnvironmentNotAllowed, match="not on the coordinator's allow list"):
            await runner.start()
        assert all(p.starts == 0 for p in runner.pool)

    asyncio.run(main())
