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

Both directions are made from plain state dicts of the model's own names (`base_of`,
`files_of`, `read`), so that a sharded policy (sharded.py), which gathers its full tensors to
rank 0 and broadcasts a version's from there, writes and reads the very files one process does.
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
        # what peft's names put before the model's own ("base_model.model.")
        self._prefix = next(n for n, m in self.peft.named_modules() if m is model) + "."

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
        return self.base_of(self.model.state_dict())

    @staticmethod
    def base_of(state: dict[str, Any]) -> dict[str, Any]:
        """The base's weights in `state` (a full state dict of the model, by its own names),
        named as in the base's own files: the adapter's tensors left out, peft's ".base_layer"
        taken out of the names of the layers it wraps."""
        return {k.replace(BASE_LAYER, ""): v for k, v in state.items() if LORA_MARK not in k}

    def files(self) -> dict[str, bytes]:
        """The adapter as the files of a PEFT adapter folder, in memory."""
        return self.files_of(self.trainable_state())

    def files_of(self, state: dict[str, torch.Tensor]) -> dict[str, bytes]:
        """The files of a PEFT adapter folder holding the adapter's tensors of `state` (a state
        dict of the model by its own names, whole tensors: all of it, or the adapter's part)."""
        tensors = {
            k: v.detach().to("cpu", torch.float32).contiguous()
            for k, v in self._file_tensors(state).items()
        }
        config = self.peft.peft_config[ADAPTER].to_dict()
        text = json.dumps(config, indent=2, sort_keys=True, default=json_value)
        return {
            ADAPTER_CONFIG: text.encode(),
            ADAPTER_WEIGHTS: save(tensors, metadata={"format": "pt"}),
        }

    def _file_tensors(self, state: dict[str, Any]) -> dict[str, Any]:
        """The adapter's entries of `state` (the model's own names) by their names in PEFT's
        files, as peft names them. Only the adapter's own tensors: a LoRA run never trains the
        base, so its embeddings are not saved even where the adapter wraps them."""
        from peft import get_peft_model_state_dict

        return get_peft_model_state_dict(
            self.peft,
            state_dict={self._prefix + k: v for k, v in state.items()},
            adapter_name=ADAPTER,
            save_embedding_layers=False,
        )

    def read(self, folder: Path) -> dict[str, torch.Tensor] | None:
        """The adapter's tensors of a committed version's folder (one `files` made), by the
        model's own names; None for a folder of the base (version 0). A file that does not fit
        the adapter (a tensor too many or too few, a name it lacks) is a ValueError."""
        path = Path(folder) / ADAPTER_WEIGHTS
        if not path.exists():
            return None
        tensors = load_file(path)
        own = list(self.trainable_state())
        if len(tensors) != len(own):
            raise ValueError(f"{path}: {len(tensors)} tensors, the adapter has {len(own)}")
        # each tensor's name in the files, found by writing its index under its own name
        named = self._file_tensors({k: torch.tensor(i) for i, k in enumerate(own)})
        own_name = {file_name: own[int(index)] for file_name, index in named.items()}
        unknown = sorted(tensors.keys() - own_name.keys())
        if unknown:
            raise ValueError(f"{path}: tensors the adapter lacks: {unknown[:3]}")
        return {own_name[k]: v for k, v in tensors.items()}

    def load(self, folder: Path) -> None:
        """Take the adapter of a committed version (a folder `files` made); a folder of the
        base (version 0) puts the adapter back at its start, where it changes nothing."""
        tensors = self.read(folder)
        if tensors is None:
            self.reset()
        else:
            self.load_trainable_state(tensors)

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
