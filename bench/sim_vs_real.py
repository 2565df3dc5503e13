"""The simulator checked against the real services on this machine.

Two real deployments of local processes (Redis, weight store, coordinator, trainer, rollout
workers with the emulated engine cost the tests use, on a tiny model): the hybrid (1 reserved +
3 preemptible workers, fair reads; one preemptible worker SIGKILLed in the middle of step
`--kill-step`, no replacement) and reserved-only (1 reserved worker). Then the simulator
(`services/sim`, scenario `services/sim/real_profile.py`) runs both systems with the same
engine cost, batch, lengths and kill. What the scenario takes:

- modelled: the engine step = the emulated sleep (settings) + the engine's compute by batch,
  measured on the engine alone before the deployments; fixed lengths (`ignore_eos`);
- measured on each real run (steps 1.., means): the trainer's compute per step (step rows:
  train_s - waits), the publish time, each pool's weight pull (worker logs); the kill's time into
  its step (from the trainer's commit of the step before it).

A step's time is commit to commit (the trainer's `trained` events; the simulator's records);
step 0 (first loads) is left out of the means on both sides.

    .venv/bin/python bench/sim_vs_real.py [--steps 8] [--kill-step 4] [--kill-after-s 1.5]

Prints a table, then as its LAST line one JSON object: real_step_s, sim_step_s, ratio (sim /
real), real_reserved_only_step_s, sim_reserved_only_step_s, sim_reserved_only_ratio,
ordering_agrees, steps, the per-step times of both sides and the measured figures.
"""

import argparse
import json
import re
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import redis
import repo_root  # noqa: F401  (the repository root on sys.path: tests.harness)

from bench.runs import wait_final
from services.cli.audit import audit_run
from services.cli.client import CoordinatorClient
from services.contracts import keys
from services.contracts.runspec import RunSpec
from services.sim.real_profile import DeploymentFigures, scenario
from services.sim.simulation import Simulation
from services.sim.systems import HYBRID_ALL_SPOT, RESERVED_ONLY
from tests.harness.deploy import Deployment, DeploymentConfig

LOADED = re.compile(r"loaded \S+ v(\d+) \(\d+ bytes\) in ([0-9.]+)s")
HEARTBEAT_S = 0.1


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ---- the model and the engine alone -------------------------------------------------------


def build_model(work: Path, hidden_size: int, layers: int) -> Path:
    """The tests' tiny model (tests/conftest.py: tiny_model), or a wider/deeper one."""
    import torch

    from services.trainer.init_model import InitModelSpec, init_model

    torch.set_num_threads(1)
    spec = InitModelSpec(
        hidden_size=hidden_size, layers=layers, heads=2, pretrain_steps=40, batch_size=64
    )
    return init_model(work / "tiny", spec)


def measure_engine(model: Path, prompt: list[int], tokens: int) -> tuple[dict[int, float], float]:
    """The engine's own compute of one decode step by batch (ms, median of a response's steps)
    and its prefill rate (tokens/s), one thread, as a worker runs it."""
    import torch

    from services.contracts.messages import Job
    from services.contracts.sampling import SamplingParams
    from services.rollout.engines.hf import HFEngine

    torch.set_num_threads(1)
    engine = HFEngine()
    engine.load_weights(model)
    compute_ms, prefill = {}, []
    for batch in (1, 2, 4, 8, 16, 32):
        for i in range(batch):
            job = Job(
                run_id="bench",
                request_id=str(i),
                lease=0,
                grant="bench",
                step=0,
                prompt_ids=prompt,
                remaining_tokens=tokens,
                sampling=SamplingParams(),
                seed=i,
            )
            engine.add(job)
        started = time.perf_counter()
        engine.decode()  # the prefill
        prefill.append(batch * len(prompt) / (time.perf_counter() - started))
        steps = []
        while engine.active:
            started = time.perf_counter()
            engine.decode()
            steps.append(time.perf_counter() - started)
        compute_ms[batch] = 1000 * statistics.median(steps)
    return compute_ms, statistics.median(prefill)


def prompts_of(model: Path, spec: RunSpec, steps: int) -> tuple[list[int], float]:
    """One prompt's token ids and the mean prompt length of the run's steps, as the coordinator
    tokenizes them."""
    from tokenizers import Tokenizer

    from services.tasks import load_task

    tokenizer = Tokenizer.from_file(str(model / "tokenizer.json"))
    task = load_task(spec.data.task, spec.data.task_path)
    ids = [
        tokenizer.encode(e.prompt).ids
        for step in range(steps)
        for e in task.examples(spec.seed, step, spec.training.prompts_per_step)
    ]
    return ids[0], statistics.fmean(len(x) for x in ids)


