"""Load generation for system benchmarks: the real services with only the model math taken out.

What it gives a benchmark (bench/soak.py; a coordinator-capacity benchmark can build on it):
- `start_stack`: Redis, the weight store and the coordinator as real processes (one thread each),
  torn down by pid.
- `build_tiny_model`: a model folder the coordinator accepts (a character tokenizer for the
  arithmetic task, config.json, a small safetensors file), built in milliseconds.
- `InstantEngine`: an `Engine` that emits one token per running request per `step()` at once.
- `LoadFleet`: real `RolloutWorker`s driving InstantEngines in this process (the tasks the
  rollout service starts), registered with the coordinator over HTTP and pulling every weight
  version from the weight store; `kill` drops one the way SIGKILL does (no flush, no release).
- `NullPolicy` and `TrainerStandIn`: the real `TrainerLoop` with a policy that does no math but
  commits a tiny real weight folder per step.
- `sample_redis`, `key_census`: Redis memory, stream lengths, key count and append-only file
  size; keys by kind, to tell what grows. `LoopLag`: how late this process's event loop runs.
- `freeze_heap`: keep the garbage collector off the imports' objects, so that this process
  generates load instead of walking its heap.

It does not measure generation speed (no model runs), does not restart Redis or services, and
runs every in-process worker and the trainer stand-in on one event loop: under full load that
loop lags (`LoopLag`), which heartbeats must tolerate.
"""

import asyncio
import contextlib
import gc
import json
import logging
import re
import shutil
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import redis.asyncio as aioredis
import torch
from safetensors.torch import load_file, save, save_file

from services.cli import procs
from services.contracts import keys
from services.contracts.messages import FinishReason, Job
from services.contracts.runspec import RunSpec
from services.infra.redis_streams import connect
from services.rollout.engines.base import Sequence, TokenEvent
from services.rollout.settings import RolloutSettings
from services.rollout.worker import RolloutWorker
from services.state.run_state import committed_version
from services.state.step_metrics import StepRow
from services.trainer.checkpoint import read_state, snapshot_of
from services.trainer.loop import TrainerLoop
from services.trainer.settings import TrainerSettings

log = logging.getLogger(__name__)
SPECIALS = ("<pad>", "<eos>", "<unk>")
CHARS = "0123456789+= "
EOS_ID = 1
DIGIT_IDS = tuple(range(len(SPECIALS), len(SPECIALS) + 10))  # what InstantEngine emits
WEIGHTS_FILE = "model.safetensors"
CENSUS_BATCH = 1000  # MEMORY USAGE commands per round trip
RECANCEL_S = 0.5  # a task not gone this long after a cancel is cancelled again


def closed_port() -> int:
    """A loopback port nothing listens on (it was free a moment ago)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# ---- a model folder without a model ----
def build_tiny_model(folder: Path) -> Path:
    """A folder the coordinator and the trainer stand-in accept: a character-level tokenizer
    covering the arithmetic task, config.json (eos, pad) and one small safetensors file."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    vocab = {tok: i for i, tok in enumerate([*SPECIALS, *CHARS])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.save(str(folder / "tokenizer.json"))
    config = {
        "model_type": "spotrl-null",
        "vocab_size": len(vocab),
        "eos_token_id": EOS_ID,
        "pad_token_id": 0,
        "max_position_embeddings": 1 << 20,
    }
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    save_file({"step": torch.zeros(4)}, folder / WEIGHTS_FILE, metadata={"format": "pt"})
    return folder


