"""Driving a run until it ends, and the process of coordinator shards 1..K-1.

`drive` is the one drive-a-run call: it runs the step loop of one shard of a run and
turns how it ended into the run's final state (succeeded, failed with the error users read,
cancelled under it) or into a wait for Redis to come back. Shard 0 is driven by the run
scheduler (`scheduler.py`), in the data plane; shards 1..K-1 (`contracts.shards`,
`RunSpec.coordinator_shards`) each by a process of its own, `follow`, so that the run's token
deltas are absorbed by K cores. Only shard 0 records a success and tidies up after a run that
ended under its step loop (`settle`); any shard records a failure.

Shard i runs the step loop of its share of every step's groups (`step.loop.build_loop` with
`shard=i`): it queues their jobs, reads its own deltas stream, keeps its own durable request
table and publishes its groups to the trainer, every read in one MULTI as on shard 0. What is
the whole step's stays on shard 0: seeding and balancing (given every shard's unfinished
requests, `ShardView`), reclaiming the jobs of dead workers (those of another shard go to it as
released requests on its deltas stream, in the MULTI that acknowledges them), the stall check
and the step's metrics row (every shard's summary added up).

Shard 0 starts the others as its children (`ShardProcesses`, below) and starts one again
when it dies while the run goes on: it resumes from its durable table like a restarted
coordinator. They die with the coordinator (PR_SET_PDEATHSIG), so that the shards of a
restarted coordinator are the only ones reading their streams.

    python -m services.coordinator.run.shard RUN_ID SHARD   (started by `ShardProcesses`, which
    hands down the coordinator's settings: `services.infra.child_process`)
"""

import asyncio
import contextlib
import logging
import sys
from functools import partial
from types import TracebackType

from prometheus_client import start_http_server
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import OutOfMemoryError
from redis.exceptions import TimeoutError as RedisTimeoutError

from services.contracts import keys
from services.contracts.runspec import FINAL_STATES
from services.coordinator.settings import CoordinatorSettings
from services.coordinator.step.loop import build_loop
from services.infra import tls
from services.infra.cancel import cancel_and_wait
from services.infra.child_process import ChildProcess, handed_settings, tie_to_parent
from services.infra.http_limits import clip
from services.infra.logs import setup_logging
from services.infra.redis_failover import RedisFailedOver, fenced
from services.infra.redis_streams import connect, with_reconnect
from services.infra.retry import brief
from services.state import run_record
from services.state.run_state import RunStopped
from services.state.runs import RunFailed, RunStore, deactivate, release_run

log = logging.getLogger(__name__)
MAX_ERROR_CHARS = 1000
REDIS_AWAY = (RedisConnectionError, RedisTimeoutError, OutOfMemoryError)


async def drive(
    store: RunStore, run_id: str, settings: CoordinatorSettings, shard: int = 0
) -> bool:
    """Drive shard `shard` of the run once: True when the run is over for it (it succeeded,
    failed, or ended under its step loop), False when Redis went away mid-step (or refused a
    write at its memory limit): everything that landed is in Redis, each batch whole or not at
    all, and the caller drives it again once Redis is back. Also False after a Redis failover
    (`RedisFailedOver`): what the loop held may be ahead of the new primary, which the next
    drive starts again from."""
    try:
        with fenced(store.r):
            spec = await store.spec(run_id)
            shards = spec.rollout.coordinator_shards
            async with contextlib.AsyncExitStack() as stack:
                if shard == 0 and shards > 1:  # the other shards live as long as shard 0's loop
                    await stack.enter_async_context(ShardProcesses(run_id, shards, settings))
                await build_loop(store.r, run_id, spec, settings, shard).run()
    except RedisFailedOver as exc:
        log.warning("run %s shard %d: %s; resuming from what it holds", run_id, shard, exc)
        return False
    except RunStopped as exc:
        log.info("run %s stopped (shard %d): %s", run_id, shard, exc)
        if shard == 0:
            await settle(store, run_id, await ended_as(store, run_id) or "cancelled")
        return True
    except RunFailed as exc:  # it cannot go on: its reason is the error
        log.error("run %s failed on coordinator shard %d: %s", run_id, shard, exc)
        await with_reconnect(partial(store.finish, run_id, "failed", str(exc)), "fail run")
        return True
    except REDIS_AWAY as exc:
        log.warning(
            "run %s shard %d: redis unavailable (%s); resuming once it is back",
            run_id,
            shard,
            brief(exc),
        )
        await asyncio.sleep(settings.scheduler_poll_s)
        return False
    except Exception as exc:
        return await _ended_by(store, run_id, shard, exc)
    if shard == 0:
        await store.finish(run_id, "succeeded")
        log.info("run %s succeeded", run_id)
    return True


