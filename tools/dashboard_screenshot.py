"""Take the README's dashboard screenshot during a real run of the embedded default.

    .venv/bin/python tools/dashboard_screenshot.py [--out docs/dashboard.png] [--steps 24]

Starts every service locally (1 reserved and 3 preemptible workers), submits a run of the
embedded default, preempts workers as it goes (one SIGKILL, one SIGTERM, then a new worker
joins), and photographs the dashboard in headless chromium while the run is still going.
Needs `make setup-browser`.
"""

import argparse
import signal
import time
from pathlib import Path

import repo_root  # noqa: F401  (the repository root on sys.path: tests.harness)

from services.cli.client import CoordinatorClient
from services.cli.local_deployment import DeploymentConfig
from services.cli.local_deployment import LocalDeployment as Deployment
from services.cli.up import ensure_model
from services.contracts.runspec import RunSpec
from tests.harness.browser import open_browser, screenshot, wait_for

HOME = Path(".spotrl")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="docs/dashboard.png")
    parser.add_argument("--steps", type=int, default=24)
    args = parser.parse_args()
    model = ensure_model(HOME / "models" / "arithmetic-base", "arithmetic", None, 1000)
    config = DeploymentConfig(
        HOME / "dashboard-shot",
        reserved=1,
        preemptible=3,
        extra_env={"SPOTRL_OBSERVE_S": "1", "SPOTRL_HEARTBEAT_TTL_S": "3"},
    )
    with Deployment(config) as dep, CoordinatorClient(dep.coordinator_url) as client:
        spec = RunSpec(model=str(model), steps=args.steps)
        run_id = client.submit(spec.model_dump(mode="json"))
        workers = [p for n, p in dep.procs.items() if n.startswith("rollout-preemptible")]
        plan = {  # step -> what happens to the pool
            args.steps // 4: lambda: workers[0].kill(),
            args.steps // 3: lambda: workers[1].popen.send_signal(signal.SIGTERM),
            args.steps // 2: lambda: dep.add_worker("preemptible", wait=False),
        }
        driver = open_browser()
        try:
            driver.get(f"{dep.coordinator_url}/?run={run_id}&refresh_ms=1000")
            while (step := client.run(run_id)["step"]) < int(args.steps * 0.8):
                dep.check_alive()
                for at in [s for s in plan if s <= step]:
                    plan.pop(at)()
                time.sleep(0.5)
            wait_for(driver, lambda s: s["charts"]["reward"]["points"] >= step - 1)
            time.sleep(2)
            print(screenshot(driver, Path(args.out), max_height=1700))
        finally:
            driver.quit()
            client.cancel(run_id)


if __name__ == "__main__":
    main()
