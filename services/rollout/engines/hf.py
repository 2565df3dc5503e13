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

Speculative decoding, exact: a job may carry reference token sequences (`Job.drafts`: its
group's finished siblings, earlier responses to the same prompt), and the engine adds its prompt
to them. Each step, a running request with references proposes up to `draft_tokens` tokens from
them (`rollout/drafts.py`: what followed the longest suffix of its context found there), and
every running row is fed 1 + k tokens in the one forward pass of the step: its last token, its
draft (k = the most any row drafts), and padding the attention mask hides. Each position is
drawn as a plain step draws it (`speculation.draws_at`: the same seeded number, penalties and
filters), and a row keeps its draws up to the first that differs from its draft, that one
included, so 1 to k + 1 tokens per pass, each the token plain decoding would draw (up to float
noise in the logits of a wider pass: a draw lands on another token only where its number falls
within that noise of a boundary of the cumulative distribution). The cache columns of the rejected
draft tokens (and the padding) are then hidden by the attention mask, where they leave holes
(positions are explicit, so a hole changes nothing but the cache's width); once the holes widen
the cache by more than a quarter of its longest row, it is compacted (`speculation.compact`: one
copy, each row's kept columns moved to its right end), so the cache stays at most that much
wider than plain decoding's, and a step costs no copy of it beyond the cache's own append. A
separate verify pass for the drafted rows would need a cache apart from the running set's; one
pass with padded rows keeps the batch whole. Rows without a draft take a plain step in
the same pass; with no draft in the step, the step is the plain one. Stop tokens and the token
budget end a request at the token where plain decoding ends it (a draft never passes the budget).
`spec_stats` counts drafted and accepted tokens and forward passes. A wider pass costs more (on
CPU, compute): `gate` (`speculation.DraftGate`) lets a step draft only when its drafts are
expected to add more tokens than widening every row costs, from the share of drafted tokens
kept so far, so drafts that keep missing (4-token answers, an untrained model) stop slowing
decoding and come back once they pay.

The model runs on the process's compute thread (`step`, `load`; services/infra/compute.py), so
the event loop stays free; only the task that drives the engine calls it.
"""

import logging
from contextlib import nullcontext
from pathlib import Path
from typing import Any
from weakref import WeakValueDictionary

import torch

from services.contracts.messages import FinishReason, Job
from services.infra.compute import compute
from services.infra.gpu import require_device
from services.rollout.drafts import DraftIndex
from services.rollout.engines.base import BASE_ONLY, Sequence, TokenEvent
from services.rollout.engines.lora_rows import RowAdapters
from services.rollout.engines.sampling import sample_rows
from services.rollout.engines.speculation import (
    COLUMN_COST,
    COLUMN_COST_ACCELERATOR,
    DraftGate,
    SpecStats,
    compact,
    draws_at,
    hide_rejected,
    holes,
    kept_tokens,
)
from services.rollout.engines.tensors import read_tensors, same_model, tensor_shapes

log = logging.getLogger(__name__)

DRAFT_TOKENS = 4  # most draft tokens a request verifies per step, by default
# the cache is compacted once its hidden columns pass this share of its longest row and HOLES_MIN
HOLES_SHARE = 0.25
HOLES_MIN = 16


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


class HFEngine:
    name = "hf"

    def __init__(
        self,
        device: str = "cpu",
        slots: int = 64,
        kv_cache_tokens: int | None = None,
        draft_tokens: int = DRAFT_TOKENS,
        column_cost: float | None = None,
        max_adapters: int = 4,
    ):
        if not 0 <= draft_tokens <= 64:
            raise ValueError(f"draft_tokens must be within 0..64, not {draft_tokens}")
        self.device = device
        self.capacity = slots
        self.max_adapters = max_adapters  # LoRA adapter versions held at once (lora_rows)
        self.adapters: RowAdapters | None = None  # once the model is loaded
        self.keep_adapters: set[int] = set()  # kept though no running request uses them
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
        self.draft_tokens = draft_tokens  # most draft tokens verified per request and step (0: off)
        self._drafts: dict[str, DraftIndex] = {}  # the running requests that have references
        # one index per distinct (prompt, references): a group's requests share theirs
        self._indexes: WeakValueDictionary[tuple, DraftIndex] = WeakValueDictionary()
        self.spec_stats = SpecStats()  # the engine's, since it was built
        # whether a step drafts: `column_cost` None takes the device's (0: always)
        cost = (
            COLUMN_COST.get(device, COLUMN_COST_ACCELERATOR) if column_cost is None else column_cost
        )
        self.gate = DraftGate(cost)
        self.request_stats: dict[str, SpecStats] = {}  # each running request's

    # ---- the Engine interface ----
    async def load(self, folder: Path, changed: frozenset[str] | None = None) -> None:
        await compute(self.load_weights, folder, changed)

    async def load_adapter(self, version: int, folder: Path) -> None:
        await compute(self.hold_adapter, version, folder)

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
        require_device(self.device)
        folder = Path(folder)
        if self.model is not None and changed is None and not self._holds_model_of(folder):
            log.info("%s holds weights of another model (another base): building it", folder)
            self.abort_all()
            self.model, self.adapters = None, None
        if self.model is None:
            from transformers import AutoModelForCausalLM

            self.model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
            self.model.to(self.device).eval()
            self.adapters = RowAdapters(self.model, self.max_adapters, self.device)
        elif changed is None:
            self._load_all(folder)
        else:
            self._load_changed(folder, changed)
        self.abort_all()
        if self.adapters is not None:
            self.adapters.clear()  # adapters of the weights held before

    def _holds_model_of(self, folder: Path) -> bool:
        """Whether `folder` holds weights of the model held, not another base's."""
        held = {name: tuple(t.shape) for name, t in self.model.state_dict().items()}
        return same_model(held, tensor_shapes(folder))

    def hold_adapter(self, version: int, folder: Path) -> None:
        """Hold the LoRA adapter in `folder` as `version`'s (`lora_rows.RowAdapters`): the
        requests added from now on generate with it, the running ones keep theirs."""
        if self.adapters is None:
            raise RuntimeError("no weights loaded: an adapter needs its base first")
        if not self.max_adapters:
            raise ValueError("this engine holds no adapters (SPOTRL_MAX_LORAS is 0)")
        in_use = {s.adapter for s in self.seqs.values() if s.adapter is not None}
        self.adapters.load(version, Path(folder), in_use | self.keep_adapters)

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

    def add(self, job: Job, adapter: int | None = None) -> None:
        if self.model is None or self.adapters is None:
            raise RuntimeError("no weights loaded")
        if adapter is None:
            adapter = self.adapters.newest
        elif adapter == BASE_ONLY:
            adapter = None
        elif adapter not in self.adapters.held:
            raise ValueError(f"{job.request_id}: no adapter held for version {adapter}")
        if job.request_id in self._cache_ids:  # a row of an earlier request of that id: gone
            self._cache_ids = [LEFT if r == job.request_id else r for r in self._cache_ids]
        self.seqs[job.request_id] = Sequence(job, adapter=adapter)
        self.request_stats[job.request_id] = SpecStats()
        self.set_drafts(job.request_id, job.drafts)
        if self._longest is not None:
            self._longest = max(self._longest, cache_tokens(job))

    def set_drafts(self, request_id: str, drafts: list[list[int]]) -> None:
        """Draft a running request from `drafts` (its prompt added) from its next step on, in
        place of what it drafted from (as siblings finish); [] or `draft_tokens` 0: no drafts."""
        seq = self.seqs.get(request_id)
        if seq is None or not drafts or not self.draft_tokens:
            self._drafts.pop(request_id, None)
            return
        references = [seq.job.prompt_ids, *drafts]
        key = tuple(tuple(r) for r in references)
        index = self._indexes.get(key)
        if index is None:
            index = self._indexes[key] = DraftIndex(references)
        self._drafts[request_id] = index

    def abort(self, request_id: str) -> bool:
        self._longest = None
        self._forget(request_id)
        return self.seqs.pop(request_id, None) is not None

    def _forget(self, request_id: str) -> None:
        self._drafts.pop(request_id, None)
        self.request_stats.pop(request_id, None)

    def abort_all(self) -> list[str]:
        out = list(self.seqs)
        self.seqs.clear()
        self._drafts.clear()
        self.request_stats.clear()
        self._longest = None
        self._drop_cache()
        return out

    def _drop_cache(self) -> None:
        self._cache, self._cache_ids = None, []

    # ---- decoding ----
    @torch.inference_mode()
    def decode(self) -> list[TokenEvent]:
        """One decode step for every active request (with drafts: 1 to k + 1 tokens each)."""
        if not self.seqs:
            return []
        cached = set(self._cache_ids) if self._cache is not None else set()
        running = [rid for rid in self._cache_ids if rid in self.seqs]
        joining = [rid for rid in self.seqs if rid not in cached]
        if joining and not self._appendable:  # a cache whose rows cannot be padded and joined
            running, self._cache, self._cache_ids = [], None, []
            joining = list(self.seqs)
        drafts = self._drafts_of(running)
        width = 1 + max((len(d) for d in drafts.values()), default=0)
        counted = self.spec_stats.drafted, self.spec_stats.accepted
        if not running:
            ids, logits = joining, self._prefill(joining)
        elif not joining:
            ids, logits = running, self._decode(running, drafts, width)
        else:  # the running rows take their step, the joining ones are prefilled beside them
            logits = self._decode(running, drafts, width)
            before = self._cache, self._cache_ids, self._attn, self._positions
            joined = self._prefill(joining)
            self._append_to(*before)
            ids, logits = running + joining, torch.cat([logits, joined])
        draws = [draws_at(self.seqs[rid], drafts.get(rid, [])) for rid in ids]
        drawn = sample_rows(logits, [d for row in draws for d in row])
        events: list[TokenEvent] = []
        kept, at = [], 0
        for rid, row in zip(ids, draws, strict=True):
            draft = drafts.get(rid, [])
            kept.append(
                self._emit(rid, draft, kept_tokens(draft, drawn[at : at + len(row)]), events)
            )
            at += len(row)
        if running:
            self._settle(kept[: len(running)], width)
        stats = self.spec_stats
        self.gate.observe(stats.drafted - counted[0], stats.accepted - counted[1])
        return events

    def _drafts_of(self, running: list[str]) -> dict[str, list[int]]:
        """The running requests' drafts for this step, none where the gate says drafting
        would not pay."""
        drafts = {rid: d for rid in running if (d := self._propose(rid))}
        if not drafts:
            return drafts
        width = 1 + max(len(d) for d in drafts.values())
        drafted = sum(len(d) for d in drafts.values())
        return drafts if self.gate.drafts(drafted, len(running), width) else {}

    def _propose(self, rid: str) -> list[int]:
        """A running request's draft for this step: [] without references, and never more
        tokens than its budget leaves after the one a plain step draws."""
        index = self._drafts.get(rid)
        if index is None or not self._appendable:
            return []
        seq = self.seqs[rid]
        k = min(self.draft_tokens, seq.tokens_left - 1)
        n = index.max_ngram  # the context's tail is all a match looks at
        tail = seq.generated[-n:] if len(seq.generated) >= n else seq.context[-n:]
        return index.propose(tail, k, position=seq.offset)

    def _emit(
        self, rid: str, draft: list[int], tokens: list[tuple[int, float]], events: list[TokenEvent]
    ) -> int:
        """Append a request's kept tokens and their events, up to a stop token or its budget
        (where it then finishes); how many it appended."""
        seq = self.seqs[rid]
        job = seq.job
        n = 0
        for token, logprob in tokens:
            offset = seq.offset
            seq.generated.append(token)
            n += 1
            reason: FinishReason | None = None
            if token in job.stop_token_ids:
                reason = "stop"
            elif len(seq.generated) >= job.remaining_tokens:
                reason = "length"
            events.append(TokenEvent(rid, job.lease, offset, token, logprob, reason))
            if reason is not None:
                del self.seqs[rid]
                self._longest = None
                break
        accepted = sum(1 for (t, _), d in zip(tokens[:n], draft, strict=False) if t == d)
        if draft and n:
            first = events[-n]
            first.drafted, first.accepted = len(draft), accepted
        for stats in (self.spec_stats, self.request_stats[rid]):
            stats.add(len(draft), accepted, n)
        if rid not in self.seqs:
            self._forget(rid)
        return n

    def _prefill(self, ids: list[str]) -> torch.Tensor:
        """Prefill the running set: each distinct context once (a GRPO group's n samples share
        their prompt), its cache rows then copied to every request that holds it."""
        rows_of: dict[tuple[int | None, tuple[int, ...]], int] = {}
        keys = [(self.seqs[rid].adapter, tuple(self.seqs[rid].context)) for rid in ids]
        row = [rows_of.setdefault(key, len(rows_of)) for key in keys]
        contexts = [context for _, context in rows_of]
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
        with self._adapters_of([adapter for adapter, _ in rows_of]):
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

    def _decode(self, ids: list[str], drafts: dict[str, list[int]], width: int) -> torch.Tensor:
        """The running rows' forward pass, each fed its last token and its draft (padded to
        `width`); the logits of every fed position but the padding, row by row."""
        if ids != self._cache_ids:  # some requests left: keep only the rows still running
            rows = torch.tensor([self._cache_ids.index(rid) for rid in ids])
            self._cache.batch_select_indices(rows.to(self.device))
            self._attn, self._positions = self._attn[rows], self._positions[rows]
            self._cache_ids = ids
            self._trim()
        pad = self.model.config.pad_token_id or 0
        fed = torch.full((len(ids), width), pad, dtype=torch.long)
        valid = torch.zeros((len(ids), width), dtype=torch.long)
        for i, rid in enumerate(ids):
            tokens = [self.seqs[rid].generated[-1], *drafts.get(rid, [])]
            fed[i, : len(tokens)] = torch.tensor(tokens)
            valid[i, : len(tokens)] = 1
        self._attn = torch.cat([self._attn, valid], dim=1)
        positions = self._positions.unsqueeze(1) + torch.arange(1, width + 1)
        with self._adapters_of([self.seqs[rid].adapter for rid in ids]):
            out = self.model(
                input_ids=fed.to(self.device),
                attention_mask=self._attn.to(self.device),
                position_ids=positions.to(self.device),
                past_key_values=self._cache,
                use_cache=True,
            )
        self._cache = out.past_key_values
        if width == 1:
            return out.logits[:, -1]
        row, col = valid.nonzero(as_tuple=True)  # row-major: each row's positions in order
        return out.logits[row.to(self.device), col.to(self.device)]

    def _adapters_of(self, versions: list[int | None]):
        """The model's forward passes within apply row i's adapter, `versions[i]`'s."""
        if self.adapters is None or not self.adapters.held:
            return nullcontext()
        return self.adapters.rows(versions)

    def _settle(self, kept: list[int], width: int) -> None:
        """After a step that fed the running rows (the cache's first rows) `width` tokens each:
        each row's position moves on by the tokens it kept, and the cache columns of the ones
        it did not keep (rejected draft tokens, padding) are hidden from attention; once the
        hidden columns widen the cache past `HOLES_SHARE` of its longest row (and `HOLES_MIN`),
        the cache is compacted (one copy of it)."""
        keep = torch.tensor(kept, dtype=torch.long)
        self._positions = torch.cat(
            [self._positions[: len(kept)] + keep, self._positions[len(kept) :]]
        )
        if width == 1:
            return
        hide_rejected(self._attn, keep, width)
        longest = int(self._attn.shape[1]) - holes(self._attn)
        if holes(self._attn) > max(HOLES_MIN, longest * HOLES_SHARE):
            self._attn = compact(self._cache.layers, self._attn)
            self._trim()

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
