"""Running an environment's calls without ever blocking or stopping the caller.

`EnvRunner` keeps `processes` environment processes (`worker.py`), each with the environment
loaded, an address-space limit and, unless `allow_network`, no network; calls run in parallel,
one per idle process. A call that takes longer than `call_timeout_s` gets its process killed
(its whole process group) and started again before the process's next call. A call that raises,
times out, crashes its process or returns a bad value ends its episode:
`Feedback("", 0.0, done=True)` (or an empty opening) with the error's kind, counted in
`spotrl_coordinator_environment_errors_total{kind}`. Only an environment that cannot be loaded,
or a sandbox that cannot be built, is an error (EnvironmentLoadError, NetworkIsolationError).

The processes are `services.infra.child_process` children, talking in its frames; what they
say is `wire.py`. A reward process (services/coordinator/scoring/rewards.py) is the same kind of
child with another policy: it scores batches and streams one outcome per call.
"""

import asyncio
import logging
import time
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client import Counter, Histogram

from services.environments.choice import EnvironmentChoice, EnvironmentLoadError
from services.environments.protocol import CRASHED, ERROR_KINDS, TIMEOUT, Feedback, Turn
from services.environments.sandbox import user_code_environ
from services.environments.wire import Call, Loaded, LoadEnvironment, OpeningCall, Reply, StepCall
from services.infra.child_process import ChildGone, ChildProcess

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
        # its own process group (a kill takes its children too), none of this service's
        # credentials in its environment
        self.child = ChildProcess(
            "services.environments.worker", env=user_code_environ, pipes=True, own_group=True
        )
        self.loaded = Loaded()

    @property
    def starts(self) -> int:
        return self.child.starts

    @property
    def running(self) -> bool:
        """Whether its process is up (a killed one is started again by the next call)."""
        return self.child.proc is not None

    async def start(self) -> Loaded:
        """Start the process and load the environment; EnvironmentLoadError when it cannot,
        NetworkIsolationError when its sandbox cannot be built."""
        await self.child.start()
        try:
            await self.child.send(self.load)
            async with asyncio.timeout(LOAD_TIMEOUT_S):  # not wait_for: see infra/cancel.py
                loaded = await self.child.read(Loaded)
        except (ChildGone, TimeoutError):
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
        await self.child.stop()

    async def call(self, message: Call, timeout_s: float) -> Reply:
        """One call's reply; a call that times out or finds the process dead gets its error,
        and the process is stopped (started again by the next call)."""
        if not self.running:
            await self.start()
        try:
            await self.child.send(message)
            async with asyncio.timeout(timeout_s):
                return await self.child.read(Reply)
        except TimeoutError:
            await self.stop()
            return Reply(error=TIMEOUT, detail=f"no answer after {timeout_s:g} s")
        except ChildGone:
            await self.stop()
            return Reply(error=CRASHED, detail="the environment process exited")
        except asyncio.CancelledError:  # its reply would answer the next call: kill it now
            self.child.kill()
            raise


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
