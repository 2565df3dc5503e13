"""The asyncio shell around the stall policy of one run: reads heartbeats and crash reports,
feeds `stall.StallTracker`, and writes what it decides (state, reason, timeline). The decisions
themselves are in `stall.py`.
"""

import logging
import time

import redis.asyncio as aioredis
from prometheus_client import Counter

from services.contracts import keys
from services.contracts.messages import Heartbeat
from services.coordinator.run.runs import RunFailed, RunStore
from services.coordinator.scheduling import crash_reports, registered_workers
from services.core.stall import (
    Action,
    Decision,
    GoneWorker,
    StallTracker,
    WorkerView,
    blocker,
)
from services.state import run_record

log = logging.getLogger(__name__)
STALLS = Counter("spotrl_coordinator_run_stalls_total", "Times the active run became stalled")
GONE_KEPT = 20  # workers gone from the run that a reason can name, newest first


class StallWatch:
    def __init__(
        self, r: aioredis.Redis, run_id: str, stall_after_s: float, timeout_s: float | None
    ) -> None:
        self.r, self.run_id = r, run_id
        self.runs = RunStore(r)
        self.tracker = StallTracker(stall_after_s, timeout_s)
        self.seen: dict[str, float] = {}  # workers seen alive on the run -> last seen (unix s)

    async def start(self) -> None:
        """Pick up a stall from before a restart, and the workers that served the run."""
        run = await run_record.read(self.r, self.run_id, "state", "stalled_since", "stall_reason")
        if run is not None and run.state == "stalled" and run.stalled_since is not None:
            self.tracker.restore(run.stalled_since, run.stall_reason)
        ids = await registered_workers(self.r)
        async with self.r.pipeline(transaction=False) as pipe:
            for worker_id in ids:
                pipe.exists(keys.worker_loads(self.run_id, worker_id))
            loaded = await pipe.execute()
        self.seen |= {w: 0.0 for w, n in zip(ids, loaded, strict=True) if n}

    async def check(self, version: int, beats: dict[str, Heartbeat]) -> None:
        """During a step of `version`, with these alive heartbeats. Raises RunFailed once the
        run has been stalled for its timeout."""
        now = time.time()
        alive = []
        for worker_id, beat in beats.items():
            ours = beat.run_id == self.run_id
            if ours:
                self.seen[worker_id] = now
            alive.append(WorkerView(worker_id, beat.version, beat.paused and ours, beat.error))
        why = blocker(version, alive, [])
        if why is not None:  # only then is it worth reading how the others went
            why = blocker(version, alive, await self._gone(beats))
        resumed = f"a worker can serve version {version}"
        await self._apply(self.tracker.observe(now, why), resumed)

    async def resume(self, step: int) -> None:
        """The run progressed (the rollout of `step` is complete): it is not stalled."""
        await self._apply(self.tracker.observe(time.time(), None), f"step {step} rolled out")

    async def _gone(self, beats: dict[str, Heartbeat]) -> list[GoneWorker]:
        gone_ids = sorted(
            (w for w in self.seen if w not in beats), key=lambda w: self.seen[w], reverse=True
        )[:GONE_KEPT]
        reports = await crash_reports(self.r, gone_ids)
        leaving = await self.r.mget([keys.worker_leaving(w) for w in gone_ids]) if gone_ids else []
        gone = []
        for worker_id, left in zip(gone_ids, leaving, strict=True):
            report = reports.get(worker_id)
            if report is not None and report.get("run_id") == self.run_id:
                gone.append(GoneWorker(worker_id, "crashed", str(report.get("error", ""))))
            else:
                gone.append(GoneWorker(worker_id, "left" if left else "lost"))
        return gone

    async def _apply(self, decision: Decision, resumed: str) -> None:
        if decision.action is Action.STALL:
            STALLS.inc()
            since = self.tracker.stalled_since or time.time()
            await self.runs.mark_stalled(self.run_id, decision.reason, since)
            log.warning("run %s stalled: %s", self.run_id, decision.reason)
        elif decision.action is Action.UPDATE:
            await self.runs.update_stall_reason(self.run_id, decision.reason)
            log.warning("run %s still stalled: %s", self.run_id, decision.reason)
        elif decision.action is Action.RESUME:
            await self.runs.mark_running(self.run_id, resumed)
            log.info("run %s running again: %s", self.run_id, resumed)
        elif decision.action is Action.FAIL:
            raise RunFailed(decision.reason)
