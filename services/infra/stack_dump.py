"""`kill -USR1 <pid>`: a service writes where each of its threads and asyncio tasks is, to its
log (stderr), and goes on. For a process that is alive and does nothing: which await it waits in.
"""

import asyncio
import faulthandler
import io
import signal
import sys
import traceback
from types import FrameType


def task_stacks(loop: asyncio.AbstractEventLoop) -> str:
    """Every task of `loop` with the frames it is suspended in, innermost last."""
    out = io.StringIO()
    tasks = sorted(asyncio.all_tasks(loop), key=lambda t: t.get_name())
    out.write(f"--- {len(tasks)} asyncio tasks\n")
    for task in tasks:
        out.write(f"task {task.get_name()}: {task.get_coro()!r}\n")
        frames = [(f, f.f_lineno) for f in awaited_frames(task.get_coro())]
        out.write("".join(traceback.format_list(traceback.StackSummary.extract(iter(frames)))))
    return out.getvalue()


def awaited_frames(coro: object) -> list[FrameType]:
    """The frames of a suspended coroutine and of what it awaits, down the await chain."""
    frames = []
    while coro is not None:
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
        if frame is not None:
            frames.append(frame)
        coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
    return frames


def _dump(signum: int, frame: FrameType | None) -> None:
    sys.stderr.write("--- stacks on SIGUSR1: threads\n")
    faulthandler.dump_traceback(sys.stderr, all_threads=True)
    loop = asyncio._get_running_loop()  # the handler runs in the thread of the loop, if any
    if loop is not None:
        sys.stderr.write(task_stacks(loop))
    sys.stderr.flush()


def install() -> None:
    """Dump the stacks on SIGUSR1 (from the main thread, where signal handlers run)."""
    signal.signal(signal.SIGUSR1, _dump)
