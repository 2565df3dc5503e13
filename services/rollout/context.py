"""What the parts of one rollout worker share. A worker serves one run, or several at once on
one engine (LoRA runs on one base, issue 52): `WorkerShared` is the worker's own (settings,
Redis, the shared engine, the engine lock, the runs it serves), and one `WorkerContext` per run
served (a lane) holds that run's part: its view of the engine, the version it serves, the jobs
read and not started (`JobInbox`) and the tokens not yet flushed (`DeltaBuffer`). They hold
state and answer questions about it; they run no loop and send nothing.

Tasks share them: each lane's jobs task (intake, weight loads) and the generation task (the
engine, flushes, control orders). A jobs task touches the engine only under `engine_lock`, and
the generation task steps it and starts jobs under it, so a load never lands in the middle of a
step and no job starts in the middle of another lane's load.
"""

import asyncio
import math
import time
from dataclasses import dataclass, field
from typing import Literal

import redis.asyncio as aioredis

from services.contracts.messages import FleetAllotment, Job
from services.core.plateau import PlateauEstimator
from services.core.request_table import step_of
from services.rollout.delta_buffer import DeltaBuffer
from services.rollout.engines.base import Engine
from services.rollout.engines.shared import RunView, SharedEngine
from services.rollout.settings import RolloutSettings

WorkerState = Literal["starting", "idle", "loading", "paused", "serving", "crashed"]


class JobInbox:
    """Jobs read from the stream and not started yet, in the order read."""

    def __init__(self) -> None:
        self._waiting: list[tuple[bytes, Job]] = []
        self.shards = 1  # the run's coordinator shards, as its newest job said (`Job.shards`)

    def __len__(self) -> int:
        return len(self._waiting)

    def put(self, entry_id: bytes, job: Job) -> None:
        self._waiting.append((entry_id, job))
        self.shards = job.shards

    def take_all(self) -> list[tuple[bytes, Job]]:
        waiting, self._waiting = self._waiting, []
        return waiting

    def jobs(self) -> list[Job]:
        return [job for _, job in self._waiting]

    def take(self, request_ids: set[str]) -> list[tuple[bytes, Job]]:
        """Remove the jobs of `request_ids`; the others keep waiting, in order."""
        taken = [(e, job) for e, job in self._waiting if job.request_id in request_ids]
        self._waiting = [(e, job) for e, job in self._waiting if job.request_id not in request_ids]
        return taken

    def put_back(self, waiting: list[tuple[bytes, Job]]) -> None:
        """Jobs taken that must wait on: they go first again."""
        self._waiting[:0] = waiting

    def clear(self) -> None:
        self._waiting.clear()


def new_buffer(settings: RolloutSettings) -> DeltaBuffer:
    return DeltaBuffer(
        settings.worker_id, settings.flush_tokens, settings.flush_ms, time.monotonic()
    )


@dataclass
class WorkerShared:
    """The worker's own state, shared by the runs it serves."""

    s: RolloutSettings
    r: aioredis.Redis
    engine: SharedEngine
    plateau: PlateauEstimator
    engine_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    slot_freed: asyncio.Event = field(default_factory=asyncio.Event)  # a request ended
    # the run the fleet's placement ordered this worker to serve (several runs active); None:
    # the oldest active run
    placed_run: str | None = None
    lanes: dict[str, "WorkerContext"] = field(default_factory=dict)  # by run, oldest first
    state: WorkerState = "starting"
    crashed: str = ""  # the error a task died of; the worker is on its way out
    tokens_generated: int = 0
    # the consumer name it reads its jobs as: its id, or the secret name the coordinator gave
    # it at registration (`contracts.consumers.jobs_consumer`)
    consumer: str = ""
    # the key the coordinator gave at registration (`worker_redis_users`): every delta batch
    # is signed with it; None: batches go unsigned, as the coordinator expects then
    signing_key: bytes | None = None
    # the fleet's allotment (keys.FLEET_ALLOT) as a lane last read it, and when (monotonic s):
    # the lanes of one round share one read (`intake.JobIntake._allotment`)
    allotment: FleetAllotment | None = None
    allotment_read_at: float = -math.inf

    def __post_init__(self) -> None:
        self.consumer = self.consumer or self.s.worker_id

    @property
    def busy(self) -> int:
        """Requests held, of every run: generating, or read and waiting to start."""
        return self.engine.active + sum(len(lane.inbox) for lane in self.lanes.values())

    def lane(self, run_id: str) -> "WorkerContext":
        """The part of the worker that serves `run_id` (made, and counted as served, now)."""
        if run_id not in self.lanes:
            self.lanes[run_id] = WorkerContext(
                w=self, run_id=run_id, engine=self.engine.view(run_id), buffer=new_buffer(self.s)
            )
        return self.lanes[run_id]


def worker_shared(settings: RolloutSettings, r: aioredis.Redis, engine: Engine) -> WorkerShared:
    return WorkerShared(
        s=settings, r=r, engine=SharedEngine(engine), plateau=PlateauEstimator(settings.slots)
    )


@dataclass
class WorkerContext:
    """One run's part of a worker (a lane): the run, the version it serves, its requests."""

    w: WorkerShared
    run_id: str
    engine: RunView
    buffer: DeltaBuffer
    inbox: JobInbox = field(default_factory=JobInbox)
    version: int | None = None  # loaded and served
    paused_version: int | None = None  # stepped aside for the rest of this version
    # the run's spec has drafts on (`keys.run_drafts`): a response finished here becomes a
    # draft of its running siblings (`sibling_drafts`)
    share_drafts: bool = False

    @property
    def s(self) -> RolloutSettings:
        return self.w.s

    @property
    def r(self) -> aioredis.Redis:
        return self.w.r

    @property
    def engine_lock(self) -> asyncio.Lock:
        return self.w.engine_lock

    @property
    def slot_freed(self) -> asyncio.Event:
        return self.w.slot_freed

    @property
    def plateau(self) -> PlateauEstimator:
        return self.w.plateau

    @property
    def busy(self) -> int:
        """This run's requests held: generating, or read and waiting to start."""
        return self.engine.active + len(self.inbox)

    @property
    def paused(self) -> bool:
        return self.paused_version is not None and self.paused_version == self.version

    def drop_steps_before(self, step: int) -> int:
        """Forget the requests of steps before `step` (a new version: those were migrated
        away, never to be finished here); those of later steps go on. How many the engine was
        running."""
        old = [rid for rid in self.buffer.pending if step_of(rid) < step]
        dropped = sum(self.engine.abort(rid) for rid in old)
        self.buffer.drop(old)
        self.inbox.take({j.request_id for j in self.inbox.jobs() if step_of(j.request_id) < step})
        return dropped

    def drop_held(self) -> int:
        """Forget every request held (a new version or run: they are no longer ours to
        finish); how many the engine was running."""
        dropped = len(self.engine.abort_all())
        self.inbox.clear()
        self.buffer.clear()
        return dropped
