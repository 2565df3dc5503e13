"""Following a run through the coordinator's API, for the benchmarks that start a deployment
(bench/preemption.py, crash.py, goodput.py, many_runs.py, multi_turn.py, recovery.py,
sim_vs_real.py): `wait_final`, the one wait for a run to end.

It starts, stops and restarts nothing: the deployment and the client are the caller's.
"""

import time

from services.cli.client import CoordinatorClient
from services.cli.local_deployment import LocalDeployment
from services.contracts.runspec import FINAL_STATES

POLL_S = 0.2  # between two reads of the run


def wait_final(
    client: CoordinatorClient, run_id: str, timeout_s: float, dep: LocalDeployment | None = None
) -> dict:
    """The run's record once its state is final (succeeded, failed, cancelled), read at least
    once; TimeoutError if it is not after `timeout_s`. With `dep`, raise as soon as one of its
    core services has died (`check_alive`): pass none where the bench kills them on purpose."""
    deadline = time.monotonic() + timeout_s
    while True:
        if dep is not None:
            dep.check_alive()
        run = client.run(run_id)
        if run["state"] in FINAL_STATES:
            return run
        if time.monotonic() > deadline:
            raise TimeoutError(f"run {run_id} not final after {timeout_s:.0f}s")
        time.sleep(POLL_S)
