"""A plain transformers/torch engine.

`HFEngine` batches continuously: requests join and leave between decode steps. It keeps one
batched, left-padded KV cache for the running set; when requests leave, their rows are dropped
from the cache (and the leading columns no row uses any more); when requests join, only they are
prefilled, each distinct context once (the n samples of a GRPO group share their prompt: one
row of prefill, its cache rows copied n times), and their rows are left-padded to the running
set's width and appended, while the running rows take their decode step. That is simple and
exact, fine for small models and tests; vLLM (`engines/vllm.py`, with paged attention and its
prefix cache) is the engine for production sizes.

Sampling (`sampling.py`) is reproducible by (request seed, response position), so a
continuation on another worker (prompt + collected prefix) draws what an uninterrupted
generation would have drawn for the same logits; a decode step draws its rows as one batch.

The model runs on the process's compute thread (`step`, `load`; services/infra/compute.py), so
the event loop stays free; only the task that drives the engine calls it.
"""

from pathlib import Path
from typing import Any

import torch

from services.contracts.messages import FinishReason, Job
from services.infra.compute import compute
from services.rollout.engines.base import Sequence, TokenEvent
from services.rollout.engines.sampling import Draw, sample_rows
from services.rollout.engines.tensors import read_tensors


def cache_tokens(job: Job) -> int:
    """The most KV-cache positions a request takes: its context and its whole budget."""
    return len(job.prompt_ids) + len(job.prefix_ids) + job.remaining_tokens


LEFT = ""  # in place of the id of a cache row whose request left (no request id is empty)


def pad_left(t: torch.Tensor, width: int, dim: int) -> torch.Tensor:
    """`t` with zeros before its entries along `dim`, up to `width`."""
    short = width - t.shape[dim]
    if short == 0:
        return t
    shape = list(t.shape)
    shape[dim] = short
    return torch.cat([t.new_zeros(shape), t], dim=dim)


def draw_of(seq: Sequence) -> Draw:
    job = seq.job
    sampling = job.sampling
    context = seq.context if sampling.repetition_penalty != 1.0 else ()
    return Draw(sampling, job.seed, seq.offset, context)


