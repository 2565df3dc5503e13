"""The deployment that the integration tests and the benchmarks drive: `spotrl up`'s
`LocalDeployment` plus what only they do to it: restart a service in place (SIGKILL, or SIGTERM
and its shutdown) with the same port and settings, restart Redis on its data folder, and stop a
worker while it holds jobs of several runs.
"""

import signal
import time
from collections.abc import Callable
from dataclasses import replace

import redis

from services.cli import procs
from services.cli.local_deployment import DeploymentConfig, LocalDeployment
from services.contracts import keys

__all__ = ["Deployment", "DeploymentConfig", "held_runs"]


# The tests and benchmarks are one client (127.0.0.1) that reads the API as often as a check
# needs: they lift the coordinator's per-client read limit unless a test sets its own
# (tests/integration/test_control_plane.py tests the limit itself).
TEST_READ_LIMITS = {"SPOTRL_READ_RATE_PER_S": "100000", "SPOTRL_READ_BURST": "100000"}


class Deployment(LocalDeployment):
    def __init__(self, config: DeploymentConfig) -> None:
        extra_env = TEST_READ_LIMITS | config.extra_env
        super().__init__(replace(config, extra_env=extra_env))

    @property
    def weightstore_urls(self) -> list[str]:
        return self.weightstore_url.split(",")

    def restart(
        self,
        name: str,
        kill: bool = True,
        timeout_s: float = 120.0,
        settings: dict[str, str] | None = None,
    ) -> procs.Proc:
        """Stop a service (SIGKILL, or SIGTERM with kill=False) and start it again on the same
        port with the same settings (and `settings`, environment variables, on top); returns
        once it is healthy."""
        module, env, port = self.launch[name]
        env = env | (settings or {})
        if kill:
            self.procs[name].kill()
        else:
            self.procs[name].stop()
        proc = self._service(name, module, env, port)
        procs.wait_healthy([proc], timeout_s)
        return proc

    def restart_redis(
        self, kill: bool = False, while_down: Callable[[], object] | None = None
    ) -> procs.Proc:
        """Stop the Redis this deployment started (SIGTERM: it writes its append-only file out;
        SIGKILL with kill=True), call `while_down()` if given, and start it again on the same
        port and data folder."""
        if kill:
            self.procs["redis"].kill()
        else:
            self.procs["redis"].stop()
        if while_down is not None:
            while_down()
        port = int(self.redis_url.rsplit(":", 1)[1].split("/")[0])
        return self.start_redis(port)

    def stop_a_holder(
        self, runs: list[str], steps: int, want: int, timeout_s: float = 120.0
    ) -> tuple[str, set[str]]:
        """SIGSTOP a live worker while it holds jobs of `want` of `runs` at least (read, not
        acknowledged; checked again once it is stopped, as it may have finished them before
        the signal landed): its name and the runs it holds. A TimeoutError past `timeout_s`."""
        rdb = redis.Redis.from_url(self.redis_url)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for name, proc in list(self.procs.items()):
                if not name.startswith("rollout-") or not proc.alive():
                    continue
                if len(held_runs(rdb, name, runs, steps)) < want:
                    continue
                proc.popen.send_signal(signal.SIGSTOP)
                held = held_runs(rdb, name, runs, steps)
                if len(held) >= want:
                    return name, held
                proc.popen.send_signal(signal.SIGCONT)
            time.sleep(0.01)
        raise TimeoutError(f"no worker caught holding jobs of {want} of the runs {runs}")


def held_runs(rdb: redis.Redis, worker: str, runs: list[str], steps: int) -> set[str]:
    """The runs of which `worker` holds jobs now (read and not acknowledged), looking at each
    run's first `steps` steps."""
    held = set()
    for run_id in runs:
        for step in range(steps):
            try:
                pending = rdb.xpending_range(
                    keys.jobs_stream(run_id, step), keys.WORKERS_GROUP, "-", "+", 1, worker
                )
            except redis.ResponseError:  # the step not queued yet
                continue
            if pending:
                held.add(run_id)
                break
    return held
