"""Builds the engine the worker's settings name. A backend's module (and its model library:
torch and transformers, or vLLM) is imported only when that backend is built.
It does not load weights: the worker's first `load` does."""

from typing import TYPE_CHECKING

from services.rollout.engines.base import Engine

if TYPE_CHECKING:
    from services.rollout.settings import RolloutSettings


def make_engine(settings: "RolloutSettings") -> Engine:
    if settings.engine == "vllm":
        from services.rollout.engines.vllm import VLLMEngine, VLLMOptions

        return VLLMEngine(VLLMOptions.from_settings(settings))
    from services.rollout.engines.hf import HFEngine

    return HFEngine(
        settings.device,
        settings.slots,
        settings.kv_cache_tokens,
        settings.draft_tokens,
        settings.draft_column_cost,
        settings.max_loras,
    )
