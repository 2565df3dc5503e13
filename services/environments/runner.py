"""Running an environment's calls without ever blocking or stopping the caller.

`EnvRunner` keeps `processes` environment processes (`worker.py`), each with the environment
loaded, an address-space limit and, unless `allow_network`, no network; calls run in parallel,
one per idle process. A call that takes longer than `call_timeout_s` gets its process killed
(its whole process group) and started again before the process's next call. A call that raises,
times out, crashes its process or returns a bad value ends its episode:
`Feedback("", 0.0, done=True)` (or an empty opening) with the error's kind, counted in
`spotrl_coordinator_environment_errors_total{kind}`. Only an environment that cannot be loaded,
or a sandbox that cannot be built, is an error (EnvironmentLoadError, NetworkIsolationError).

Why not the reward runner's processes (services/coordinator/reward_runner.py): a reward process
scores batches and streams one outcome per call; an environment process answers one call at a
time inside a sandbox. What both do alike (the frames, starting a process in its own group and
killing the group) is some forty lines; its shared home would be a module of services/infra
that both import, not one package importing the other.
"""

import asyncio
import contextlib
import logging
import os
import signal
import sys
import time
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client import Counter, Histogram

from services.environments.choice import EnvironmentChoice, EnvironmentLoadError
from services.environments.protocol import CRASHED, ERROR_KINDS, TIMEOUT, Feedback, Turn
from services.environments.sandbox import user_code_environ
from services.environments.wire import (
    HEADER,
    MAX_REPLY_BYTES,
    Call,
    Loaded,
    LoadEnvironment,
    OpeningCall,
    Reply,
    StepCall,
    decode,
    frame,
)

log = logging.getLogger(__name__)
ENVIRONMENT_ERRORS = Counter(
    "spotrl_coordinator_environment_errors_total",
    "Environment calls that ended their episode because the environment raised, timed out, "
    "crashed its process or returned a bad feedback",
    ["kind"],
)
ERRORS = {kind: ENVIRONMENT_ERRORS.labels(kind) for kind in ERROR_KINDS}
CALL_SECONDS = Histogram(
    "spotrl_coordinator_environment_call_seconds",
    "Time of one environment call (opening or step), from taking a process to its answer",
    buckets=(0.001, 0.005, 0.02, 0.1, 0.5, 2.0, 10.0, 60.0),
)
LOAD_TIMEOUT_S = 60.0  # to start a process and import a user environment's module
MIB = 1024 * 1024


class NetworkIsolationError(RuntimeError):
    """No network namespace could be entered and the network is not allowed."""


class ProcessGone(Exception):
    """The environment process exited or closed its side of the pipes."""


@dataclass(frozen=True)
class StepResult:
    """One step call: the feedback, and why the episode was ended when it failed."""

    feedback: Feedback
    error: str = ""  # one of protocol.ERROR_KINDS, or ""
    detail: str = ""
    at: str = ""  # where in the environment's code (`wire.Reply.at`)
    trace: str = ""  # what raised's traceback (`wire.Reply.trace`)

    @property
    def short(self) -> str:
        """The failure in one line: its kind, what went wrong and where."""
        where = f" (at {self.at})" if self.at else ""
        return f"{self.error}: {self.detail}{where}" if self.error else ""


@dataclass(frozen=True)
class OpeningResult:
    """One opening call: the episode's first message ("" when it failed) and why."""

    text: str
    error: str = ""
    detail: str = ""


FAILED = Feedback("", 0.0, done=True)


