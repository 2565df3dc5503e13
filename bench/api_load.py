"""Does reading the API slow training? A real run of the embedded default (`spotrl up`'s
deployment and spec, run long), its steps/s measured in windows: unread, then read by a wall of
dashboards, unread, hammered, unread, probed for capacity, unread. Each read window is compared
with the unread windows beside it, in the same invocation.

- (a) `steps_ratio`: 20 clients each reading every GET route once a second (aim >= 0.90);
- (b) `hammer_steps_ratio`: 100 clients reading as fast as answers come, waiting out a 429's
  Retry-After (aim >= 0.70);
- (c) `read_rps`, `read_p99_s`: 80 clients at 8 reads/s each (under the per-client limit)
  while the run trains: reads answered per second and their p99 (aim >= 500/s, < 0.1 s).

The readers (`bench/api_clients.py`) run in one process of their own at `--readers-nice`
(default 10): on a real deployment they are browsers and scrapers on other machines, here they
share the run's 2 cores. Steps are read from Redis by this process (one GET a second).

    .venv/bin/python bench/api_load.py [--window-s 25]
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import redis

if not __package__:  # run as a script: bench/ is on sys.path, the repo root is not
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from services.cli.client import CoordinatorClient
from services.cli.local_deployment import DeploymentConfig, LocalDeployment
from services.cli.up import ensure_model, local_sizing
from services.contracts import keys
from services.contracts.runspec import EMBEDDED_DEFAULTS, EMBEDDED_PRETRAIN_STEPS, RunSpec

CLIENTS = Path(__file__).with_name("api_clients.py")


def version(r: redis.Redis, run_id: str) -> int:
    raw = r.get(keys.run_version(run_id))
    return int(raw) if raw is not None else 0


def steps_per_s(r: redis.Redis, run_id: str, window_s: float, readers: list[str] | None) -> dict:
    """Steps/s of the run over `window_s`, while `readers` (a command) run, if any."""
    proc = subprocess.Popen(readers, stdout=subprocess.PIPE, text=True) if readers else None
    v0, t0 = version(r, run_id), time.monotonic()
    time.sleep(window_s)
    v1, t1 = version(r, run_id), time.monotonic()
    out: dict = {"steps_per_s": round((v1 - v0) / (t1 - t0), 3)}
    if proc is not None:
        stdout, _ = proc.communicate(timeout=120)
        out["readers"] = json.loads(stdout.strip().splitlines()[-1])
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=".spotrl/models/arithmetic-base")
    parser.add_argument("--window-s", type=float, default=25.0)
    parser.add_argument("--readers-nice", type=int, default=10)
    parser.add_argument("--dashboards", type=int, default=20)
    parser.add_argument("--hammers", type=int, default=100)
    parser.add_argument("--probes", type=int, default=80)
    parser.add_argument("--probe-rate", type=float, default=8.0)
    parser.add_argument(
        "--warm-steps",
        type=int,
        default=60,
        help="steps before the first window: past the "
        "first steps, whose responses shorten as the model learns, steps/s drifts less",
    )
    args = parser.parse_args()

    model = ensure_model(Path(args.model), "arithmetic", None, EMBEDDED_PRETRAIN_STEPS)
    spec = RunSpec(model=str(model.resolve()), **{**EMBEDDED_DEFAULTS, "steps": 100_000})
    slots, threads = local_sizing(spec, 1, os.cpu_count() or 1)
    work = Path(tempfile.mkdtemp(prefix="spotrl-bench-api-"))
    config = DeploymentConfig(work, reserved=1, preemptible=1, worker_slots=slots)
    config.trainer_threads = threads
    with LocalDeployment(config) as dep, CoordinatorClient(dep.coordinator_url) as client:
        r = redis.Redis.from_url(dep.redis_url)
        run_id = client.submit(json.loads(spec.model_dump_json()))
        while version(r, run_id) < args.warm_steps:  # warm: loads, compiles, shorter answers
            dep.check_alive()
            time.sleep(0.5)

        def readers(mode: str, clients: int, rate: float = 10.0) -> list[str]:
            return [
                sys.executable, str(CLIENTS), "--url", dep.coordinator_url, "--run-id", run_id,
                "--mode", mode, "--clients", str(clients), "--rate", str(rate),
                "--duration-s", str(args.window_s), "--nice", str(args.readers_nice),
            ]  # fmt: skip

        plan = [
            ("unread", None),
            ("dashboards", readers("dashboard", args.dashboards)),
            ("unread", None),
            ("hammer", readers("hammer", args.hammers)),
            ("unread", None),
            ("probe", readers("paced", args.probes, args.probe_rate)),
            ("unread", None),
        ]
        windows = []
        for name, command in plan:
            dep.check_alive()
            windows.append((name, steps_per_s(r, run_id, args.window_s, command)))
            print(name, json.dumps(windows[-1][1]), flush=True)
        client.cancel(run_id)

    def ratio(i: int) -> float:
        base = (windows[i - 1][1]["steps_per_s"] + windows[i + 1][1]["steps_per_s"]) / 2
        return round(windows[i][1]["steps_per_s"] / base, 3) if base else 0.0

    probe = windows[5][1]["readers"]
    print(
        json.dumps(
            {
                "steps_ratio": ratio(1),
                "hammer_steps_ratio": ratio(3),
                "read_rps": probe["served_per_s"],
                "read_p99_s": probe["p99_s"],
                "probe_steps_ratio": ratio(5),
                "unread_steps_per_s": [w["steps_per_s"] for n, w in windows if n == "unread"],
                "dashboards": windows[1][1]["readers"],
                "hammer": windows[3][1]["readers"],
                "probe": probe,
                "window_s": args.window_s,
                "readers_nice": args.readers_nice,
            }
        )
    )


if __name__ == "__main__":
    main()