async def _ended_by(store: RunStore, run_id: str, shard: int, exc: Exception) -> bool:
    """After an unforeseen error of a run's step loop: the run ended under it (its keys went
    while the loop still read them), or the error fails it."""
    ended = await ended_as(store, run_id)
    if ended is not None:
        log.info("run %s stopped (%s) under shard %d: %s", run_id, ended, shard, exc)
        if shard == 0:
            await settle(store, run_id, ended)
        return True
    log.exception("run %s failed on coordinator shard %d", run_id, shard)
    failed = partial(store.finish, run_id, "failed", failure_text(exc))
    await with_reconnect(failed, "fail run")
    return True


def failure_text(exc: Exception) -> str:
    """A failed run's error as users read it: the exception's type and message, cut short;
    never its repr (the repr of a decoding error holds the bytes it could not decode)."""
    return clip(f"{type(exc).__name__}: {exc}", MAX_ERROR_CHARS)


async def ended_as(store: RunStore, run_id: str) -> str | None:
    """The final state of a run (cancelled under its step loop, say), or None while it is live."""
    state = await run_record.read_state(store.r, run_id)
    return state if state in FINAL_STATES else None


async def settle(store: RunStore, run_id: str, state: str) -> None:
    """The step loop of a run that ended under it has stopped: drop what it wrote meanwhile."""
    await release_run(store.r, run_id, state, store.audit_ttl_s)
    await deactivate(store.r, run_id)


async def follow(run_id: str, shard: int, settings: CoordinatorSettings) -> None:
    """Drive shard `shard` (1..K-1) of the run until the run ends; a failure fails the run
    (shard 0 then stops), a Redis outage is waited out (the shard resumes from its durable
    table)."""
    r = connect(settings.redis_url, ca_file=settings.tls_ca_file)
    store = RunStore(r)
    if not settings.protect_reads:  # the metrics server has no token check
        server, _ = start_http_server(
            0,
            addr=settings.host,
            certfile=str(settings.tls_cert_file) if settings.tls_cert_file else None,
            keyfile=str(settings.tls_key_file) if settings.tls_key_file else None,
        )
        url = f"{tls.scheme(settings)}://{settings.host}:{server.server_port}/metrics"
        await with_reconnect(lambda: r.hset(keys.shard_metrics(run_id), shard, url), "metrics")
    while await with_reconnect(partial(ended_as, store, run_id), "run state") is None:
        if await drive(store, run_id, settings, shard):
            return


def main() -> None:
    run_id, shard = sys.argv[1], int(sys.argv[2])
    settings = handed_settings(CoordinatorSettings)
    setup_logging(f"coordinator-shard-{shard}", settings.log_level)
    tie_to_parent()
    asyncio.run(follow(run_id, shard, settings))


if __name__ == "__main__":
    main()


# The other shards of a run, as shard 0 runs them: `ShardProcesses` runs shards 1..K-1 as child
# processes and starts one again when it dies while the run goes on. The shard process itself is
# `services.coordinator.run.shard`; what the shards report of a step is `step.store.ShardView`.
log = logging.getLogger(__name__)
SHARD_MODULE = "services.coordinator.run.shard"  # `python -m SHARD_MODULE RUN_ID SHARD`
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
