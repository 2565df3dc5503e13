"""Many runs on one fleet (issue 52): four runs of the embedded default, different seeds and
learning rates, on one deployment (a coordinator that keeps up to four runs active, a pool of
four trainers, the spot workers shared by the fleet), (a) one after another, (b) all at once,
then (c) all at once again while a worker that holds requests of three runs is SIGKILLed (a
new one joins): the fleet's use is measured in (b), what a kill costs and loses in (c).

    .venv/bin/python bench/many_runs.py [--runs 4] [--steps 30] [--preemptible 2]
        [--lora-r 8] [--runs-at-once 4] [--max-staleness 0]
        [--phases sequential,concurrent,killed] [--task countdown [--model DIR]]

`--task countdown` runs the long-response task (issue 50) with its `spotrl up` preset's group
size and response length (`--prompts-per-step` to change its step), so rollout, not training,
is most of each run's step: the regime a shared spot pool is for. Its base model is built
first (3-4 minutes) unless `--model` names one.

By default the runs are LoRA runs on the embedded base and each worker serves all of them at
once on its one engine (`--runs-at-once`, SPOTRL_RUNS_AT_ONCE), one batch of every run's
requests, each under its run's adapter. `--runs-at-once 1` has a worker serve one run at a time,
moved among them by the fleet's shares; `--lora-r 0` trains every weight (then a worker serves
one run at a time whatever `--runs-at-once` says: one engine holds one run's full weights).

What it measures, from a sampler that reads every worker's heartbeat (sent every
`--heartbeat-s`) and every active run's demand each `--sample-s`:
- `fleet_busy_frac_*`: the share of worker-seconds (alive workers) in which a worker holds at
  least one request, over each phase's wall time;
- `rollout_work_frac_*`: the share of the phase's time in which some run had rollout work
  waiting (slots allotted): the most a fleet of any size could be busy, however it is shared;
  `idle_with_work_frac`: the worker-seconds idle while some run had work waiting;
- `share_error_max`: over whole windows of 5 steps (of the phase's mean step), the
  largest gap between a run's share of the slots the fleet's placer allots
  (`core.fleet_shares.allot` over the runs' demands, weighted max-min; keys.FLEET_ALLOT) and
  its share of the requests held (`core.fleet_shares.share_error`);
- each run's `reward_first10` / `reward_last10`, and `lost` / `duplicated` from the audit;
- `killed_holding_runs`: how many runs' jobs the killed worker held (checked with the worker
  stopped, just before the kill); the phase's own figures are under "killed".

Prints progress to stderr and, as its LAST line, one JSON object.
"""

import argparse
import asyncio
import contextlib
import dataclasses
import json
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

import redis
import redis.asyncio as aioredis
import repo_root  # noqa: F401  (the repository root on sys.path: tests.harness)

from bench.runs import wait_final
from services.cli.audit import audit_run
from services.cli.client import CoordinatorClient
from services.cli.up import ensure_model, sized_for
from services.cli.up_summary import mean
from services.contracts import keys
from services.contracts.messages import FleetAllotment, Heartbeat
from services.contracts.runspec import TASK_PRESETS, RunSpec
from services.coordinator.workers.fleet import heartbeats
from services.coordinator.workers.placement import claims_of
from services.core.fleet_shares import allot, share_error
from services.state.run_state import active_runs
from tests.harness.deploy import Deployment, DeploymentConfig

LR_FACTORS = (1.0, 0.5, 2.0, 1.5)  # each run's learning rate, times the spec's default
LORA_LR_FACTOR = 10.0  # a LoRA run's learning rate, times the spec's default (full weights')
WINDOW_STEPS = 5
RUNS_TIMEOUT_S = 3600  # the runs of one setup, together


@dataclass
class Sample:
    at: float
    busy: int  # alive workers holding at least one request
    alive: int
    used: dict[str, int]  # run -> requests its workers hold
    allotted: dict[str, int]  # run -> slots the fleet's shares allot it
    holding: dict[str, list[str]]  # worker -> the runs it holds requests of


