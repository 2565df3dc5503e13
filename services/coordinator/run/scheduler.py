"""The coordinator's data plane: the run scheduler (which drives each run's shard 0, its step
loop, its delta ingest and its shards) and the observer, in a process of their own, started
by the control plane (`app.py`, through `run.data_plane.DataPlaneProcess`) as its child and dying
with it.

The run scheduler makes the oldest queued run active and drives it (`shard.drive`) until the
run ends; with the coordinator's `max_active_runs` above 1 it activates another queued run
whenever a trainer of the pool is idle for it (`trainer_pool.idle_trainers`), drives each
active run in a task of its own (a queued run whose submitting token holds its most active runs
or share waits: `core.run_admission`), and the fleet's placement (`workers.placement`) shares the
workers among them. Whenever the oldest active run changes (at start, when a run becomes
active, when one ended) it sets the fleet's gauges from the run records
(`step.record.publish_fleet`): a restarted coordinator restores them, an ended run clears them.

Nothing a client does reaches this process: the REST API, the dashboard and the metrics are
answered by the control plane from its read model. Its own metrics are served on loopback, on a
port it hands the control plane through a pipe, and appear in the control plane's /metrics.

    python -m services.coordinator.run.scheduler [PORT_FD]   (the coordinator's settings handed
    down by its parent: `services.infra.child_process`; PORT_FD: the pipe's write end)
"""

import asyncio
import logging
import os
import signal
import sys
from functools import partial

from prometheus_client import Gauge, start_http_server

from services.contracts import keys
from services.coordinator.run.shard import drive
from services.coordinator.settings import CoordinatorSettings
from services.coordinator.step.record import publish_fleet
from services.coordinator.workers.observer import Observer
from services.coordinator.workers.placement import FleetPlacer
from services.infra import stack_dump
from services.infra.cancel import cancel_and_wait
from services.infra.child_process import handed_settings, tie_to_parent
from services.infra.logs import setup_logging
from services.infra.redis_streams import connect, with_reconnect
from services.infra.service import BackgroundTasks
from services.state.runs import RunStore, deactivate
from services.state.trainer_pool import idle_trainers

log = logging.getLogger(__name__)
QUEUED = Gauge("spotrl_coordinator_runs_queued", "Runs waiting in the queue")
NOT_SHOWN = object()  # the fleet's gauges are not set yet


async def schedule_runs(store: RunStore, settings: CoordinatorSettings) -> None:
    """Forever: activate queued runs as the settings and the trainers allow, and drive each
    active run (again after a Redis outage) until it ends."""
    shown: object = NOT_SHOWN  # the run the gauges were last set for (a run id or None)
    driving: dict[str, asyncio.Task[None]] = {}
    try:
        while True:
            for run_id, task in list(driving.items()):
                if task.done():
                    del driving[run_id]
                    task.result()  # a driver that died of an error takes the scheduler down
            active = await with_reconnect(store.active_runs, "active runs")
            if not active or len(active) < settings.max_active_runs:
                idle = 0
                if active:
                    idle = await with_reconnect(lambda: idle_trainers(store.r), "trainers")
                activated = await with_reconnect(
                    partial(
                        store.activate_next,
                        settings.max_active_runs,
                        idle,
                        settings.token_limits(),
                    ),
                    "activate run",
                )
                if activated is not None:
                    active.append(activated)
            for run_id in active:
                if run_id not in driving:
                    driving[run_id] = asyncio.create_task(drive_until_over(store, run_id, settings))
            QUEUED.set(await with_reconnect(lambda: store.r.llen(keys.RUN_QUEUE), "run queue"))
            oldest = active[0] if active else None
            if oldest != shown:
                await with_reconnect(lambda: publish_fleet(store.r), "fleet gauges")
                shown = oldest
            await asyncio.sleep(settings.scheduler_poll_s)
    finally:
        await cancel_and_wait(driving.values())


async def drive_until_over(store: RunStore, run_id: str, settings: CoordinatorSettings) -> None:
    """Drive the run until it is over (again after each Redis outage)."""
    log.info("run %s active", run_id)
    while not await drive(store, run_id, settings):
        pass
    # over: out of the active runs even if its end was written before they existed
    await with_reconnect(lambda: deactivate(store.r, run_id), "deactivate run")


def serve_metrics(port_fd: int | None) -> None:
    """Serve this process's metrics on a free loopback port and write the port to `port_fd`."""
    server, _ = start_http_server(0, addr="127.0.0.1")
    if port_fd is not None:
        with os.fdopen(port_fd, "w") as pipe:
            pipe.write(f"{server.server_port}\n")


async def run(settings: CoordinatorSettings) -> None:
    """Schedule runs and observe the pool until SIGTERM."""
    r = connect(settings.redis_url, ca_file=settings.tls_ca_file)
    store = RunStore(r, settings.audit_ttl_s)
    observer = Observer(
        r,
        settings.observe_s,
        settings.redis_memory_limit_mb,
        settings.forget_workers_after_s,
        settings.worker_redis_users,
    )
    tasks = BackgroundTasks()
    tasks.start("scheduler", lambda: schedule_runs(store, settings))
    tasks.start("observer", observer.forever)
    if settings.max_active_runs > 1:
        placer = FleetPlacer(r, settings.placement_s, settings.placement_switch_share)
        tasks.start("placement", placer.forever)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("data plane stopping")
    await tasks.stop()
    await r.aclose()


def main() -> None:
    settings = handed_settings(CoordinatorSettings)
    setup_logging("coordinator-data", settings.log_level)
    tie_to_parent()
    stack_dump.install()
    serve_metrics(int(sys.argv[1]) if len(sys.argv) > 1 else None)
    asyncio.run(run(settings))


if __name__ == "__main__":
    main()
