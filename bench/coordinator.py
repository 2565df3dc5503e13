"""Coordinator ingest at scale (issue 22): how many response tokens per second one real
coordinator absorbs, with every step still exact, and how late each flush is applied.

What runs: Redis (append-only file on, as compose runs it), the weight store and the coordinator
as real processes; `--workers` synthetic rollout workers, each a process of its own
(`bench/coordinator_load.py`: no model; they register over HTTP, heartbeat, read the step's jobs
with the workers' consumer group, obey balancing and fencing orders, and flush one DeltaBatch per
tick with `--tokens-per-flush` new tokens of every request they hold, `--tok-s-per-worker` tokens
per second with every slot busy); in this process the real TrainerLoop with a policy that does no
math but checks every response it is given against what the workers were to generate. The run is
submitted through the coordinator's REST API and runs `--steps` steps. During step `--kill-step`
one worker is killed (SIGKILL: no flush, no release) and a new one takes its place: the
coordinator reclaims the dead worker's requests once its heartbeat expires and the others continue
them from their collected tokens (each response's tokens are fixed by its id and position, so a
continuation goes on where the collected tokens end).

Figures: `tok_s` is the response tokens of the steps over their rollout time (from the step's
jobs queued to its last group published, the coordinator's own step rows); `tok_s_wall` the same
tokens over the whole run, the trainer's commits between steps included; `tok_s_peak` the most
response tokens/s the coordinator's shards absorbed over any `--peak-window-s` of the run (their
`spotrl_coordinator_tokens_total`, sampled every 0.5 s: a step's tail, where the last long
responses finish at a slot's rate, left out). `p50_lag_s` and
`p99_lag_s`: from a flush (the Redis time in its deltas entry's id) to the stored outcome of the
read that took it (the coordinator's `spotrl_coordinator_delta_lag_seconds` histogram,
interpolated in its buckets). `lost` and `duplicated`: response tokens missing from, or added to,
what the trainer was given, against the plan (a response whose tokens differ from the plan's is
counted in `mismatched`). CPU shares are CPU-seconds per second of the run, by process; `wait_`
the share of it the process's main thread was ready to run but waited for a core. The workers run
at `--worker-nice` (their autogroup's nice value), standing for machines of their own.
`--shards K` runs the run with K coordinator shards (`RunSpec.rollout.coordinator_shards`): the
coordinator's CPU is its own process's, `cpu_coordinator_shards` that of shards 1..K-1.

`--collect-only` measures the collector alone: the coordinator's DeltaCollector in this process,
with no workers and no run, takes pre-flushed deltas (`--rounds` flushes of every request, taken
`--rounds-per-read` at a time) from a real Redis: the coordinator's CPU and Redis's per delta
item, where the time of a full run is shared with the workers and the trainer.

Prints progress to stderr and, as its LAST stdout line, one JSON object ending with
tok_s, p50_lag_s, p99_lag_s, lost, duplicated, workers, shards.

    .venv/bin/python bench/coordinator.py [--workers 4] [--tok-s-per-worker 250000]
        [--tokens-per-flush 4] [--steps 3] [--shards 1] [--profile coordinator.prof]
    .venv/bin/python bench/coordinator.py --collect-only [--rounds-per-read 1] [--no-aof]
"""

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil
import torch
from tokenizers import Tokenizer

if not __package__:  # run as a script: bench/ is on sys.path, the repo root is not
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.coordinator_load import Checker, TokenPlan
from bench.loadgen import NullPolicy, Supervised, build_tiny_model, freeze_heap, read
from services.cli import procs
from services.cli.audit import audit_run
from services.contracts import keys
from services.contracts.messages import DeltaBatch, DeltaItem
from services.contracts.runspec import FINAL_STATES, RunSpec
from services.coordinator.scoring.rewards import open_runner
from services.coordinator.step.deltas import DeltaCollector, LiveStep
from services.coordinator.step.store import StepStore
from services.core.collect import CollectRules
from services.core.request_table import RequestTable
from services.core.step_controller import StepController
from services.infra.logs import setup_logging
from services.infra.redis_streams import connect
from services.state.run_state import committed_version
from services.state.runs import RunStore
from services.state.step_metrics import read_steps
from services.tasks.reward_choice import RewardChoice
from services.trainer.loop import TrainerLoop
from services.trainer.settings import TrainerSettings

