"""The coordinator's data plane: the run scheduler (which drives each run's rollout manager,
its delta ingest and its shards) and the observer, in a process of their own, started by the
control plane (`services.coordinator.app`) as its child and dying with it.

Nothing a client does reaches this process: the REST API, the dashboard and the metrics are
answered by the control plane from its read model. Its own metrics are served on loopback, on
a port it hands the control plane through a pipe, and appear in the control plane's /metrics.

    python -m services.coordinator.data_plane   (the coordinator's settings in
    SPOTRL_DATA_PLANE_SETTINGS, as JSON; its parent's pid in SPOTRL_DATA_PLANE_PARENT; the pipe's
    write end in SPOTRL_DATA_PLANE_PORT_FD)
"""

import asyncio
import logging
import os
import signal

from prometheus_client import start_http_server

from services.coordinator.data_plane_process import PARENT_ENV, PORT_FD_ENV, SETTINGS_ENV
from services.coordinator.run.runs import RunStore
from services.coordinator.scheduler import schedule_runs
from services.coordinator.settings import CoordinatorSettings
from services.coordinator.workers.observer import Observer
from services.infra import stack_dump
from services.infra.lifeline import die_with_parent
from services.infra.logs import setup_logging
from services.infra.redis_streams import connect
from services.infra.service import BackgroundTasks

log = logging.getLogger(__name__)


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
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("data plane stopping")
    await tasks.stop()
    await r.aclose()


def main() -> None:
    raw = os.environ.get(SETTINGS_ENV)
    settings = (
        CoordinatorSettings.model_validate_json(raw) if raw is not None else CoordinatorSettings()
    )
    setup_logging("coordinator-data", settings.log_level)
    if PARENT_ENV in os.environ:
        die_with_parent(int(os.environ[PARENT_ENV]))
    stack_dump.install()
    port_fd = os.environ.get(PORT_FD_ENV)
    serve_metrics(int(port_fd) if port_fd else None)
    asyncio.run(run(settings))


if __name__ == "__main__":
    main()
