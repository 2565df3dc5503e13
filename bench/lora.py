"""LoRA versions vs full-weight versions, side by side (issue 51): the bytes a version moves and
the time from its commit until a worker serves it.

For each model of `--models` (bench/delta_share.py's `embedded` and `qwen2-236m`, or a local
Hugging Face folder; nothing is downloaded) it trains two runs of the same model with the
trainer's own code, one version per RL step on delta_share's synthetic groups (`Policy`: its
GRPO loss, AdamW at `--lr`, bf16 exports), `--versions` versions after version 0:
- `full`: the full-weight spec; every version is the whole model (`Policy.export_files`),
  committed by a `WeightClient(deltas=True)` as the trainer's default is;
- `lora`: the same spec with `lora_r` (`--lora-r`), lora_alpha 16, target all-linear; version 0
  is the base's whole folder, every later one the PEFT adapter alone (base_version 0).
Each version is committed and announced by the trainer's `VersionPublisher` (digest recorded,
uploaded with its metadata, the store's manifest announced) to one weight store whose block
server's egress is capped at `--store-mbps` (default 1000: 1 Gbit/s), with one Redis.

The worker's side is the real `VersionLoader` over a `WorkerContext` built as
tests/integration/test_lora_versions.py builds it (no worker process, no coordinator; one worker
per side, so peer-to-peer is off) with a real `HFEngine` on CPU. Each worker joins at version 0
(not measured) and then holds the version before each one it loads (steady state): the `full`
worker pulls by sparse deltas (`weight_deltas`, the worker's default) and loads the tensors that
changed in place; a `full_nodelta` worker (`--no-nodelta` leaves it out) pulls the same versions
with deltas off and reloads the whole model; the `lora` worker pulls the adapter (the base v0 it
holds) and hands it to its engine, which applies it per request on the base it holds
(`engines/lora_rows.py`, the worker's default `max_loras` 4); the `lora_merged` worker
(`max_loras` 0) merges each adapter into the base (`write_merged`) and loads the merged layers
in place.

Then the two LoRA workers' engines, holding the last version, generate the same
`GEN_REQUESTS` greedy requests of `--gen-tokens` tokens: `lora_vs_merged_tok_s` is the
adapter-applying engine's decode tokens/s over the merged one's (best of two, alternately
first): what serving LoRA unmerged costs in generation, against what it saves in loading.

Measured per version v >= 1 (means over the versions):
- serve_s: from the commit's return (upload done) until `VersionLoader.load` returns with v
  served: the announce + the load (pull, merge, engine load, the loader's cleanup). Of it:
  pull_s (the worker's `WeightClient.pull` calls), engine_s (`engine.load` calls), rest_s (the
  rest: the LoRA merge written to its scratch folder, the announce, the folders removed);
- bytes: pulled by the worker (`PullResult.bytes`: the adapter, the deltas or whole files; files
  the version held already has are linked, not pulled);
- version_bytes: the version's files as committed (the store's manifest); commit_s, the
  trainer's commit (export, hash, upload).
adapter_bytes_ratio: a LoRA version's files (v >= 1) / version 0's files (the whole model
folder). serve_speedup: serve_s of `full` / serve_s of `lora` (`serve_speedup_nodelta` against
`full_nodelta`; `serve_speedup_merged`: `full` / `lora_merged`). The issue's bars (qwen2-236m,
r=8): ratio <= 0.02, speedup >= 5.

The work folder (store, worker caches, merged scratch folders) is in /dev/shm where there is
room, so neither side measures a disk's write-back. The trainer's steps and the engines' loads
share the process's compute thread (services/infra/compute.py), one at a time.

Prints progress to stderr and one JSON object as its LAST line: per model, both sides' means and
the ratios; top-level adapter_bytes_ratio and serve_speedup of qwen2-236m (else of the last
model), and the regime.

    OMP_NUM_THREADS=2 .venv/bin/python bench/lora.py [--models embedded,qwen2-236m]
        [--versions 3] [--lora-r 8] [--store-mbps 1000] [--lr 1e-6] [--no-nodelta]
        [--gen-tokens 32]
"""