log = logging.getLogger("bench.coordinator")
LOAD = Path(__file__).resolve().parent / "coordinator_load.py"
TICK_S = 0.5
LAG_METRIC = "spotrl_coordinator_delta_lag_seconds"
TOKENS_METRIC = "spotrl_coordinator_tokens_total"
TOKEN_IDS = "3,4,5,6,7,8,9,10,11,12"  # the tiny model's digits: never its end-of-sequence id
EOS_ID = 1


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--tok-s-per-worker", type=float, default=250_000.0, help="all slots busy")
    p.add_argument("--tokens-per-flush", type=int, default=4, help="per request per flush")
    p.add_argument("--slots", type=int, default=2048, help="requests a worker holds at most")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument(
        "--shards",
        type=int,
        default=1,
        help="coordinator processes (RunSpec.rollout.coordinator_shards)",
    )
    p.add_argument("--prompts", type=int, default=2048, help="prompts per step (B)")
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=512)
    p.add_argument("--min-len", type=int, default=128, help="shortest response that stops")
    p.add_argument("--kill-step", type=int, default=1, help="-1: kill no worker")
    p.add_argument(
        "--peak-window-s", type=float, default=2.0, help="the stretch tok_s_peak is taken over"
    )
    p.add_argument("--kill-after-s", type=float, default=2.0, help="into the kill step")
    p.add_argument(
        "--collect-only",
        action="store_true",
        help="the DeltaCollector in this process on pre-flushed deltas: CPU per delta item",
    )
    p.add_argument("--rounds", type=int, default=32, help="--collect-only: flushes per request")
    p.add_argument(
        "--rounds-per-read",
        type=int,
        default=1,
        help="--collect-only: a request's flushes a read takes",
    )
    p.add_argument("--worker-nice", type=int, default=10, help="nice value of the workers")
    p.add_argument("--no-aof", action="store_true", help="Redis without its append-only file")
    p.add_argument("--profile", type=Path, help="run the coordinator under cProfile, to here")
    p.add_argument("--work-dir", type=Path, help="keep logs and data here (default: temp dir)")
    p.add_argument("--json-out", type=Path, help="write the summary here too")
    p.add_argument("--timeout-s", type=float, default=600.0, help="give up on the run after")
    args = p.parse_args(argv)
    if args.profile is not None:
        args.profile = args.profile.resolve()
    return args


class CheckingPolicy(NullPolicy):
    """NullPolicy (no math, a tiny real weight folder per version) that checks each group."""

    checker: Checker

    def accumulate(self, groups: list) -> None:
        for group in groups:
            self.checker.check(group)
        super().accumulate(groups)


