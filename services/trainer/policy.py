"""The trained policy: a Hugging Face causal LM, its optimizer and the frozen reference copy.
Synchronous torch code; the trainer loop runs it in a thread.

`accumulate()` backpropagates the groups it is given at once (micro-batch pipelining: groups are
trained as they arrive); `optimizer_step()` applies the summed gradient once per RL step.
"""

import copy
import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from services.common.messages import Group
from services.common.runspec import RunSpec
from services.common.step_metrics import StepRow
from services.trainer.grpo import group_advantages, grpo_loss, token_logprobs

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SHARD_BYTES = 1 << 30


@dataclass
class StepStats:
    sequences: int = 0
    tokens: int = 0
    policy_loss: float = 0.0
    kl: float = 0.0
    clip_fraction: float = 0.0
    rewards: list[float] = field(default_factory=list)

    def add(self, parts, n_seq: int) -> None:
        self.policy_loss += parts.policy * n_seq
        self.kl += parts.kl * n_seq
        self.clip_fraction += parts.clip_fraction * n_seq
        self.sequences += n_seq
        self.tokens += parts.tokens

    def summary(self, grad_norm: float) -> StepRow:
        """The training fields of the step's metrics row."""
        n = max(1, self.sequences)
        return StepRow(
            policy_loss=self.policy_loss / n,
            kl=self.kl / n,
            clip_fraction=self.clip_fraction / n,
            grad_norm=grad_norm,
            trained_sequences=self.sequences,
            trained_tokens=self.tokens,
        )


class Policy:
    def __init__(self, model_dir: Path, spec: RunSpec, device: str = "cpu") -> None:
        from transformers import AutoModelForCausalLM

        self.model_dir = Path(model_dir)
        self.spec = spec
        self.device = device
        torch.manual_seed(spec.seed)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.model = model.to(device)  # type: ignore[arg-type]  # transformers wraps `to`
        if getattr(self.model.config, "tie_word_embeddings", False):
            raise ValueError("models with tied embeddings are not supported; untie them first")
        self.model.train()
        self.ref = None
        if spec.kl_coef > 0:
            self.ref = copy.deepcopy(self.model).eval().requires_grad_(False)
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=spec.learning_rate, betas=(0.9, 0.99), weight_decay=0.0
        )
        self.pad_id = self.model.config.pad_token_id or 0
        self.stats = StepStats()

    def accumulate(self, groups: list[Group]) -> None:
        rows = []  # (prompt_ids, response_ids, old_logprobs, advantage)
        for g in groups:
            advantages = group_advantages([r.reward for r in g.responses])
            self.stats.rewards.extend(r.reward for r in g.responses)
            for resp, adv in zip(g.responses, advantages, strict=True):
                if resp.token_ids:
                    rows.append((g.prompt_ids, resp.token_ids, resp.logprobs, adv))
        per_step = self.spec.prompts_per_step * self.spec.group_size
        mb = self.spec.micro_batch_size
        for start in range(0, len(rows), mb):
            self._backward(rows[start : start + mb], per_step)

    def _backward(self, rows: list, sequences_per_step: int) -> None:
        width = max(len(p) + len(r) for p, r, _, _ in rows)
        n = len(rows)
        ids = torch.full((n, width), self.pad_id, dtype=torch.long)
        attn = torch.zeros((n, width), dtype=torch.long)
        mask = torch.zeros((n, width - 1))
        old = torch.zeros((n, width - 1))
        for i, (prompt, resp, logps, _) in enumerate(rows):
            seq = prompt + resp
            ids[i, : len(seq)] = torch.tensor(seq)
            attn[i, : len(seq)] = 1
            # logits at position t predict token t+1: the response starts at len(prompt)
            mask[i, len(prompt) - 1 : len(seq) - 1] = 1
            old[i, len(prompt) - 1 : len(seq) - 1] = torch.tensor(logps[: len(resp)])
        adv = torch.tensor([a for _, _, _, a in rows], dtype=torch.float32)
        ids, attn = ids.to(self.device), attn.to(self.device)
        temperature = self.spec.temperature
        logits = self.model(input_ids=ids, attention_mask=attn).logits
        logp = token_logprobs(logits, ids, temperature)
        ref_logp = None
        if self.ref is not None:
            with torch.no_grad():
                ref_logits = self.ref(input_ids=ids, attention_mask=attn).logits
                ref_logp = token_logprobs(ref_logits, ids, temperature)
        parts = grpo_loss(
            logp,
            old.to(self.device),
            adv.to(self.device),
            mask.to(self.device),
            self.spec.clip_range,
            sequences_per_step,
            ref_logp,
            self.spec.kl_coef,
        )
        parts.loss.backward()
        self.stats.add(parts, n)

    def optimizer_step(self) -> StepRow:
        """Apply the step's summed gradient; what the step trained (its metrics row's training
        fields)."""
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        out = self.stats.summary(float(grad_norm))
        self.stats = StepStats()
        return out

    def state(self) -> dict:
        """Everything a resumed trainer needs besides the data position: weights (fp32),
        optimizer moments and the RNG."""
        rng: dict[str, Any] = {"torch": torch.get_rng_state()}
        if torch.cuda.is_available():
            rng["cuda"] = torch.cuda.get_rng_state_all()
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "rng": rng,
        }

    def load_state(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["rng"]["torch"])
        if "cuda" in state["rng"] and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["rng"]["cuda"])

    def load_weights(self, folder: Path) -> None:
        """Take the weights of a committed version (a folder `export` wrote)."""
        tensors: dict[str, torch.Tensor] = {}
        for path in sorted(Path(folder).glob("*.safetensors")):
            tensors.update(load_file(path))
        own = self.model.state_dict()
        self.model.load_state_dict(
            {k: v.to(own[k].device, own[k].dtype) for k, v in tensors.items()}, strict=True
        )

    def export(self, folder: Path) -> Path:
        """Write the current weights as a Hugging Face folder (safetensors shards + config)."""
        folder = Path(folder)
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        dtype_name = self.spec.weight_dtype
        if dtype_name == "auto":
            dtype_name = "bfloat16" if self.device.startswith("cuda") else "float32"
        dtype = DTYPES[dtype_name]
        tensors = {
            k: v.detach().to("cpu", dtype).contiguous() for k, v in self.model.state_dict().items()
        }
        shards: list[dict[str, torch.Tensor]] = [{}]
        size = 0
        for name, t in tensors.items():
            nbytes = t.numel() * t.element_size()
            if shards[-1] and size + nbytes > SHARD_BYTES:
                shards.append({})
                size = 0
            shards[-1][name] = t
            size += nbytes
        if len(shards) == 1:
            save_file(shards[0], folder / "model.safetensors", metadata={"format": "pt"})
        else:
            weight_map = {}
            for i, shard in enumerate(shards, start=1):
                fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
                save_file(shard, folder / fname, metadata={"format": "pt"})
                weight_map.update(dict.fromkeys(shard, fname))
            index = {"metadata": {}, "weight_map": weight_map}
            (folder / "model.safetensors.index.json").write_text(json.dumps(index))
        for src in self.model_dir.iterdir():
            if src.is_file() and not src.name.startswith("model") and src.suffix != ".safetensors":
                shutil.copy2(src, folder / src.name)
        config = json.loads((folder / "config.json").read_text())
        config["torch_dtype"] = config["dtype"] = dtype_name
        (folder / "config.json").write_text(json.dumps(config, indent=2))
        return folder
