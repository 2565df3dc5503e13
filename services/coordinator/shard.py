"""Coordinator shards 1..K-1 of a run (`contracts.shards`, `RunSpec.coordinator_shards`): each a
process of its own, so that the run's token deltas are absorbed by K cores.

Shard i runs the rollout manager of its share of every step's groups (`RunManager` with
`shard=i`): it queues their jobs, reads its own deltas stream, keeps its own durable request
table and publishes its groups to the trainer, every read in one MULTI as on shard 0. What is
the whole step's stays on shard 0, the coordinator's own process: seeding and balancing (given
every shard's unfinished requests, `ShardView`), reclaiming the jobs of dead workers (those of
another shard go to it as released requests on its deltas stream, in the MULTI that acknowledges
them), the stall watch and the step's metrics row (every shard's summary added up).

Shard 0 starts the others as its children (`ShardProcesses`) and starts one again when it dies
while the run goes on: it resumes from its durable table like a restarted coordinator. They die
with the coordinator (PR_SET_PDEATHSIG), so that the shards of a restarted coordinator are the
only ones reading their streams.

    python -m services.coordinator.shard RUN_ID SHARD   (the coordinator's settings in
    SPOTRL_SHARD_SETTINGS, as JSON; its pid in SPOTRL_SHARD_PARENT)
"""

import asyncio
import contextlib
import logging
import os
import sys
from functools import partial
from types import TracebackType
from typing import cast

import msgspec
import redis.asyncio as aioredis
from prometheus_client import start_http_server
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import OutOfMemoryError
from redis.exceptions import TimeoutError as RedisTimeoutError

from services.contracts import keys
from services.coordinator.settings import CoordinatorSettings
from services.coordinator.step_record import ShardSummary
from services.core.request_table import RequestTable
from services.infra.cancel import cancel_and_wait
from services.infra.lifeline import die_with_parent
from services.infra.logs import setup_logging
from services.infra.redis_streams import connect, with_reconnect
from services.infra.retry import brief
from services.state.run_state import RunStopped

log = logging.getLogger(__name__)
SETTINGS_ENV = "SPOTRL_SHARD_SETTINGS"
PARENT_ENV = "SPOTRL_SHARD_PARENT"  # the coordinator's pid
RESTART_S = 1.0  # a shard that died is started again after this long
STOP_S = 10.0  # a shard told to stop (SIGTERM) is killed after this long
TTL_S = 24 * 3600


class ShardView:
    """What shard 0 reads of the other shards' part of one step, and what they report: their
    unfinished requests while the step runs, their summary once their groups are published."""

    def __init__(self, r: aioredis.Redis, run_id: str, step: int, shards: int) -> None:
        self.r, self.key, self.shards = r, keys.step_shards(run_id, step), shards

    async def _fields(self) -> dict[str, bytes]:
        raw = cast(dict[bytes, bytes], await self.r.hgetall(self.key))
        return {k.decode(): v for k, v in raw.items()}

    async def all_done(self) -> bool:
        """Whether every other shard has published all its groups of the step."""
        if self.shards == 1:
            return True
        fields = await self._fields()
        return all(f"{i}:done" in fields for i in range(1, self.shards))

    async def unfinished(self, table: RequestTable) -> int:
        """The other shards' unfinished requests, as last reported (a shard that reported
        nothing yet: all of its requests)."""
        if self.shards == 1:
            return 0
        fields, total = await self._fields(), 0
        for i in range(1, self.shards):
            if f"{i}:done" in fields:
                continue
            reported = fields.get(f"{i}:unfinished")
            total += int(reported) if reported is not None else table.requests_of_shard(i)
        return total

    async def summaries(self) -> list[ShardSummary]:
        fields = await self._fields()
        return [
            msgspec.json.decode(fields[f"{i}:done"], type=ShardSummary)
            for i in range(1, self.shards)
            if f"{i}:done" in fields
        ]

    async def report_unfinished(self, shard: int, n: int) -> None:
        async with self.r.pipeline(transaction=True) as pipe:
            pipe.hset(self.key, f"{shard}:unfinished", n)
            pipe.expire(self.key, TTL_S)
            await pipe.execute()

    async def report_done(self, shard: int, summary: ShardSummary) -> None:
        async with self.r.pipeline(transaction=True) as pipe:
            pipe.hset(
                self.key,
                mapping={f"{shard}:unfinished": 0, f"{shard}:done": msgspec.json.encode(summary)},
            )
            pipe.expire(self.key, TTL_S)
            await pipe.execute()

    async def expire(self, ttl_s: int) -> None:
        if self.shards > 1:
            await self.r.expire(self.key, ttl_s)


