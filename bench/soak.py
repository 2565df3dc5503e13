"""Soak: one run at full speed for `--minutes`, while load workers are killed and replaced;
Redis memory, stream lengths, key count and append-only file size sampled all along. They must
stay flat (bounded by the step, not the run): DESIGN.md section 5.

Real Redis (append-only file on), real coordinator and weight store processes; in this process
the real RolloutWorker on an instant engine (bench/loadgen.py) and the real TrainerLoop with a
policy that does no math but commits real weight folders. Every `--kill-every-s` the oldest
worker dies without notice (no flush, no release: its heartbeat expires and the coordinator
reclaims its jobs) and one with a new id takes its place. At the end the run is audited from
the trainer's ledger: no response lost, none duplicated.

Prints a progress line per sample to stderr and, as its LAST stdout line, one JSON object ending
with: minutes, tokens (collected by the coordinator), tok_s, redis_mem_mib_first and
redis_mem_mib_last (Redis used_memory: its typical high over `--window-s` right after the
warm-up, and at the end; a step's requests make it rise and fall within every step),
mem_growth (last / first), deltas_len_last, groups_len_last, aof_mib_last, lost, duplicated.
Before them: steps, kills, reclaimed (killed workers whose jobs the coordinator took back),
declared_dead_alive (live workers it took for dead), keys_grown (kinds of key that grew from
the warm-up to the end), loop_lag_ms_max (of this process), coordinator_cpu_share and
tok_per_coordinator_cpu_s (tokens the coordinator accepted per second of its own CPU after the
warm-up: its capacity, whichever process bounds this run), and more.

    .venv/bin/python bench/soak.py [--minutes 10] [--workers 2] [--kill-every-s 120]
        [--prompts 256 --group-size 8 --max-new-tokens 256] [--json-out soak.json]
"""

import argparse
import asyncio
import json
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil
import redis.asyncio as aioredis
import torch

from services.cli.audit import audit_run
from services.contracts import keys
from services.contracts.runspec import FINAL_STATES, RunSpec
from services.infra.logs import setup_logging
from services.infra.redis_streams import connect
from services.state.run_state import committed_version

if not __package__:  # run as a script: bench/ is on sys.path, the repo root is not
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.loadgen import (
    FleetConfig,
    LoadFleet,
    LoopLag,
    Stack,
    TrainerStandIn,
    build_tiny_model,
    census_growth,
    coordinator_tokens,
    freeze_heap,
    key_census,
    log_findings,
    read,
    sample_redis,
    start_stack,
)

log = logging.getLogger("soak")
MIB = 1024 * 1024
TICK_S = 0.2
TICK_HIGHS = ("used_memory", "deltas_len", "groups_len")  # read every tick: highs per sample
KILL_PATIENCE_S = 10.0  # most a kill waits for its victim to hold requests


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--minutes", type=float, default=10.0, help="length of the soak")
    p.add_argument("--warmup-s", type=float, default=60.0, help="memory baseline taken after")
    p.add_argument("--sample-s", type=float, default=5.0, help="sampling period")
    p.add_argument(
        "--window-s", type=float, default=30.0, help="memory peaks compared over (a few steps)"
    )
    p.add_argument("--kill-every-s", type=float, default=120.0, help="0: no kills")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--slots", type=int, default=512)
    p.add_argument("--flush-tokens", type=int, default=4)
    p.add_argument("--step-delay-ms", type=float, default=0.0, help="per decode step (0: instant)")
    p.add_argument("--prompts", type=int, default=256, help="prompts per step (B)")
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--json-out", type=Path, help="write the summary and every sample here")
    p.add_argument("--work-dir", type=Path, help="keep logs and data here (default: a temp dir)")
    p.add_argument("--log-level", default="WARNING", help="of the in-process workers, trainer")
    return p.parse_args(argv)