# ---- the rollout side ----
class InstantEngine:
    """One token per running request per `step()`, at once: token ids are digits drawn from the
    request's seed and position (never a stop id), logprob -1.0; a request ends on a stop id or
    when its budget is spent. `load` only records the folder."""

    name = "instant"

    max_adapters = 0  # no LoRA adapters held: a worker merges them into the weights

    def __init__(self, slots: int) -> None:
        self.capacity = slots
        self.seqs: dict[str, Sequence] = {}
        self.folder: Path | None = None
        self.loads = 0

    @property
    def active(self) -> int:
        return len(self.seqs)

    async def load(self, folder: Path, changed: frozenset[str] | None = None) -> None:
        self.folder = Path(folder)
        self.loads += 1
        self.abort_all()

    def fits(self, job: Job) -> bool:
        return True  # no memory to run out of

    def add(self, job: Job, adapter: int | None = None) -> None:
        if self.folder is None:
            raise RuntimeError("no weights loaded")
        self.seqs[job.request_id] = Sequence(job)

    def abort(self, request_id: str) -> bool:
        return self.seqs.pop(request_id, None) is not None

    def abort_all(self) -> list[str]:
        out = list(self.seqs)
        self.seqs.clear()
        return out

    def tokens_left(self, request_id: str) -> int:
        seq = self.seqs.get(request_id)
        return seq.tokens_left if seq else 0

    async def step(self) -> list[TokenEvent]:
        await asyncio.sleep(0)  # let the other workers and the trainer run between steps
        events, done = [], []
        for rid, seq in self.seqs.items():
            job, generated = seq.job, seq.generated
            offset = len(job.prefix_ids) + len(generated)
            token = DIGIT_IDS[(job.seed * 1_000_003 + offset) % len(DIGIT_IDS)]
            generated.append(token)
            reason: FinishReason | None = None
            if token in job.stop_token_ids:
                reason = "stop"
            elif len(generated) >= job.remaining_tokens:
                reason = "length"
            events.append(TokenEvent(rid, job.lease, offset, token, -1.0, reason))
            if reason is not None:
                done.append(rid)
        for rid in done:
            del self.seqs[rid]
        return events

    async def pause(self) -> None:
        return None

    async def close(self) -> None:
        self.abort_all()


class TaskDied(RuntimeError):
    """A task of an in-process worker or of the trainer stand-in died of an error."""


