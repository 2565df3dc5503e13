"""Slow clients against the coordinator while a run trains (issue 53): a real run of the
embedded default (`spotrl up`'s deployment and spec, run long) on the test harness's
deployment, its steps/s measured in windows: unharmed, then 1,000 slow-body connections
(`bench/slow_attack.py`, one process of bare asyncio sockets, each sending a POST's headers and
then one byte of its 60,000-byte body a second) from ONE address, unharmed, the same 1,000 from
MANY addresses, unharmed. Each attacked window is compared with the unharmed ones beside it, in
the same invocation.

- `one_address`: all 1,000 from 127.0.0.2: the per-client cap (SPOTRL_HTTP_CONNECTIONS_PER_CLIENT,
  128) refuses all but 128 at once, and those 128 are cut off at the body timeout;
- `many_addresses`: 4 from each of 250 addresses (127.0.1.1-250), each under the cap: all 1,000
  are served and held until the body timeout cuts them (what raising the cap would do, with the
  cap left as it is).

The deployment's own processes talk over 127.0.0.1, the only address left uncapped here
(SPOTRL_HTTP_UNCAPPED_CLIENTS=127.0.0.1; the default exempts all of loopback), so the cap sees
the attackers and nothing else. The other limits are the defaults: headers 10 s, a body 30 s
plus its bytes at 64 KiB/s.

While each window runs, a prober GETs /healthz 10 times a second, each on a new connection (as
a kubelet or Compose probes). Aims: healthz p99 < 0.5 s, steps/s under attack >= 0.9 of
unharmed, every slow connection closed within its limit (`late_s_max` <= ~1 s: a timer that
fires late on a loaded machine), none never closed.

Prints progress to stderr and, as its LAST line, one JSON object.

    .venv/bin/python bench/slow_clients.py [--window-s 60] [--connections 1000]
"""

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import redis
import repo_root  # noqa: F401  (the repository root on sys.path: tests.harness)

from services.cli.client import CoordinatorClient
from services.cli.up import ensure_model, sized_for
from services.contracts import keys
from services.contracts.runspec import EMBEDDED_DEFAULTS, EMBEDDED_PRETRAIN_STEPS, RunSpec
from tests.harness.deploy import Deployment, DeploymentConfig

ATTACK = Path(__file__).with_name("slow_attack.py")
SERVER = "spotrl coordinator"
CLOSED = re.compile(
    rf'spotrl_http_connections_closed_total\{{reason="(\w+)",server="{SERVER}"\}} (\S+)'
)


def version(r: redis.Redis, run_id: str) -> int:
    raw = r.get(keys.run_version(run_id))
    return int(raw) if raw is not None else 0