import argparse
import asyncio
import gc
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import redis.asyncio as aioredis
import repo_root  # noqa: F401  (the repository root on sys.path)
from delta_versions import VersionMaker, model_folder
from weight_pull import start_capped_store

from services.cli import procs
from services.infra.compute import compute
from services.rollout.engines.hf import HFEngine
from services.weights.pull import PullResult
from services.weights.transfer import WeightClient

LORA_ALPHA = 16
REAL_MODEL = "qwen2-236m"  # the real architecture: its ratios are the top-level ones
SHM_ROOM_BYTES = 8e9  # /dev/shm is the work folder when it has this much free
LORAS = 4  # adapters the `lora` worker's engine holds (the worker's default max_loras)
GEN_REQUESTS = 16  # requests generated at once for lora_vs_merged_tok_s
KILL_AFTER_STEP = 5  # the learning run's worker is killed mid-step, past this one
ADAPTER_LOG = "an adapter the engine applies"  # weight_loader's line for an adapter served so
ENGINE_ENV = "SPOTRL_ENGINE"
VLLM_LORA_LOG = "vLLM restarted with LoRA"  # the vLLM engine's line once its LoRA layers are on


def log(*parts) -> None:
    print(*parts, file=sys.stderr, flush=True)


class TimedEngine(HFEngine):
    """The HF engine on CPU, adding up the seconds its loads (of weights or adapters) take."""

    def __init__(self, max_adapters: int) -> None:
        super().__init__("cpu", slots=GEN_REQUESTS, max_adapters=max_adapters)
        self.load_s = 0.0

    async def load(self, folder: Path, changed: frozenset[str] | None = None) -> None:
        started = time.perf_counter()
        await super().load(folder, changed)
        self.load_s += time.perf_counter() - started

    async def load_adapter(self, version: int, folder: Path) -> None:
        started = time.perf_counter()
        await super().load_adapter(version, folder)
        self.load_s += time.perf_counter() - started


class CountingClient(WeightClient):
    """A worker's WeightClient, adding up the seconds and the bytes of its pulls."""

    def __init__(self, store_url: str, deltas: bool) -> None:
        super().__init__([store_url], deltas=deltas)
        self.pull_s, self.bytes = 0.0, 0

    async def pull(self, *args, **kwargs) -> PullResult:
        started = time.perf_counter()
        result = await super().pull(*args, **kwargs)
        self.pull_s += time.perf_counter() - started
        self.bytes += result.bytes
        return result


class Worker:
    """One rollout worker's weight loading: the real VersionLoader, a real HF engine."""

    def __init__(
        self, name: str, work: Path, redis_url: str, store_url: str, deltas: bool, loras: int = 0
    ):
        from services.core.plateau import PlateauEstimator
        from services.rollout.context import WorkerContext, new_buffer
        from services.rollout.settings import RolloutSettings
        from services.rollout.weight_loader import VersionLoader

        settings = RolloutSettings(
            worker_id=name,
            redis_url=redis_url,
            weightstore_url=store_url,
            cache_dir=work / "cache",
            p2p=False,
            weight_deltas=deltas,
        )
        self.name, self.engine = name, TimedEngine(loras)
        ctx = WorkerContext(
            s=settings,
            r=aioredis.Redis.from_url(redis_url),
            engine=self.engine,
            buffer=new_buffer(settings),
            plateau=PlateauEstimator(settings.slots),
        )
        self.loader = VersionLoader(ctx)
        self.client = self.loader.weights = CountingClient(store_url, deltas)

    async def serve(self, run_id: str, version: int) -> dict:
        """Load `version` as the worker does; what it pulled and how long each part took."""
        self.client.pull_s, self.client.bytes, self.engine.load_s = 0.0, 0, 0.0
        started = time.perf_counter()
        await self.loader.load(run_id, version)
        load_s = time.perf_counter() - started
        if self.loader.ctx.version != version:
            raise RuntimeError(f"{self.name} did not load {run_id} v{version} (see the log)")
        return {
            "bytes": self.client.bytes,
            "pull_s": self.client.pull_s,
            "engine_s": self.engine.load_s,
            "load_s": load_s,
        }

    async def close(self) -> None:
        await self.loader.ctx.r.aclose()


