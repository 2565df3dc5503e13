"""Coordinator shards 1..K-1 of a run (`contracts.shards`, `RunSpec.coordinator_shards`): each a
process of its own, so that the run's token deltas are absorbed by K cores.

Shard i runs the step loop of its share of every step's groups (`step_loop.build_loop` with
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
import logging
import os
import sys
from functools import partial

from prometheus_client import start_http_server
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import OutOfMemoryError
from redis.exceptions import TimeoutError as RedisTimeoutError

from services.contracts import keys
from services.coordinator.run_end import ended_as, failure_text
from services.coordinator.runs import RunFailed, RunStore
from services.coordinator.settings import CoordinatorSettings
from services.coordinator.shard_group import PARENT_ENV, SETTINGS_ENV
from services.coordinator.step_loop import build_loop
from services.infra import tls
from services.infra.lifeline import die_with_parent
from services.infra.logs import setup_logging
from services.infra.redis_streams import connect, with_reconnect
from services.infra.retry import brief
from services.state.run_state import RunStopped

log = logging.getLogger(__name__)


async def follow(run_id: str, shard: int, settings: CoordinatorSettings) -> None:
    """Drive shard `shard` of the run until the run ends; a failure fails the run (shard 0
    then stops), a Redis outage is waited out (the shard resumes from its durable table)."""
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
    while True:
        try:
            if await ended_as(store, run_id) is not None:
                return
            spec = await store.spec(run_id)
            await build_loop(r, run_id, spec, settings, shard).run()
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
