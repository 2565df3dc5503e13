"""LoRA on the trained policy (peft, the run spec's `lora` section): the adapter that is trained
instead of every weight, what of it a checkpoint holds, and the files of its versions.

peft injects its LoRA layers into the Hugging Face model in place, so the policy keeps scoring
the model object it built (`Adapter.model`) and the optimizer finds the adapter's parameters
only (the base is frozen). The KL term's reference is the same model with the adapter disabled
(`disabled`): no second copy of the base.

A LoRA run's versions: version 0 is the base, a whole Hugging Face folder (`base_tensors`,
named as in the base's own files); every later version is the adapter alone, in PEFT's format
(`files`: `adapter_config.json` and `adapter_model.safetensors`, float32), a few megabytes
whatever the model's size. Workers merge it onto the base they keep (`weights.adapter`).
"""

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save

from services.contracts.runspec import LoraSection
from services.weights.adapter import ADAPTER_CONFIG, ADAPTER_WEIGHTS

ADAPTER = "default"  # peft's name of the one adapter
LORA_MARK = ".lora_"  # in the names of the adapter's own tensors
BASE_LAYER = ".base_layer"  # what peft puts in the name of a wrapped layer's own tensors


class Adapter:
    """The LoRA adapter of one policy's model."""

    def __init__(self, model: torch.nn.Module, section: LoraSection) -> None:
        from peft import LoraConfig, get_peft_model

        config = LoraConfig(
            r=section.lora_r,
            lora_alpha=section.lora_alpha,
            lora_dropout=section.lora_dropout,
            target_modules=section.lora_target_modules,
            bias="none",
            task_type="CAUSAL_LM",
        )
        self.peft: Any = get_peft_model(model, config)  # type: ignore[arg-type]
        self.model = model  # the Hugging Face model, its layers wrapped in place

    @contextlib.contextmanager
    def disabled(self) -> Iterator[None]:
        """The base model alone while inside (the reference of the KL term)."""
        with self.peft.disable_adapter():
            yield

    def trainable_state(self) -> dict[str, torch.Tensor]:
        """The adapter's tensors by the model's own names (what a checkpoint holds of it)."""
        return {k: v for k, v in self.model.state_dict().items() if LORA_MARK in k}

    def load_trainable_state(self, state: dict[str, torch.Tensor]) -> None:
        """Put back what `trainable_state` took: all of it, nothing else."""
        own = self.trainable_state()
        if state.keys() != own.keys():
            missing, unexpected = sorted(own.keys() - state.keys()), sorted(state.keys() - own)
            raise ValueError(
                f"checkpoint does not fit the adapter: missing {missing[:3]}, "
                f"unexpected {unexpected[:3]}"
            )
        self.model.load_state_dict(state, strict=False)

    def base_tensors(self) -> dict[str, torch.Tensor]:
        """The base's weights, named as in its own files (version 0 of a LoRA run)."""
        return {
            k.replace(BASE_LAYER, ""): v
            for k, v in self.model.state_dict().items()
            if LORA_MARK not in k
        }

    def files(self) -> dict[str, bytes]:
        """The adapter as the files of a PEFT adapter folder, in memory."""
        from peft import get_peft_model_state_dict

        tensors = {
            k: v.detach().to("cpu", torch.float32).contiguous()
            for k, v in get_peft_model_state_dict(self.peft, adapter_name=ADAPTER).items()
        }
        config = self.peft.peft_config[ADAPTER].to_dict()
        text = json.dumps(config, indent=2, sort_keys=True, default=json_value)
        return {
            ADAPTER_CONFIG: text.encode(),
            ADAPTER_WEIGHTS: save(tensors, metadata={"format": "pt"}),
        }

    def load(self, folder: Path) -> None:
        """Take the adapter of a committed version (a folder `files` made); a folder of the
        base (version 0) puts the adapter back at its start, where it changes nothing."""
        from peft import set_peft_model_state_dict

        path = Path(folder) / ADAPTER_WEIGHTS
        if not path.exists():
            self.reset()
            return
        tensors = load_file(path)
        own = self.trainable_state()
        if len(tensors) != len(own):
            raise ValueError(f"{path}: {len(tensors)} tensors, the adapter has {len(own)}")
        result = set_peft_model_state_dict(self.peft, tensors, adapter_name=ADAPTER)
        unexpected = getattr(result, "unexpected_keys", [])
        if unexpected:
            raise ValueError(f"{path}: tensors the adapter lacks: {unexpected[:3]}")

    def reset(self) -> None:
        """The adapter at its start: B zero, so the model is its base."""
        with torch.no_grad():
            for name, param in self.model.named_parameters():
                if ".lora_B." in name:
                    param.zero_()


def json_value(value: Any) -> Any:
    """JSON for what peft's config holds beside plain values (sets of module names, enums)."""
    if isinstance(value, set | frozenset):
        return sorted(value)
    return str(value)