class Trainer:
    """One run's trainer: the trainer's Policy stepping on synthetic groups, and its
    VersionPublisher committing and announcing each version."""

    def __init__(self, run_id: str, folder: Path, lora: dict, args, r, store_url: str, work: Path):
        from services.trainer.versions import VersionPublisher

        self.run_id = run_id
        self.maker = VersionMaker(folder, args.lr, "bfloat16", **lora)
        self.policy = self.maker.policy
        self.publisher = VersionPublisher(r, WeightClient([store_url], deltas=True), work)

    async def commit(self, version: int) -> dict:
        """A step (after version 0), then the version committed: its bytes, the seconds."""
        if version > 0:
            await compute(self.maker.step)
        commit_s = await self.publisher.commit(self.run_id, self.policy, version)
        manifest = self.publisher.manifest
        assert manifest is not None
        if self.policy.adapter is not None and version > 0:
            assert manifest.metadata.get("base_version") == 0, manifest.metadata
        return {"version_bytes": manifest.total_bytes(), "commit_s": commit_s}

    async def announce(self, version: int) -> float:
        started = time.perf_counter()
        await self.publisher.announce(self.run_id, version)
        return time.perf_counter() - started


async def run_side(
    side: str, folder: Path, args, r, urls: tuple[str, str], work: Path
) -> dict[str, list[dict]]:
    """One run (`side`: "full" or "lora") trained, committed and served version by version; the
    rows per worker (the full run's: with deltas and, unless left out, without)."""
    redis_url, store_url = urls
    lora = {"lora_r": args.lora_r, "lora_alpha": LORA_ALPHA, "lora_target_modules": "all-linear"}
    run_id = f"{folder.name}-{side}"
    trainer = Trainer(run_id, folder, lora if side == "lora" else {}, args, r, store_url, work)
    workers = [Worker(side, work, redis_url, store_url, deltas=True, loras=LORAS)]
    if side == "full" and args.nodelta:
        workers.append(Worker("full_nodelta", work, redis_url, store_url, deltas=False))
    if side == "lora":  # the same adapters merged into the base on the worker
        workers.append(Worker("lora_merged", work, redis_url, store_url, deltas=True))
    rows: dict[str, list[dict]] = {w.name: [] for w in workers}
    try:
        for version in range(args.versions + 1):
            committed = await trainer.commit(version)
            announce_s = await trainer.announce(version)
            order = workers if version % 2 else workers[::-1]  # alternately first
            for worker in order:
                row = committed | await worker.serve(run_id, version)
                row["serve_s"] = announce_s + row["load_s"]
                row["rest_s"] = row["serve_s"] - row["pull_s"] - row["engine_s"]
                log(f"{run_id} v{version} {worker.name}:", json.dumps(rounded(row)))
                rows[worker.name].append(row)
        if side == "full" and len(workers) == 2:
            log(f"{run_id}: the two full workers' engines equal:", same_state(workers))
        if side == "lora":
            generation = await generation_tok_s(workers, args.gen_tokens)
            if folder.name in args.vllm_models.split(","):
                cache = workers[0].loader.ctx.s.cache_dir / workers[0].name / run_id
                generation["vllm"] = await vllm_generation_tok_s(
                    cache / "v0", cache / f"v{args.versions}", work / "vllm-merged", args.gen_tokens
                )
            rows["generation"] = [generation]
    finally:
        for worker in workers:
            await worker.close()
    return rows


