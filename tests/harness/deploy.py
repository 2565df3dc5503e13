"""The deployment that the integration tests and the benchmarks drive: `spotrl up`'s
`LocalDeployment` plus what only they do to it: restart a service in place (SIGKILL, or SIGTERM
and its shutdown) with the same port and settings, and restart Redis on its data folder.
"""

from collections.abc import Callable
from dataclasses import replace

from services.cli import procs
from services.cli.local_deployment import DeploymentConfig, LocalDeployment

__all__ = ["Deployment", "DeploymentConfig"]


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
