"""Engine processes die with the rollout worker that started them.

vLLM runs its engine core (and that one's workers) in child processes. If a worker is killed
with SIGKILL, they would live on as orphans holding memory and cores. Each such child asks the
kernel for SIGKILL when its parent dies (PR_SET_PDEATHSIG), whether it was forked (an at-fork
hook) or spawned (`services.rollout.main` runs `die_with_parent` when multiprocessing imports it
as `__mp_main__` in the child). Linux only; elsewhere, a no-op.
"""

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1
PARENT_ENV = "SPOTRL_LIFELINE_PARENT"
_tied = False


def die_with_parent() -> None:
    """In a child: SIGKILL when the parent dies; exit now if it died already."""
    if not sys.platform.startswith("linux"):
        return
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    expected = os.environ.get(PARENT_ENV)
    if expected and os.getppid() != int(expected):
        os._exit(1)
    os.environ[PARENT_ENV] = str(os.getpid())  # for this process's own children


def tie_children_to_this_process() -> None:
    """Every child this process starts from now on dies with it."""
    global _tied
    os.environ[PARENT_ENV] = str(os.getpid())
    if not _tied and sys.platform.startswith("linux"):
        os.register_at_fork(after_in_child=die_with_parent)
        _tied = True
