"""The rollout worker: registers with the coordinator, heartbeats, pulls the weights of the
active run's newest version, reads token-level jobs of exactly that version, generates, and
flushes token deltas every few tokens. One asyncio task talks to Redis; one drives the engine.

`RolloutWorker` only puts the parts together and names the tasks the service runs:
- `intake.JobIntake`: the jobs task (run, version, orders and jobs read);
- `weight_loader.VersionLoader`: pulls and loads a version;
- `generation.Generator`: the generation task (admission, decode steps);
- `control.Control`: the coordinator's orders (abort, release, pause);
- `flusher.Flusher` over `services.rollout.delta_buffer.DeltaBuffer`: deltas, releases, acks;
- `crash.CrashReporter`: a task that dies of an error reports the crash first;
- `presence`: registration and heartbeat; `redis_login.RedisLogin`: Redis connections wait for
  the registration and log in as it says.
Their shared state is a `context.WorkerContext`. This module decides nothing itself.
"""

from collections.abc import Awaitable, Callable

import redis.asyncio as aioredis

from services.core.plateau import PlateauEstimator
from services.infra.signing import key_bytes
from services.rollout.context import WorkerContext, new_buffer
from services.rollout.control import Control
from services.rollout.crash import CrashReporter
from services.rollout.engines.base import Engine
from services.rollout.engines.factory import make_engine
from services.rollout.flusher import Flusher
from services.rollout.generation import Generator
from services.rollout.intake import JobIntake
from services.rollout.presence import heartbeat_forever, register
from services.rollout.redis_login import RedisLogin
from services.rollout.settings import RolloutSettings
from services.rollout.weight_loader import VersionLoader


class RolloutWorker:
    def __init__(
        self,
        settings: RolloutSettings,
        r: aioredis.Redis,
        engine: Engine | None = None,
        login: RedisLogin | None = None,
    ) -> None:
        # `engine`: a backend built elsewhere (benchmarks drive the worker with an instant one)
        # `login`: the credential provider of `r`'s pool, told what each registration answered
        self.login = login
        self.ctx = WorkerContext(
            s=settings,
            r=r,
            engine=engine if engine is not None else make_engine(settings),
            buffer=new_buffer(settings),
            plateau=PlateauEstimator(settings.slots),
        )
        self.flusher = Flusher(self.ctx)
        self.control = Control(self.ctx, self.flusher)
        self.loader = VersionLoader(self.ctx, self.flusher.held, self.flusher.release)
        self.intake = JobIntake(self.ctx, self.control, self.loader)
        self.generator = Generator(self.ctx, self.control, self.flusher)
        self.crashes = CrashReporter(self.ctx, self.flusher)

    @property
    def engine(self) -> Engine:
        return self.ctx.engine

    @property
    def busy(self) -> int:
        return self.ctx.busy

    @property
    def tokens_generated(self) -> int:
        return self.ctx.tokens_generated

    # ---- the service's tasks ----
    async def jobs_forever(self) -> None:
        await self.register()  # again each time the task starts again
        await self.intake.run_forever()

    async def register(self) -> None:
        """Register with the coordinator; Redis connections log in, and delta batches are
        signed, with what it answered (its own user and key, where it mints them)."""
        try:
            answer = await register(self.ctx.s, self.flusher.signing_key)
        except Exception:
            if self.login is not None:  # a crash report still reaches Redis, as configured
                self.login.as_configured()
            raise
        self.flusher.signing_key = key_bytes(answer.signing_key) if answer.signing_key else None
        self.ctx.consumer = answer.consumer or self.ctx.s.worker_id
        if self.login is not None:
            self.login.registered(answer)

    async def generate_forever(self) -> None:
        await self.generator.run_forever()

    async def heartbeat_forever(self) -> None:
        await heartbeat_forever(self.ctx)

    async def reporting_crash(
        self, loop: Callable[[], Awaitable[None]], drives_engine: bool = False
    ) -> None:
        """Run `loop` (a task above); if it dies of an error, report the crash first."""
        await self.crashes.reporting(loop, drives_engine)

    async def release_all(self) -> int:
        """Preemption notice: flush every partial response, give every held request back and
        acknowledge its job, so the coordinator continues them elsewhere at once."""
        return await self.flusher.release(self.flusher.held(), "preemption")

    def status(self) -> dict:
        ctx = self.ctx
        return {
            "worker_id": ctx.s.worker_id,
            "pool": ctx.s.pool,
            "state": ctx.state,
            "run_id": ctx.run_id,
            "version": ctx.version,
            "active": ctx.engine.active,
            "tokens_generated": ctx.tokens_generated,
            # where it serves the weight blocks it holds to its peers ("" until its first pull)
            "peer_url": self.loader.peers.url if self.loader.peers else None,
        }
