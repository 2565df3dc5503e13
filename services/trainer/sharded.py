"""The policy over N ranks (torchrun): FSDP2 (`fully_shard` per decoder layer, then the whole
model), each rank training its share of every micro-batch.

Every rank holds the same bookkeeping as a single-process `Policy` (ranks.py hands each rank
the same calls with the same groups, so each cuts the same micro-batches); only the passes
differ: rank r trains rows r, r + N, ... of each micro-batch, and the gradients are summed
over the ranks. Every aggregation of grpo.py is a sum over responses once bnpo is told the
whole micro-batch's sizes, so the summed gradient is the single process's, up to float
rounding (tests/integration/test_trainer_ranks.py). A rank with no row of a micro-batch
still runs a pass, weighted 0: FSDP's all-gathers and reduce-scatters are collective.

Weights leave as a full state dict gathered to rank 0 (exports); a committed version comes in
on rank 0 and is broadcast; checkpoints are torch.distributed.checkpoint folders, every rank
writing its shards in the background (`dcp.async_save` on a process group of its own, so that
the write's collectives never meet the training's).

LoRA: peft wraps the model's layers in place before they are sharded, so a decoder layer's unit
holds its frozen base weights beside its adapter's (FSDP2 shards both; gradients flow, and are
reduced, for the adapter's only, the optimizer's only parameters). Its versions are the files
one process makes (lora.py): version 0 the base, gathered whole; later ones the adapter alone,
only its tensors gathered. A checkpoint holds the adapter's shards and their optimizer state,
as one process's holds the adapter: the base never changes.
"""

import datetime
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from services.contracts.runspec import RunSpec
from services.trainer.batching import Row
from services.trainer.checkpoint import serialize
from services.trainer.export import DTYPES, weight_files
from services.trainer.grpo import StepSize
from services.trainer.lora import LORA_MARK, Adapter
from services.trainer.policy import Policy, ResponseScorer
from services.trainer.stats import PassStats

EXTRA_FILE = "extra.pt"  # the schedule's position and rank 0's RNG, beside the DCP files
FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)
# what rank 0 found in a LoRA version's folder, broadcast: every rank does the same with it
BASE_FOLDER, ADAPTER_FOLDER, REFUSED_FOLDER = 0, 1, 2


