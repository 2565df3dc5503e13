"""Scoring a run's responses without ever blocking or stopping the coordinator.

A reward that may hang or crash (a user function, a pattern from the spec, sympy) runs in reward
processes (`reward_worker.py`) that the runner kills and starts again when a call takes longer
than the spec's `reward_timeout_s` or kills its process; exact and numeric matches run in a
thread. A call that raises, hangs, crashes its process or returns no finite number scores 0 and
is counted (`spotrl_coordinator_reward_errors_total{kind}`, and per step by the caller); only a
reward that cannot be loaded at all is an error (RewardLoadError).
"""

import abc
import asyncio
import contextlib
import logging
import os
import signal
import sys
from collections.abc import Sequence
from typing import TypeVar

from prometheus_client import Counter

from services.coordinator.reward_protocol import (
    HEADER,
    MAX_REPLY_BYTES,
    Loaded,
    LoadReward,
    ScoreBatch,
    decode,
    frame,
)
from services.environments.sandbox import user_code_environ
from services.tasks.base import Example
from services.tasks.reward_choice import (
    CRASHED,
    ERROR_KINDS,
    TIMEOUT,
    Outcome,
    RewardChoice,
    RewardLoadError,
    call_reward,
)

log = logging.getLogger(__name__)
REWARD_ERRORS = Counter(
    "spotrl_coordinator_reward_errors_total",
    "Reward calls scored 0 because the reward raised, timed out, crashed its process or "
    "returned no finite number",
    ["kind"],
)
ERRORS = {kind: REWARD_ERRORS.labels(kind) for kind in ERROR_KINDS}
LOAD_TIMEOUT_S = 60.0  # to import a user reward's module
Call = tuple[Example, str]  # an example and a decoded response
T = TypeVar("T")


class ProcessGone(Exception):
    """The reward process exited or closed its side of the pipes."""


class RewardProcess:
    """One reward process, with the reward loaded; started again after a call hung or
    crashed it."""

    def __init__(self, choice: RewardChoice, timeout_s: float) -> None:
        self.choice, self.timeout_s = choice, timeout_s
        self.proc: asyncio.subprocess.Process | None = None
        self.restarts = 0

    async def start(self) -> None:
        """Start the process and load the reward; RewardLoadError when it cannot."""
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "services.coordinator.reward_worker",
            str(os.getpid()),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            start_new_session=True,  # its own process group: a kill takes its children too
            env=user_code_environ(),  # none of this service's credentials
        )
        c = self.choice
        try:
            await self._send(LoadReward(c.name, c.answer_regex, c.tolerance))
            async with asyncio.timeout(LOAD_TIMEOUT_S):  # not wait_for: see infra/cancel.py
                loaded = await self._read(Loaded)
        except (ProcessGone, TimeoutError):
            await self.stop()
            raise RewardLoadError(f"reward {c.name}: its process did not load it") from None
        if loaded.error:
            await self.stop()
            raise RewardLoadError(loaded.error)

    async def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):  # it exited meanwhile
                os.killpg(proc.pid, signal.SIGKILL)
        await proc.wait()

    async def _send(self, message: object) -> None:
        assert self.proc is not None and self.proc.stdin is not None
        try:
            self.proc.stdin.write(frame(message))
            await self.proc.stdin.drain()
        except (BrokenPipeError, ConnectionResetError):
            raise ProcessGone from None

    async def _read(self, kind: type[T]) -> T:
        assert self.proc is not None and self.proc.stdout is not None
        try:
            (size,) = HEADER.unpack(await self.proc.stdout.readexactly(HEADER.size))
            if size > MAX_REPLY_BYTES:
                raise ProcessGone
            return decode(await self.proc.stdout.readexactly(size), kind)
        except asyncio.IncompleteReadError:
            raise ProcessGone from None

    async def score(
        self, examples: list[tuple[str, str, dict]], calls: list[tuple[int, str]]
    ) -> list[Outcome]:
        """One outcome per call, in order: the one that hangs or crashes the process scores 0,
        and the calls after it go to a new process."""
        out: list[Outcome] = []
        resent_at = -1  # a process found dead before a batch is replaced once, free
        while len(out) < len(calls):
            if self.proc is None:
                self.restarts += 1
                await self.start()
            pending = calls[len(out) :]
            try:
                await self._send(ScoreBatch(examples, pending))
            except ProcessGone:
                await self.stop()
                if resent_at != len(out):
                    resent_at = len(out)
                    continue
                out.append(Outcome(0.0, CRASHED, "the reward process exited"))
                continue
            try:
                for _ in pending:
                    async with asyncio.timeout(self.timeout_s):
                        out.append(await self._read(Outcome))
            except TimeoutError:
                out.append(Outcome(0.0, TIMEOUT, f"no score after {self.timeout_s:g} s"))
                await self.stop()
            except ProcessGone:
                out.append(Outcome(0.0, CRASHED, "the reward process exited"))
                await self.stop()
        return out


