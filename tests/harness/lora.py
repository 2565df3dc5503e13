"""LoRA runs' weights for tests (issue 51): a tiny Qwen2 base and peft adapters of it whose
lora_B weights are random, so that an adapter changes every weight it wraps (peft starts
lora_B at zero). peft builds them."""

from pathlib import Path
from typing import Any

import torch

INPUT_IDS = [[1, 5, 9, 2, 33, 17, 4]]  # what the tests compare logits on


def tiny_qwen2(seed: int = 0, hidden_size: int = 32) -> Any:
    """An untrained Qwen2 causal LM: hidden 32 (or `hidden_size`), 2 layers, a vocabulary of
    64, float32."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=64,
        hidden_size=hidden_size,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    )
    return Qwen2ForCausalLM(config).eval()


def lora_of(base: Path, seed: int, **config: Any) -> Any:
    """A peft model of the base saved in `base`: LoRA r 4, alpha 8 on every Linear (with
    `config` over that), lora_B drawn with `seed`."""
    import peft
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    lora = peft.LoraConfig(**({"r": 4, "lora_alpha": 8, "target_modules": "all-linear"} | config))
    wrapped = peft.get_peft_model(model, lora).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in wrapped.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=g) * 0.2)
    return wrapped


def logits(model: Any) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.tensor(INPUT_IDS)).logits