class ShardedPolicy(Policy):
    def __init__(self, model_dir: Path, spec: RunSpec, device: str) -> None:
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.mesh = init_device_mesh(torch.device(device).type, (self.world,))
        # checkpoint writes run their collectives in a thread: on a group of their own
        self.ckpt_group = dist.new_group(backend="gloo", timeout=datetime.timedelta(hours=2))
        self._writing: Callable[[], None] | None = None
        super().__init__(model_dir, spec, device)

    def _place(self, scorer: ResponseScorer) -> ResponseScorer:
        """Each decoder layer a unit, then the scorer (embeddings, final norm, LM head)."""
        layers = getattr(scorer.lm.base_model, "layers", None)
        for layer in layers if isinstance(layers, torch.nn.ModuleList) else []:
            fully_shard(layer, mesh=self.mesh)
        fully_shard(scorer, mesh=self.mesh)
        return scorer

    def _backward(
        self, rows: list[Row], size: StepSize, adv_scale: float, stats: PassStats
    ) -> None:
        mine = rows[self.rank :: self.world]
        # FSDP averages the ranks' gradients (gloo cannot pre-scale a sum): x world to sum them
        weight = float(self.world)
        if not mine:  # a pass all the same, weighted 0
            mine, weight = rows[:1], 0.0
        whole = (len(rows), sum(r.generated_tokens for r in rows))  # observations not trained
        parts = self._loss(mine, size, adv_scale, whole)
        (parts.loss * weight).backward()
        if weight:
            stats.add(parts, len(mine))

    def _gather(self, passes: list[PassStats]) -> list[PassStats]:
        fields = ("sequences", "tokens", "policy_loss", "kl", "clipped_tokens")
        sums = torch.tensor(
            [[float(getattr(p, f)) for f in fields] for p in passes], dtype=torch.float64
        )
        dist.all_reduce(sums)  # a CPU tensor: gloo (cpu:gloo beside cuda:nccl on GPUs)
        return [
            PassStats(int(row[0]), int(row[1]), float(row[2]), float(row[3]), float(row[4]))
            for row in sums.tolist()
        ]

    # weights in and out: full state dicts, on rank 0

    def load_weights(self, folder: Path) -> None:
        """Rank 0 reads the version's files and broadcasts them; the other ranks' `folder` is
        not read. With LoRA, the adapter's tensors (or, for the base's folder, the adapter put
        back at its start on every rank)."""
        from safetensors.torch import load_file

        if self.adapter is not None:
            self._load_adapter(self.adapter, folder)
            return
        tensors: dict[str, Any] = {}
        if self.rank == 0:
            for path in sorted(Path(folder).glob("*.safetensors")):
                tensors.update({k: v.float() for k, v in load_file(path).items()})
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        set_model_state_dict(self.model, tensors, options=options)

    def _load_adapter(self, adapter: Adapter, folder: Path) -> None:
        """Rank 0 reads the folder (`Adapter.read`) and tells the ranks what it found: an
        adapter, broadcast into the shards of its tensors; the base's folder, the adapter reset
        on every rank; a file that does not fit the adapter, nothing changed on any rank and
        the ValueError raised on rank 0 (the caller's; a follower carries on)."""
        tensors: dict[str, Any] = {}
        refusal: ValueError | None = None
        found = torch.tensor([BASE_FOLDER])
        if self.rank == 0:
            try:
                read = adapter.read(folder)
            except ValueError as exc:
                refusal, found[0] = exc, REFUSED_FOLDER
            else:
                if read is not None:
                    tensors, found[0] = {k: v.float() for k, v in read.items()}, ADAPTER_FOLDER
        dist.broadcast(found, src=0)  # a CPU tensor: gloo
        if refusal is not None:
            raise refusal
        if int(found) == BASE_FOLDER:
            adapter.reset()
        elif int(found) == ADAPTER_FOLDER:  # the base's shards are left as they are
            options = StateDictOptions(
                full_state_dict=True, broadcast_from_rank0=True, strict=False
            )
            set_model_state_dict(self.model, tensors, options=options)

    def export_files(self, version: int) -> dict[str, bytes]:
        """The full weights, gathered to rank 0, as a version's files; {} on the other ranks.
        With LoRA, version 0 is the base's weights and every later one the adapter's files,
        only its tensors gathered."""
        if self.adapter is not None and version > 0:
            state = self.adapter.trainable_state()
            whole = {k: cast(DTensor, v).full_tensor() for k, v in state.items()}  # collective
            return self.adapter.files_of(whole) if self.rank == 0 else {}
        full: dict[str, Any] = get_model_state_dict(self.model, options=FULL)
        if self.rank != 0:
            return {}
        if self.adapter is not None:
            full = self.adapter.base_of(full)
        dtype = DTYPES[self.weight_dtype]
        tensors = {k: v.to(dtype).contiguous() for k, v in full.items()}
        return weight_files(tensors) | self._companions

    # checkpoints: torch.distributed.checkpoint

    def _sharded_state(self) -> dict:
        """This rank's shards of what a checkpoint holds: the weights (with LoRA, the
        adapter's alone) and the optimizer's state."""
        model = get_model_state_dict(self.model)
        if self.adapter is not None:
            model = {k: v for k, v in model.items() if LORA_MARK in k}
        return {
            "model": model,
            "optimizer": get_optimizer_state_dict(self.model, self.optimizer),
        }

    def snapshot(self, folder: Path) -> Callable[[], None]:
        """Every rank stages a copy of its shards now and writes them to `folder` (rank 0
        created it; it must be storage every rank sees) in the background. Rank 0's function
        returns once every rank's shards and the metadata are written; the other ranks wait
        for their write before their next snapshot or restore."""
        self.finish_writes()
        extra = serialize({"scheduler": self.scheduler.state_dict(), "rng": torch.get_rng_state()})
        future = cast(
            Future,
            dcp.async_save(
                self._sharded_state(), checkpoint_id=str(folder), process_group=self.ckpt_group
            ),
        )

        def write() -> None:
            future.result()
            if self.rank == 0:
                (Path(folder) / EXTRA_FILE).write_bytes(extra)

        if self.rank != 0:
            self._writing = write
        return write

    def finish_writes(self) -> None:
        if self._writing is not None:
            write, self._writing = self._writing, None
            write()

    def restore(self, folder: Path) -> None:
        self.finish_writes()
        state = self._sharded_state()
        dcp.load(state, checkpoint_id=str(folder), process_group=self.ckpt_group)
        # with LoRA, the adapter's tensors only: the base's are left as they are
        options = StateDictOptions(strict=self.adapter is None)
        set_model_state_dict(self.model, state["model"], options=options)
        set_optimizer_state_dict(self.model, self.optimizer, state["optimizer"])
        extra = torch.load(Path(folder) / EXTRA_FILE, map_location="cpu", weights_only=False)
        self.scheduler.load_state_dict(extra["scheduler"])
        torch.set_rng_state(extra["rng"])
