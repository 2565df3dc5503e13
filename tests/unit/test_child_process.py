"""The child-process helper (`services.infra.child_process`) with a real child
(`tests.data.echo_child`): frames both ways, what the child prints stays out of them, the
parent's pid leaves the child's environment, a child that ignores SIGTERM is killed after the
grace period, a stop of a child in its own group takes the group's other processes too, and a
dead child is ChildGone and can be started again."""

import asyncio
import signal
import time

import pytest

from services.infra.child_process import ChildGone, ChildProcess
from tests.data.echo_child import Echo

MODULE = "tests.data.echo_child"


def gone(pid: int) -> bool:
    """Whether the process is dead (a zombie that nobody reaped yet counts as dead)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_frames_go_both_ways_and_the_child_keeps_none_of_the_parents_pid():
    async def main():
        child = ChildProcess(MODULE, pipes=True)
        await child.start()
        try:
            for text in ("one", "two"):
                await child.send(Echo(text))
                assert await child.read(Echo) == Echo(text, parent_env=False, printed_to_log=True)
        finally:
            await child.stop()
        assert not child.alive and child.starts == 1

    asyncio.run(main())


def test_a_child_that_ignores_sigterm_is_killed_after_the_grace_period():
    async def main():
        child = ChildProcess(MODULE, ["stubborn"], pipes=True)
        await child.start()
        await child.send(Echo("ready?"))
        await child.read(Echo)  # it ignores SIGTERM from now on
        proc = child.proc
        started = time.monotonic()
        await child.stop(grace_s=0.5)
        assert 0.5 <= time.monotonic() - started < 5.0
        assert proc is not None and proc.returncode == -signal.SIGKILL

    asyncio.run(main())


def test_a_stop_kills_the_childs_whole_group_and_a_dead_child_is_gone():
    async def main():
        child = ChildProcess(MODULE, ["grandchild"], pipes=True, own_group=True)
        await child.start()
        grandchild = int((await child.read(Echo)).text)
        assert not gone(grandchild)
        await child.stop()
        deadline = time.monotonic() + 5.0
        while not gone(grandchild) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert gone(grandchild)
        await child.start()  # started again
        assert child.starts == 2
        assert child.proc is not None
        child.proc.kill()
        assert await child.wait() == -signal.SIGKILL
        with pytest.raises(ChildGone):
            await child.read(Echo)
        await child.stop()

    asyncio.run(main())
