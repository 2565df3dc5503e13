"""LoRA adapters held by the transformers engine beside its base weights and applied row by row
(issue 51): several adapter versions in one batch, each row with its own, no merge, no reload.

peft computes a wrapped linear layer as `W x + scaling * B (A x)`. `RowAdapters` holds, per
version, the (A, B) pair of every layer its adapter wraps, and adds one forward hook to each
such layer of the model: before a forward pass the engine names each batch row's version
(`rows`; None: the base alone), and the hook adds `scaling * (x A^T) B^T` to the rows of each
version, the rows of one version computed together (one matmul pair per version and layer, so
a batch of one version costs what an unmerged peft model costs). The base weights are never
written: loading an adapter is reading megabytes and moving them to the device.

An adapter is read and checked by `services.weights.adapter.read_adapter` (what cannot be
applied exactly, DoRA, rank or alpha patterns, non-LoRA tensors, is refused with the reason),
then against the model: every layer it wraps must be an `nn.Linear` whose weight has B @ A's
shape. At most `capacity` versions are held; one more drops the oldest that no running row
uses (the caller says which are in use), and where every one is in use, it is refused.

It decides which adapters are held and what each row adds; the engine decides which rows run.
"""

from collections.abc import Iterable, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from services.weights.adapter import read_adapter


class RowAdapters:
    def __init__(self, model: Any, capacity: int, device: str = "cpu") -> None:
        self.model, self.capacity, self.device = model, capacity, device
        # version -> (scaling, {module name: (A [r x in], B [out x r])}), oldest first
        self.held: dict[int, tuple[float, dict[str, tuple[torch.Tensor, torch.Tensor]]]] = {}
        self._hooks: dict[str, Any] = {}  # module name -> its forward hook's handle
        # the forward pass under way: (version, row indices or None for every row) per version
        self._groups: list[tuple[int, torch.Tensor | None]] = []

    def load(self, version: int, folder: Path, in_use: Iterable[int]) -> int | None:
        """Hold the adapter in `folder` as `version`'s; the version dropped to make room, if
        any. A ValueError where it does not fit the model or no held one is free."""
        adapter = read_adapter(folder)
        pairs = {}
        for weight_name, (a, b) in adapter.pairs.items():
            module = weight_name.removesuffix(".weight")
            layer = self._layer(module)
            if tuple(layer.weight.shape) != (b.shape[0], a.shape[1]):
                raise ValueError(
                    f"{module}: base shape {tuple(layer.weight.shape)}, adapter B @ A "
                    f"{(b.shape[0], a.shape[1])}"
                )
            dtype = layer.weight.dtype
            pairs[module] = (a.to(self.device, dtype), b.to(self.device, dtype))
        dropped = None
        if version not in self.held and len(self.held) >= self.capacity:
            used = set(in_use)
            free = [v for v in self.held if v not in used]
            if not free:
                raise ValueError(
                    f"adapter v{version}: all {self.capacity} held adapters "
                    f"({sorted(self.held)}) are in use by running requests; set "
                    "SPOTRL_MAX_LORAS to at least the run's max_staleness + 1"
                )
            dropped = free[0]
            self.drop(dropped)
        self.held.pop(version, None)
        self.held[version] = (adapter.scaling, pairs)
        for module in pairs:
            if module not in self._hooks:
                self._hooks[module] = self._layer(module).register_forward_hook(self._hook(module))
        return dropped

    def drop(self, version: int) -> None:
        self.held.pop(version, None)
        wrapped = {m for _, pairs in self.held.values() for m in pairs}
        for module in [m for m in self._hooks if m not in wrapped]:
            self._hooks.pop(module).remove()

    def clear(self) -> None:
        for version in list(self.held):
            self.drop(version)

    @property
    def newest(self) -> int | None:
        return next(reversed(self.held), None)

    @contextmanager
    def rows(self, versions: Sequence[int | None]):
        """Within it, the model's forward passes apply to batch row i the adapter of
        `versions[i]` (None: none)."""
        unknown = {v for v in versions if v is not None} - self.held.keys()
        if unknown:
            raise ValueError(f"no adapter held for versions {sorted(unknown)}")
        groups: list[tuple[int, torch.Tensor | None]] = []
        distinct = dict.fromkeys(v for v in versions if v is not None)
        for version in distinct:
            if all(v == version for v in versions):
                groups.append((version, None))
            else:
                index = [i for i, v in enumerate(versions) if v == version]
                groups.append((version, torch.tensor(index, device=self.device)))
        self._groups = groups
        try:
            yield
        finally:
            self._groups = []

    def _hook(self, module: str):
        def add_lora(_layer: Any, args: tuple, out: torch.Tensor) -> torch.Tensor:
            x = args[0]
            for version, index in self._groups:
                scaling, pairs = self.held[version]
                pair = pairs.get(module)
                if pair is None:
                    continue
                a, b = pair
                if index is None:
                    out = out + scaling * ((x @ a.T) @ b.T)
                else:
                    out = out.index_add(0, index, scaling * ((x[index] @ a.T) @ b.T))
            return out

        return add_lora

    def _layer(self, module: str) -> torch.nn.Linear:
        try:
            layer = self.model.get_submodule(module)
        except AttributeError:
            raise ValueError(f"adapter wraps {module}, which the model lacks") from None
        if not isinstance(layer, torch.nn.Linear):
            raise ValueError(f"adapter wraps {module}, a {type(layer).__name__}, not a Linear")
        return layer