@dataclass
class Sampler:
    """Reads the fleet every `every_s` in a thread of its own until stopped."""

    redis_url: str
    every_s: float
    samples: list[Sample] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def start(self) -> threading.Thread:
        thread = threading.Thread(target=lambda: asyncio.run(self._forever()), daemon=True)
        thread.start()
        return thread

    async def _forever(self) -> None:
        r = aioredis.Redis.from_url(self.redis_url)
        try:
            while not self.stop.is_set():
                with contextlib.suppress(redis.ConnectionError, OSError):
                    self.samples.append(await self._once(r))
                await asyncio.sleep(self.every_s)
        finally:
            await r.aclose()

    async def _once(self, r: aioredis.Redis) -> Sample:
        runs = await active_runs(r)
        beats = {w: b for w, b in (await heartbeats(r)).items() if not b.error}
        allotted = await fleet_allotment(r, runs, beats)
        used: dict[str, int] = {}
        holding: dict[str, list[str]] = {}
        for worker_id, beat in beats.items():
            for run_id in beat.served_runs:  # each run's own requests (`Heartbeat.serving`)
                if (view := beat.serving(run_id)) is not None and view.active:
                    used[run_id] = used.get(run_id, 0) + view.active
                    holding.setdefault(worker_id, []).append(run_id)
        return Sample(time.monotonic(), len(holding), len(beats), used, allotted, holding)

    def between(self, start: float, end: float) -> list[Sample]:
        return [s for s in self.samples if start <= s.at <= end]


async def fleet_allotment(
    r: aioredis.Redis, runs: list[str], beats: dict[str, Heartbeat]
) -> dict[str, int]:
    """Each active run's slots as the fleet's placer last allotted them (keys.FLEET_ALLOT);
    with one run active (no allotment then), `allot` over the runs' demands as it would."""
    raw = await r.get(keys.FLEET_ALLOT)
    if isinstance(raw, bytes):
        allotment = FleetAllotment.decode(raw)
        return {run: allotment.runs.get(run, 0) for run in runs}
    demands = cast(list[bytes | None], await r.mget([keys.run_demand(x) for x in runs]))
    return allot(sum(b.slots for b in beats.values()), claims_of(runs, demands))


def work_frac(samples: list[Sample]) -> float | None:
    """The share of the samples in which some run had rollout work waiting (slots allotted):
    the most of its time a fleet of any size could be busy, however it is shared."""
    wanting = sum(_wanted(s) for s in samples)
    return round(wanting / len(samples), 4) if samples else None


def idle_with_work_frac(samples: list[Sample]) -> float | None:
    """The share of worker-seconds in which a worker held nothing while some run had rollout
    work waiting (loading weights, placement lag, read caps); the rest of the idle ones had
    no run with work (every run training)."""
    alive = sum(s.alive for s in samples)
    idle = sum(s.alive - s.busy for s in samples if _wanted(s))
    return round(idle / alive, 4) if alive else None


def _wanted(sample: Sample) -> bool:
    return any(n > 0 for n in sample.allotted.values())


def busy_frac(samples: list[Sample]) -> float | None:
    alive = sum(s.alive for s in samples)
    return round(sum(s.busy for s in samples) / alive, 4) if alive else None


def share_error_max(samples: list[Sample], window_s: float) -> float | None:
    """The largest `share_error` over consecutive whole windows of `window_s` (a last window
    cut short by the phase's end, a few samples, is not one) that allotted or used anything."""
    if not samples or window_s <= 0:
        return None
    worst, start = 0.0, samples[0].at
    while start + window_s <= samples[-1].at:
        allotted: dict[str, float] = {}
        used: dict[str, float] = {}
        for s in samples:
            if start <= s.at < start + window_s:
                for run, n in s.allotted.items():
                    allotted[run] = allotted.get(run, 0.0) + n
                for run, n in s.used.items():
                    used[run] = used.get(run, 0.0) + n
        worst = max(worst, share_error(allotted, used))
        start += window_s
    return round(worst, 4)


def kill_a_busy_worker(dep: Deployment, runs: list[str], steps: int, want: int) -> list[str]:
    """SIGKILL a worker caught holding jobs of `want` runs (fewer where none ever does: the
    most any holds, down to one); a new one joins. The runs it held."""
    for wanted in range(want, 0, -1):
        try:
            victim, held = dep.stop_a_holder(runs, steps, wanted, timeout_s=60)
        except TimeoutError:
            continue
        print(f"SIGKILL {victim} holding runs {sorted(held)}", file=sys.stderr, flush=True)
        dep.procs[victim].kill()
        dep.add_worker("preemptible", wait=False)
        return sorted(held)
    raise TimeoutError("no worker ever held a request")


