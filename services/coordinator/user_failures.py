"""Telling the failures of a run's user code (its environment's calls, its reward's): the first
failure of each kind is written to the coordinator's log with its traceback and to the run's
timeline (`spotrl logs`, kind `user_code_failed`), once per kind and coordinator process; each
step keeps its own first failure in short form for its metrics row. Later failures are only
counted: the step's log line says how many (`step_record.record_rollout`).

It decides nothing: whether the failures end the run is `core.call_errors`'.
"""

import logging

import redis.asyncio as aioredis

from services.state import timeline

log = logging.getLogger(__name__)


class FailureLog:
    """The failures told so far by this process, for one run."""

    def __init__(self, r: aioredis.Redis, run_id: str) -> None:
        self.r, self.run_id = r, run_id
        self.told: set[str] = set()  # kinds whose first failure is in the log

    async def tell(
        self, firsts: dict[str, str], step: int, kind: str, short: str, trace: str
    ) -> None:
        """A failure of `kind` in `step` (`short`: one line; `trace`: its traceback, "" when
        nothing raised): kept as the step's first of its kind in `firsts`; the run's first of
        its kind is logged and put on the timeline."""
        firsts.setdefault(kind, short)
        if kind in self.told:
            return
        self.told.add(kind)
        trace = trace or "(no traceback: the call did not raise)"
        log.error("run %s step %d: first %s failure: %s\n%s", self.run_id, step, kind, short, trace)
        await timeline.emit(
            self.r,
            self.run_id,
            "user_code_failed",
            source=kind,
            step=step,
            error=short,
            trace=trace,
        )
