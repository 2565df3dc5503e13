"""The rollout worker: registers with the coordinator, heartbeats, pulls the weights of the
active run's newest version, reads token-level jobs of exactly that version, generates, and
flushes token deltas every few tokens. It serves one run, or several at once on one engine
(LoRA runs on one base: `lanes`). Asyncio tasks talk to Redis; one drives the engine.

`RolloutWorker` only puts the parts together and names the tasks the service runs:
- `lanes.Lanes`: the jobs task (which runs it serves), and per run `intake.JobIntake` (its
  version, orders and jobs read);
- `weight_loader.VersionLoader`: pulls and loads a version;
- `generation.Generator`: the generation task (admission, decode steps);
- `control.Control`: the coordinator's orders (abort, release, pause);
- `flusher.Flusher` over `services.rollout.delta_buffer.DeltaBuffer`: deltas, releases, acks;
- `crash.CrashReporter`: a task that dies of an error reports the crash first;
- `presence`: registration and heartbeat; `redis_login.RedisLogin`: Redis connections wait for
  the registration and log in as it says.
Their shared state is a `context.WorkerShared`, and each run's a `context.WorkerContext`. This
module decides nothing itself.
"""

from collections.abc import Awaitable, Callable

import redis.asyncio as aioredis

from services.infra.signing import key_bytes
from services.rollout.context import WorkerShared, worker_shared
from services.rollout.control import Control
from services.rollout.crash import CrashReporter
from services.rollout.engines.base import Engine
from services.rollout.engines.factory import make_engine
from services.rollout.generation import Generator
from services.rollout.lanes import Lanes
from services.rollout.peers import Peers
from services.rollout.presence import heartbeat_forever, register
from services.rollout.redis_login import RedisLogin
from services.rollout.settings import RolloutSettings


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
        self.w: WorkerShared = worker_shared(
            settings, r, engine if engine is not None else make_engine(settings)
        )
        self.peers = Peers(settings) if settings.p2p else None
        self.control = Control(self.w)
        self.generator = Generator(self.w, self.control)
        self.lanes = Lanes(self.w, self.control, self.generator, self.peers)
        self.crashes = CrashReporter(self.w, self.lanes)

    @property
    def engine(self) -> Engine:
        """The engine itself, every run's."""
        return self.w.engine.engine

    @property
    def busy(self) -> int:
        return self.w.busy

    @property
    def tokens_generated(self) -> int:
        return self.w.tokens_generated

    # ---- the service's tasks ----
    async def jobs_forever(self) -> None:
        await self.register()  # again each time the task starts again
        await self.lanes.run_forever()

    async def register(self) -> None:
        """Register with the coordinator; Redis connections log in, and delta batches are
        signed, with what it answered (its own user and key, where it mints them)."""
        try:
            answer = await register(self.w.s, self.w.signing_key)
        except Exception:
            if self.login is not None:  # a crash report still reaches Redis, as configured
                self.login.as_configured()
            raise
        self.w.signing_key = key_bytes(answer.signing_key) if answer.signing_key else None
        self.w.consumer = answer.consumer or self.w.s.worker_id
        if self.login is not None:
            self.login.registered(answer)

    async def generate_forever(self) -> None:
        await self.generator.run_forever()

    async def heartbeat_forever(self) -> None:
        await heartbeat_forever(self.w)

    async def reporting_crash(
        self, loop: Callable[[], Awaitable[None]], drives_engine: bool = False
    ) -> None:
        """Run `loop` (a task above); if it dies of an error, report the crash first."""
        await self.crashes.reporting(loop, drives_engine)

    async def release_all(self) -> int:
        """Preemption notice: flush every partial response, give every held request back and
        acknowledge its job, of every run served, so the coordinator continues them elsewhere
        at once."""
        return await self.lanes.release_all()

    def status(self) -> dict:
        w = self.w
        lanes = list(w.lanes.values())
        return {
            "worker_id": w.s.worker_id,
            "pool": w.s.pool,
            "state": w.state,
            "run_id": lanes[0].run_id if lanes else None,
            "version": lanes[0].version if lanes else None,
            # each run served, with the version it serves and the requests it holds of it
            "runs": {c.run_id: {"version": c.version, "active": c.busy} for c in lanes},
            "active": w.engine.active,
            "tokens_generated": w.tokens_generated,
            # where it serves the weight blocks it holds to its peers ("" until its first pull)
            "peer_url": self.peers.url if self.peers else None,
        }