def run_phase(
    name: str,
    client: CoordinatorClient,
    dep: Deployment,
    sampler: Sampler,
    specs: list[RunSpec],
) -> dict:
    started = time.monotonic()
    killed_holding: list[str] = []
    run_ids: list[str] = []
    if name == "sequential":
        for spec in specs:
            run_ids.append(client.submit(spec.model_dump(mode="json")))
            print(f"{name}: run {run_ids[-1]} submitted", file=sys.stderr, flush=True)
            wait_final(client, run_ids[-1], RUNS_TIMEOUT_S, dep)
    else:
        run_ids = [client.submit(spec.model_dump(mode="json")) for spec in specs]
        print(f"{name}: runs {run_ids} submitted", file=sys.stderr, flush=True)
        if name == "killed":
            steps = max(spec.training.steps for spec in specs)
            killed_holding = kill_a_busy_worker(dep, run_ids, steps, min(3, len(run_ids)))
        deadline = time.monotonic() + RUNS_TIMEOUT_S
        for run_id in run_ids:
            wait_final(client, run_id, deadline - time.monotonic(), dep)
    ended = time.monotonic()
    wall_s = ended - started
    samples = sampler.between(started, ended)
    runs = []
    for run_id, spec in zip(run_ids, specs, strict=True):
        run = client.run(run_id)
        rewards = [row["reward_mean"] for row in client.metrics(run_id) if "reward_mean" in row]
        audit = audit_run(dep.redis_url, run_id, spec)
        runs.append(
            {
                "run_id": run_id,
                "state": run["state"],
                "seed": spec.seed,
                "learning_rate": spec.optimizer.learning_rate,
                "reward_first10": round(mean(rewards[:10]) or 0.0, 4),
                "reward_last10": round(mean(rewards[-10:]) or 0.0, 4),
                "lost": audit["lost"],
                "duplicated": audit["duplicated"],
            }
        )
    steps = sum(spec.training.steps for spec in specs)
    window_s = WINDOW_STEPS * wall_s * len(specs) / steps if name != "sequential" else 0.0
    print(f"{name}: {wall_s:.1f} s, busy {busy_frac(samples)}", file=sys.stderr, flush=True)
    return {
        "wall_s": round(wall_s, 1),
        "fleet_busy_frac": busy_frac(samples),
        "rollout_work_frac": work_frac(samples),
        "idle_with_work_frac": idle_with_work_frac(samples),
        "share_error_max": share_error_max(samples, window_s),
        "killed_holding_runs": killed_holding,  # the runs whose requests the killed worker held
        "runs": runs,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--task", default="arithmetic", choices=("arithmetic", "countdown"))
    parser.add_argument("--model", type=Path, default=None, help="the task's base model folder")
    parser.add_argument(
        "--prompts-per-step", type=int, default=None, help="default: the task preset's"
    )
    parser.add_argument("--runs", type=int, default=4)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--preemptible", type=int, default=2)
    parser.add_argument(
        "--phases",
        default="sequential,concurrent,killed",
        help="of sequential, concurrent, killed (all at once, a worker SIGKILLed)",
    )
    parser.add_argument("--placement-s", type=float, default=1.0, help="SPOTRL_PLACEMENT_S")
    parser.add_argument(
        "--switch-share", type=float, default=0.5, help="SPOTRL_PLACEMENT_SWITCH_SHARE"
    )
    parser.add_argument(
        "--runs-at-once",
        type=int,
        default=4,
        help="SPOTRL_RUNS_AT_ONCE: runs a worker serves at once on its one engine (LoRA runs "
        "on one base); 1: one run at a time, moved by the fleet's shares",
    )
    parser.add_argument(
        "--lora-r", type=int, default=8, help="the runs' LoRA rank (0: every weight trained)"
    )
    parser.add_argument(
        "--max-staleness",
        type=int,
        default=0,
        help="the runs' max_staleness: 0 synchronous; 1 generates a run's next step while it "
        "trains this one (its workers' part of the pool busy during training too)",
    )
    parser.add_argument("--sample-s", type=float, default=0.05)
    parser.add_argument("--heartbeat-s", type=float, default=0.05)
    parser.add_argument("--work-dir", type=Path, default=None, help="keep the logs there")
    parser.add_argument("--samples", type=Path, default=None, help="write the samples (JSON lines)")
    args = parser.parse_args()
    phases = args.phases.split(",")
    if not set(phases) <= {"sequential", "concurrent", "killed"}:
        parser.error("--phases: of sequential, concurrent, killed")
    model = args.model or ensure_model(
        Path(f".spotrl/models/{args.task}-base"), args.task, None, None
    )
    default = RunSpec(model=str(model.resolve()))
    preset = dict(TASK_PRESETS.get(args.task, {})) | {"task": args.task}
    preset.pop("steps", None)  # each run its own steps and learning rate, below
    preset.pop("learning_rate", None)
    if args.prompts_per_step:
        preset["prompts_per_step"] = args.prompts_per_step
    # LoRA trains a few megabytes where full weights train all: its learning rate is higher
    lr = default.optimizer.learning_rate * (LORA_LR_FACTOR if args.lora_r else 1.0)
    lora = {"lora_r": args.lora_r, "lora_alpha": 2 * args.lora_r} if args.lora_r else {}
    specs = [
        RunSpec.model_validate(
            {
                "model": str(model.resolve()),
                "steps": args.steps,
                "seed": i + 1,
                "learning_rate": lr * LR_FACTORS[i % len(LR_FACTORS)],
                "max_staleness": args.max_staleness,
            }
            | preset
            | lora
        )
        for i in range(args.runs)
    ]
    out: dict = {
        "task": args.task,
        "prompts_per_step": specs[0].training.prompts_per_step,
        "runs": args.runs,
        "steps": args.steps,
        "lora_r": args.lora_r,
        "runs_at_once": args.runs_at_once,
        "max_staleness": args.max_staleness,
    }
    with tempfile.TemporaryDirectory(prefix="spotrl-many-") as scratch:
        work = args.work_dir or scratch
        config = DeploymentConfig(
            Path(work),
            reserved=0,
            preemptible=args.preemptible,
            trainers=args.runs,
            extra_env={
                "SPOTRL_MAX_ACTIVE_RUNS": str(args.runs),
                "SPOTRL_PLACEMENT_S": str(args.placement_s),
                "SPOTRL_PLACEMENT_SWITCH_SHARE": str(args.switch_share),
            },
            worker_env={
                "SPOTRL_HEARTBEAT_S": str(args.heartbeat_s),
                "SPOTRL_RUNS_AT_ONCE": str(args.runs_at_once),
                # each run's adapters in flight (max_staleness + 1) and the next one
                "SPOTRL_MAX_LORAS": str(max(4, (args.max_staleness + 2) * args.runs_at_once)),
            },
        )
        config = sized_for(config, specs[0], 2)
        with Deployment(config) as dep, CoordinatorClient(dep.coordinator_url) as client:
            sampler = Sampler(dep.redis_url, args.sample_s)
            sampler.start()
            for phase in phases:
                out[phase] = run_phase(phase, client, dep, sampler, specs)
            sampler.stop.set()
    if args.samples:
        with args.samples.open("w") as f:
            for sample in sampler.samples:
                f.write(json.dumps(dataclasses.asdict(sample)) + "\n")
    phase_runs = [run for phase in phases for run in out[phase]["runs"]]
    out |= {f"fleet_busy_frac_{phase}": out[phase]["fleet_busy_frac"] for phase in phases}
    out |= {f"rollout_work_frac_{phase}": out[phase]["rollout_work_frac"] for phase in phases} | {
        f"wall_{phase}_s": out[phase]["wall_s"] for phase in phases
    }
    if "concurrent" in out:
        out["share_error_max"] = out["concurrent"]["share_error_max"]
    if "killed" in out:
        out["killed_holding_runs"] = len(out["killed"]["killed_holding_runs"])
    out["lost"] = sum(run["lost"] for run in phase_runs)
    out["duplicated"] = sum(run["duplicated"] for run in phase_runs)
    out["all_learned"] = all(run["reward_last10"] > run["reward_first10"] for run in phase_runs)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