async def take_sample(
    r: aioredis.Redis,
    http: httpx.AsyncClient,
    stack: Stack,
    fleet: LoadFleet,
    lag: LoopLag,
    run_id: str,
) -> dict:
    sample = await sample_redis(r, run_id, stack.redis_dir)
    run = (await read(http, f"/v1/runs/{run_id}")).json()
    if run["state"] in FINAL_STATES:
        raise RuntimeError(f"run {run_id} ended early: {run['state']} {run.get('error', '')}")
    sample["state"] = run["state"]
    cpu = psutil.Process(stack.processes["coordinator"].pid).cpu_times()
    sample["coordinator_cpu_s"] = cpu.user + cpu.system
    sample["tokens"] = await coordinator_tokens(http)
    sample["tokens_generated"] = fleet.tokens_generated
    sample["workers"] = len(fleet.workers)
    sample["kills"] = fleet.kills
    sample["loop_lag_ms"] = round(lag.take() * 1000, 1)
    return sample


def progress(sample: dict) -> str:
    return (
        f"t={sample['t']:6.0f}s v={sample['version']} {sample['state']} "
        f"mem={sample['used_memory'] / MIB:5.1f}MiB (max {sample['used_memory_max'] / MIB:5.1f}) "
        f"keys={sample['keys']} "
        f"deltas={sample['deltas_len']} groups={sample['groups_len']} jobs={sample['jobs_len']} "
        f"aof={sample['aof_bytes'] / MIB:6.1f}MiB tokens={sample['tokens']:.0f} "
        f"generated={sample['tokens_generated']} kills={sample['kills']} "
        f"lag={sample['loop_lag_ms']:.0f}ms"
    )


async def drive(args, stack: Stack, spec: RunSpec, work: Path) -> tuple[dict, dict]:
    """Run the soak, cancel the run, audit it; the summary, and for --json-out the samples and
    the key census."""
    r = connect(stack.redis_url)
    try:
        async with httpx.AsyncClient(base_url=stack.coordinator_url, timeout=30.0) as http:
            resp = await http.post("/v1/runs", json=spec.model_dump(mode="json"))
            if resp.status_code != 201:
                raise RuntimeError(f"run refused: {resp.status_code} {resp.text}")
            run_id = resp.json()["id"]
            soak = Soak(args, r, http, stack, run_id)
            await soak.run(work)
            # the steps the trainer committed: the audit covers exactly [0, version)
            steps = await committed_version(r, run_id) or 0
            resp = await http.post(f"/v1/runs/{run_id}/cancel")
            if resp.status_code != 200:
                log.warning("cancel: %s %s", resp.status_code, resp.text)
    finally:
        await r.aclose()
    audit = await asyncio.to_thread(audit_run, stack.redis_url, run_id, spec, steps)
    found = log_findings(stack.processes["coordinator"].log_path, soak.fleet.gone)
    for line in found["error_lines"][:20]:
        print(f"coordinator: {line}", file=sys.stderr)
    first, last = soak.census
    grown = census_growth(first or {}, last or {})
    for kind, more in grown.items():
        print(f"grew: {kind} +{more['keys']} keys, {more['bytes']:+d} bytes", file=sys.stderr)
    extra = {
        # killed workers whose jobs the coordinator reclaimed (a victim between steps has none)
        "reclaimed": len(set(found["declared_dead"]) & set(soak.fleet.killed)),
        "declared_dead_alive": len(found["declared_dead_alive"]),
        "coordinator_errors": len(found["error_lines"]),
        "keys_grown": {kind: more["keys"] for kind, more in grown.items() if more["keys"] > 0},
    }
    summary = summarize(args, soak.samples, audit, steps, soak.fleet)
    return extra | summary, {"samples": soak.samples, "census": soak.census, "grown": grown}