# ---- the real run -------------------------------------------------------------------------


def holders(r: redis.Redis, stream: str) -> list[str]:
    """Workers holding jobs of `stream` (read, not acknowledged)."""
    try:
        consumers = r.xinfo_consumers(stream, keys.WORKERS_GROUP)
    except redis.ResponseError:
        return []
    names = [c["name"] for c in consumers if c["pending"] > 0]
    return [n.decode() if isinstance(n, bytes) else n for n in names]


def kill_mid_step(dep: Deployment, r: redis.Redis, run_id: str, step: int, after_s: float) -> str:
    """SIGKILL a preemptible worker that holds jobs of `step`, `after_s` after the version the
    step runs on is committed; the worker's name."""
    deadline = time.monotonic() + 300
    while int(r.get(keys.run_version(run_id)) or -1) < step:
        if time.monotonic() > deadline:
            raise TimeoutError(f"version {step} of run {run_id} never came")
        dep.check_alive()
        time.sleep(0.005)
    time.sleep(after_s)
    busy = holders(r, keys.jobs_stream(run_id, step))
    pool = [n for n in dep.procs if n.startswith("rollout-preemptible") and dep.procs[n].alive()]
    victim = next((n for n in busy if n in pool), pool[0])
    dep.procs[victim].kill()
    return victim


def pull_times(dep: Deployment, pool: str) -> list[float]:
    """Seconds each worker of `pool` took to pull and load versions 1.. (its log lines)."""
    out = []
    for path in dep.log_dir.glob(f"rollout-{pool}-*.log"):
        for match in LOADED.finditer(path.read_text(errors="replace")):
            if int(match.group(1)) >= 1:
                out.append(float(match.group(2)))
    return out


def real_run(work: Path, spec: RunSpec, args, preemptible: int, kill_step: int | None) -> dict:
    env = {
        "SPOTRL_STEP_DELAY_MS": str(args.step_delay_ms),
        "SPOTRL_STEP_DELAY_PER_REQUEST_MS": str(args.step_delay_per_request_ms),
        "SPOTRL_HEARTBEAT_S": str(HEARTBEAT_S),
        "SPOTRL_HEARTBEAT_TTL_S": str(args.heartbeat_ttl_s),
    }
    config = DeploymentConfig(
        work,
        reserved=1,
        preemptible=preemptible,
        worker_slots=args.worker_slots,
        flush_tokens=args.flush_tokens,
        extra_env=env,
    )
    victim, killed_at = None, None
    with Deployment(config) as dep, CoordinatorClient(dep.coordinator_url) as client:
        r = redis.Redis.from_url(dep.redis_url)
        workers = [n for n in dep.procs if n.startswith("rollout-")]
        while not all(r.exists(keys.worker_heartbeat(w)) for w in workers):
            time.sleep(0.05)
        run_id = client.submit(spec.model_dump(mode="json"))
        if kill_step is not None:
            victim = kill_mid_step(dep, r, run_id, kill_step, args.kill_after_s)
            killed_at = time.time()
        run = wait_final(client, run_id, 600, dep)
        rows = {row["step"]: row for row in client.metrics(run_id)}
        events = client.timeline(run_id)["events"]
        audit = audit_run(dep.redis_url, run_id, spec)
        r.close()
        pulls = {pool: pull_times(dep, pool) for pool in ("reserved", "preemptible")}
    if run["state"] != "succeeded":
        raise RuntimeError(f"real run {run_id} ended {run['state']}: {run}")
    commits = {e["step"]: e["at"] for e in events if e["kind"] == "trained"}
    rollout_done = {e["step"]: e["at"] for e in events if e["kind"] == "rollout_done"}
    steps = range(1, spec.training.steps)
    step_s = [commits[k] - commits[k - 1] for k in steps]
    train_s = [rows[k]["train_s"] - rows[k]["train_wait_s"] - rows[k]["seed_wait_s"] for k in steps]
    return {
        "step_s": step_s,
        "rollout_s": [rows[k]["rollout_s"] for k in steps],
        # commit of the version -> the step's jobs queued (the coordinator's poll)
        "queue_s": [rollout_done[k] - commits[k - 1] - rows[k]["rollout_s"] for k in steps],
        # the last group published -> the next version announced (training, publication)
        "tail_s": [commits[k] - rollout_done[k] for k in steps],
        "t_seed_s": [rows[k]["t_seed_s"] for k in steps],
        "train_s": statistics.fmean(train_s),
        "publish_s": statistics.fmean(rows[k]["publish_s"] for k in steps),
        "reserved_pull_s": statistics.fmean(pulls["reserved"]),
        "pool_pull_s": statistics.fmean(pulls["preemptible"]) if pulls["preemptible"] else 0.0,
        "kill_offset_s": None if killed_at is None else killed_at - commits[kill_step - 1],
        "victim": victim,
        "lost": audit["lost"],
        "duplicated": audit["duplicated"],
    }


