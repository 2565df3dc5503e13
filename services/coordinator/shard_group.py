"""The other shards of a run, as shard 0 sees them: `ShardView` reads what they report of a
step (their unfinished requests, their summary once done), `ShardProcesses` runs shards 1..K-1
as child processes and starts one again when it dies while the run goes on. The shard process
itself is `services.coordinator.shard`."""

import asyncio
import logging
from types import TracebackType
from typing import cast

import msgspec
import redis.asyncio as aioredis

from services.contracts import keys
from services.coordinator.settings import CoordinatorSettings
from services.coordinator.step_record import ShardSummary
from services.core.request_table import RequestTable
from services.infra.cancel import cancel_and_wait
from services.infra.child_process import ChildProcess

log = logging.getLogger(__name__)
SHARD_MODULE = "services.coordinator.shard"  # `python -m SHARD_MODULE RUN_ID SHARD`
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
    """Shards 1..K-1 of one run as child processes (`services.infra.child_process`), for as
    long as the `async with` lasts; one that dies of anything but the run's end (exit 0) is
    started again after RESTART_S."""

    def __init__(self, run_id: str, shards: int, settings: CoordinatorSettings) -> None:
        self.run_id, self.shards, self.settings = run_id, shards, settings
        self.children = {
            shard: ChildProcess(SHARD_MODULE, [run_id, str(shard)], settings=settings)
            for shard in range(1, shards)
        }
        self.restarts = 0
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> "ShardProcesses":
        for shard in self.children:
            await self._start(shard)
        self._task = asyncio.create_task(self._supervise())
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await cancel_and_wait([self._task])
        await asyncio.gather(*(child.stop(STOP_S) for child in self.children.values()))

    async def _start(self, shard: int) -> None:
        child = self.children[shard]
        await child.start()
        assert child.proc is not None
        log.info(
            "run %s: coordinator shard %d started (pid %d)", self.run_id, shard, child.proc.pid
        )

    async def _supervise(self) -> None:
        """Start a shard again when it dies of anything but the run's end (exit 0)."""
        while True:
            waits = {
                asyncio.ensure_future(child.wait()): shard
                for shard, child in self.children.items()
                if child.alive
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
                await self._start(shard)