class ShardProcesses:
    """Shards 1..K-1 of one run as child processes, for as long as the `async with` lasts."""

    def __init__(self, run_id: str, shards: int, settings: CoordinatorSettings) -> None:
        self.run_id, self.shards, self.settings = run_id, shards, settings
        self.procs: dict[int, asyncio.subprocess.Process] = {}
        self.restarts = 0
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> "ShardProcesses":
        for shard in range(1, self.shards):
            self.procs[shard] = await self._start(shard)
        self._task = asyncio.create_task(self._supervise())
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await cancel_and_wait([self._task])
        running = [p for p in self.procs.values() if p.returncode is None]
        for proc in running:
            with contextlib.suppress(ProcessLookupError):
                proc.terminate()
        for proc in running:
            try:
                async with asyncio.timeout(STOP_S):
                    await proc.wait()
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                await proc.wait()

    async def _start(self, shard: int) -> asyncio.subprocess.Process:
        env = {
            **os.environ,
            SETTINGS_ENV: self.settings.model_dump_json(),
            PARENT_ENV: str(os.getpid()),
        }
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "services.coordinator.shard",
            self.run_id,
            str(shard),
            env=env,
        )
        log.info("run %s: coordinator shard %d started (pid %d)", self.run_id, shard, proc.pid)
        return proc

    async def _supervise(self) -> None:
        """Start a shard again when it dies of anything but the run's end (exit 0)."""
        while True:
            waits = {
                asyncio.ensure_future(p.wait()): shard
                for shard, p in self.procs.items()
                if p.returncode is None
            }
            if not waits:
                return
            done, pending = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            for fut in pending:
                fut.cancel()
            for fut in done:
                shard, code = waits[fut], fut.result()
                if code == 0:
                    continue
                log.warning(
                    "run %s: coordinator shard %d died (exit %d); starting it again",
                    self.run_id,
                    shard,
                    code,
                )
                await asyncio.sleep(RESTART_S)
                self.restarts += 1
                self.procs[shard] = await self._start(shard)


async def follow(run_id: str, shard: int, settings: CoordinatorSettings) -> None:
    """Drive shard `shard` of the run until the run ends; a failure fails the run (shard 0
    then stops), a Redis outage is waited out (the shard resumes from its durable table)."""
    from services.coordinator.app import ended_as, failure_text
    from services.coordinator.rollout_manager import RunManager
    from services.coordinator.runs import RunFailed, RunStore

    r = connect(settings.redis_url)
    store = RunStore(r)
    if not settings.protect_reads:  # the metrics server has no token check
        server, _ = start_http_server(0, addr=settings.host)
        url = f"http://{settings.host}:{server.server_port}/metrics"
        await with_reconnect(lambda: r.hset(keys.shard_metrics(run_id), shard, url), "metrics")
    while True:
        try:
            if await ended_as(store, run_id) is not None:
                return
            spec = await store.spec(run_id)
            await RunManager.configured(r, run_id, spec, settings, shard).run()
            return
        except RunStopped:
            return
        except RunFailed as exc:
            log.error("run %s failed on coordinator shard %d: %s", run_id, shard, exc)
            await with_reconnect(partial(store.finish, run_id, "failed", str(exc)), "fail run")
            return
        except (RedisConnectionError, RedisTimeoutError, OutOfMemoryError) as exc:
            log.warning(
                "run %s shard %d: redis unavailable (%s); resuming", run_id, shard, brief(exc)
            )
            await asyncio.sleep(settings.scheduler_poll_s)
        except Exception as exc:
            if await ended_as(store, run_id) is not None:
                return
            log.exception("run %s failed on coordinator shard %d", run_id, shard)
            failed = partial(store.finish, run_id, "failed", failure_text(exc))
            await with_reconnect(failed, "fail run")
            return


def main() -> None:
    run_id, shard = sys.argv[1], int(sys.argv[2])
    raw = os.environ.get(SETTINGS_ENV)
    settings = (
        CoordinatorSettings.model_validate_json(raw) if raw is not None else CoordinatorSettings()
    )
    setup_logging(f"coordinator-shard-{shard}", settings.log_level)
    if PARENT_ENV in os.environ:
        die_with_parent(int(os.environ[PARENT_ENV]))
    asyncio.run(follow(run_id, shard, settings))


if __name__ == "__main__":
    main()
