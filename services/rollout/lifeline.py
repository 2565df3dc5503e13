"""Engine processes die with the rollout worker that started them.

vLLM runs its engine core (and that one's workers) in child processes. If a worker is killed
with SIGKILL, they would live on as orphans holding memory and cores. Each such child ties
itself to its parent (`services.infra.lifeline.die_with_parent`), whether it was forked (an
at-fork hook) or spawned (`services.rollout.main` runs `tie_to_parent` when multiprocessing
imports it as `__mp_main__` in the child). A spawned child learns its parent's pid from the
environment, which each process in the chain sets for its own children.
"""

import os

from services.infra.lifeline import die_with_parent

PARENT_ENV = "SPOTRL_LIFELINE_PARENT"
_tied = False


def tie_to_parent() -> None:
    """In a child: SIGKILL when the parent dies; exit now if it died already."""
    expected = os.environ.get(PARENT_ENV)
    die_with_parent(int(expected) if expected else None)
    os.environ[PARENT_ENV] = str(os.getpid())  # for this process's own children


def tie_children_to_this_process() -> None:
    """Every child this process starts from now on dies with it."""
    global _tied
    os.environ[PARENT_ENV] = str(os.getpid())
    if not _tied:
        os.register_at_fork(after_in_child=tie_to_parent)
        _tied = True
