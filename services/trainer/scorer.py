"""The forward a policy trains through: `ResponseScorer`, one module from token ids to the
logprobs of the response tokens (the decoder's last hidden states, then the LM head at the
response's positions only, `logprob_chunk_tokens` at a time), and `score`, which runs it on a
micro-batch under the precision the run asks for. sharded.py shards the same module over N
ranks. No optimizer and no loss here (policy.py, grpo.py).
"""

import contextlib
from typing import Any

import torch

from services.contracts.runspec import RunSpec
from services.trainer.batching import MicroBatch
from services.trainer.grpo import response_logprobs


class ResponseScorer(torch.nn.Module):
    """A causal LM's logprobs of response tokens, as one module: the decoder's last hidden
    states, then the LM head at the response's positions only, in chunks
    (grpo.response_logprobs). One module, so that a sharded model's root is this one: its
    forward gathers the embeddings and the LM head, which the head's chunks use directly."""

    def __init__(self, lm: torch.nn.Module, spec: RunSpec, softcap: float | None) -> None:
        super().__init__()
        self.lm: Any = lm  # a transformers causal LM
        self.temperature = spec.sampling.temperature
        self.chunk_tokens = spec.training.logprob_chunk_tokens
        self.softcap = softcap

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        position_ids: torch.Tensor | None,
        positions: torch.Tensor,
        targets: torch.Tensor,
        mask: torch.Tensor,
    ) -> torch.Tensor:
        out = self.lm.base_model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=False,
        )
        hidden = out.last_hidden_state
        head = self.lm.get_output_embeddings()
        return response_logprobs(
            hidden.reshape(-1, hidden.shape[-1]),
            head.weight,
            head.bias,
            positions,
            targets,
            mask,
            self.temperature,
            self.chunk_tokens,
            self.softcap,
        )


def score(scorer: ResponseScorer, batch: MicroBatch, device: str, autocast: bool) -> torch.Tensor:
    """[N, T] logprobs of the micro-batch's response tokens under the scorer's model, computed
    in bfloat16 autocast with `autocast`."""
    precision = (
        torch.autocast(torch.device(device).type, dtype=torch.bfloat16)
        if autocast
        else contextlib.nullcontext()
    )
    with precision:
        # no attention mask even when padded: rows are right-padded and attention is causal,
        # so no token of a sequence sees a pad, and sdpa may take its causal kernels (flash
        # on a GPU) instead of a masked one; pads' own states are never read
        return scorer(
            batch.input_ids.to(device),
            None,
            _to(batch.position_ids, device),
            batch.positions.to(device),
            batch.targets.to(device),
            batch.mask.to(device),
        )


def compile_layers(model: torch.nn.Module) -> None:
    """torch.compile each decoder layer in place: the layers run the same code, so one compiled
    graph serves all of them (their parameters are its inputs); the embeddings, the LM head's
    chunks and the loss stay eager."""
    layers = getattr(model.base_model, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise ValueError(f"torch_compile: {type(model).__name__} has no list of decoder layers")
    for layer in layers:
        layer.compile()


def _to(t: torch.Tensor | None, device: str) -> torch.Tensor | None:
    return None if t is None else t.to(device)