def generation_jobs(tokens: int, tag: str = "") -> list:
    """GEN_REQUESTS greedy jobs of `tokens` tokens, one prompt each (a step's distinct
    prompts)."""
    from services.contracts.messages import Job
    from services.contracts.sampling import SamplingParams

    return [
        Job(
            run_id="gen",
            request_id=f"0:{i}:{tag}",
            lease=0,
            grant="g",
            step=0,
            prompt_ids=[1 + i, 7, 3 + i, 9],
            remaining_tokens=tokens,
            sampling=SamplingParams(temperature=0.0, max_new_tokens=tokens),
            seed=i,
        )
        for i in range(GEN_REQUESTS)
    ]


def tokens_per_s(engine: HFEngine, tokens: int) -> tuple[float, list[list[int]]]:
    """`engine` generating the `generation_jobs` at once: tokens/s of the decode loop, and the
    tokens."""
    for job in generation_jobs(tokens):
        engine.add(job)
    out: dict[str, list[int]] = {}
    started = time.perf_counter()
    while engine.active:
        for ev in engine.decode():
            out.setdefault(ev.request_id, []).append(ev.token_id)
    took = time.perf_counter() - started
    return sum(map(len, out.values())) / took, [out[k] for k in sorted(out)]


async def generation_tok_s(workers: list[Worker], tokens: int) -> dict:
    """The LoRA worker's engine (adapter applied per row) against the merged one's, the same
    greedy requests on the same version: tokens/s each, alternately first, twice; and whether
    their tokens agree (float noise may part them where two logits nearly tie)."""
    applied, merged = (w.engine for w in workers)
    speeds: dict[str, list[float]] = {"applied": [], "merged": []}
    same = []
    for first in (0, 1):
        pair = (("applied", applied), ("merged", merged))
        results = {}
        for name, engine in pair[first:] + pair[:first]:
            speed, generated = await compute(tokens_per_s, engine, tokens)
            speeds[name].append(speed)
            results[name] = generated
        same.append(
            sum(a == b for a, b in zip(results["applied"], results["merged"], strict=True))
            / GEN_REQUESTS
        )
    applied_s, merged_s = max(speeds["applied"]), max(speeds["merged"])
    return {
        "tok_s_lora": round(applied_s, 1),
        "tok_s_merged": round(merged_s, 1),
        "lora_vs_merged_tok_s": round(applied_s / merged_s, 3),
        "same_tokens_frac": min(same),
        "requests": GEN_REQUESTS,
        "tokens": tokens,
    }


async def vllm_tokens_per_s(engine, tokens: int, tag: str) -> tuple[float, list[list[int]]]:
    """`tokens_per_s` for the vLLM engine (its own step loop)."""
    for job in generation_jobs(tokens, tag):
        engine.add(job)
    out: dict[str, list[int]] = {}
    started = time.perf_counter()
    while engine.active:
        for ev in await engine.step():
            out.setdefault(ev.request_id, []).append(ev.token_id)
    took = time.perf_counter() - started
    return sum(map(len, out.values())) / took, [out[k] for k in sorted(out)]


async def vllm_generation_tok_s(base: Path, adapter: Path, scratch: Path, tokens: int) -> dict:
    """vLLM serving the adapter unmerged (its LoRA support: the engine restarted with it at
    the first adapter) against a plain vLLM engine serving it merged into the base (the
    worker's `write_merged`, loaded in place): the `generation_jobs`, tokens/s (best of two,
    after a warm-up batch), and whether the tokens agree."""
    from services.rollout.engines.vllm import VLLMEngine, VLLMOptions
    from services.rollout.weight_loader import write_merged

    merged = await asyncio.to_thread(write_merged, base, adapter, scratch, frozenset())
    speeds: dict[str, float] = {}
    tokens_of: dict[str, list[list[int]]] = {}
    for name in ("merged", "lora"):
        engine = VLLMEngine(VLLMOptions(slots=GEN_REQUESTS, kv_cache_gib=0.25))
        try:
            await engine.load(base)
            started = time.perf_counter()
            if name == "merged":
                await engine.load(merged.folder, merged.changed)
            else:
                await engine.load_adapter(1, adapter)
            log(f"vllm {name}: loaded in {time.perf_counter() - started:.1f}s")
            await vllm_tokens_per_s(engine, tokens, "warm")
            runs = [await vllm_tokens_per_s(engine, tokens, str(k)) for k in range(2)]
            speeds[name], tokens_of[name] = max(r[0] for r in runs), runs[-1][1]
        finally:
            await engine.close()
    same = sum(a == b for a, b in zip(tokens_of["lora"], tokens_of["merged"], strict=True))
    return {
        "tok_s_lora": round(speeds["lora"], 1),
        "tok_s_merged": round(speeds["merged"], 1),
        "lora_vs_merged_tok_s": round(speeds["lora"] / speeds["merged"], 3),
        "same_tokens_frac": same / GEN_REQUESTS,
    }


