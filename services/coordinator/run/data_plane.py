"""The data plane as the control plane sees it: the control plane (`app.py`) starts it as its
child (`services.infra.child_process`), learns where its metrics are served, relays them, and
stops it. The data plane itself, the run scheduler and the observer in a process of their own,
is `run/scheduler.py`.

A data plane that exits on its own is an error of the whole coordinator: `watch` raises, the
control plane's background task dies and the service stops, so that its supervisor starts both
again. This module stays light: the control plane imports none of the data plane's modules.
"""

import asyncio
import logging
import os
import time

import httpx

from services.coordinator.settings import CoordinatorSettings
from services.infra.child_process import ChildProcess

log = logging.getLogger(__name__)
MODULE = (
    "services.coordinator.run.scheduler"  # the data plane's process: `python -m MODULE PORT_FD`
)
STOP_S = 15.0  # a data plane told to stop (SIGTERM) is killed after this long
START_S = 60.0  # its metrics port must come within this long
METRICS_CACHE_S = 1.0  # its metrics are fetched at most this often, however often they are read


class DataPlaneExited(RuntimeError):
    """The data plane exited while the control plane still ran."""


class DataPlaneProcess:
    def __init__(self, settings: CoordinatorSettings) -> None:
        self.settings = settings
        self.child: ChildProcess | None = None
        self.metrics_url = ""
        self._metrics = b""
        self._metrics_at = -METRICS_CACHE_S
        # plain HTTP even under TLS: the data plane serves its metrics on 127.0.0.1 only, to
        # this process, on a port that never leaves the machine
        self._client = httpx.AsyncClient(timeout=2.0)

    async def start(self) -> None:
        """Start the data plane and wait for the port of its metrics (written to a pipe)."""
        read_fd, write_fd = os.pipe()
        self.child = ChildProcess(
            MODULE, [str(write_fd)], settings=self.settings, pass_fds=(write_fd,)
        )
        await self.child.start()
        os.close(write_fd)
        log.info("data plane started (pid %d)", self.pid)
        try:
            async with asyncio.timeout(START_S):
                port = await asyncio.to_thread(_read_line, read_fd)
        finally:
            os.close(read_fd)
        if not port:
            raise DataPlaneExited(f"the data plane exited before it served metrics: {self.pid}")
        self.metrics_url = f"http://127.0.0.1:{int(port)}/metrics"

    @property
    def pid(self) -> int | None:
        proc = self.child.proc if self.child is not None else None
        return proc.pid if proc is not None else None

    async def watch(self) -> None:
        """Wait for the data plane's exit, and raise: it must not end before the control plane."""
        assert self.child is not None
        code = await self.child.wait()
        raise DataPlaneExited(f"the data plane exited ({code})")

    def status(self) -> dict:
        """For /healthz: the data plane's pid and whether it runs."""
        return {"pid": self.pid, "alive": self.child is not None and self.child.alive}

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
        if self.child is not None:
            await self.child.stop(STOP_S)


def _read_line(fd: int) -> str:
    """One line from a pipe ('' when its writer closed it without one)."""
    data = b""
    while not data.endswith(b"\n"):
        chunk = os.read(fd, 64)
        if not chunk:
            break
        data += chunk
    return data.decode().strip()
