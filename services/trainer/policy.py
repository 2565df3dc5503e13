"""The trained policy: a Hugging Face causal LM, its optimizer and LR schedule, and the frozen
reference copy (only when `beta` > 0). Synchronous torch code; the trainer loop runs it in a
thread: `accumulate()` as the step's groups arrive, `optimizer_step()` once per RL step.

Micro-batch pipelining: `accumulate()` backpropagates the groups it is given at once, so that
training overlaps the rollout. Each micro-batch's loss is its share of the step's (grpo.py), and
two quantities of the step are known only once all its groups are in: the std of its rewards
(`scale_rewards="batch"`) and its token count (`loss_type="dapo"`). Each is a single factor on
the gradient (the std's on the policy term, the count's on the whole loss), so the pipelined
micro-batches use the centred rewards and the provisional token count responses x
max_new_tokens, and `optimizer_step()` multiplies the summed gradient by the factors: exact, up
to float rounding. The one case a factor cannot fix is the batch std with a KL term (the std
scales the policy term, not the KL): then the step's backward
waits for `optimizer_step()` ("deferred": no pipelining). grpo, dr_grpo and bnpo under group or
no scaling need nothing at the end.

Responses whose advantage is 0 (a group whose rewards are all equal) add nothing to the
gradient when the loss is a sum over responses (grpo, dr_grpo, dapo) and has no KL term
(beta 0): their policy term is -min(r 0, clip(r) 0) = 0. Those are not run through the model
at all (`skips_flat_groups`); they still count where the step's sizes count responses and
tokens, and in its metrics (as responses of zero loss, zero clipped tokens), so the gradient,
the optimizer step and the metrics are those of training them, up to float rounding. On a task
the policy mostly solves (or mostly fails) that is most of the step: verl's and DAPO's dynamic
sampling drop such groups from the batch for the same reason.

A multi-turn response's observation tokens (`Response.observed`: tool results, feedback) are
context, never trained: its row carries the mask of the tokens the model generated, and the
step's token count (dapo) and metrics count generated tokens only. A response with no generated
token is left out, as an empty one is.

`num_iterations` > 1: after the step's first optimizer step, `optimizer_step()` runs the step's
micro-batches again, once per further iteration, each followed by an optimizer step; the ratio
is always to the rollout's logprobs (the policy that sampled), as TRL's second and later
iterations use the logprobs from before the first.

A pass runs the model through scorer.py, in micro-batches of `micro_batch_size` sequences
(padded) or cut by `max_tokens_per_micro_batch` (packed), as batching.py lays them out.
"""

import copy
import math
from collections.abc import Callable
from pathlib import Path

import torch

from services.contracts.messages import Group
from services.contracts.runspec import RunSpec
from services.contracts.spans import generated_count, generated_mask
from services.state.step_metrics import StepRow
from services.trainer.batching import (
    Row,
    cut_by_count,
    cut_by_tokens,
    packed,
    padded,
    stale_tokens,
)
from services.trainer.checkpoint import (
    load_training_state,
    read_state,
    snapshot_of,
    training_state,
)
from services.trainer.export import (
    DTYPES,
    companion_files,
    read_weights,
    weight_files,
    write_files,
)
from services.trainer.grpo import LossParts, StepSize, batch_scale, group_advantages, grpo_loss
from services.trainer.lora import Adapter
from services.trainer.optim import build_optimizer, build_scheduler, set_schedule
from services.trainer.scorer import ResponseScorer, compile_layers, score
from services.trainer.stats import PassStats, step_row


