"""The control plane's side of the data plane (`services.coordinator.data_plane`): it starts the
process, learns where its metrics are served, relays them, and stops it. A data plane that
exits on its own is an error of the whole coordinator: `watch` raises, the control plane's
background task dies and the service stops, so that its supervisor starts both again.
"""

import asyncio
import contextlib
import logging
import os
import sys
import time

import httpx

from services.coordinator.settings import CoordinatorSettings

log = logging.getLogger(__name__)
SETTINGS_ENV = "SPOTRL_DATA_PLANE_SETTINGS"  # the coordinator's settings, as JSON
PARENT_ENV = "SPOTRL_DATA_PLANE_PARENT"  # the control plane's pid
PORT_FD_ENV = "SPOTRL_DATA_PLANE_PORT_FD"  # the pipe the metrics port is written to
STOP_S = 15.0  # a data plane told to stop (SIGTERM) is killed after this long
START_S = 60.0  # its metrics port must come within this long
METRICS_CACHE_S = 1.0  # its metrics are fetched at most this often, however often they are read


class DataPlaneExited(RuntimeError):
    """The data plane exited while the control plane still ran."""


class DataPlaneProcess:
    def __init__(self, settings: CoordinatorSettings) -> None:
        self.settings = settings
        self.proc: asyncio.subprocess.Process | None = None
        self.metrics_url = ""
        self._metrics = b""
        self._metrics_at = -METRICS_CACHE_S
        # plain HTTP even under TLS: the data plane serves its metrics on 127.0.0.1 only, to
        # this process, on a port that never leaves the machine
        self._client = httpx.AsyncClient(timeout=2.0)

    async def start(self) -> None:
        read_fd, write_fd = os.pipe()
        env = {
            **os.environ,
            SETTINGS_ENV: self.settings.model_dump_json(),
            PARENT_ENV: str(os.getpid()),
            PORT_FD_ENV: str(write_fd),
        }
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "services.coordinator.data_plane", env=env, pass_fds=(write_fd,)
        )
        os.close(write_fd)
        log.info("data plane started (pid %d)", self.proc.pid)
        try:
            async with asyncio.timeout(START_S):
                port = await asyncio.to_thread(_read_line, read_fd)
        finally:
            os.close(read_fd)
        if not port:
            raise DataPlaneExited(f"the data plane exited before it served metrics: {self.proc}")
        self.metrics_url = f"http://127.0.0.1:{int(port)}/metrics"

    async def watch(self) -> None:
        """Wait for the data plane's exit, and raise: it must not end before the control plane."""
        assert self.proc is not None
        code = await self.proc.wait()
        raise DataPlaneExited(f"the data plane exited ({code})")

    def status(self) -> dict:
        """For /healthz: the data plane's pid and whether it runs."""
        proc = self.proc
        return {
            "pid": proc.pid if proc else None,
            "alive": proc is not None and proc.returncode is None,
        }

    async def metrics(self) -> bytes:
        """The data plane's metrics (text exposition), fetched at most every METRICS_CACHE_S."""
        if time.monotonic() - self._metrics_at < METRICS_CACHE_S or not self.metrics_url:
            return self._metrics
        self._metrics_at = time.monotonic()
        try:
            reply = await self._client.get(self.metrics_url)
            reply.raise_for_status()
            self._metrics = reply.content
        except httpx.HTTPError as exc:
            log.warning("data plane metrics unavailable: %s", exc)
        return self._metrics

    async def stop(self) -> None:
        await self._client.aclose()
        proc = self.proc
        if proc is None or proc.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            proc.terminate()
        try:
            async with asyncio.timeout(STOP_S):
                await proc.wait()
        except TimeoutError:
            log.error("data plane did not stop in %.0f s; killing it", STOP_S)
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()


def _read_line(fd: int) -> str:
    """One line from a pipe ('' when its writer closed it without one)."""
    data = b""
    while not data.endswith(b"\n"):
        chunk = os.read(fd, 64)
        if not chunk:
            break
        data += chunk
    return data.decode().strip()
