"""The engine interface of a rollout worker, shared by every generation backend.

A worker drives its engine from one asyncio task: it adds token-level jobs (prompt + already
collected prefix + remaining budget + sampling parameters), awaits `step()` for the tokens
generated since the last call, aborts requests whose lease moved on, loads each new weight
version from the folder it pulled, and pauses the engine (freeing its memory where the platform
can) when a reserved worker steps aside for training.

LoRA: an engine with `max_adapters` > 0 holds adapters beside its base (`load_adapter`) and
applies each request's own, several versions in one batch; the worker's `weight_loader` loads
an adapter version so, and merges it into the base for an engine that cannot.

Backends: `hf.HFEngine` (transformers, exact and simple) and `vllm.VLLMEngine`; `factory`
builds the one the settings name. This module holds only the interface and the types every
backend shares: it imports no backend, and no model library.
"""

from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from services.contracts.messages import FinishReason, Job

BASE_ONLY = 0  # `Engine.add`'s adapter: none, the base alone, whatever adapters are held


@dataclass
class TokenEvent:
    request_id: str
    lease: int
    offset: int  # position of this token in the response
    token_id: int
    # under the distribution it was drawn from: after the repetition penalty, temperature, top-k
    # and top-p (renormalised over the tokens they keep)
    logprob: float
    finish_reason: FinishReason | None  # set on the request's last token
    # speculative decoding (the first token a forward pass kept for a drafted request): the
    # draft tokens that pass verified, and how many of them were the engine's own draws
    drafted: int = 0
    accepted: int = 0


@dataclass
class Sequence:
    job: Job
    generated: list[int] = field(default_factory=list)
    adapter: int | None = None  # the version of the LoRA adapter it generates with (None: none)

    @property
    def context(self) -> list[int]:
        return self.job.prompt_ids + self.job.prefix_ids + self.generated

    @property
    def offset(self) -> int:
        return len(self.job.prefix_ids) + len(self.generated)

    @property
    def tokens_left(self) -> int:
        return self.job.remaining_tokens - len(self.generated)


class Engine(Protocol):
    name: str
    capacity: int  # most requests generated at once
    # LoRA (issue 51): the most adapter versions held at once (`load_adapter`); 0: the engine
    # applies no adapter itself (a worker then merges each adapter into the base and loads that)
    max_adapters: int
    # adapters kept even where no running request uses them: those a worker's runs add their
    # next requests under (`shared.SharedEngine`); a load that needs room drops another
    keep_adapters: set[int]

    @property
    def active(self) -> int: ...

    async def load(self, folder: Path, changed: frozenset[str] | None = None) -> None:
        """Serve the weights in `folder` (a Hugging Face folder). The first call builds the
        engine; later calls replace the weights in place. Requests still running are aborted:
        every token of a request must come from its job's version, and caches of the old
        weights are dropped.

        `changed`: the names of the tensors (as in the safetensors files) that differ from the
        weights held now, so only those need loading; None: unknown, load them all (the first
        call always loads all). An empty set still aborts and drops caches: the version moved."""

    async def load_adapter(self, version: int, folder: Path) -> None:
        """Hold the LoRA adapter in `folder` (PEFT format: adapter_config.json and
        adapter_model.safetensors) as `version`'s, applied on the base weights held (the last
        whole `load`), without reloading them; requests added from now on generate with it
        unless `add` names another. Requests running keep the adapter they were added with.
        One more than `max_adapters` drops the oldest that no running request uses and
        `keep_adapters` does not name; a
        ValueError where every one is in use, or the adapter does not fit the base (it names
        what). A whole `load` drops every adapter."""

    def add(self, job: Job, adapter: int | None = None) -> None:
        """Start `job`; under the adapter of version `adapter` (one held: a ValueError
        otherwise), None: the newest loaded since the last whole load (none: the base),
        `BASE_ONLY`: the base alone."""

    def fits(self, job: Job) -> bool:
        """Whether `job` can start now without the engine outgrowing its memory bound (it
        waits otherwise); an engine that manages its own memory always says yes."""

    def abort(self, request_id: str) -> bool:
        """Stop a request and free its slot; no event of it follows. False if unknown."""

    def abort_all(self) -> list[str]: ...

    async def step(self) -> list[TokenEvent]:
        """The tokens generated since the last call (waits for some while requests run)."""

    def tokens_left(self, request_id: str) -> int: ...

    async def pause(self) -> None:
        """Nothing runs until the next `load`: free what memory the platform allows."""

    async def close(self) -> None: ...
