"""How a run's responses are sampled: one class for the run spec's `sampling` section, the `Job`
a worker runs, the coordinator's request table and both engines.

`SamplingParams` is a frozen (pydantic) dataclass so that both worlds take it as it is: pydantic
validates it inside `RunSpec` and on construction (bounds, no unknown field, no NaN), and
msgspec encodes and decodes it inside a `Job` (checking the same bounds, from `msgspec.Meta`;
msgspec skips fields it does not know in a dataclass, and does not call `__init__`).

Not here: the per-request seed and stop tokens and the tokens a job has left (`Job`'s own).
"""

from typing import Annotated

import msgspec
from pydantic import ConfigDict, Field
from pydantic.dataclasses import dataclass

MAX_NEW_TOKENS = 131072


@dataclass(frozen=True, kw_only=True, config=ConfigDict(extra="forbid", allow_inf_nan=False))
class SamplingParams:
    max_new_tokens: Annotated[
        int,
        Field(ge=1, le=MAX_NEW_TOKENS, description="Response token budget."),
        msgspec.Meta(ge=1, le=MAX_NEW_TOKENS),
    ] = 8
    temperature: Annotated[
        float,
        Field(ge=0.0, le=10.0, description="Sampling temperature; 0 = greedy."),
        msgspec.Meta(ge=0.0, le=10.0),
    ] = 1.0
    top_p: Annotated[
        float,
        Field(gt=0.0, le=1.0, description="Nucleus sampling mass."),
        msgspec.Meta(gt=0.0, le=1.0),
    ] = 1.0
    top_k: Annotated[
        int,
        Field(ge=0, le=1_000_000, description="Sample among the k likeliest tokens (0: all)."),
        msgspec.Meta(ge=0, le=1_000_000),
    ] = 0
    repetition_penalty: Annotated[
        float,
        Field(
            gt=0.0,
            le=10.0,
            description="Penalise tokens already in the prompt or response: their positive "
            "logits divided by it, negative ones multiplied (> 1: fewer repeats; 1: off), as "
            "transformers and vLLM do.",
        ),
        msgspec.Meta(gt=0.0, le=10.0),
    ] = 1.0
    ignore_eos: Annotated[
        bool, Field(description="Generate max_new_tokens, ignoring end-of-text.")
    ] = False

    @property
    def plain(self) -> bool:
        """Sampled at a temperature with no filter (no top-k, top-p or repetition penalty)."""
        return (
            self.temperature > 0
            and self.top_k == 0
            and self.top_p >= 1.0
            and self.repetition_penalty == 1.0
        )