class Supervised:
    """Background tasks whose first error is kept, for `check()` to raise."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.tasks: list[asyncio.Task] = []
        self.error: BaseException | None = None
        self.recancels = 0  # cancellations a task swallowed (and got again)

    def spawn(self, what: str, loop: Callable[[], Awaitable[None]]) -> None:
        task = asyncio.create_task(loop(), name=f"{self.name}:{what}")
        task.add_done_callback(self._done)
        self.tasks.append(task)

    def _done(self, task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None and self.error is None:
            self.error = task.exception()
            log.error("%s died", task.get_name(), exc_info=self.error)

    def check(self) -> None:
        if self.error is not None:
            raise TaskDied(f"{self.name}: {self.error!r}") from self.error

    async def cancel(self, timeout_s: float = 10.0) -> None:
        """Cancel every task and wait for them, cancelling again any that swallowed it (on
        Python 3.11 `asyncio.wait_for`, which redis-py sends through, drops a cancellation
        that lands as its wait ends)."""
        deadline = time.monotonic() + timeout_s
        pending = {t for t in self.tasks if not t.done()}
        while pending:
            for task in pending:
                task.cancel()
            _, pending = await asyncio.wait(pending, timeout=RECANCEL_S)
            for task in pending:
                self.recancels += 1
                log.warning(
                    "%s still runs after a cancel, now at %s", task.get_name(), awaits(task)
                )
            if pending and time.monotonic() > deadline:
                raise TaskDied(f"{self.name}: tasks would not stop: {pending}")


def awaits(task: asyncio.Task) -> str:
    """Where a task waits: the chain of coroutines it awaits, as function:line."""
    where, coro = [], task.get_coro()
    while coro is not None:
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
        if frame is None:
            break
        where.append(f"{frame.f_code.co_name}:{frame.f_lineno}")
        coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
    return " > ".join(where)


@dataclass
class FleetConfig:
    redis_url: str
    coordinator_url: str
    weightstore_url: str
    cache_dir: Path
    slots: int = 512
    flush_tokens: int = 4
    heartbeat_s: float = 0.5
    heartbeat_ttl_s: float = 2.0
    step_delay_ms: float = 0.0  # sleep after each decode step (0: full speed)
    pool: str = "preemptible"
    prefix: str = "load"


class LoadWorker(Supervised):
    """One RolloutWorker on an InstantEngine, with the tasks the rollout service starts."""

    def __init__(self, settings: RolloutSettings) -> None:
        super().__init__(settings.worker_id)
        self.r = connect(settings.redis_url, ca_file=settings.tls_ca_file)
        self.worker = RolloutWorker(settings, self.r, engine=InstantEngine(settings.slots))

    def start(self) -> None:
        w = self.worker
        self.spawn("jobs", lambda: w.reporting_crash(w.jobs_forever))
        self.spawn("generate", lambda: w.reporting_crash(w.generate_forever, True))
        self.spawn("heartbeat", w.heartbeat_forever)

    async def kill(self) -> None:
        """Gone like SIGKILL: nothing flushed or released; its heartbeat expires. Its Redis
        connections are cut first, and new ones lead nowhere: a task that swallows the cancel
        (redis-py's wait_for on Python 3.11 can) must not go on flushing tokens and finish the
        jobs the coordinator has to take back, as a killed process could not."""
        self.r.connection_pool.connection_kwargs["port"] = closed_port()
        await self.r.connection_pool.disconnect()
        await self.cancel()
        await self.r.aclose()


@dataclass
class LoadFleet:
    """In-process load workers that come and go; each new one has a new id."""

    config: FleetConfig
    workers: list[LoadWorker] = field(default_factory=list)
    started: int = 0
    kills: int = 0
    tokens_of_dead: int = 0
    recancels: int = 0  # cancellations the workers' tasks swallowed (see Supervised.cancel)
    killed: list[str] = field(default_factory=list)
    gone: list[str] = field(default_factory=list)  # every worker stopped here, killed or closed
    held_at_kill: list[int] = field(default_factory=list)  # requests each victim held

    def add(self) -> LoadWorker:
        self.started += 1
        c = self.config
        settings = RolloutSettings(
            redis_url=c.redis_url,
            coordinator_url=c.coordinator_url,
            weightstore_url=c.weightstore_url,
            worker_id=f"{c.prefix}-{self.started}",
            pool=c.pool,
            slots=c.slots,
            flush_tokens=c.flush_tokens,
            heartbeat_s=c.heartbeat_s,
            heartbeat_ttl_s=c.heartbeat_ttl_s,
            step_delay_ms=c.step_delay_ms,
            cache_dir=c.cache_dir,
        )
        worker = LoadWorker(settings)
        worker.start()
        self.workers.append(worker)
        return worker

    async def kill_oldest(self) -> str:
        """Kill the longest-running worker (its weights cache goes too); its id."""
        victim = self.workers.pop(0)
        self.held_at_kill.append(victim.worker.busy)
        await victim.kill()
        self.recancels += victim.recancels
        self.kills += 1
        self.killed.append(victim.name)
        self.gone.append(victim.name)
        self.tokens_of_dead += victim.worker.tokens_generated
        folder = self.config.cache_dir / victim.name
        await asyncio.to_thread(_remove_tree, folder)
        return victim.name

    async def replace_oldest(self) -> tuple[str, str]:
        """Kill the oldest worker and start another under a new id: (killed, started)."""
        killed = await self.kill_oldest()
        return killed, self.add().name

    def oldest_busy(self) -> bool:
        """Whether the next victim holds requests (a kill then has jobs to reclaim)."""
        return bool(self.workers) and self.workers[0].worker.busy > 0

    @property
    def tokens_generated(self) -> int:
        return self.tokens_of_dead + sum(w.worker.tokens_generated for w in self.workers)

    def check(self) -> None:
        for w in self.workers:
            w.check()

    async def close(self) -> None:
        while self.workers:
            worker = self.workers.pop(0)
            await worker.kill()
            self.recancels += worker.recancels
            self.gone.append(worker.name)


def _remove_tree(folder: Path) -> None:
    shutil.rmtree(folder, ignore_errors=True)


# ---- the trainer side ----
class NullPolicy:
    """What TrainerLoop calls on a policy, with no model: counts what it is given and exports
    a tiny real weight folder (the model folder's config and tokenizer, one safetensors file
    holding the step number) so that every version goes through the weight store."""

    def __init__(self, model_dir: Path, spec: RunSpec, device: str = "cpu") -> None:
        self.model_dir = Path(model_dir)
        self.spec = spec
        self.steps = 0
        self.groups = self.sequences = self.tokens = 0

    def accumulate(self, groups: list) -> None:
        for group in groups:
            self.groups += 1
            self.sequences += len(group.responses)
            self.tokens += sum(len(r.token_ids) for r in group.responses)

    def optimizer_step(self) -> StepRow:
        stats = StepRow(
            policy_loss=0.0,
            kl=0.0,
            grad_norm=0.0,
            trained_sequences=self.sequences,
            trained_tokens=self.tokens,
        )
        self.steps += 1
        self.groups = self.sequences = self.tokens = 0
        return stats

    def snapshot(self, folder: Path) -> Callable[[], None]:
        return snapshot_of({"steps": self.steps}, folder)

    def restore(self, folder: Path) -> None:
        self.steps = int(read_state(folder)["steps"])

    def load_weights(self, folder: Path) -> None:
        self.steps = int(load_file(Path(folder) / WEIGHTS_FILE)["step"][0])

    def export_files(self, version: int) -> dict[str, bytes]:
        weights = torch.full((4,), float(self.steps))
        files = {WEIGHTS_FILE: save({"step": weights}, metadata={"format": "pt"})}
        for name in ("config.json", "tokenizer.json"):
            files[name] = (self.model_dir / name).read_bytes()
        return files


class TrainerStandIn(Supervised):
    """The real TrainerLoop (`forever`) with NullPolicy, in this process."""

    def __init__(self, redis_url: str, weightstore_url: str, work_dir: Path) -> None:
        super().__init__("trainer")
        self.settings = TrainerSettings(
            redis_url=redis_url,
            weightstore_url=weightstore_url,
            work_dir=work_dir,
            checkpoint_every=100_000,  # no torch checkpoint per step (one at exit, tiny)
        )
        self.r = connect(redis_url)
        self.loop = TrainerLoop(self.settings, self.r, policy_factory=NullPolicy)

    def start(self) -> None:
        self.spawn("loop", self.loop.forever)

    async def stop(self) -> None:
        await self.cancel()
        await self.r.aclose()


class LoopLag:
    """How late this event loop runs a task that asks to wake every `period_s`: a loop held by
    one task (a big decode, say) delays every other one, heartbeats included."""

    def __init__(self, period_s: float = 0.05) -> None:
        self.period_s = period_s
        self.max_s = 0.0  # since the last `take()`
        self.task: asyncio.Task | None = None

    def start(self) -> None:
        self.task = asyncio.create_task(self._forever(), name="loop-lag")

    async def _forever(self) -> None:
        while True:
            before = time.monotonic()
            await asyncio.sleep(self.period_s)
            self.max_s = max(self.max_s, time.monotonic() - before - self.period_s)

    def take(self) -> float:
        """The largest lag since the last call, in seconds."""
        out, self.max_s = self.max_s, 0.0
        return out

    async def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)


def freeze_heap() -> int:
    """Move every object alive now (the imports: torch, pydantic, fastapi...) out of the
    garbage collector's sight; the number frozen. Without it each full collection walks them
    all: a quarter-second pause of this event loop, every second or so, under load."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


# ---- the services ----
@dataclass
class Stack:
    """Redis, the weight store and the coordinator, each a process of its own."""

    work_dir: Path
    redis_dir: Path
    redis_url: str
    weightstore_url: str
    coordinator_url: str
    processes: dict[str, procs.Proc]

    def check_alive(self) -> None:
        for p in self.processes.values():
            if not p.alive():
                raise procs.died(p)

    def stop(self) -> None:
        """Coordinator and weight store first, then Redis (it writes out its append-only file)."""
        for name in ("coordinator", "weightstore", "redis"):
            if name in self.processes:
                self.processes[name].stop()


def start_stack(
    work_dir: Path,
    appendonly: bool = True,
    coordinator_env: dict[str, str] | None = None,
    timeout_s: float = 120.0,
) -> Stack:
    """Start Redis (append-only file on: as docker compose runs it), the weight store and the
    coordinator, one thread each; returns once every one answers. Stops them if one fails."""
    work_dir = Path(work_dir).resolve()
    log_dir, redis_dir = work_dir / "logs", work_dir / "redis"
    started: dict[str, procs.Proc] = {}
    stack = Stack(work_dir, redis_dir, "", "", "", started)
    try:
        started["redis"], stack.redis_url = procs.start_redis(
            log_dir, redis_dir, appendonly=appendonly
        )
        ws_port, co_port = procs.free_port(), procs.free_port()
        stack.weightstore_url = f"http://127.0.0.1:{ws_port}"
        stack.coordinator_url = f"http://127.0.0.1:{co_port}"
        env = procs.thread_env(1) | {
            "SPOTRL_REDIS_URL": stack.redis_url,
            "SPOTRL_WEIGHTSTORE_URL": stack.weightstore_url,
            "SPOTRL_COORDINATOR_URL": stack.coordinator_url,
        }
        started["weightstore"] = procs.start_service(
            "weightstore",
            "services.weightstore.main",
            env | {"SPOTRL_PORT": str(ws_port), "SPOTRL_ROOT": str(work_dir / "weights")},
            log_dir,
            ws_port,
        )
        started["coordinator"] = procs.start_service(
            "coordinator",
            "services.coordinator.main",
            env | {"SPOTRL_PORT": str(co_port)} | (coordinator_env or {}),
            log_dir,
            co_port,
        )
        procs.wait_healthy(list(started.values()), timeout_s)
    except BaseException:
        stack.stop()
        raise
    return stack


def log_findings(log_path: Path, gone: list[str]) -> dict:
    """From a coordinator's log: the workers it declared dead that were not `gone` (their
    heartbeat came late), and its error lines."""
    text = Path(log_path).read_text(errors="replace")
    declared = set(re.findall(r"worker (\S+) missed its heartbeat", text))
    errors = [line for line in text.splitlines() if " ERROR " in line or " CRITICAL " in line]
    return {
        "declared_dead": sorted(declared),
        "declared_dead_alive": sorted(declared - set(gone)),
        "error_lines": errors,
    }


async def read(http: httpx.AsyncClient, path: str, tries: int = 4) -> httpx.Response:
    """GET, tried again on a transport error: a server closes an idle keep-alive connection
    (uvicorn after 5 s) just as a sampler that runs every 5 s reuses it."""
    for attempt in range(tries - 1):
        try:
            return (await http.get(path)).raise_for_status()
        except httpx.TransportError:
            await asyncio.sleep(0.1 * (attempt + 1))
    return (await http.get(path)).raise_for_status()  # the last try: its error goes up


async def coordinator_tokens(http: httpx.AsyncClient) -> float:
    """Response tokens the coordinator collected (`spotrl_coordinator_tokens_total`)."""
    resp = await read(http, "/metrics")
    for line in resp.text.splitlines():
        if line.startswith("spotrl_coordinator_tokens_total "):
            return float(line.split()[1])
    return 0.0


# ---- what Redis holds ----
def aof_bytes(redis_dir: Path) -> int:
    """Size of the append-only file: Redis 7 keeps several under appendonlydir/."""
    files = list(Path(redis_dir).glob("appendonly*"))
    files += list((Path(redis_dir) / "appendonlydir").glob("*"))
    total = 0
    for f in files:
        with contextlib.suppress(FileNotFoundError):  # a rewrite may replace it meanwhile
            if f.is_file():
                total += f.stat().st_size
    return total


def key_kind(key: str, run_id: str) -> str:
    """A key's name with the run id and every number replaced: spotrl:run:R:step:N:requests."""
    return re.sub(r"\d+", "N", key.replace(run_id, "R"))


async def key_census(r: aioredis.Redis, run_id: str) -> dict[str, dict[str, int]]:
    """Keys by kind (`key_kind`): how many, and the bytes Redis says they take."""
    names = [raw async for raw in r.scan_iter(count=1000)]
    kinds: dict[str, dict[str, int]] = {}
    for at in range(0, len(names), CENSUS_BATCH):
        batch = names[at : at + CENSUS_BATCH]
        async with r.pipeline(transaction=False) as pipe:
            for raw in batch:
                pipe.memory_usage(raw)
            sizes = await pipe.execute()
        for raw, size in zip(batch, sizes, strict=True):
            kind = kinds.setdefault(key_kind(raw.decode(errors="replace"), run_id), {})
            kind["keys"] = kind.get("keys", 0) + 1
            kind["bytes"] = kind.get("bytes", 0) + (size or 0)  # None: gone meanwhile
    return dict(sorted(kinds.items()))


def census_growth(first: dict, last: dict) -> dict[str, dict[str, int]]:
    """The kinds of key with more keys or bytes in `last` than in `first`: the deltas."""
    grown = {}
    for kind, now in last.items():
        was = first.get(kind, {"keys": 0, "bytes": 0})
        if now["keys"] > was["keys"] or now["bytes"] > was["bytes"]:
            grown[kind] = {"keys": now["keys"] - was["keys"], "bytes": now["bytes"] - was["bytes"]}
    return grown


async def sample_redis(r: aioredis.Redis, run_id: str, redis_dir: Path) -> dict:
    """One sample: memory, the run's stream lengths, keys, AOF size."""
    memory = await r.info("memory")
    version = await committed_version(r, run_id)
    async with r.pipeline(transaction=False) as pipe:
        pipe.xlen(keys.deltas_stream(run_id))
        pipe.xlen(keys.groups_stream(run_id))
        pipe.xlen(keys.jobs_stream(run_id, version or 0))
        pipe.dbsize()
        deltas, groups, jobs, dbsize = await pipe.execute()
    return {
        "at": time.time(),
        "version": version,
        "used_memory": int(memory["used_memory"]),
        "used_memory_rss": int(memory["used_memory_rss"]),
        "deltas_len": deltas,
        "groups_len": groups,
        "jobs_len": jobs,
        "keys": dbsize,
        "aof_bytes": await asyncio.to_thread(aof_bytes, redis_dir),
    }