# ---- the simulator ------------------------------------------------------------------------


def simulate(
    figures: DeploymentFigures, hybrid: bool, steps: int, kill: tuple[int, float] | None
) -> dict:
    """Steps 1.. of the simulated run: step, rollout and tail times, T_seed. The hybrid has 3
    preemptible instances from the start; `kill` (step, seconds into it) takes one away then,
    with no notice (a first pass finds when that step starts in the simulation)."""
    sc = scenario(figures)
    # the deployment has no scaler: the hybrid holds every worker it was given
    system = HYBRID_ALL_SPOT if hybrid else RESERVED_ONLY
    targets = [(0.0, 3)]  # reserved-only has no pool: it ignores them
    if kill is not None:
        step, offset_s = kill
        before = Simulation(sc, system, targets, max_steps=step).run().records
        targets.append((before[-1].end_s + offset_s, 2))
    records = Simulation(sc, system, targets, max_steps=steps).run().records
    rows = records[1:]
    # the kill fell inside the simulated step's rollout (not after it, in the next step)
    out = {} if kill is None else {"kill_mid_rollout": kill[1] < records[kill[0]].rollout_s}
    return out | {
        "step_s": [r.end_s - r.start_s for r in rows],
        "rollout_s": [r.rollout_s for r in rows],
        "tail_s": [r.end_s - r.start_s - r.rollout_s for r in rows],
        "t_seed_s": [None if r.t_seed_s == float("inf") else r.t_seed_s for r in rows],
    }


def figures_of(base: DeploymentFigures, real: dict) -> DeploymentFigures:
    return replace(
        base,
        train_s=real["train_s"],
        publish_s=real["publish_s"],
        reserved_pull_s=real["reserved_pull_s"],
        pool_pull_s=real["pool_pull_s"],
    )


# ---- the comparison -----------------------------------------------------------------------


def mean(xs: list[float]) -> float:
    return statistics.fmean(xs)


def rounded(d: dict) -> dict:
    def r3(x):
        return round(x, 3) if isinstance(x, float) else x

    return {k: [r3(x) for x in v] if isinstance(v, list) else r3(v) for k, v in d.items()}


