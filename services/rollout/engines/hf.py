"""A plain transformers/torch engine.

`HFEngine` batches continuously: requests join and leave between decode steps. It keeps one
batched KV cache for the running set; when requests leave, their rows are dropped from the
cache; when requests join, the whole batch is prefilled again (left-padded). That is simple and
exact, fine for small models and tests; vLLM (`engines/vllm.py`) is the engine for production sizes.

Sampling is reproducible: the token at response position k of a request is drawn with a
generator seeded by (request seed, k), so a continuation on another worker (prompt + collected
prefix) draws what an uninterrupted generation would have drawn for the same logits. It applies,
in vLLM's order, the repetition penalty (over the prompt and the response so far), then greedy
or the temperature, top-k and top-p; each token's logprob is under the distribution it was drawn
from (renormalised over what top-k and top-p keep), as vLLM's "processed_logprobs" are.

The model runs in a worker thread (`step`, `load`), so the event loop stays free; only the task
that drives the engine calls it.
"""

import asyncio
import math
from collections.abc import Collection
from pathlib import Path
from typing import Any

import torch

from services.common.messages import FinishReason, Job
from services.rollout.engines.base import Sequence, TokenEvent


def penalise_repeats(
    logits: torch.Tensor, context: Collection[int], penalty: float
) -> torch.Tensor:
    """The repetition penalty of transformers and vLLM: the logit of every token in `context`
    divided by `penalty` where positive, multiplied by it where negative."""
    if penalty == 1.0 or not context:
        return logits
    seen = torch.tensor(sorted(set(context)), dtype=torch.long, device=logits.device)
    scores = logits[seen]
    return logits.index_copy(0, seen, torch.where(scores > 0, scores / penalty, scores * penalty))


def keep_likeliest(logp: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Log-probs renormalised over the tokens top-k keeps (ties with the k-th included), then
    over those top-p keeps of these (the fewest likeliest whose mass reaches top_p); -inf
    elsewhere."""
    if 0 < top_k < logp.numel():
        kth = torch.topk(logp, top_k).values[-1]
        logp = torch.log_softmax(logp.masked_fill(logp < kth, -math.inf), dim=-1)
    if top_p < 1.0:
        sorted_logp, order = torch.sort(logp, descending=True)
        p = sorted_logp.exp()
        dropped = order[torch.cumsum(p, 0) - p >= top_p]
        logp = torch.log_softmax(logp.index_fill(0, dropped, -math.inf), dim=-1)
    return logp


def sample_token(
    logits: torch.Tensor,
    temperature: float,
    top_p: float,
    seed: int,
    position: int,
    *,
    top_k: int = 0,
    repetition_penalty: float = 1.0,
    context: Collection[int] = (),
) -> tuple[int, float]:
    """Draw one token from a row of logits, `context` being the tokens before it (prompt and
    response); returns (token, its logprob under the distribution it was drawn from; greedy:
    under the penalised logits)."""
    logits = penalise_repeats(logits.float(), context, repetition_penalty)
    if temperature == 0:
        logp = torch.log_softmax(logits, dim=-1)
        token = int(torch.argmax(logp))
        return token, float(logp[token])
    logp = keep_likeliest(torch.log_softmax(logits / temperature, dim=-1), top_k, top_p)
    # The generator lives on the CPU, so the draw is drawn there too: the same token on every
    # device (a continuation on another worker, CPU or CUDA, reproduces the draw exactly).
    gen = torch.Generator().manual_seed((seed * 1_000_003 + position) & 0x7FFF_FFFF_FFFF)
    token = int(torch.multinomial(logp.exp().cpu(), 1, generator=gen))
    return token, float(logp[token])


class HFEngine:
    name = "hf"

    def __init__(self, device: str = "cpu", slots: int = 64) -> None:
        self.device = device
        self.capacity = slots
        self.model: Any = None  # a transformers causal LM, once loaded
        self.seqs: dict[str, Sequence] = {}
        self._cache: Any = None  # a transformers DynamicCache of the running set
        self._cache_ids: list[str] = []  # row order of the cache
        # attention mask and last positions of the cache's rows (valid while there is a cache)
        self._attn = torch.zeros((0, 0), dtype=torch.long)
        self._positions = torch.zeros(0, dtype=torch.long)

    # ---- the Engine interface ----
    async def load(self, folder: Path) -> None:
        await asyncio.to_thread(self.load_weights, folder)

    async def step(self) -> list[TokenEvent]:
        return await asyncio.to_thread(self.decode) if self.seqs else []

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
    def load_weights(self, folder: Path) -> None:
        from safetensors.torch import load_file
        from transformers import AutoModelForCausalLM

        folder = Path(folder)
        if self.model is None:
            self.model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
            self.model.to(self.device).eval()
        else:
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
        self.abort_all()

    # ---- requests ----
    @property
    def active(self) -> int:
        return len(self.seqs)

    def add(self, job: Job) -> None:
        if self.model is None:
            raise RuntimeError("no weights loaded")
        self.seqs[job.request_id] = Sequence(job)
        self._drop_cache()

    def abort(self, request_id: str) -> bool:
        return self.seqs.pop(request_id, None) is not None

    def abort_all(self) -> list[str]:
        out = list(self.seqs)
        self.seqs.clear()
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
        ids = list(self.seqs)
        if self._cache is not None and set(ids) <= set(self._cache_ids):
            logits = self._decode(ids)
        else:
            logits = self._prefill(ids)
        events = []
        for row, rid in enumerate(ids):
            seq = self.seqs[rid]
            job = seq.job
            offset = seq.offset
            token, logprob = sample_token(
                logits[row],
                job.temperature,
                job.top_p,
                job.seed,
                offset,
                top_k=job.top_k,
                repetition_penalty=job.repetition_penalty,
                context=seq.context if job.repetition_penalty != 1.0 else (),
            )
            seq.generated.append(token)
            reason: FinishReason | None = None
            if token in job.stop_token_ids:
                reason = "stop"
            elif len(seq.generated) >= job.remaining_tokens:
                reason = "length"
            events.append(TokenEvent(rid, job.lease, offset, token, logprob, reason))
            if reason is not None:
                del self.seqs[rid]
        return events

    def _prefill(self, ids: list[str]) -> torch.Tensor:
        contexts = [self.seqs[rid].context for rid in ids]
        width = max(len(c) for c in contexts)
        pad = self.model.config.pad_token_id or 0
        input_ids = torch.full((len(ids), width), pad, dtype=torch.long)
        attn = torch.zeros((len(ids), width), dtype=torch.long)
        for i, c in enumerate(contexts):
            input_ids[i, width - len(c) :] = torch.tensor(c)
            attn[i, width - len(c) :] = 1
        positions = (attn.cumsum(1) - 1).clamp(min=0)
        from transformers import DynamicCache

        cache = DynamicCache()
        out = self.model(
            input_ids=input_ids.to(self.device),
            attention_mask=attn.to(self.device),
            position_ids=positions.to(self.device),
            past_key_values=cache,
            use_cache=True,
        )
        self._cache, self._cache_ids = out.past_key_values, ids
        self._attn, self._positions = attn, positions[:, -1]
        return out.logits[:, -1]

    def _decode(self, ids: list[str]) -> torch.Tensor:
        if ids != self._cache_ids:  # some requests left: keep only the rows still running
            rows = torch.tensor([self._cache_ids.index(rid) for rid in ids])
            self._cache.batch_select_indices(rows.to(self.device))
            self._attn, self._positions = self._attn[rows], self._positions[rows]
            self._cache_ids = ids
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
