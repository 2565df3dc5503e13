"""The run scheduler of the data plane: it makes the oldest queued run active (or resumes the
active one) and drives its rollout manager until the run ends, one run at a time. Whenever the
run it drives changes (at start, when a run becomes active, when one ended) it sets the fleet's
gauges from the run records (`step_record.publish_fleet`): a restarted coordinator restores
them, an ended run clears them."""

import asyncio
import logging

from prometheus_client import Gauge
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import OutOfMemoryError
from redis.exceptions import TimeoutError as RedisTimeoutError

from services.contracts import keys
from services.coordinator.run_end import ended_as, failure_text, settle
from services.coordinator.runs import RunFailed, RunStore
from services.coordinator.settings import CoordinatorSettings
from services.coordinator.step_loop import build_loop
from services.coordinator.step_record import publish_fleet
from services.infra.redis_streams import with_reconnect
from services.infra.retry import brief
from services.state.run_state import RunStopped

log = logging.getLogger(__name__)
QUEUED = Gauge("spotrl_coordinator_runs_queued", "Runs waiting in the queue")
NOT_SHOWN = object()  # the fleet's gauges are not set yet


async def schedule_runs(store: RunStore, settings: CoordinatorSettings) -> None:
    """Forever: activate the oldest queued run (or resume the active one) and drive it."""
    shown: object = NOT_SHOWN  # the run the gauges were last set for (a run id or None)
    while True:
        run_id = await with_reconnect(store.active, "active run") or await with_reconnect(
            store.activate_next, "activate run"
        )
        QUEUED.set(await with_reconnect(lambda: store.r.llen(keys.RUN_QUEUE), "run queue"))
        if run_id != shown:
            await with_reconnect(lambda: publish_fleet(store.r), "fleet gauges")
            shown = run_id
        if run_id is None:
            await asyncio.sleep(settings.scheduler_poll_s)
            continue
        log.info("run %s active", run_id)
        try:
            spec = await store.spec(run_id)
            await build_loop(store.r, run_id, spec, settings).run()
        except RunStopped as exc:
            log.info("run %s stopped: %s", run_id, exc)
            await settle(store, run_id, await ended_as(store, run_id) or "cancelled")
            continue
        except RunFailed as exc:  # it cannot go on: its reason is the error
            log.error("run %s failed: %s", run_id, exc)
            await store.finish(run_id, "failed", str(exc))
            continue
        except (RedisConnectionError, RedisTimeoutError, OutOfMemoryError) as exc:
            # Redis went away (or refused a write at its memory limit) mid-step: everything that
            # landed is in Redis, each batch whole or not at all; resume from it
            log.warning(
                "run %s: redis unavailable (%s); resuming once it is back", run_id, brief(exc)
            )
            await asyncio.sleep(settings.scheduler_poll_s)
            continue
        except Exception as exc:
            ended = await ended_as(store, run_id)
            if ended is not None:  # its keys went while the manager still read them
                log.info("run %s stopped (%s) under its manager: %s", run_id, ended, exc)
                await settle(store, run_id, ended)
                continue
            log.exception("run %s failed", run_id)
            await store.finish(run_id, "failed", failure_text(exc))
            continue
        await store.finish(run_id, "succeeded")
        log.info("run %s succeeded", run_id)