class Policy:
    def __init__(self, model_dir: Path, spec: RunSpec, device: str = "cpu") -> None:
        from transformers import AutoModelForCausalLM

        self.model_dir = Path(model_dir)
        self.spec = spec
        self.device = device
        torch.manual_seed(spec.seed)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        if getattr(model.config, "tie_word_embeddings", False):
            raise ValueError("models with tied embeddings are not supported; untie them first")
        model = model.to(device)  # type: ignore[arg-type]  # transformers wraps `to`
        # LoRA: the adapter's layers go into the model in place; only they train
        self.adapter = Adapter(model, spec.lora) if spec.lora.use_peft else None
        model.train()
        if spec.training.gradient_checkpointing:
            model.gradient_checkpointing_enable({"use_reentrant": False})
        # bfloat16 compute over float32 weights and optimizer state (autocast), or float32
        self.autocast = auto_dtype(spec.training.train_precision, device) == "bfloat16"
        self.softcap = getattr(model.config, "final_logit_softcapping", None)
        self.ref = None
        self.ref_scorer = None
        if spec.loss.beta > 0 and self.adapter is None:  # LoRA's reference: adapter disabled
            self.ref = copy.deepcopy(model).eval().requires_grad_(False)
            if spec.training.torch_compile:
                compile_layers(self.ref)
            self.ref_scorer = self._place(ResponseScorer(self.ref, spec, self.softcap))
        if spec.training.torch_compile:
            compile_layers(model)
        self.model = model
        self.scorer = self._place(ResponseScorer(model, spec, self.softcap))
        self.optimizer = build_optimizer(self.model, spec)
        self.scheduler = build_scheduler(self.optimizer, spec)
        self.pad_id = self.model.config.pad_token_id or 0
        # backward waits for optimizer_step: the batch std scales the policy term, not the KL
        self.deferred = spec.loss.scale_rewards == "batch" and spec.loss.beta > 0
        self._keeps_rows = self.deferred or spec.training.num_iterations > 1
        # zero-advantage responses need no pass: bnpo's share depends on the micro-batch
        # (every response counts in its token mean), and the KL term has gradient of its own
        self.skips_flat_groups = spec.loss.loss_type != "bnpo" and spec.loss.beta == 0
        # what a published version holds: its weights in this dtype, beside these files
        self.weight_dtype = auto_dtype(spec.training.weight_dtype, device)
        self._companions = companion_files(self.model_dir, self.weight_dtype)
        self._new_step()

    def _new_step(self) -> None:
        self.stats = PassStats()  # the step's first pass
        self.batches: list[list[Row]] = []  # its micro-batches, kept for a later pass
        self.waiting: list[Row] = []  # rows short of a full micro-batch
        self.rewards: list[float] = []
        self.tokens = 0
        self.skipped = PassStats()  # zero-advantage responses not run through the model

    def _size(self, exact: bool) -> StepSize:
        """The step's sizes; with `exact` False, the provisional token count of a pipelined
        micro-batch."""
        n = self.spec.training.prompts_per_step * self.spec.training.group_size
        budget = self.spec.sampling.max_new_tokens
        return StepSize(n, budget, self.tokens if exact else n * budget)

    def accumulate(self, groups: list[Group]) -> None:
        """Take these groups into the step; backpropagate them now unless deferred."""
        rows = []
        for g in groups:
            rewards = [r.reward for r in g.responses]
            self.rewards.extend(rewards)
            advantages = group_advantages(rewards, self.spec.loss.scale_rewards)
            for resp, adv in zip(g.responses, advantages, strict=True):
                n = len(resp.token_ids)
                generated = generated_mask(resp.observed, n)  # None: no observation token
                trained = generated_count(resp.observed, n)
                if not trained:
                    continue
                self.tokens += trained
                if adv == 0.0 and self.skips_flat_groups:
                    self.skipped.sequences += 1
                    self.skipped.tokens += trained
                    continue
                stale = stale_tokens(resp.version_runs, n, g.step)
                rows.append(Row(g.prompt_ids, resp.token_ids, resp.logprobs, adv, stale, generated))
        # full micro-batches only: the rest waits for the next groups (or the step's end), so
        # a step of R rows (its responses less the skipped ones) makes ceil(R /
        # micro_batch_size) passes however its groups arrive (by tokens: as many as cutting
        # all its rows in order makes)
        self.waiting.extend(rows)
        batches, self.waiting = self._cut(self.waiting, final=False)
        self._take(batches)

    def _cut(self, rows: list[Row], final: bool) -> tuple[list[list[Row]], list[Row]]:
        budget = self.spec.training.max_tokens_per_micro_batch
        if budget is not None:
            return cut_by_tokens(rows, budget, final)
        return cut_by_count(rows, self.spec.training.micro_batch_size, final)

    def _take(self, batches: list[list[Row]]) -> None:
        """Keep micro-batches for a later pass where needed; backpropagate them now unless
        deferred."""
        if self._keeps_rows:
            self.batches.extend(batches)
        if not self.deferred:
            size = self._size(exact=False)
            for batch in batches:
                self._backward(batch, size, 1.0, self.stats)

    def _place(self, scorer: ResponseScorer) -> ResponseScorer:
        """Where the model's parameters live: whole on this process here; sharded over the
        ranks in sharded.py."""
        return scorer

    def _backward(
        self, rows: list[Row], size: StepSize, adv_scale: float, stats: PassStats
    ) -> None:
        parts = self._loss(rows, size, adv_scale)
        parts.loss.backward()
        stats.add(parts, len(rows))

    def _loss(
        self,
        rows: list[Row],
        size: StepSize,
        adv_scale: float,
        whole: tuple[int, int] | None = None,
    ) -> LossParts:
        """The loss of these rows (all of a micro-batch, or with `whole` a part of one)."""
        # packed (no padding) when micro-batches are cut by tokens, else padded
        if self.spec.training.max_tokens_per_micro_batch is not None:
            batch = packed(rows)
        else:
            batch = padded(rows, self.pad_id)
        adv = torch.tensor([r.advantage * adv_scale for r in rows], dtype=torch.float32)
        logp = score(self.scorer, batch, self.device, self.autocast)
        ref_logp = None
        if self.ref_scorer is not None:
            with torch.no_grad():
                ref_logp = score(self.ref_scorer, batch, self.device, self.autocast)
        elif self.adapter is not None and self.spec.loss.beta > 0:
            with torch.no_grad(), self.adapter.disabled():
                ref_logp = score(self.scorer, batch, self.device, self.autocast)
        return grpo_loss(
            logp,
            batch.old_logprobs.to(self.device),
            adv.to(self.device),
            batch.mask.to(self.device),
            size,
            epsilon=self.spec.loss.epsilon,
            epsilon_high=self.spec.loss.epsilon_high,
            loss_type=self.spec.loss.loss_type,
            ref_logprobs=ref_logp,
            beta=self.spec.loss.beta,
            whole=whole,
            stale=None if batch.stale is None else batch.stale.to(self.device),
            behaviour_cap=self.spec.loss.behaviour_cap,
        )

    def optimizer_step(self) -> StepRow:
        """Finish the step's gradient and apply it, then take the step's further iterations;
        what the step trained (its metrics row's training fields)."""
        if self.waiting:
            batches, self.waiting = self._cut(self.waiting, final=True)
            self._take(batches)
        adv_scale = batch_scale(self.rewards) if self.spec.loss.scale_rewards == "batch" else 1.0
        exact = self._size(exact=True)
        if self.deferred:
            for batch in self.batches:
                self._backward(batch, exact, adv_scale, self.stats)
        else:
            factor = adv_scale
            if self.spec.loss.loss_type == "dapo" and exact.tokens > 0:
                factor *= self._size(exact=False).tokens / exact.tokens
            self._scale_gradient(factor)
            self.stats.policy_loss *= adv_scale  # it was measured with the centred rewards
        passes, grad_norms = [self.stats], [self._apply()]
        for _ in range(self.spec.training.num_iterations - 1):
            stats = PassStats()
            for batch in self.batches:
                self._backward(batch, exact, adv_scale, stats)
            passes.append(stats)
            grad_norms.append(self._apply())
        skipped = self.skipped
        self._new_step()
        gathered = self._gather(passes)
        for p in gathered:  # the skipped responses count once, as trained with zero loss
            p.sequences += skipped.sequences
            p.tokens += skipped.tokens
        return step_row(gathered, grad_norms)

    def _gather(self, passes: list[PassStats]) -> list[PassStats]:
        """What the passes measured, over every process that trained a part of them."""
        return passes

    def _scale_gradient(self, factor: float) -> None:
        if factor == 1.0:
            return
        for p in self.model.parameters():
            if p.grad is not None:
                p.grad.mul_(factor)

    def _apply(self) -> float:
        """Clip the gradient, step the optimizer and the schedule, clear the gradient; the norm
        before clipping."""
        params = [p for p in self.model.parameters() if p.requires_grad]
        if all(p.grad is None for p in params):  # a step of skipped responses only: the
            for p in params:  # gradient of training them, zero (weight decay and momentum on)
                p.grad = torch.zeros_like(p)
        limit = self.spec.optimizer.max_grad_norm or math.inf  # 0: no clipping
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), limit)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        full = getattr(grad_norm, "full_tensor", None)  # a sharded model's norm is a DTensor
        return float(full() if full else grad_norm)

    def state(self) -> dict:
        """Everything a resumed trainer needs besides the data position: weights (fp32),
        optimizer moments, the LR schedule's position and the RNG. With LoRA, of the weights
        only the adapter's: the base never changes."""
        state = training_state(self.model, self.optimizer, self.scheduler)
        if self.adapter is not None:
            state["model"] = self.adapter.trainable_state()
        return state

    def snapshot(self, folder: Path) -> Callable[[], None]:
        """Take a copy of the state now, for a checkpoint in `folder` (an empty scratch folder);
        the function returned writes it there, on any thread, while training goes on."""
        return snapshot_of(self.state(), folder)

    def restore(self, folder: Path) -> None:
        """Take the state of a checkpoint that `snapshot` wrote."""
        self.load_state(read_state(folder))

    def load_state(self, state: dict) -> None:
        if self.adapter is not None:
            self.adapter.load_trainable_state(state["model"])
        model = None if self.adapter is not None else self.model
        load_training_state(state, model, self.optimizer, self.scheduler)

    def schedule_at(self, version: int) -> None:
        """Put the learning-rate schedule where it is after `version` RL steps (a trainer that
        resumed from the weight store, its checkpoint older or missing)."""
        set_schedule(self.optimizer, self.scheduler, version * self.spec.training.num_iterations)

    def load_weights(self, folder: Path) -> None:
        """Take the weights of a committed version (a folder `export` wrote; with LoRA, its
        adapter)."""
        if self.adapter is not None:
            self.adapter.load(folder)
        else:
            read_weights(self.model, folder)

    def export_files(self, version: int) -> dict[str, bytes]:
        """The files of weight version `version`, in memory: the current weights as a Hugging
        Face folder (safetensors shards in the published dtype, and the model folder's config
        and tokenizer). With LoRA, version 0 is that folder of the base, and every later one
        the adapter alone (lora.py)."""
        if self.adapter is not None and version > 0:
            return self.adapter.files()
        dtype = DTYPES[self.weight_dtype]
        state = self.adapter.base_tensors() if self.adapter else self.model.state_dict()
        tensors = {k: v.detach().to("cpu", dtype).contiguous() for k, v in state.items()}
        return weight_files(tensors) | self._companions

    def export(self, folder: Path, version: int = 0) -> Path:
        """Write the files of `version` (export_files) as a folder."""
        return write_files(self.export_files(version), folder)


def auto_dtype(choice: str, device: str) -> str:
    """A dtype setting's value, "auto" being bfloat16 on a GPU and float32 elsewhere."""
    if choice != "auto":
        return choice
    return "bfloat16" if device.startswith("cuda") else "float32"