# ---- the processes ----
class Bench:
    def __init__(self, args: argparse.Namespace, work: Path) -> None:
        self.args, self.work = args, work
        self.log_dir = work / "logs"
        self.procs: dict[str, procs.Proc] = {}
        self.workers: list[procs.Proc] = []
        self.started = 0
        self.redis_url = self.coordinator_url = self.weightstore_url = ""
        self.cpu_first: dict[int, float] = {}  # pid -> CPU-seconds at the window's start
        self.cpu_last: dict[int, float] = {}
        self.role: dict[int, str] = {}
        self.loop_first = self.loop_last = 0.0  # CPU-s of the coordinator's event loop thread
        self.wait_first: dict[str, float] = {}  # process -> seconds waited for a core
        self.shard_lags: dict[int, list[tuple[float, float]]] = {}  # coordinator shards 1..K-1
        self.shard_tokens: dict[int, float] = {}  # tokens absorbed, by coordinator shard
        self.token_samples: list[tuple[float, float]] = []  # (monotonic, all shards' tokens)
        self.wait_last: dict[str, float] = {}

    def start_services(self) -> None:
        args, work = self.args, self.work
        self.procs["redis"], self.redis_url = procs.start_redis(
            self.log_dir, work / "redis", appendonly=not args.no_aof
        )
        ws_port, co_port = procs.free_port(), procs.free_port()
        self.weightstore_url = f"http://127.0.0.1:{ws_port}"
        self.coordinator_url = f"http://127.0.0.1:{co_port}"
        env = procs.thread_env(1) | {
            "SPOTRL_REDIS_URL": self.redis_url,
            "SPOTRL_WEIGHTSTORE_URL": self.weightstore_url,
            "SPOTRL_COORDINATOR_URL": self.coordinator_url,
        }
        self.procs["weightstore"] = procs.start_service(
            "weightstore",
            "services.weightstore.main",
            env | {"SPOTRL_PORT": str(ws_port), "SPOTRL_ROOT": str(work / "weights")},
            self.log_dir,
            ws_port,
        )
        co_args = [sys.executable, "-m", "services.coordinator.main"]
        if args.profile is not None:
            co_args = [sys.executable, str(LOAD), "profiled-coordinator", str(args.profile)]
        self.procs["coordinator"] = procs.start(
            "coordinator",
            co_args,
            env | {"SPOTRL_PORT": str(co_port)},
            self.log_dir,
            self.coordinator_url,
        )
        procs.wait_healthy(list(self.procs.values()), 120.0)

    def start_worker(self) -> procs.Proc:
        a = self.args
        self.started += 1
        worker_id = f"synthetic-{self.started}"
        cmd = [
            sys.executable,
            str(LOAD),
            *("--redis-url", self.redis_url, "--coordinator-url", self.coordinator_url),
            *("--worker-id", worker_id, "--stats", str(self.work / f"{worker_id}.json")),
            *("--slots", str(a.slots), "--tok-s", str(a.tok_s_per_worker)),
            *("--tokens-per-flush", str(a.tokens_per_flush)),
            *("--max-new-tokens", str(a.max_new_tokens), "--min-len", str(a.min_len)),
            *("--eos-id", str(EOS_ID), "--token-ids", TOKEN_IDS),
        ]
        proc = procs.start(worker_id, cmd, {}, self.log_dir)
        if a.worker_nice:
            lower_priority(proc.pid, a.worker_nice)
        self.workers.append(proc)
        return proc

    def processes(self) -> dict[int, str]:
        out = {p.pid: name for name, p in self.procs.items()}
        out |= {p.pid: "workers" for p in self.workers if p.alive()}
        with contextlib.suppress(psutil.Error):  # the coordinator's shards 1..K-1
            for child in psutil.Process(self.procs["coordinator"].pid).children():
                if "services.coordinator.run.shard" in child.cmdline():
                    out[child.pid] = "coordinator_shards"
        return out | {psutil.Process().pid: "bench"}

    async def scrape(self, r, http: httpx.AsyncClient, run_id: str) -> None:
        """The tokens every coordinator shard has absorbed so far, sampled with the time, and
        the lag histogram of shards 1..K-1 (processes of their own, gone once the run ends: the
        last scrape is kept)."""
        texts = {0: (await read(http, "/metrics")).text}
        urls = await r.hgetall(keys.shard_metrics(run_id))
        for shard, url in urls.items():
            with contextlib.suppress(httpx.HTTPError):
                texts[int(shard)] = (await http.get(url.decode(), timeout=2.0)).text
        for shard, text in texts.items():
            self.shard_tokens[shard] = counter(text, TOKENS_METRIC)
            if shard:
                self.shard_lags[shard] = histogram(text, LAG_METRIC)
        self.token_samples.append((time.monotonic(), sum(self.shard_tokens.values())))

    def main_thread_cpu_s(self) -> float | None:
        pid = self.procs["coordinator"].pid
        try:
            threads = psutil.Process(pid).threads()
        except psutil.Error:
            return None
        main = [t for t in threads if t.id == pid]
        return main[0].user_time + main[0].system_time if main else None

    def sample_cpu(self, first: bool = False) -> None:
        loop = self.main_thread_cpu_s()
        if loop is not None:
            self.loop_last = loop
            if first:
                self.loop_first = loop
        for name in ("coordinator", "redis"):
            waited = runqueue_wait_s(self.procs[name].pid)
            if first or name not in self.wait_first:
                self.wait_first[name] = waited
            self.wait_last[name] = waited
        for pid, role in self.processes().items():
            try:
                t = psutil.Process(pid).cpu_times()
            except psutil.Error:
                continue
            self.role[pid] = role
            self.cpu_last[pid] = t.user + t.system
            if first or pid not in self.cpu_first:
                self.cpu_first[pid] = self.cpu_last[pid] if first else 0.0

    def cpu_shares(self, wall_s: float) -> dict[str, float]:
        out: dict[str, float] = {}
        for pid, last in self.cpu_last.items():
            role = self.role[pid]
            out[role] = out.get(role, 0.0) + last - self.cpu_first.get(pid, 0.0)
        shares = {f"cpu_{role}": round(s / wall_s, 3) for role, s in sorted(out.items())}
        # the event loop's thread; the rest of the coordinator's CPU is threads (decode, rewards)
        shares["cpu_coordinator_loop"] = round((self.loop_last - self.loop_first) / wall_s, 3)
        for name, last in self.wait_last.items():
            # runnable but waiting for a core (its main thread): what the machine withheld
            shares[f"wait_{name}"] = round((last - self.wait_first[name]) / wall_s, 3)
        return shares

    def check_alive(self) -> None:
        for p in [*self.procs.values(), *self.workers]:
            if not p.alive() and not p.stopped_on_purpose:
                raise procs.died(p)

    def stop_workers(self) -> list[dict]:
        counts = []
        for p in self.workers:
            p.stop(10.0)
            stats = self.work / f"{p.name}.json"
            if stats.exists():
                counts.append(json.loads(stats.read_text()))
        return counts

    def stop_services(self) -> None:
        for name in ("coordinator", "weightstore", "redis"):
            if name in self.procs:
                self.procs[name].stop(30.0)