class EnvProcess:
    """One environment process with the environment loaded; started again after a call hung
    or crashed it."""

    def __init__(self, load: LoadEnvironment) -> None:
        self.load = load
        self.proc: asyncio.subprocess.Process | None = None
        self.loaded = Loaded()
        self.starts = 0

    async def start(self) -> Loaded:
        """Start the process and load the environment; EnvironmentLoadError when it cannot,
        NetworkIsolationError when its sandbox cannot be built."""
        self.starts += 1
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "services.environments.worker",
            str(os.getpid()),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            start_new_session=True,  # its own process group: a kill takes its children too
            env=user_code_environ(),  # none of this service's credentials
        )
        try:
            await self._send(self.load)
            async with asyncio.timeout(LOAD_TIMEOUT_S):  # not wait_for: see infra/cancel.py
                loaded = await self._read(Loaded)
        except (ProcessGone, TimeoutError):
            await self.stop()
            raise EnvironmentLoadError(
                f"environment {self.load.name}: its process did not load it"
            ) from None
        if loaded.error:
            await self.stop()
            raise (NetworkIsolationError if loaded.network_refused else EnvironmentLoadError)(
                loaded.error
            )
        self.loaded = loaded
        return loaded

    async def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):  # it exited meanwhile
                os.killpg(proc.pid, signal.SIGKILL)
        await proc.wait()

    async def call(self, message: Call, timeout_s: float) -> Reply:
        """One call's reply; a call that times out or finds the process dead gets its error,
        and the process is stopped (started again by the next call)."""
        if self.proc is None:
            await self.start()
        try:
            await self._send(message)
            async with asyncio.timeout(timeout_s):
                return await self._read(Reply)
        except TimeoutError:
            await self.stop()
            return Reply(error=TIMEOUT, detail=f"no answer after {timeout_s:g} s")
        except ProcessGone:
            await self.stop()
            return Reply(error=CRASHED, detail="the environment process exited")
        except asyncio.CancelledError:  # its reply would answer the next call: kill it now
            self._kill()
            raise

    def _kill(self) -> None:
        """Kill the process group without waiting (asyncio's child watcher reaps it)."""
        proc, self.proc = self.proc, None
        if proc is not None and proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)

    async def _send(self, message: object) -> None:
        assert self.proc is not None and self.proc.stdin is not None
        try:
            self.proc.stdin.write(frame(message))
            await self.proc.stdin.drain()
        except (BrokenPipeError, ConnectionResetError):
            raise ProcessGone from None

    async def _read(self, kind: Any) -> Any:
        assert self.proc is not None and self.proc.stdout is not None
        try:
            (size,) = HEADER.unpack(await self.proc.stdout.readexactly(HEADER.size))
            if size > MAX_REPLY_BYTES:
                raise ProcessGone
            return decode(await self.proc.stdout.readexactly(size), kind)
        except asyncio.IncompleteReadError:
            raise ProcessGone from None


class EnvRunner:
    """A run's environment in `processes` sandboxed processes; `start` before the first call,
    `close` at the end."""

    def __init__(
        self,
        choice: EnvironmentChoice,
        *,
        allowed_modules: Collection[str] = (),
        processes: int = 2,
        call_timeout_s: float = 10.0,
        memory_limit_mb: int = 2048,
        allow_network: bool = False,
    ) -> None:
        self.choice, self.allowed_modules = choice, allowed_modules
        self.call_timeout_s = call_timeout_s
        load = LoadEnvironment(choice.name, memory_limit_mb * MIB, not allow_network)
        self.pool = [EnvProcess(load) for _ in range(max(1, processes))]
        self._idle: asyncio.Queue[EnvProcess] = asyncio.Queue()
        self.tools: list[dict[str, Any]] = []
        self.max_turns = 0

    async def start(self) -> None:
        """Start every process with the environment loaded. EnvironmentNotAllowed for a user
        module off the allow list (checked before any process imports it),
        EnvironmentLoadError or NetworkIsolationError when it cannot be run."""
        self.choice.check_allowed(self.allowed_modules)
        try:
            loaded = await asyncio.gather(*(p.start() for p in self.pool))
        except BaseException:
            await self.close()
            raise
        self.tools, self.max_turns = loaded[0].tools, loaded[0].max_turns
        for process in self.pool:
            self._idle.put_nowait(process)

    async def opening(self, row: Mapping[str, Any]) -> OpeningResult:
        reply = await self._call(OpeningCall(dict(row)))
        return OpeningResult(reply.opening, reply.error, reply.detail)

    async def step(
        self, row: Mapping[str, Any], turns: Sequence[Turn], feedback: Sequence[Feedback]
    ) -> StepResult:
        """The answer to the last of `turns` (len(feedback) == len(turns) - 1)."""
        if len(feedback) != len(turns) - 1:
            raise ValueError(
                f"{len(turns)} turns need {len(turns) - 1} feedback, not {len(feedback)}"
            )
        reply = await self._call(StepCall(dict(row), list(turns), list(feedback)))
        if reply.error or reply.feedback is None:
            return StepResult(FAILED, reply.error or CRASHED, reply.detail, reply.at, reply.trace)
        return StepResult(reply.feedback)

    async def _call(self, message: Call) -> Reply:
        process = await self._idle.get()
        started = time.monotonic()
        try:
            reply = await self._call_on(process, message)
        finally:
            self._idle.put_nowait(process)
        CALL_SECONDS.observe(time.monotonic() - started)
        if reply.error:  # told once per step by its caller, the first with its traceback
            ERRORS[reply.error].inc()
            log.debug("environment %s: %s (%s)", self.choice.name, reply.error, reply.detail)
        return reply

    async def _call_on(self, process: EnvProcess, message: Call) -> Reply:
        try:
            return await process.call(message, self.call_timeout_s)
        except (EnvironmentLoadError, NetworkIsolationError) as exc:  # a restart that failed
            return Reply(error=CRASHED, detail=f"could not start again: {exc}")

    async def close(self) -> None:
        await asyncio.gather(*(p.stop() for p in self.pool))