def same_state(workers: list[Worker]) -> bool:
    import torch

    a, b = (w.engine.model.state_dict() for w in workers)
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def rounded(row: dict) -> dict:
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}


def mean(rows: list[dict], key: str) -> float:
    return sum(r[key] for r in rows) / len(rows)


def side_summary(rows: list[dict]) -> dict:
    """Means over the versions after 0 (each loaded by a worker holding the one before)."""
    later = rows[1:]
    keys = ("serve_s", "pull_s", "engine_s", "rest_s", "commit_s")
    return {
        "bytes_per_version": round(mean(later, "bytes")),
        "version_bytes": round(mean(later, "version_bytes")),
        **{k: round(mean(later, k), 4) for k in keys},
        "v0_bytes": rows[0]["version_bytes"],
    }


async def measure_model(name: str, args, r, urls: tuple[str, str], work: Path) -> dict:
    folder = model_folder(name, work / "model")
    sides: dict[str, dict] = {}
    generation: dict = {}
    for side in ("full", "lora"):
        for worker, rows in (await run_side(side, folder, args, r, urls, work)).items():
            if worker == "generation":
                generation = rows[0]
            else:
                sides[worker] = side_summary(rows)
        gc.collect()  # one side's policy and engines gone before the next side's
    full, lora, merged = sides["full"], sides["lora"], sides["lora_merged"]
    out = {
        "adapter_bytes_ratio": round(lora["version_bytes"] / lora["v0_bytes"], 5),
        "serve_s_full": full["serve_s"],
        "serve_s_lora": lora["serve_s"],
        "serve_speedup": round(full["serve_s"] / lora["serve_s"], 3),
        "serve_s_lora_merged": merged["serve_s"],
        "serve_speedup_merged": round(full["serve_s"] / merged["serve_s"], 3),
        "lora_vs_merged_tok_s": generation["lora_vs_merged_tok_s"],
        "generation": generation,
        "bytes_per_version_full": full["bytes_per_version"],
        "bytes_per_version_lora": lora["bytes_per_version"],
        "model_bytes": lora["v0_bytes"],
    }
    if "full_nodelta" in sides:
        nodelta = sides["full_nodelta"]
        out |= {
            "serve_s_full_nodelta": nodelta["serve_s"],
            "serve_speedup_nodelta": round(nodelta["serve_s"] / lora["serve_s"], 3),
            "bytes_per_version_full_nodelta": nodelta["bytes_per_version"],
        }
    return out | {"sides": sides}


