"""The other shards of a run, as shard 0 runs them: `ShardProcesses` runs shards 1..K-1 as child
processes and starts one again when it dies while the run goes on. The shard process itself is
`services.coordinator.shard`; what the shards report of a step is `step_store.ShardView`."""

import asyncio
import logging
from types import TracebackType

from services.coordinator.settings import CoordinatorSettings
from services.infra.cancel import cancel_and_wait
from services.infra.child_process import ChildProcess

log = logging.getLogger(__name__)
SHARD_MODULE = "services.coordinator.shard"  # `python -m SHARD_MODULE RUN_ID SHARD`
RESTART_S = 1.0  # a shard that died is started again after this long
STOP_S = 10.0  # a shard told to stop (SIGTERM) is killed after this long


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