def closes(url: str) -> dict[str, float]:
    """The coordinator's closes by reason, from its /metrics."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return {reason: float(n) for reason, n in CLOSED.findall(text)}


class Prober:
    """GET /healthz every `every_s` on a new connection, on a thread, until stopped."""

    def __init__(self, url: str, every_s: float = 0.1) -> None:
        self.url, self.every_s = url, every_s
        self.latencies: list[float] = []
        self.failures = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._probe, daemon=True)
        self.thread.start()

    def _probe(self) -> None:
        while not self.stop.wait(self.every_s):
            started = time.monotonic()
            try:
                ok = httpx.get(f"{self.url}/healthz", timeout=10).status_code == 200
            except httpx.HTTPError:
                ok = False
            self.latencies.append(time.monotonic() - started)
            self.failures += not ok

    def result(self) -> dict:
        self.stop.set()
        self.thread.join()
        ordered = sorted(self.latencies) or [0.0]
        return {
            "probes": len(self.latencies),
            "failures": self.failures,
            "p50_s": round(ordered[len(ordered) // 2], 4),
            "p99_s": round(ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))], 4),
            "max_s": round(ordered[-1], 4),
        }


def window(dep: Deployment, r: redis.Redis, run_id: str, window_s: float, attack: list[str]):
    """Steps/s of the run over `window_s`, healthz as a probe sees it, and (with an `attack`
    command) what the attackers saw and the coordinator counted; an attack's connections
    still open when the window ends are followed to their close before this returns."""
    before = closes(dep.coordinator_url)
    proc = subprocess.Popen(attack, stdout=subprocess.PIPE, text=True) if attack else None
    prober = Prober(dep.coordinator_url)
    v0, t0 = version(r, run_id), time.monotonic()
    time.sleep(window_s)
    v1, t1 = version(r, run_id), time.monotonic()
    out: dict = {"steps_per_s": round((v1 - v0) / (t1 - t0), 3), "healthz": prober.result()}
    if proc is not None:
        stdout, _ = proc.communicate(timeout=300)
        out["attack"] = json.loads(stdout.strip().splitlines()[-1])
        after = closes(dep.coordinator_url)
        out["closed"] = {k: int(after[k] - before.get(k, 0.0)) for k in after}
    return out


def attacker(args: argparse.Namespace, url: str, sources: list[str]) -> list[str]:
    return [
        sys.executable, str(ATTACK), "--url", url, "--sources", ",".join(sources),
        "--connections", str(args.connections), "--duration-s", str(args.window_s),
    ]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=".spotrl/models/arithmetic-base")
    parser.add_argument("--window-s", type=float, default=60.0)
    parser.add_argument("--connections", type=int, default=1000)
    parser.add_argument("--addresses", type=int, default=250, help="of the spread attack")
    parser.add_argument("--warm-steps", type=int, default=60)
    args = parser.parse_args()

    model = ensure_model(Path(args.model), "arithmetic", None, EMBEDDED_PRETRAIN_STEPS)
    spec = RunSpec(model=str(model.resolve()), **{**EMBEDDED_DEFAULTS, "steps": 100_000})
    work = Path(tempfile.mkdtemp(prefix="spotrl-bench-slow-"))
    config = DeploymentConfig(
        work, reserved=1, preemptible=1, extra_env={"SPOTRL_HTTP_UNCAPPED_CLIENTS": "127.0.0.1"}
    )
    config = sized_for(config, spec, os.cpu_count() or 1)
    with Deployment(config) as dep, CoordinatorClient(dep.coordinator_url) as client:
        r = redis.Redis.from_url(dep.redis_url)
        run_id = client.submit(json.loads(spec.model_dump_json()))
        while version(r, run_id) < args.warm_steps:  # warm: loads, compiles, shorter answers
            dep.check_alive()
            time.sleep(0.5)
        url = dep.coordinator_url
        spread = [f"127.0.{1 + i // 250}.{1 + i % 250}" for i in range(args.addresses)]
        plan = [
            ("unharmed", []),
            ("one_address", attacker(args, url, ["127.0.0.2"])),
            ("unharmed", []),
            ("many_addresses", attacker(args, url, spread)),
            ("unharmed", []),
        ]
        windows = []
        for name, command in plan:
            dep.check_alive()
            windows.append((name, window(dep, r, run_id, args.window_s, command)))
            print(name, json.dumps(windows[-1][1]), file=sys.stderr, flush=True)
        client.cancel(run_id)

    def ratio(i: int) -> float:
        base = (windows[i - 1][1]["steps_per_s"] + windows[i + 1][1]["steps_per_s"]) / 2
        return round(windows[i][1]["steps_per_s"] / base, 3) if base else 0.0

    attacked = [windows[1][1], windows[3][1]]
    print(
        json.dumps(
            {
                "steps_ratio_one_address": ratio(1),
                "steps_ratio_many_addresses": ratio(3),
                "healthz_p99_s": max(w["healthz"]["p99_s"] for w in attacked),
                "late_s_max": max(w["attack"]["late_s_max"] for w in attacked),
                "never_closed": sum(w["attack"]["never_closed"] for w in attacked),
                "unharmed_steps_per_s": [w["steps_per_s"] for n, w in windows if n == "unharmed"],
                "one_address": windows[1][1],
                "many_addresses": windows[3][1],
                "unharmed_healthz_p99_s": [
                    w["healthz"]["p99_s"] for n, w in windows if n == "unharmed"
                ],
                "window_s": args.window_s,
                "connections": args.connections,
            }
        )
    )


if __name__ == "__main__":
    main()