class RewardRunner(abc.ABC):
    """Scores calls with a run's reward; `open_runner` builds the right one."""

    async def score(self, calls: Sequence[Call]) -> list[Outcome]:
        outcomes = await self._score(calls)
        for outcome in outcomes:
            if outcome.error:
                ERRORS[outcome.error].inc()
        return outcomes

    @abc.abstractmethod
    async def _score(self, calls: Sequence[Call]) -> list[Outcome]:
        """One outcome per call, in order."""

    async def close(self) -> None:  # noqa: B027  (most runners start nothing)
        """Stop what it started."""


class ThreadRewards(RewardRunner):
    """A reward that is linear in the response (exact, numeric match): called in a thread."""

    def __init__(self, choice: RewardChoice) -> None:
        self.scorer = choice.load()

    async def _score(self, calls: Sequence[Call]) -> list[Outcome]:
        if not calls:
            return []
        return await asyncio.to_thread(
            lambda: [call_reward(self.scorer, example, text) for example, text in calls]
        )


class ProcessRewards(RewardRunner):
    """A reward that may hang or crash: `processes` reward processes share each batch."""

    def __init__(self, choice: RewardChoice, timeout_s: float, processes: int) -> None:
        self.pool = [RewardProcess(choice, timeout_s) for _ in range(processes)]

    async def start(self) -> None:
        try:
            await asyncio.gather(*(p.start() for p in self.pool))
        except BaseException:
            await self.close()
            raise

    async def _score(self, calls: Sequence[Call]) -> list[Outcome]:
        if not calls:
            return []
        # each example once, however many of its responses are in the batch
        index: dict[int, int] = {}
        examples: list[tuple[str, str, dict]] = []
        indexed: list[tuple[int, str]] = []
        for example, text in calls:
            if id(example) not in index:
                index[id(example)] = len(examples)
                examples.append((example.prompt, example.answer, example.row))
            indexed.append((index[id(example)], text))
        share = -(-len(indexed) // len(self.pool))  # ceil
        chunks = [indexed[i : i + share] for i in range(0, len(indexed), share)]
        parts = await asyncio.gather(
            *(p.score(examples, c) for p, c in zip(self.pool, chunks, strict=False))
        )
        return [outcome for part in parts for outcome in part]

    async def close(self) -> None:
        await asyncio.gather(*(p.stop() for p in self.pool))


async def open_runner(choice: RewardChoice, timeout_s: float, processes: int) -> RewardRunner:
    """The runner of a run's reward, its processes started and the reward loaded in them
    (RewardLoadError when it cannot be)."""
    if not choice.isolated:
        return ThreadRewards(choice)
    runner = ProcessRewards(choice, timeout_s, processes)
    await runner.start()
    return runner


async def check_loads(choice: RewardChoice) -> None:
    """RewardLoadError unless a user reward loads, in a process of its own that is then
    stopped (the submit check: the coordinator's API process never imports a user's module)."""
    if choice.builtin:
        return
    probe = RewardProcess(choice, timeout_s=1.0)
    await probe.start()
    await probe.stop()