class HFEngine:
    name = "hf"

    def __init__(self, device: str = "cpu", slots: int = 64, kv_cache_tokens: int | None = None):
        self.device = device
        self.capacity = slots
        # the KV cache's bound in token positions: rows x the longest context (left-padded)
        self.kv_cache_tokens = kv_cache_tokens
        self._longest: int | None = None  # the running set's longest cache_tokens (None: stale)
        self.model: Any = None  # a transformers causal LM, once loaded
        self.seqs: dict[str, Sequence] = {}
        self._cache: Any = None  # a transformers DynamicCache of the running set
        self._cache_ids: list[str] = []  # row order of the cache (LEFT: a row that left)
        self._appendable = True  # whether joining rows can be appended to the cache
        # attention mask and last positions of the cache's rows (valid while there is a cache)
        self._attn = torch.zeros((0, 0), dtype=torch.long)
        self._positions = torch.zeros(0, dtype=torch.long)

    # ---- the Engine interface ----
    async def load(self, folder: Path, changed: frozenset[str] | None = None) -> None:
        await compute(self.load_weights, folder, changed)

    async def step(self) -> list[TokenEvent]:
        return await compute(self.decode) if self.seqs else []

    def tokens_left(self, request_id: str) -> int:
        seq = self.seqs.get(request_id)
        return seq.tokens_left if seq else 0

    async def pause(self) -> None:
        """Nothing runs until the next load: give the KV cache's memory back."""
        self._drop_cache()
        if self.device.startswith("cuda"):
            torch.cuda.empty_cache()

    async def close(self) -> None:
        self.abort_all()

    # ---- weights ----
    def load_weights(self, folder: Path, changed: frozenset[str] | None = None) -> None:
        """Serve the weights in `folder`; with `changed` (the names of the tensors that differ
        from the weights held now), read and copy only those, in place."""
        folder = Path(folder)
        if self.model is None:
            from transformers import AutoModelForCausalLM

            self.model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
            self.model.to(self.device).eval()
        elif changed is None:
            self._load_all(folder)
        else:
            self._load_changed(folder, changed)
        self.abort_all()

    def _load_all(self, folder: Path) -> None:
        from safetensors.torch import load_file

        state = {}
        for f in sorted(folder.glob("*.safetensors")):
            state.update(load_file(f, device=self.device))
        missing, unexpected = self.model.load_state_dict(
            {k: v.to(torch.float32) for k, v in state.items()}, strict=False
        )
        if unexpected or any(not k.endswith("rotary_emb.inv_freq") for k in missing):
            raise ValueError(
                f"weights do not fit the model: missing {missing}, unexpected {unexpected}"
            )

    @torch.no_grad()
    def _load_changed(self, folder: Path, changed: frozenset[str]) -> None:
        """Copy the `changed` tensors into the model's own storage. Tied weights share that
        storage (lm_head and embed_tokens), so copying into either name updates both."""
        state = self.model.state_dict()  # tensors sharing the parameters' storage
        unknown = sorted(changed - state.keys())
        if unknown:
            raise ValueError(f"weights do not fit the model: unexpected {unknown}")
        for name, t in read_tensors(folder, changed):
            target = state[name]
            if t.shape != target.shape:
                raise ValueError(f"{name}: shape {tuple(t.shape)}, model {tuple(target.shape)}")
            target.copy_(t.to(device=target.device, dtype=target.dtype))

    # ---- requests ----
    @property
    def active(self) -> int:
        return len(self.seqs)

    def fits(self, job: Job) -> bool:
        """Whether the running set and `job`, each grown to its whole budget, stay within
        `kv_cache_tokens` (the cache is left-padded: rows x the longest); a job larger than
        the whole bound fits an empty engine only."""
        if self.kv_cache_tokens is None or not self.seqs:
            return True
        if self._longest is None:
            self._longest = max(cache_tokens(s.job) for s in self.seqs.values())
        longest = max(self._longest, cache_tokens(job))
        return (len(self.seqs) + 1) * longest <= self.kv_cache_tokens

    def add(self, job: Job) -> None:
        if self.model is None:
            raise RuntimeError("no weights loaded")
        if job.request_id in self._cache_ids:  # a row of an earlier request of that id: gone
            self._cache_ids = [LEFT if r == job.request_id else r for r in self._cache_ids]
        self.seqs[job.request_id] = Sequence(job)
        if self._longest is not None:
            self._longest = max(self._longest, cache_tokens(job))

    def abort(self, request_id: str) -> bool:
        self._longest = None
        return self.seqs.pop(request_id, None) is not None

    def abort_all(self) -> list[str]:
        out = list(self.seqs)
        self.seqs.clear()
        self._longest = None
        self._drop_cache()
        return out

    def _drop_cache(self) -> None:
        self._cache, self._cache_ids = None, []

    # ---- decoding ----
    @torch.inference_mode()
    def decode(self) -> list[TokenEvent]:
        """One decode step for every active request."""
        if not self.seqs:
            return []
        cached = set(self._cache_ids) if self._cache is not None else set()
        running = [rid for rid in self._cache_ids if rid in self.seqs]
        joining = [rid for rid in self.seqs if rid not in cached]
        if joining and not self._appendable:  # a cache whose rows cannot be padded and joined
            running, self._cache, self._cache_ids = [], None, []
            joining = list(self.seqs)
        if not running:
            ids, logits = joining, self._prefill(joining)
        elif not joining:
            ids, logits = running, self._decode(running)
        else:  # the running rows take their step, the joining ones are prefilled beside them
            logits = self._decode(running)
            before = self._cache, self._cache_ids, self._attn, self._positions
            joined = self._prefill(joining)
            self._append_to(*before)
            ids, logits = running + joining, torch.cat([logits, joined])
        seqs = [self.seqs[rid] for rid in ids]
        draws = [draw_of(seq) for seq in seqs]
        events = []
        for rid, seq, (token, logprob) in zip(ids, seqs, sample_rows(logits, draws), strict=True):
            job, offset = seq.job, seq.offset
            seq.generated.append(token)
            reason: FinishReason | None = None
            if token in job.stop_token_ids:
                reason = "stop"
            elif len(seq.generated) >= job.remaining_tokens:
                reason = "length"
            events.append(TokenEvent(rid, job.lease, offset, token, logprob, reason))
            if reason is not None:
                del self.seqs[rid]
                self._longest = None
        return events

    def _prefill(self, ids: list[str]) -> torch.Tensor:
        """Prefill the running set: each distinct context once (a GRPO group's n samples share
        their prompt), its cache rows then copied to every request that holds it."""
        rows_of: dict[tuple[int, ...], int] = {}
        row = [rows_of.setdefault(tuple(self.seqs[rid].context), len(rows_of)) for rid in ids]
        contexts = list(rows_of)
        width = max(len(c) for c in contexts)
        pad = self.model.config.pad_token_id or 0
        input_ids = torch.full((len(contexts), width), pad, dtype=torch.long)
        attn = torch.zeros((len(contexts), width), dtype=torch.long)
        for i, c in enumerate(contexts):
            input_ids[i, width - len(c) :] = torch.tensor(c)
            attn[i, width - len(c) :] = 1
        positions = (attn.cumsum(1) - 1).clamp(min=0)
        from transformers import DynamicCache
        from transformers.cache_utils import DynamicLayer

        cache = DynamicCache()
        out = self.model(
            input_ids=input_ids.to(self.device),
            attention_mask=attn.to(self.device),
            position_ids=positions.to(self.device),
            past_key_values=cache,
            use_cache=True,
        )
        cache, index = out.past_key_values, torch.tensor(row)
        on_device = index.to(self.device)
        if len(contexts) < len(ids):
            cache.batch_select_indices(on_device)
        self._cache, self._cache_ids = cache, ids
        self._attn, self._positions = attn[index], positions[index, -1]
        # full-attention layers only (a sliding window crops its cache itself)
        self._appendable = all(type(layer) is DynamicLayer for layer in cache.layers)
        return out.logits[on_device, -1]

    def _append_to(self, cache: Any, ids: list[str], attn: torch.Tensor, positions: torch.Tensor):
        """Put the cache just prefilled (the joining rows) after `cache`'s rows, the narrower of
        the two left-padded to the other's width, and keep the result as the running set's."""
        width = max(attn.shape[1], self._attn.shape[1])
        for old, new in zip(cache.layers, self._cache.layers, strict=True):
            old.keys = torch.cat([pad_left(old.keys, width, 2), pad_left(new.keys, width, 2)])
            old.values = torch.cat([pad_left(old.values, width, 2), pad_left(new.values, width, 2)])
        self._attn = torch.cat([pad_left(attn, width, 1), pad_left(self._attn, width, 1)])
        self._positions = torch.cat([positions, self._positions])
        self._cache, self._cache_ids = cache, ids + self._cache_ids

    def _decode(self, ids: list[str]) -> torch.Tensor:
        if ids != self._cache_ids:  # some requests left: keep only the rows still running
            rows = torch.tensor([self._cache_ids.index(rid) for rid in ids])
            self._cache.batch_select_indices(rows.to(self.device))
            self._attn, self._positions = self._attn[rows], self._positions[rows]
            self._cache_ids = ids
            self._trim()
        last = torch.tensor([[self.seqs[rid].generated[-1]] for rid in ids])
        self._attn = torch.cat([self._attn, torch.ones((len(ids), 1), dtype=torch.long)], dim=1)
        self._positions = self._positions + 1
        out = self.model(
            input_ids=last.to(self.device),
            attention_mask=self._attn.to(self.device),
            position_ids=self._positions.unsqueeze(1).to(self.device),
            past_key_values=self._cache,
            use_cache=True,
        )
        self._cache = out.past_key_values
        return out.logits[:, -1]

    def _trim(self) -> None:
        """Drop the leading cache columns that no running row attends to any more (they were
        padding for rows that have left)."""
        used = self._attn.any(dim=0).nonzero()
        first = int(used[0]) if len(used) else 0
        if first == 0:
            return
        for layer in self._cache.layers:
            layer.keys = layer.keys[:, :, first:]
            layer.values = layer.values[:, :, first:]
        self._attn = self._attn[:, first:]
