"""Children die with the process that started them (`services.infra.lifeline`): the exec
wrapper refuses to run a program for a parent that is gone, a program it runs (Python or not)
is SIGKILLed when its parent is, as is a process a rollout worker forks once it tied its
children to itself (the vLLM engine's way), and `procs.start` called from a short-lived thread
starts a child that outlives the thread (while one forked by that thread itself does not)."""

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from services.cli import procs
from services.infra import lifeline

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux only")

# waits for GO to exist, then writes DONE: it can only write DONE if it is still alive
WAITER = textwrap.dedent(
    """
    import os, sys, time
    ready, go, done = sys.argv[1:4]
    open(ready, "w").close()
    while not os.path.exists(go):
        time.sleep(0.01)
    open(done, "w").close()
    """
)


def wait_until(condition, what: str, timeout_s: float = 20.0):
    deadline = time.monotonic() + timeout_s
    while not (result := condition()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"after {timeout_s:.0f}s: {what}")
        time.sleep(0.01)
    return result


def gone(pid: int) -> bool:
    """No such process, or a zombie (dead, waiting for a parent to reap it)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


def test_the_wrapper_runs_the_program_in_its_own_place(tmp_path):
    marker = tmp_path / "ran"
    code = f"import os; open({str(marker)!r}, 'w').write(str(os.getpid())); raise SystemExit(7)"
    child = subprocess.Popen(lifeline.wrap([sys.executable, "-c", code]))
    assert child.wait(timeout=30) == 7  # the program's own exit code: exec, not a subprocess
    assert marker.read_text() == str(child.pid)


def test_the_wrapper_exits_at_once_when_its_parent_is_gone(tmp_path):
    # a pid that is not the wrapper's parent: what it sees when the parent died before it ran
    dead = subprocess.Popen(["true"])
    dead.wait()
    marker = tmp_path / "ran"
    started = time.monotonic()
    out = subprocess.run(
        lifeline.wrap(["touch", str(marker)], parent_pid=dead.pid),
        capture_output=True,
        text=True,
        timeout=30,
    )
    elapsed_s = time.monotonic() - started
    assert out.returncode == lifeline.ORPHANED_EXIT_CODE, out.stderr
    assert f"its parent {dead.pid} is gone" in out.stderr
    assert not marker.exists()
    assert elapsed_s < 10, elapsed_s  # an interpreter's start, never a wait


def test_the_wrapper_says_what_it_cannot_run():
    out = subprocess.run(
        lifeline.wrap(["/nonexistent/program"]), capture_output=True, text=True, timeout=30
    )
    assert out.returncode == lifeline.NOT_RUNNABLE_EXIT_CODE
    assert "cannot run /nonexistent/program" in out.stderr


def test_procs_start_refuses_a_missing_program_in_the_caller(tmp_path):
    with pytest.raises(FileNotFoundError):
        procs.start("missing", ["/nonexistent/program"], {}, tmp_path)


# a parent that starts a Python child and a non-Python one (sleep) with procs.start, one from
# its main thread and one from a thread that exits, prints their pids, and waits to be killed
PARENT = textwrap.dedent(
    """
    import sys, threading, time
    from pathlib import Path
    from services.cli import procs

    logs = Path(sys.argv[1])
    python = procs.start("py", [sys.executable, "-c", "import time; time.sleep(600)"], {}, logs)
    box = []
    starter = threading.Thread(
        target=lambda: box.append(procs.start("sleep", ["sleep", "600"], {}, logs))
    )
    starter.start()
    starter.join()
    print(python.pid, box[0].pid, flush=True)
    time.sleep(600)
    """
)


def test_the_children_of_a_sigkilled_parent_die(tmp_path):
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    children: list[int] = []
    try:
        assert parent.stdout is not None
        children = [int(pid) for pid in parent.stdout.readline().split()]
        assert len(children) == 2, children

        def exec_done() -> bool:  # each child is its program now, not the wrapper
            lines = [Path(f"/proc/{pid}/cmdline").read_bytes() for pid in children]
            return all(lifeline.WRAPPER_MODULE.encode() not in line for line in lines)

        wait_until(exec_done, "the children never exec'd their programs")
        assert not any(gone(pid) for pid in children)
        parent.kill()
        parent.wait(10)
        started = time.monotonic()
        wait_until(lambda: all(gone(pid) for pid in children), "a child outlived its parent")
        assert time.monotonic() - started < 5
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
        for pid in children:
            if not gone(pid):
                os.kill(pid, signal.SIGKILL)


# a rollout worker that tied its children to itself (as the vLLM engine does), then forks one
TIED_WORKER = textwrap.dedent(
    """
    import os, time
    from services.rollout.lifeline import tie_children_to_this_process

    tie_children_to_this_process()
    child = os.fork()
    if child == 0:
        time.sleep(600)
        os._exit(0)
    print(child, flush=True)
    time.sleep(600)
    """
)


def test_an_engine_process_dies_with_the_worker_that_forked_it():
    worker = subprocess.Popen([sys.executable, "-c", TIED_WORKER], stdout=subprocess.PIPE)
    child = 0
    try:
        assert worker.stdout is not None
        child = int(worker.stdout.readline())
        assert not gone(child)
        worker.kill()
        worker.wait(10)
        wait_until(lambda: gone(child), "the engine process outlived its worker")
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()
        if child and not gone(child):
            os.kill(child, signal.SIGKILL)


def run_in_short_lived_thread(start) -> subprocess.Popen:
    """Call `start()` on a thread of its own that exits after, and wait until the kernel has
    let go of that thread (its task gone from /proc): any death signal it causes is sent."""
    box: list[subprocess.Popen] = []
    thread = threading.Thread(target=lambda: box.append(start()))
    thread.start()
    thread.join()
    wait_until(
        lambda: not Path(f"/proc/self/task/{thread.native_id}").exists(),
        "the thread's task never left",
    )
    return box[0]


@pytest.mark.parametrize("through_launcher", [True, False])
def test_a_child_started_from_a_thread_that_exits(tmp_path, through_launcher):
    """Through `procs.start` (the launcher) the child lives on; forked by the thread itself,
    the kernel kills it when the thread exits: the reason the launcher exists, and proof that
    this test can tell the two apart."""
    ready, go, done = (tmp_path / name for name in ("ready", "go", "done"))
    argv = [sys.executable, "-c", WAITER, str(ready), str(go), str(done)]

    def start() -> subprocess.Popen:
        if through_launcher:
            popen = procs.start("waiter", argv, {}, tmp_path).popen
        else:
            popen = subprocess.Popen(lifeline.wrap(argv), start_new_session=True)
        wait_until(ready.exists, "the child never started")  # tied to its parent by now
        return popen

    popen = run_in_short_lived_thread(start)
    try:
        go.touch()
        if through_launcher:
            wait_until(done.exists, "the child died with the thread that asked for it")
            assert popen.wait(timeout=20) == 0
        else:
            assert popen.wait(timeout=20) == -signal.SIGKILL
            assert not done.exists()
    finally:
        if popen.poll() is None:
            popen.kill()
            popen.wait()
