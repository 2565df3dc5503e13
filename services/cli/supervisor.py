"""Keeping the rollout workers of `spotrl up` alive, and knowing when to give up.

The decisions are pure and take a clock: `RestartPolicy` (when to restart a worker that died:
exponential backoff, reset once it stayed up a while) and `StallGuard` (when `spotrl up` stops
waiting for a run that cannot progress). `WorkerSupervisor` is the thin shell that applies them
to a `LocalDeployment`, polled from the loop that follows the run. It does not own workers that a
chaos replay starts and kills on purpose: it watches only the workers it is given.
"""

import re
import signal
from collections.abc import Callable
from dataclasses import dataclass, field

from services.cli.procs import Proc

LOG_TAIL_LINES = 6


@dataclass(frozen=True)
class Backoff:
    first_s: float = 1.0  # delay before the first restart
    max_s: float = 30.0  # delays double up to this
    stable_after_s: float = 60.0  # a worker up this long starts again from `first_s`

    def delay_s(self, deaths_in_a_row: int) -> float:
        return min(self.max_s, self.first_s * 2 ** max(0, deaths_in_a_row - 1))


@dataclass
class Slot:
    """One supervised worker position; each restart fills it with a new process."""

    started_at: float
    deaths_in_a_row: int = 0
    restart_at: float | None = None  # set while the slot waits for its restart


@dataclass
class RestartPolicy:
    backoff: Backoff = field(default_factory=Backoff)
    slots: dict[str, Slot] = field(default_factory=dict)
    restarts: int = 0

    def started(self, slot: str, now: float) -> None:
        known = self.slots.get(slot)
        if known is None:
            self.slots[slot] = Slot(started_at=now)
        else:
            known.started_at, known.restart_at = now, None

    def died(self, slot: str, now: float) -> float:
        """Record a death; return the delay before the restart."""
        s = self.slots[slot]
        stayed_up = now - s.started_at >= self.backoff.stable_after_s
        s.deaths_in_a_row = 1 if stayed_up else s.deaths_in_a_row + 1
        delay = self.backoff.delay_s(s.deaths_in_a_row)
        s.restart_at = now + delay
        return delay

    def due(self, now: float) -> list[str]:
        """Slots whose restart time has come; the caller restarts them and calls `started`."""
        due = [n for n, s in self.slots.items() if s.restart_at is not None and s.restart_at <= now]
        self.restarts += len(due)
        return due

    def crash_looping(self) -> bool:
        """Every slot died again after being restarted, and has not stayed up since."""
        return bool(self.slots) and all(s.deaths_in_a_row >= 2 for s in self.slots.values())


@dataclass
class StallGuard:
    """When `spotrl up` stops waiting (the server fails a run stalled past its timeout; this is
    the client's guard in case it does not): the run has been `stalled` for longer than the
    timeout plus a margin, or every supervised worker is crash-looping while no step finished
    for the timeout. `check` returns the reason to stop, or None."""

    timeout_s: float | None
    margin_s: float = 15.0
    stalled_since: float | None = None
    step: int = -1
    progress_at: float = 0.0

    def check(self, run: dict, now: float, crash_looping: bool, worker_error: str) -> str | None:
        if run["step"] != self.step:
            self.step, self.progress_at = run["step"], now
        if run["state"] != "stalled":
            self.stalled_since = None
        elif self.stalled_since is None:
            self.stalled_since = now
        if self.timeout_s is None:
            return None
        if self.stalled_since is not None and now - self.stalled_since > (
            self.timeout_s + self.margin_s
        ):
            return f"stalled for over {self.timeout_s:g} s: {run.get('stall_reason') or '?'}"
        if crash_looping and now - self.progress_at > self.timeout_s:
            return (
                f"every rollout worker keeps dying and no step finished for "
                f"{self.timeout_s:g} s; last error: {worker_error or '?'}"
            )
        return None


TRACEBACK = "Traceback (most recent call last):"
ERROR_LINE = re.compile(r"(Error|Exception|CRITICAL|Killed)\b")


def error_headline(log_text: str) -> str:
    """The line that says why a process died: the last traceback's exception line, else the last
    line that names an error; "" when the log names none (killed from outside)."""
    lines = [line.rstrip() for line in log_text.splitlines() if line.strip()]
    last_tb = max((i for i, line in enumerate(lines) if line.endswith(TRACEBACK)), default=None)
    if last_tb is not None:
        for line in lines[last_tb + 1 :]:
            if not line.startswith((" ", "\t")):
                return line
    for line in reversed(lines):
        if ERROR_LINE.search(line):
            return line
    return ""


def exit_description(returncode: int | None) -> str:
    if returncode is not None and returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit code {returncode}"


@dataclass
class Death:
    worker: str
    exit_code: int | None
    uptime_s: float
    headline: str
    log_tail: str
    restart_in_s: float


class WorkerSupervisor:
    """Restarts the watched workers of a deployment that die on their own (not stopped by us),
    with `RestartPolicy`'s backoff; reports each death once through `report`."""

    def __init__(
        self,
        deployment,
        workers: list[str],
        clock: Callable[[], float],
        report: Callable[[Death], None],
        policy: RestartPolicy | None = None,
    ) -> None:
        self.deployment = deployment
        self.clock = clock
        self.report = report
        self.policy = policy or RestartPolicy()
        self.current: dict[str, str] = {}  # slot -> the worker process that fills it now
        self.last_error = ""
        now = clock()
        for name in workers:
            self.current[name] = name
            self.policy.started(name, now)

    @property
    def restarts(self) -> int:
        return self.policy.restarts

    def poll(self) -> None:
        now = self.clock()
        for slot, name in self.current.items():
            proc: Proc | None = self.deployment.procs.get(name)
            waiting = self.policy.slots[slot].restart_at is not None
            if waiting or proc is None or proc.alive() or proc.stopped_on_purpose:
                continue
            uptime_s = now - self.policy.slots[slot].started_at
            delay = self.policy.died(slot, now)
            log_text = proc.log_tail(200)
            code = proc.popen.returncode
            self.last_error = error_headline(log_text) or exit_description(code)
            tail = "\n".join(log_text.splitlines()[-LOG_TAIL_LINES:])
            self.report(Death(name, code, uptime_s, self.last_error, tail, delay))
        for slot in self.policy.due(now):
            new = self.deployment.replace_worker(self.current[slot])
            self.current[slot] = new.name
            self.policy.started(slot, now)

    def crash_looping(self) -> bool:
        return self.policy.crash_looping()
