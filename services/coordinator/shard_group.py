"""The other shards of a run, as shard 0 runs them: `ShardProcesses` runs shards 1..K-1 as child
processes and starts one again when it dies while the run goes on. The shard process itself is
`services.coordinator.shard`; what the shards report of a step is `step_store.ShardView`."""

import asyncio
import contextlib
import logging
import os
import sys
from types import TracebackType

from services.coordinator.settings import CoordinatorSettings
from services.infra.cancel import cancel_and_wait

log = logging.getLogger(__name__)
SETTINGS_ENV = "SPOTRL_SHARD_SETTINGS"
PARENT_ENV = "SPOTRL_SHARD_PARENT"  # the coordinator's pid
RESTART_S = 1.0  # a shard that died is started again after this long
STOP_S = 10.0  # a shard told to stop (SIGTERM) is killed after this long


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
