"""The fleet's placement when several runs are active: which run each worker serves.

Every `every_s`, the active runs' demands (each run's step loop says it, `DemandNotice`) and
the alive workers' heartbeats go into the fleet's shares (`core.fleet_shares`): `allot` gives
each run its slots, `place` each worker its run. A worker's engine holds one run's full weights,
so the run is the model placed. A worker placed on a run it does not serve (none of its
`served_runs`) gets a "serve" order on its control stream (again after ORDER_AGAIN_S if it has
not followed it); it gives back what it holds of the other run and loads the new one's weights,
and its heartbeat then names the new run, which is how each run's step loop counts it. With one
run active this does nothing: every worker follows the oldest active run by itself.

Workers stepped aside (paused reserved workers) and workers shutting down are left where they
are. This shell reads and writes; what is decided is `fleet_shares`'.
"""

import dataclasses
import functools
import logging
import time
from collections.abc import Mapping
from typing import cast

import redis.asyncio as aioredis
from prometheus_client import Counter

from services.contracts import keys
from services.contracts.messages import FleetAllotment, Heartbeat, WorkerControl
from services.coordinator.workers.fleet import heartbeats, order
from services.core.fleet_shares import FleetWorker, RunClaim, allot, in_tail, place
from services.infra.redis_streams import read_entries, with_reconnect
from services.state.run_state import active_runs

log = logging.getLogger(__name__)
ORDER_AGAIN_S = 5.0  # a serve order not followed by then is sent again
DEMAND_TTL_S = 10  # a run's demand lapses this long after its step loop last said it
ALLOT_TTL_MS = 3000  # the fleet's allotment lapses this long after the placer's last pass
MAX_SHARE = 1000.0  # the most a run's share may be (RolloutSection.share)
SWITCHES = Counter(
    "spotrl_coordinator_worker_switches_total",
    "Serve orders that move a worker from one active run to another",
)


class DemandNotice:
    """A run's demand on the fleet as its step loop says it (keys.run_demand): its oldest
    step's unfinished requests and whether they are its tail; written when it changes, and
    again before its TTL runs out. When work comes or goes, or the tail begins, it also wakes
    the fleet's placer (keys.FLEET_DEMAND), which then places at once, not at its period."""

    def __init__(
        self, r: aioredis.Redis, run_id: str, step_requests: int, share: float = 1.0
    ) -> None:
        self.r, self.run_id, self.step_requests, self.share = r, run_id, step_requests, share
        self.said, self.said_at = "", 0.0  # the demand last written, and when
        self.phase: tuple[bool, bool] | None = None  # (work waiting, in its tail) last said

    async def say(self, unfinished: int) -> None:
        tail = in_tail(unfinished, self.step_requests)
        said = f"{unfinished} {int(tail)} {self.share!r}"
        now = time.monotonic()
        if said == self.said and now - self.said_at < DEMAND_TTL_S / 2:
            return
        phase = (unfinished > 0, tail)
        async with self.r.pipeline(transaction=False) as pipe:
            pipe.set(keys.run_demand(self.run_id), said, ex=DEMAND_TTL_S)
            if phase != self.phase:  # work came or went, or the tail began: place at once
                pipe.xadd(
                    keys.FLEET_DEMAND,
                    {"run": self.run_id},
                    maxlen=keys.FLEET_DEMAND_MAXLEN,
                    approximate=True,
                )
            await pipe.execute()
        self.said, self.said_at, self.phase = said, now, phase


def parse_demand(raw: bytes | None) -> tuple[int, bool, float]:
    """A run's demand as its step loop wrote it ("UNFINISHED TAIL SHARE"); (0, False, 1.0)
    where it is absent (the run's first step not opened yet, or its loop stopped) or not ours."""
    try:
        unfinished, tail, share = (raw or b"").split()
        weight = float(share)
        if not (0 < weight <= MAX_SHARE):
            raise ValueError(share)
        return max(0, int(unfinished)), tail == b"1", weight
    except ValueError:
        return 0, False, 1.0