def report(steps, kill_step, hybrid, sim_h, reserved, sim_r, fig_r: DeploymentFigures) -> dict:
    """Print the table; the JSON object of the last line."""
    print(
        f"{'step':>7} | {'real hybrid':>11} {'sim hybrid':>10} | {'real res.':>9} {'sim res.':>9}"
    )
    for k in range(steps - 1):
        mark = "  <- a preemptible worker killed" if k + 1 == kill_step else ""
        print(
            f"{k + 1:7d} | {hybrid['step_s'][k]:11.2f} {sim_h['step_s'][k]:10.2f} | "
            f"{reserved['step_s'][k]:9.2f} {sim_r['step_s'][k]:9.2f}{mark}"
        )
    real_step, sim_step = mean(hybrid["step_s"]), mean(sim_h["step_s"])
    real_res, sim_res = mean(reserved["step_s"]), mean(sim_r["step_s"])
    print(f"{'mean':>7} | {real_step:11.2f} {sim_step:10.2f} | {real_res:9.2f} {sim_res:9.2f}")
    for part in ("rollout_s", "tail_s"):
        print(
            f"{part[:-2]:>7} | {mean(hybrid[part]):11.2f} {mean(sim_h[part]):10.2f} | "
            f"{mean(reserved[part]):9.2f} {mean(sim_r[part]):9.2f}"
        )
    # the worker's decode step in the deployment vs the profile's (engine alone + the sleep):
    # what the serving shell adds per step (flushes, the event loop), which the profile lacks
    batch = fig_r.prompts_per_step * fig_r.group_size
    profile_ms = 1000 * scenario(fig_r).reserved_engine.step_s(batch, fig_r.prompt_tokens)
    real_ms = 1000 * (mean(reserved["rollout_s"]) - fig_r.reserved_pull_s) / fig_r.response_tokens
    print(
        f"reserved-only decode step at batch {batch}: {real_ms:.1f} ms in the deployment, "
        f"{profile_ms:.1f} ms in the profile"
    )
    rollout_k = hybrid["rollout_s"][kill_step - 1]
    sim_mid = sim_h["kill_mid_rollout"]
    if not sim_mid:
        print(f"the simulated step {kill_step} ended before the kill: it hit the next one")
    return {
        "real_step_s": round(real_step, 3),
        "sim_step_s": round(sim_step, 3),
        "ratio": round(sim_step / real_step, 3),
        "real_reserved_only_step_s": round(real_res, 3),
        "sim_reserved_only_step_s": round(sim_res, 3),
        "sim_reserved_only_ratio": round(sim_res / real_res, 3),
        "ordering_agrees": (real_res > real_step) == (sim_res > sim_step),
        "reserved_only_slower": {"real": real_res > real_step, "sim": sim_res > sim_step},
        "real_speedup": round(real_res / real_step, 3),
        "sim_speedup": round(sim_res / sim_step, 3),
        "steps": steps,
        "kill_step": kill_step,
        "kill_offset_s": round(hybrid["kill_offset_s"], 3),
        "kill_mid_rollout": {"real": hybrid["kill_offset_s"] < rollout_k, "sim": sim_mid},
        "decode_step_ms": {"deployment": round(real_ms, 2), "profile": round(profile_ms, 2)},
        "real_hybrid": rounded(hybrid),
        "sim_hybrid": rounded(sim_h),
        "real_reserved_only": rounded(reserved),
        "sim_reserved_only": rounded(sim_r),
        "engine_compute_ms": {b: round(m, 3) for b, m in fig_r.compute_ms.items()},
        "prefill_tokens_per_s": round(fig_r.prefill_tokens_per_s),
        "prompt_tokens": fig_r.prompt_tokens,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--prompts-per-step", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--step-delay-ms", type=float, default=30.0)
    parser.add_argument("--step-delay-per-request-ms", type=float, default=1.5)
    parser.add_argument("--worker-slots", type=int, default=32)
    parser.add_argument("--flush-tokens", type=int, default=4)
    parser.add_argument("--heartbeat-ttl-s", type=float, default=1.0)
    parser.add_argument("--kill-step", type=int, default=None, help="default: steps // 2")
    parser.add_argument(
        "--kill-after-s", type=float, default=1.5, help="seconds into the step (its commit)"
    )
    parser.add_argument("--hidden-size", type=int, default=64, help="of the model built")
    parser.add_argument("--layers", type=int, default=2, help="of the model built")
    parser.add_argument(
        "--model", default=None, help="a model folder (default: build the tiny one)"
    )
    args = parser.parse_args()
    kill_step = args.kill_step if args.kill_step is not None else args.steps // 2
    if not 1 <= kill_step < args.steps:
        parser.error("--kill-step must be within 1..steps-1")
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="spotrl-sim-vs-real-") as tmp:
        work = Path(tmp)
        model = Path(args.model) if args.model else build_model(work, args.hidden_size, args.layers)
        spec = RunSpec(
            model=str(model.resolve()),
            steps=args.steps,
            prompts_per_step=args.prompts_per_step,
            group_size=args.group_size,
            max_new_tokens=args.max_new_tokens,
            ignore_eos=True,
            fair_reads=True,
            micro_batch_size=8,
            seed=1,
        )
        prompt, prompt_len = prompts_of(model, spec, args.steps)
        compute_ms, prefill = measure_engine(model, prompt, args.max_new_tokens)
        log(f"engine alone: compute ms by batch {compute_ms}, prefill {prefill:.0f} tok/s")
        log("real: hybrid (1 reserved + 3 preemptible, one killed) ...")
        hybrid = real_run(work / "hybrid", spec, args, 3, kill_step)
        log(f"  steps {[round(x, 2) for x in hybrid['step_s']]}, killed {hybrid['victim']}")
        log("real: reserved-only ...")
        reserved = real_run(work / "reserved", spec, args, 0, None)
        log(f"  steps {[round(x, 2) for x in reserved['step_s']]}")
    base = DeploymentFigures(
        step_delay_ms=args.step_delay_ms,
        step_delay_per_request_ms=args.step_delay_per_request_ms,
        compute_ms=compute_ms,
        prefill_tokens_per_s=prefill,
        slots=args.worker_slots,
        flush_tokens=args.flush_tokens,
        heartbeat_ttl_s=args.heartbeat_ttl_s,
        prompts_per_step=args.prompts_per_step,
        group_size=args.group_size,
        response_tokens=args.max_new_tokens,
        prompt_tokens=round(prompt_len),
        train_s=0.0,
        publish_s=0.0,
        reserved_pull_s=0.0,
        pool_pull_s=0.0,
    )
    fig_h, fig_r = figures_of(base, hybrid), figures_of(base, reserved)
    sim_h = simulate(fig_h, True, args.steps, (kill_step, hybrid["kill_offset_s"]))
    sim_r = simulate(fig_r, False, args.steps, None)
    out = report(args.steps, kill_step, hybrid, sim_h, reserved, sim_r, fig_r)
    out["wall_s"] = round(time.monotonic() - started, 1)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
