"""A child process of ours, `python -m MODULE ARGS...`, as its parent sees it and as it sees
itself.

The parent (`ChildProcess`) starts it, with pipes to talk to it in frames (`frames.py`) when
asked and in a process group of its own when asked, notices its exit, and stops it: SIGTERM and
a grace period, then SIGKILL, to its whole group when it has one. It may be started again after
it died or was stopped. The child ties itself to its parent first thing (`tie_to_parent`: it
dies when the parent dies, `lifeline.die_with_parent`), reads the settings its parent handed
down (`handed_settings`) and, when it talks in frames, takes the pipes for itself
(`take_pipes`: what its code prints goes to the log, never into the frames).

What a child's death means (start it again, fail the call it was on, stop the whole service) is
each user's own policy: the data plane (`coordinator/run/data_plane.py`), the coordinator's shards
(`coordinator/run/shard.py`), the reward runner and the environment runner.
"""

import asyncio
import contextlib
import logging
import os
import signal
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import IO, Any, TypeVar

from pydantic import BaseModel

from services.infra.frames import HEADER, MAX_REPLY_BYTES, decode, frame
from services.infra.lifeline import die_with_parent

log = logging.getLogger(__name__)
PARENT_ENV = "SPOTRL_CHILD_PARENT"  # the parent's pid; the child drops it once read
SETTINGS_ENV = "SPOTRL_CHILD_SETTINGS"  # the settings the parent hands down, as JSON
M = TypeVar("M", bound=BaseModel)


class ChildGone(Exception):
    """The child exited or closed its side of the pipes."""


class ChildProcess:
    """One child process: `start`, then `send` / `read` frames (with `pipes`), `wait` for its
    exit, `stop` it (or `kill` it without waiting); `start` again after either."""

    def __init__(
        self,
        module: str,
        args: Sequence[str] = (),
        *,
        env: Mapping[str, str] | Callable[[], Mapping[str, str]] | None = None,
        settings: BaseModel | None = None,
        pipes: bool = False,
        own_group: bool = False,
        pass_fds: Sequence[int] = (),
    ) -> None:
        """`env`: the child's environment, or what gives it at each start (default: this
        process's); `settings` handed down in it; `pipes`: frames over the child's stdin and
        stdout; `own_group`: a process group of its own, which a stop kills whole (the child's
        own children too)."""
        self.module, self.args = module, list(args)
        self.env, self.settings = env, settings
        self.pipes, self.own_group, self.pass_fds = pipes, own_group, tuple(pass_fds)
        self.proc: asyncio.subprocess.Process | None = None
        self.starts = 0

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.returncode is None

    async def start(self) -> None:
        given = self.env() if callable(self.env) else self.env
        env = dict(os.environ if given is None else given)
        env[PARENT_ENV] = str(os.getpid())
        if self.settings is not None:
            env[SETTINGS_ENV] = self.settings.model_dump_json()
        pipe = asyncio.subprocess.PIPE if self.pipes else None
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            self.module,
            *self.args,
            stdin=pipe,
            stdout=pipe,
            start_new_session=self.own_group,
            env=env,
            pass_fds=self.pass_fds,
        )
        self.starts += 1

    async def wait(self) -> int:
        """The child's exit code, once it exited."""
        assert self.proc is not None
        return await self.proc.wait()

    async def send(self, message: Any) -> None:
        """`message` as a frame on the child's stdin; ChildGone when it is not there to read."""
        assert self.proc is not None and self.proc.stdin is not None
        try:
            self.proc.stdin.write(frame(message))
            await self.proc.stdin.drain()
        except (BrokenPipeError, ConnectionResetError):
            raise ChildGone from None

    async def read(self, kind: Any, max_bytes: int = MAX_REPLY_BYTES) -> Any:
        """The next frame on the child's stdout, as a `kind`; ChildGone when the child closed
        it or sent a frame over `max_bytes`."""
        assert self.proc is not None and self.proc.stdout is not None
        try:
            (size,) = HEADER.unpack(await self.proc.stdout.readexactly(HEADER.size))
            if size > max_bytes:
                raise ChildGone
            return decode(await self.proc.stdout.readexactly(size), kind)
        except asyncio.IncompleteReadError:
            raise ChildGone from None

    async def stop(self, grace_s: float = 0.0) -> None:
        """Stop the child and wait for its end: SIGTERM, then SIGKILL after `grace_s` (at once
        when 0). Nothing to do when none was started or it was stopped already."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        if grace_s > 0 and proc.returncode is None:
            self._signal(proc, signal.SIGTERM)
            try:
                async with asyncio.timeout(grace_s):  # not wait_for: see infra/cancel.py
                    await proc.wait()
                return
            except TimeoutError:
                log.error(
                    "%s (pid %d) did not stop in %.0f s; killing it", self.module, proc.pid, grace_s
                )
        self._signal(proc, signal.SIGKILL)
        await proc.wait()

    def kill(self) -> None:
        """SIGKILL the child without waiting (asyncio's child watcher reaps it)."""
        proc, self.proc = self.proc, None
        if proc is not None:
            self._signal(proc, signal.SIGKILL)

    def _signal(self, proc: asyncio.subprocess.Process, sig: int) -> None:
        if proc.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):  # it exited meanwhile
            if self.own_group:
                os.killpg(proc.pid, sig)
            else:
                proc.send_signal(sig)


def tie_to_parent() -> None:
    """First thing in a child: die when the parent that started it dies (exit now if it is gone
    already). The parent's pid leaves this process's environment: user code never reads it."""
    parent = os.environ.pop(PARENT_ENV, None)
    if parent is not None:
        die_with_parent(int(parent))


def handed_settings(kind: type[M]) -> M:
    """The settings the parent handed down; `kind`'s own (from the environment) without."""
    raw = os.environ.get(SETTINGS_ENV)
    return kind.model_validate_json(raw) if raw is not None else kind()


def take_pipes() -> tuple[IO[bytes], IO[bytes]]:
    """The streams a child reads and writes frames on (its stdin and stdout as started): from
    now on what its code prints goes to the log (fd 2), and what reads stdin reads nothing."""
    channel = os.fdopen(os.dup(1), "wb")
    inbox = os.fdopen(os.dup(0), "rb")
    os.dup2(2, 1)
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    sys.stdout = sys.stderr
    return inbox, channel