async def bench(args) -> dict:
    import torch

    torch.set_num_threads(args.threads)
    shm = Path("/dev/shm")
    in_memory = shm.is_dir() and shutil.disk_usage(shm).free > SHM_ROOM_BYTES
    work = Path(tempfile.mkdtemp(prefix="spotrl-bench-lora-", dir=shm if in_memory else None))
    redis_proc, redis_url = procs.start_redis(work / "redis-log", work / "redis")
    store = start_capped_store(work, args.store_mbps)
    r = aioredis.Redis.from_url(redis_url)
    models = {}
    try:
        for name in args.models.split(","):
            models[name] = await measure_model(name, args, r, (redis_url, store.url), work)
            log(name, json.dumps(models[name]))
    finally:
        await r.aclose()
        store.stop()
        redis_proc.stop()
        shutil.rmtree(work, ignore_errors=True)
    of_model = REAL_MODEL if REAL_MODEL in models else list(models)[-1]
    top = models[of_model]
    where = "in memory (/dev/shm)" if in_memory else "on disk"
    # vLLM's figure: of the real architecture where it was measured on it, else of the first
    measured = [m["generation"]["vllm"] for m in models.values() if "vllm" in m["generation"]]
    on_vllm = top["generation"].get("vllm") or (measured[0] if measured else None)
    return {
        "adapter_bytes_ratio": top["adapter_bytes_ratio"],
        "serve_speedup": top["serve_speedup"],
        "lora_vs_merged_tok_s": {"hf": top["lora_vs_merged_tok_s"]}
        | ({"vllm": on_vllm["lora_vs_merged_tok_s"]} if on_vllm else {}),
        "of_model": of_model,
        "regime": f"CPU ({args.threads} torch threads), loopback, store egress capped at "
        f"{args.store_mbps:g} Mbit/s, work folder {where}",
        "lora_r": args.lora_r,
        "lora_alpha": LORA_ALPHA,
        "lr": args.lr,
        "versions": args.versions,
        "models": models,
    }


def engines_applying(dep) -> list[str]:
    """The engines of the workers whose logs say they served an adapter on their base."""
    found = set()
    for name, proc in dep.procs.items():
        if name.startswith("rollout-") and ADAPTER_LOG in proc.log_tail(4000):
            found.add(dep.launch[name][1].get(ENGINE_ENV, "hf"))
    return sorted(found)


def learning_run(args) -> dict:
    """A LoRA run of the embedded default, every service a real process, one hf worker per pool
    and a vLLM one (`--run-engines`), a preemptible worker SIGKILLed while it holds requests
    mid-step (a new one joins): rewards, the audit (lost, duplicated), the engines that
    served adapters."""
    import redis

    from services.cli.audit import audit_run
    from services.cli.client import CoordinatorClient
    from services.cli.up import ensure_model
    from services.cli.up_summary import summarize
    from services.contracts.runspec import FINAL_STATES, RunSpec
    from tests.harness.deploy import Deployment, DeploymentConfig

    model = ensure_model(Path(".spotrl/models/arithmetic-base"), "arithmetic", None, None)

    def spec_of(steps: int) -> RunSpec:
        return RunSpec(
            model=str(model.resolve()),
            steps=steps,
            lora_r=args.lora_r,
            lora_alpha=LORA_ALPHA,
            learning_rate=args.run_lr,
        )

    spec = spec_of(args.run_steps)
    engines = args.run_engines.split(",")
    with tempfile.TemporaryDirectory(prefix="spotrl-bench-lora-run-") as work:
        config = DeploymentConfig(Path(work), reserved=1, preemptible=0)
        with Deployment(config) as dep, CoordinatorClient(dep.coordinator_url) as client:
            for engine in engines:
                dep.add_worker("preemptible", engine=engine)
            if "vllm" in engines:
                warm_up_vllm(dep, client, spec_of(1000))
            started = time.monotonic()
            run_id = client.submit(spec.model_dump(mode="json"))
            r = redis.Redis.from_url(dep.redis_url)
            killed = kill_mid_step(dep, r, run_id, spec)
            while client.run(run_id)["state"] not in FINAL_STATES:
                time.sleep(0.5)
            run, rows = client.run(run_id), client.metrics(run_id)
            summary = summarize(run, rows, time.monotonic() - started)
            r.close()
            audit = audit_run(dep.redis_url, run_id, spec)
            applied = engines_applying(dep)
            for name, proc in dep.procs.items():  # say why an engine served no adapter
                if not name.startswith("rollout-"):
                    continue
                engine = dep.launch[name][1].get(ENGINE_ENV, "hf")
                if engine not in applied:
                    log(f"{name} ({engine}) served no adapter; its log ends:")
                    log(proc.log_tail(3000))
    return {
        "state": summary["state"],
        "steps": summary["steps"],
        "reward_first10": summary["reward_first10_mean"],
        "reward_last10": summary["reward_last10_mean"],
        "lost": audit["lost"],
        "duplicated": audit["duplicated"],
        "killed": killed,
        "engines": applied,
        "wall_s": summary["wall_s"],
        "step_s_mean": summary["step_s_mean"],
    }