def lower_priority(pid: int, nice: int) -> None:
    """Run a worker at a lower priority: here the workers share the coordinator's cores, where
    a deployment's run on machines of their own. A process in a session of its own is in an
    autogroup of its own (Linux's default), where only the group's nice value counts."""
    os.setpriority(os.PRIO_PROCESS, pid, nice)
    with contextlib.suppress(OSError):
        Path(f"/proc/{pid}/autogroup").write_text(str(nice))


def runqueue_wait_s(pid: int) -> float:
    """Seconds the process's main thread has been runnable but waiting for a core (Linux
    schedstat; 0 where the kernel does not say)."""
    try:
        return int(Path(f"/proc/{pid}/schedstat").read_text().split()[1]) / 1e9
    except (OSError, ValueError, IndexError):
        return 0.0


# ---- reading the coordinator's figures ----
def histogram(text: str, name: str) -> list[tuple[float, float]]:
    """The cumulative buckets (upper bound, count) of an unlabelled histogram in /metrics text."""
    out = []
    for line in text.splitlines():
        if line.startswith(f"{name}_bucket{{"):
            bound = line.split('le="', 1)[1].split('"', 1)[0]
            out.append((float(bound), float(line.rsplit(" ", 1)[1])))
    return sorted(out)


def counter(text: str, name: str) -> float:
    """The value of an unlabelled counter in /metrics text (0 when absent)."""
    for line in text.splitlines():
        if line.startswith(f"{name} "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def peak_rate(samples: list[tuple[float, float]], window_s: float) -> float:
    """The highest rate of a cumulative count over any stretch of at least `window_s` between
    two of its samples (time, count)."""
    best, start = 0.0, 0
    for end in range(len(samples)):
        while start + 1 < end and samples[end][0] - samples[start + 1][0] >= window_s:
            start += 1
        span = samples[end][0] - samples[start][0]
        if span >= window_s:
            best = max(best, (samples[end][1] - samples[start][1]) / span)
    return best


def add_histograms(parts: list[list[tuple[float, float]]]) -> list[tuple[float, float]]:
    """Histograms of the same buckets, added up (one per coordinator shard)."""
    parts = [p for p in parts if p]
    if not parts:
        return []
    return [(bound, sum(p[i][1] for p in parts)) for i, (bound, _) in enumerate(parts[0])]


def quantile(buckets: list[tuple[float, float]], q: float) -> float | None:
    """The q-quantile of a cumulative histogram, linear within its bucket (as PromQL's
    histogram_quantile); the last finite bound where it falls in the +Inf bucket."""
    if not buckets or buckets[-1][1] == 0:
        return None
    rank = q * buckets[-1][1]
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if bound == float("inf"):
                return lower_bound
            share = (rank - lower_count) / max(count - lower_count, 1e-12)
            return lower_bound + (bound - lower_bound) * share
        lower_bound, lower_count = bound, count
    return lower_bound


async def drive(bench: Bench, spec: RunSpec, checker: Checker) -> dict:
    args = bench.args
    r = connect(bench.redis_url)
    settings = TrainerSettings(
        redis_url=bench.redis_url,
        weightstore_url=bench.weightstore_url,
        work_dir=bench.work / "trainer",
        checkpoint_every=100_000,
    )

    def policy(model_dir: Path, run_spec: RunSpec, device: str) -> CheckingPolicy:
        out = CheckingPolicy(model_dir, run_spec, device)
        out.checker = checker
        return out

    trainer = Supervised("trainer")  # a cancel that redis-py swallows is sent again
    trainer.spawn("loop", TrainerLoop(settings, r, policy_factory=policy).forever)
    found: dict = {"kills": 0}
    try:
        async with httpx.AsyncClient(base_url=bench.coordinator_url, timeout=30.0) as http:
            resp = await http.post("/v1/runs", json=spec.model_dump(mode="json"))
            if resp.status_code != 201:
                raise RuntimeError(f"run refused: {resp.status_code} {resp.text}")
            run_id = found["run_id"] = resp.json()["id"]
            for _ in range(args.workers):
                bench.start_worker()
            began = await run_until_done(bench, r, http, trainer, run_id, found)
            ended = time.monotonic()
            bench.sample_cpu()
            found["wall_s"] = ended - began
            metrics = (await read(http, "/metrics")).text
            found["tok_s_peak"] = peak_rate(bench.token_samples, args.peak_window_s)
            found["lag"] = add_histograms(
                [histogram(metrics, LAG_METRIC), *bench.shard_lags.values()]
            )
            found["rows"] = await read_steps(r, run_id)
            found["state"] = (await read(http, f"/v1/runs/{run_id}")).json()
            if args.profile is not None:
                await write_profile(bench, args.profile)
    finally:
        await trainer.cancel()
        await r.aclose()
    return found


async def run_until_done(
    bench: Bench,
    r,
    http: httpx.AsyncClient,
    trainer: Supervised,
    run_id: str,
    found: dict,
) -> float:
    """Until the run ends: the kill (and its replacement) on schedule; when step 0 began."""
    args = bench.args
    deadline = time.monotonic() + args.timeout_s
    began: float | None = None
    kill_at: float | None = None
    last_version = -1
    while True:
        await asyncio.sleep(TICK_S)
        bench.check_alive()
        trainer.check()
        run = (await read(http, f"/v1/runs/{run_id}")).json()
        if run["state"] in FINAL_STATES:
            if run["state"] != "succeeded":
                raise RuntimeError(f"run {run['state']}: {run.get('error', '')}")
            return began if began is not None else time.monotonic()
        version = await committed_version(r, run_id)
        now = time.monotonic()
        if version is not None and began is None:
            began = now
            bench.sample_cpu(first=True)
        else:
            bench.sample_cpu()
        await bench.scrape(r, http, run_id)
        if version is not None and version != last_version:
            last_version = version
            print(f"step {version} began at {now - (began or now):.1f}s", file=sys.stderr)
            if version == args.kill_step:
                kill_at = now + args.kill_after_s
        if kill_at is not None and now >= kill_at and version == args.kill_step:
            kill_at = None
            victim = bench.workers[0]
            victim.kill()
            found["kills"] += 1
            new = bench.start_worker()
            print(f"killed {victim.name}, started {new.name}", file=sys.stderr, flush=True)
        if now > deadline:
            raise TimeoutError(f"run {run_id} not done after {args.timeout_s}s")


async def write_profile(bench: Bench, out: Path) -> None:
    """Ask the profiled coordinator for its profile (SIGUSR1) and wait for the file."""
    out.unlink(missing_ok=True)
    bench.procs["coordinator"].popen.send_signal(signal.SIGUSR1)
    for _ in range(300):
        await asyncio.sleep(0.1)
        if out.exists() and out.stat().st_size > 0:
            await asyncio.sleep(0.5)  # written whole
            print(f"coordinator profile: {out}", file=sys.stderr)
            return
    log.warning("no profile from the coordinator")


def summarize(args, found: dict, checker: Checker, counts: list[dict], audit: dict) -> dict:
    rows = [row for row in found["rows"] if row.rollout_s]
    tokens = sum(row.response_tokens or 0 for row in rows)
    rollout_s = sum(row.rollout_s or 0.0 for row in rows)
    migrations: dict[str, int] = {}
    for row in rows:
        for cause, n in (row.migrations or {}).items():
            migrations[cause] = migrations.get(cause, 0) + n
    never = checker.never_given(args.steps, args.prompts)
    p50, p99 = quantile(found["lag"], 0.5), quantile(found["lag"], 0.99)
    sent = {k: sum(c.get(k, 0) for c in counts) for k in ("flushes", "items", "tokens")}
    return {
        "offered_tok_s": args.workers * args.tok_s_per_worker,
        "tokens_per_flush": args.tokens_per_flush,
        "slots": args.slots,
        "steps": len(rows),
        "tokens": tokens,
        "tok_s_by_step": [round((row.response_tokens or 0) / row.rollout_s) for row in rows],
        "tok_s_wall": round(tokens / max(found["wall_s"], 1e-9)),
        "wall_s": round(found["wall_s"], 1),
        "deltas_applied": int(found["lag"][-1][1]) if found["lag"] else 0,
        "items_per_flush": round(sent["items"] / max(sent["flushes"], 1), 1),
        "kills": found["kills"],
        "migrations": migrations,
        "tokens_received": sum(row.tokens_received or 0 for row in rows),
        "bad_prefix": sum(c.get("bad_prefix", 0) for c in counts),
        "late_ticks": sum(c.get("late_ticks", 0) for c in counts),
        "responses_checked": checker.responses,
        "mismatched": checker.mismatched,
        "audit_lost": audit["lost"],
        "audit_duplicated": audit["duplicated"],
        **found["cpu"],
        # tokens absorbed per CPU-second of the coordinator: its capacity on a core of its own
        "tok_per_coordinator_cpu_s": round(
            tokens
            / max(
                (
                    found["cpu"].get("cpu_coordinator", 0)
                    + found["cpu"].get("cpu_coordinator_shards", 0)
                )
                * found["wall_s"],
                1e-9,
            )
        ),
        # the most tokens/s absorbed over any --peak-window-s (the steps' tails left out)
        "tok_s_peak": round(found["tok_s_peak"]),
        "peak_window_s": args.peak_window_s,
        "tok_s": round(tokens / max(rollout_s, 1e-9)),
        "p50_lag_s": None if p50 is None else round(p50, 3),
        "p99_lag_s": None if p99 is None else round(p99, 3),
        "lost": checker.lost + never,
        "duplicated": checker.duplicated,
        "workers": args.workers,
        "shards": args.shards,
    }


# ---- the collector alone ----
async def collect_only(
    args: argparse.Namespace, work: Path, redis_url: str, redis_pid: int
) -> dict:
    """The coordinator's own DeltaCollector in this process, with no workers and no run: each
    round every request (`--workers` x `--slots`) gets one flush of `--tokens-per-flush` tokens
    (one stream entry per worker), and every `--rounds-per-read` rounds `collect` takes what
    was added. Only the time inside `collect` is counted: this thread's CPU (the coordinator's
    event loop) and Redis's."""
    model = build_tiny_model(work / "model")
    spec = RunSpec(
        model=str(model),
        task="arithmetic",
        prompts_per_step=args.workers * args.slots // args.group_size,
        group_size=args.group_size,
        max_new_tokens=args.rounds * args.tokens_per_flush + 1,  # no response ends
    )
    run_id = "collect-only"
    r = connect(redis_url)
    rewards = await open_runner(RewardChoice.from_spec(spec), spec.scoring.reward_timeout_s, 1)
    tokenizer = Tokenizer.from_file(str(model / "tokenizer.json"))
    collector = DeltaCollector(r, run_id, spec, RunStore(r), tokenizer, [EOS_ID], rewards)
    await collector.start()
    prompts = [[3, 4, 5]] * spec.training.prompts_per_step
    table = RequestTable(run_id, 0, prompts, spec.training.group_size, spec.sampling, 0, [])
    control = StepController(table, CollectRules.for_run(spec))
    live = {0: LiveStep(control, StepStore(r, run_id, 0), [])}
    rids = list(table.requests)
    plan = TokenPlan(
        spec.sampling.max_new_tokens, 1, EOS_ID, [int(t) for t in TOKEN_IDS.split(",")], 0
    )
    redis = psutil.Process(redis_pid)
    stream, per = keys.deltas_stream(run_id), args.tokens_per_flush
    cpu_s = redis_s = feed_s = 0.0  # in collect: this thread's, Redis's; Redis's in XADDs
    reads = 0
    for n in range(args.rounds):
        redis_before = sum(redis.cpu_times()[:2])
        async with r.pipeline(transaction=False) as pipe:
            for w in range(args.workers):
                items = []
                for rid in rids[w * args.slots : (w + 1) * args.slots]:
                    at = plan.start(rid) + n * per
                    items.append(
                        DeltaItem(
                            request_id=rid,
                            lease=0,
                            grant=table.requests[rid].grant,  # as its holder sends it
                            offset=n * per,
                            token_ids=plan.tokens[at : at + per],
                            logprobs=plan.logprobs[at : at + per],
                        )
                    )
                batch = DeltaBatch(worker_id=f"w{w}", version=0, items=items)
                pipe.xadd(stream, batch.fields())
            await pipe.execute()
        feed_s += sum(redis.cpu_times()[:2]) - redis_before
        if (n + 1) % args.rounds_per_read and n + 1 < args.rounds:
            continue
        while await r.xlen(stream):
            redis_before, before = sum(redis.cpu_times()[:2]), time.thread_time()
            await collector.collect(live, 1)
            cpu_s += time.thread_time() - before
            redis_s += sum(redis.cpu_times()[:2]) - redis_before
            reads += 1
    await rewards.close()
    await r.aclose()
    items, tokens = args.rounds * len(rids), table.tokens_appended
    if tokens != items * per:
        raise RuntimeError(f"collected {tokens} tokens of {items * per}")
    return {
        "mode": "collect-only",
        "aof": not args.no_aof,
        "tokens_per_flush": per,
        "items_per_flush": args.slots,
        "rounds_per_read": args.rounds_per_read,
        "reads": reads,
        "items": items,
        "tokens": tokens,
        "coordinator_us_per_item": round(cpu_s / items * 1e6, 2),
        "redis_us_per_item": round(redis_s / items * 1e6, 2),
        "redis_xadd_us_per_item": round(feed_s / items * 1e6, 2),  # the workers' flushes
        "tok_per_coordinator_cpu_s": round(tokens / max(cpu_s, 1e-9)),
        "tok_per_redis_cpu_s": round(tokens / max(redis_s, 1e-9)),
    }


def run_collect_only(args: argparse.Namespace, work: Path) -> dict:
    proc, url = procs.start_redis(work / "logs", work / "redis", appendonly=not args.no_aof)
    try:
        return asyncio.run(collect_only(args, work, url, proc.pid))
    finally:
        proc.stop()


def run_bench(args: argparse.Namespace, work: Path) -> dict:
    model = build_tiny_model(work / "model")
    spec = RunSpec(
        model=str(model),
        task="arithmetic",
        steps=args.steps,
        prompts_per_step=args.prompts,
        group_size=args.group_size,
        max_new_tokens=args.max_new_tokens,
        coordinator_shards=args.shards,
    )
    plan = TokenPlan(
        args.max_new_tokens, args.min_len, EOS_ID, [int(t) for t in TOKEN_IDS.split(",")], 0
    )
    checker = Checker(plan, args.group_size)
    bench = Bench(args, work)
    try:
        bench.start_services()
        freeze_heap()
        found = asyncio.run(drive(bench, spec, checker))
        found["cpu"] = bench.cpu_shares(found["wall_s"])
        counts = bench.stop_workers()
        audit = audit_run(bench.redis_url, found["run_id"], spec)
    except BaseException:
        if "coordinator" in bench.procs:
            print(bench.procs["coordinator"].log_tail(40), file=sys.stderr)
        raise
    finally:
        for p in bench.workers:
            p.kill()
        bench.stop_services()
    return summarize(args, found, checker, counts, audit)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    setup_logging("bench", "WARNING")
    torch.set_num_threads(1)
    run = run_collect_only if args.collect_only else run_bench
    if args.work_dir is not None:
        args.work_dir.mkdir(parents=True, exist_ok=True)
        summary = run(args, args.work_dir.resolve())
    else:
        with tempfile.TemporaryDirectory(prefix="spotrl-coordinator-") as tmp:
            summary = run(args, Path(tmp))
    if args.json_out is not None:
        args.json_out.write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary), flush=True)
    return summary


if __name__ == "__main__":
    main()