class Soak:
    """The load of one run for `--minutes`: workers (killed and replaced on schedule), the
    trainer stand-in, a sample every `--sample-s`."""

    def __init__(
        self, args, r: aioredis.Redis, http: httpx.AsyncClient, stack: Stack, run_id: str
    ) -> None:
        self.args, self.r, self.http, self.stack, self.run_id = args, r, http, stack, run_id
        self.fleet: LoadFleet
        self.lag = LoopLag()
        self.samples: list[dict] = []
        self.census: list[dict | None] = [None, None]  # keys by kind: after warm-up, at the end
        self.highs = dict.fromkeys(TICK_HIGHS, 0)  # highest of each since the last sample

    async def run(self, work: Path) -> None:
        args, stack = self.args, self.stack
        self.fleet = LoadFleet(
            FleetConfig(
                redis_url=stack.redis_url,
                coordinator_url=stack.coordinator_url,
                weightstore_url=stack.weightstore_url,
                cache_dir=work / "rollout",
                slots=args.slots,
                flush_tokens=args.flush_tokens,
                step_delay_ms=args.step_delay_ms,
            )
        )
        trainer = TrainerStandIn(stack.redis_url, stack.weightstore_url, work / "trainer")
        try:
            for _ in range(args.workers):
                self.fleet.add()
            trainer.start()
            self.lag.start()
            await self._until_the_end(trainer)
        finally:
            await self.lag.stop()
            await self.fleet.close()
            await trainer.stop()

    async def _until_the_end(self, trainer: TrainerStandIn) -> None:
        args = self.args
        started = time.monotonic()
        end = started + args.minutes * 60
        next_sample, next_kill = started, started + args.kill_every_s
        while True:
            now = time.monotonic()
            await self._tick_highs()
            self.stack.check_alive()
            self.fleet.check()
            trainer.check()
            if now >= next_sample or now >= end:
                await self._sample(time.monotonic() - started, last=now >= end)
                next_sample += args.sample_s
                if now >= end:
                    return
            # a kill waits (a while) for its victim to hold requests: a kill between steps,
            # while the worker loads the new version, leaves nothing to reclaim
            patience_over = now >= next_kill + KILL_PATIENCE_S
            if (
                args.kill_every_s > 0
                and now >= next_kill
                and (self.fleet.oldest_busy() or patience_over)
            ):
                killed, new = await self.fleet.replace_oldest()
                print(f"killed {killed}, started {new}", file=sys.stderr, flush=True)
                next_kill += args.kill_every_s
            await asyncio.sleep(TICK_S)

    async def _tick_highs(self) -> None:
        """Memory and stream lengths every tick, for their highs between samples."""
        async with self.r.pipeline(transaction=False) as pipe:
            pipe.info("memory")
            pipe.xlen(keys.deltas_stream(self.run_id))
            pipe.xlen(keys.groups_stream(self.run_id))
            memory, deltas, groups = await pipe.execute()
        now = {
            "used_memory": int(memory["used_memory"]),
            "deltas_len": deltas,
            "groups_len": groups,
        }
        for name, value in now.items():
            self.highs[name] = max(self.highs[name], value)

    async def _sample(self, t: float, last: bool) -> None:
        sample = await take_sample(self.r, self.http, self.stack, self.fleet, self.lag, self.run_id)
        sample["t"] = round(t, 2)
        for name in TICK_HIGHS:
            sample[f"{name}_max"] = max(self.highs[name], sample[name])
        self.highs = dict.fromkeys(TICK_HIGHS, 0)
        self.samples.append(sample)
        print(progress(sample), file=sys.stderr, flush=True)
        if self.census[0] is None and t >= self.args.warmup_s:
            self.census[0] = await key_census(self.r, self.run_id)
        if last:
            self.census[1] = await key_census(self.r, self.run_id)


def peak_mib(samples: list[dict]) -> float:
    """The typical high of memory between samples: the median of their highs, in MiB."""
    return statistics.median(s["used_memory_max"] for s in samples) / MIB