def claims_of(runs: list[str], demands: list[bytes | None]) -> list[RunClaim]:
    """The runs' claims on the fleet, each with its spec's share."""
    claims = []
    for run_id, raw in zip(runs, demands, strict=True):
        wanted, tail, share = parse_demand(raw)
        claims.append(RunClaim(run_id=run_id, share=share, wanted=wanted, tail=tail))
    return claims


def placeable(beat: Heartbeat) -> bool:
    """A worker placement may move: alive, not shutting down, not stepped aside."""
    return not beat.error and not beat.paused


def held_floor(claims: list[RunClaim], beats: Mapping[str, Heartbeat]) -> list[RunClaim]:
    """The claims, each wanting at least the requests its workers hold now: a run's demand
    said at a step's end (0) or before its new step's first tick may trail what its workers
    just read, and a worker holding a run's requests is not moved for a demand not said yet.
    A worker serving several runs holds each run's own requests (`Heartbeat.serving`)."""
    held: dict[str, int] = {}
    for beat in beats.values():
        for run_id in beat.served_runs:
            if (view := beat.serving(run_id)) is not None:
                held[run_id] = held.get(run_id, 0) + view.active
    return [dataclasses.replace(c, wanted=max(c.wanted, held.get(c.run_id, 0))) for c in claims]


class FleetPlacer:
    def __init__(self, r: aioredis.Redis, every_s: float = 1.0, switch_share: float = 0.5) -> None:
        self.r, self.every_s, self.switch_share = r, every_s, switch_share
        self.sent: dict[str, tuple[str, float]] = {}  # worker -> (run ordered, when)

    async def forever(self) -> None:
        """Place the fleet every `every_s`, and at once when a run's demand changes (a step
        opened, ended, or came to its tail)."""
        last = b"0-0"  # changes said before this placer started wake it once
        while True:
            await with_reconnect(self.place_once, "fleet placement")
            last = await with_reconnect(functools.partial(self._wait, last), "fleet demand")

    async def _wait(self, last: bytes) -> bytes:
        """Until a demand changes after `last` (an entry id), or `every_s` passes; the id of
        the newest change seen."""
        block_ms = max(1, int(self.every_s * 1000))
        reply = await self.r.xread(
            {keys.FLEET_DEMAND: last}, count=keys.FLEET_DEMAND_MAXLEN, block=block_ms
        )
        entries = read_entries(reply)
        return entries[-1][0] if entries else last

    async def place_once(self) -> dict[str, str | None]:
        """Place the fleet once; the run each placeable worker should serve ({} with fewer
        than two runs active)."""
        runs = await active_runs(self.r)
        if len(runs) < 2:
            self.sent.clear()
            await self.r.delete(keys.FLEET_ALLOT)
            return {}
        beats = {w: b for w, b in (await heartbeats(self.r)).items() if placeable(b)}
        demands = cast(list[bytes | None], await self.r.mget([keys.run_demand(r) for r in runs]))
        claims = held_floor(claims_of(runs, demands), beats)
        slots = sum(b.slots for b in beats.values())
        allotted = allot(slots, claims)
        # workers serving several runs at once read each run's part of it (`worker_part`)
        shares = {c.run_id: c.share for c in claims}
        allotment = FleetAllotment(slots=slots, runs=allotted, shares=shares).encode()
        await self.r.set(keys.FLEET_ALLOT, allotment, px=ALLOT_TTL_MS)
        workers = [
            FleetWorker(w, b.slots, b.run_id if b.run_id in runs else None)
            for w, b in beats.items()
        ]
        placed = place(workers, allotted, self.switch_share)
        now = time.monotonic()
        for worker_id, run_id in placed.items():
            serving = beats[worker_id].run_id
            if run_id is None or run_id in beats[worker_id].served_runs:
                self.sent.pop(worker_id, None)
                continue
            last = self.sent.get(worker_id)
            if last is not None and last[0] == run_id and now - last[1] < ORDER_AGAIN_S:
                continue
            await order(self.r, worker_id, WorkerControl(action="serve", run_id=run_id))
            self.sent[worker_id] = (run_id, now)
            if serving in runs:
                SWITCHES.inc()
            log.info(
                "worker %s: serve run %s (was %s; allotted %s)", worker_id, run_id, serving,
                allotted,
            )  # fmt: skip
        return placed
