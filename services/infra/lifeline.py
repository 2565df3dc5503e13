"""A process's children die with it, however it dies (SIGKILL, the OOM killer included).

Linux sends a child a chosen signal when its parent dies (PR_SET_PDEATHSIG); this module asks
for SIGKILL. Three ways in:

- `die_with_parent()`, called first thing in a child we wrote (the coordinator's shards and
  reward processes, the trainer's ranks, the rollout worker's engine processes). It exits at
  once when the parent is already gone, since the kernel will then never send the signal.
- The exec wrapper, for any program (redis-server, or a Python service before its imports):
  `python -m services.infra.lifeline PARENT_PID -- ARGV...` does the same, then execs ARGV.
  The setting survives exec, except into a set-user-ID or set-group-ID program.
- `Launcher`: the kernel sends the signal when the *thread* that forked the child exits, not
  when its process does. A child forked from a short-lived thread (a chaos replay's) would be
  killed with that thread. The launcher forks every child from one thread that lives as long
  as the process does.

What this does not do: it has no effect outside Linux (the calls return and children may
outlive their parent), and it does not reach a child's own children: each of them must call
`die_with_parent` itself, or be started through the wrapper.
"""

import ctypes
import logging
import os
import queue
import shutil
import signal
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

log = logging.getLogger(__name__)
PR_SET_PDEATHSIG = 1
ORPHANED_EXIT_CODE = 1  # the parent was gone before this process could tie itself to it
USAGE_EXIT_CODE = 2
NOT_RUNNABLE_EXIT_CODE = 127  # as a shell says "command not found"
WRAPPER_MODULE = "services.infra.lifeline"
# signals Python ignores at start; an ignored signal stays ignored across exec, so the wrapper
# gives them back their default action first (as subprocess's restore_signals does)
RESTORED_SIGNALS = ("SIGPIPE", "SIGXFSZ")
T = TypeVar("T")


def set_parent_death_signal(sig: int = signal.SIGKILL) -> bool:
    """Ask the kernel to send `sig` to this process when its parent dies; False where this is
    not possible (not Linux, no prctl in the C library)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return False
    if prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"prctl(PR_SET_PDEATHSIG): {os.strerror(errno)}")
    return True


def die_with_parent(parent_pid: int | None = None) -> None:
    """From now on the kernel SIGKILLs this process when its parent dies; exit at once if the
    parent has died already. `parent_pid` is the pid the parent handed down (argv or the
    environment), which catches a parent that died before this process started; None takes the
    parent this process has now, read before the call (catches one that dies during it)."""
    expected = os.getppid() if parent_pid is None else parent_pid
    if not set_parent_death_signal():
        return
    if os.getppid() != expected:
        log.warning("pid %d: its parent %d is gone, exiting", os.getpid(), expected)
        os._exit(ORPHANED_EXIT_CODE)


def wrap(argv: Sequence[str], parent_pid: int | None = None) -> list[str]:
    """`argv` run through the exec wrapper, tied to `parent_pid` (default: this process)."""
    pid = os.getpid() if parent_pid is None else parent_pid
    return [sys.executable, "-m", WRAPPER_MODULE, str(pid), "--", *argv]


def require_program(program: str, env: Mapping[str, str]) -> None:
    """Raise FileNotFoundError now, in the caller, when the wrapper could not exec `program`
    (looked up on `env`'s PATH, as the wrapper does)."""
    if shutil.which(program, path=env.get("PATH", os.defpath)) is None:
        raise FileNotFoundError(f"no such program: {program}")


@dataclass
class _Call:
    fn: Callable[[], Any]
    done: threading.Event = field(default_factory=threading.Event)
    result: Any = None
    error: BaseException | None = None


class Launcher:
    """Runs the calls that start child processes on one thread of its own, which is never
    left: a child started through it (with the exec wrapper, or calling `die_with_parent`)
    dies when this process dies, and only then, whichever thread asked for it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._calls: queue.SimpleQueue[_Call] = queue.SimpleQueue()
        self._owner_pid = 0  # the process whose thread serves `_calls`; 0: none yet

    def run(self, fn: Callable[[], T]) -> T:
        """`fn()` (which starts a process) called on the launcher's thread; its result, or its
        exception raised here."""
        call = _Call(fn)
        self._queue().put(call)
        call.done.wait()
        if call.error is not None:
            raise call.error
        return cast(T, call.result)

    def _queue(self) -> "queue.SimpleQueue[_Call]":
        with self._lock:
            if self._owner_pid != os.getpid():  # first use, or a forked copy without the thread
                self._calls = queue.SimpleQueue()
                thread = threading.Thread(
                    target=self._serve, args=(self._calls,), name="lifeline-launcher", daemon=True
                )
                thread.start()
                self._owner_pid = os.getpid()
            return self._calls

    @staticmethod
    def _serve(calls: "queue.SimpleQueue[_Call]") -> None:
        while True:
            call = calls.get()
            try:
                call.result = call.fn()
            except BaseException as exc:  # handed to the caller, which raises it
                call.error = exc
            finally:
                call.done.set()


launcher = Launcher()


def main(args: list[str]) -> None:
    """The exec wrapper: `PARENT_PID -- ARGV...`."""
    if len(args) < 3 or not args[0].isdigit() or args[1] != "--":
        print(f"usage: python -m {WRAPPER_MODULE} PARENT_PID -- ARGV...", file=sys.stderr)
        sys.exit(USAGE_EXIT_CODE)
    die_with_parent(int(args[0]))
    command = args[2:]
    for name in RESTORED_SIGNALS:
        if hasattr(signal, name):
            signal.signal(getattr(signal, name), signal.SIG_DFL)
    try:
        os.execvp(command[0], command)
    except OSError as exc:
        print(f"{WRAPPER_MODULE}: cannot run {command[0]}: {exc}", file=sys.stderr, flush=True)
        os._exit(NOT_RUNNABLE_EXIT_CODE)


if __name__ == "__main__":
    main(sys.argv[1:])