def warm_up_vllm(dep, client, spec, timeout_s: float = 600) -> None:
    """`spec` (a LoRA run of many steps), cancelled once every vLLM worker has started vLLM
    with its LoRA layers (vLLM starts plain; its first adapter restarts it with them, a minute
    or two on CPU): the measured run then finds them ready, as a fleet that served LoRA runs
    is."""
    from services.contracts.runspec import FINAL_STATES

    names = [n for n in dep.procs if dep.launch.get(n, ("", {}))[1].get(ENGINE_ENV) == "vllm"]
    run_id = client.submit(spec.model_dump(mode="json"))
    deadline = time.monotonic() + timeout_s
    ready = lambda n: VLLM_LORA_LOG in dep.procs[n].log_tail(200_000)  # noqa: E731
    while not all(ready(n) for n in names):
        if time.monotonic() > deadline:
            raise TimeoutError(f"vLLM workers {names} never started with LoRA")
        time.sleep(1)
    client.cancel(run_id)
    while client.run(run_id)["state"] not in FINAL_STATES:
        time.sleep(0.2)
    log(f"warm-up run {run_id}: vLLM workers {names} ready with LoRA")


def kill_mid_step(dep, r, run_id: str, spec) -> str:
    """SIGKILL the first preemptible worker (hf) once it holds requests of a step past the
    first few (a new one of its engine joins in its place); the worker's name."""
    from services.contracts import keys

    victim = next(n for n in dep.procs if n.startswith("rollout-preemptible"))
    engine = dep.launch[victim][1].get(ENGINE_ENV, "hf")
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        version = int(r.get(keys.run_version(run_id)) or 0)
        published = r.scard(keys.step_published(run_id, version))
        if version >= KILL_AFTER_STEP and 0 < published < spec.training.prompts_per_step:
            dep.procs[victim].kill()
            log(f"step {version}: {victim} SIGKILLed")
            dep.add_worker("preemptible", wait=False, engine=engine)
            return victim
        time.sleep(0.01)
    raise TimeoutError("never caught the run mid-step")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=f"embedded,{REAL_MODEL}")
    parser.add_argument("--versions", type=int, default=3, help="versions after version 0")
    parser.add_argument("--lora-r", type=int, default=8)
    parser.add_argument("--store-mbps", type=float, default=1000.0, help="store egress cap")
    parser.add_argument("--lr", type=float, default=1e-6, help="AdamW learning rate, both runs")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument(
        "--gen-tokens", type=int, default=32, help="tokens per request, lora_vs_merged_tok_s"
    )
    parser.add_argument(
        "--vllm-models",
        default="embedded",
        help="models whose lora_vs_merged_tok_s is also measured on vLLM ('' : none)",
    )
    parser.add_argument(
        "--no-nodelta",
        dest="nodelta",
        action="store_false",
        help="leave out the full-weight worker that pulls with deltas off",
    )
    parser.add_argument(
        "--run",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the learning run (rewards, a worker SIGKILLed, the engines)",
    )
    parser.add_argument("--run-steps", type=int, default=40)
    parser.add_argument("--run-lr", type=float, default=1e-3, help="the learning run's")
    parser.add_argument(
        "--run-engines", default="hf,vllm", help="the learning run's preemptible workers"
    )
    args = parser.parse_args()
    if args.versions < 1:
        parser.error("--versions: at least 1")
    out = asyncio.run(bench(args))
    if args.run:
        run = learning_run(args)
        log("learning run", json.dumps(run))
        out = (
            {
                k: run[k]
                for k in ("reward_first10", "reward_last10", "lost", "duplicated", "engines")
            }
            | out
            | {"run": run}
        )
    print(json.dumps(out))


if __name__ == "__main__":
    main()