def summarize(args, samples: list[dict], audit: dict, steps: int, fleet: LoadFleet) -> dict:
    """Memory is compared as its typical high (`peak_mib`) over a window of several steps, at
    the start (right after the warm-up) and at the end: within a step it rises and falls with
    the step's requests, so two single samples would compare phases of a step, not times of the
    run (and samples every few seconds can fall in step with the steps and see one phase only:
    the highs come from INFO memory read every tick)."""
    last = samples[-1]
    after = [s for s in samples if s["t"] >= args.warmup_s]
    if not after:
        log.warning("the soak ended within its warm-up: the memory baseline is the first sample")
        after = samples
    first = after[0]
    start_window = [s for s in after if s["t"] < first["t"] + args.window_s]
    end_window = [s for s in after if s["t"] > last["t"] - args.window_s]
    mem_first, mem_last = peak_mib(start_window), peak_mib(end_window)
    # the coordinator's cost: tokens it accepted per second of its own CPU, after the warm-up
    cpu_s = last["coordinator_cpu_s"] - first["coordinator_cpu_s"]
    span_s = max(last["t"] - first["t"], 1e-9)
    accepted = last["tokens"] - first["tokens"]
    return {
        "coordinator_cpu_share": round(cpu_s / span_s, 3),
        "tok_per_coordinator_cpu_s": round(accepted / max(cpu_s, 1e-9), 1),
        "steps": steps,
        "workers": args.workers,
        "kills": fleet.kills,
        "recancels": fleet.recancels,
        "held_at_kill": fleet.held_at_kill,
        "tokens_generated": last["tokens_generated"],
        "tokens_trained": audit["tokens"],
        "expected_responses": audit["expected_responses"],
        "window_s": args.window_s,
        "mem_mib_first_sample": round(first["used_memory"] / MIB, 2),
        "mem_mib_last_sample": round(last["used_memory"] / MIB, 2),
        "mem_mib_max": round(max(s["used_memory_max"] for s in after) / MIB, 2),
        "loop_lag_ms_max": max(s["loop_lag_ms"] for s in samples),
        "keys_first": first["keys"],
        "keys_last": last["keys"],
        "jobs_len_last": last["jobs_len"],
        "deltas_len_max": max(s["deltas_len_max"] for s in after),
        "groups_len_max": max(s["groups_len_max"] for s in after),
        "aof_mib_max": round(max(s["aof_bytes"] for s in after) / MIB, 2),
        "minutes": round(last["t"] / 60, 2),
        "tokens": int(last["tokens"]),
        "tok_s": round(last["tokens"] / max(last["t"], 1e-9), 1),
        "redis_mem_mib_first": round(mem_first, 2),
        "redis_mem_mib_last": round(mem_last, 2),
        "mem_growth": round(mem_last / mem_first, 3),
        "deltas_len_last": last["deltas_len"],
        "groups_len_last": last["groups_len"],
        "aof_mib_last": round(last["aof_bytes"] / MIB, 2),
        "lost": audit["lost"],
        "duplicated": audit["duplicated"],
    }


def run_soak(args: argparse.Namespace, work: Path) -> dict:
    model = build_tiny_model(work / "model")
    spec = RunSpec(
        model=str(model),
        task="arithmetic",
        steps=1_000_000,  # as many as fit: the soak ends by time, the audit by committed steps
        prompts_per_step=args.prompts,
        group_size=args.group_size,
        max_new_tokens=args.max_new_tokens,
        ignore_eos=True,
    )
    stack = start_stack(work)
    freeze_heap()
    try:
        summary, detail = asyncio.run(drive(args, stack, spec, work))
    except BaseException:
        print(stack.processes["coordinator"].log_tail(40), file=sys.stderr)
        raise
    finally:
        stack.stop()
    if args.json_out is not None:
        args.json_out.write_text(json.dumps({"summary": summary, **detail}, indent=1))
    return summary


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    setup_logging("soak", args.log_level)
    torch.set_num_threads(1)
    if args.work_dir is not None:
        args.work_dir.mkdir(parents=True, exist_ok=True)
        summary = run_soak(args, args.work_dir.resolve())
    else:
        with tempfile.TemporaryDirectory(prefix="spotrl-soak-") as tmp:
            summary = run_soak(args, Path(tmp))
    print(json.dumps(summary), flush=True)
    return summary


if __name__ == "__main__":
    main()
