"""The long tail of a step's rollout, speculative against plain (issue 50), on the transformers
engine alone: the same prompts over several epochs, the same seeds for every variant.

Each epoch runs N prompts x a group of G samples at temperature 1.0 (fresh seeds each epoch),
at most `--slots` requests at once. Epoch 1 runs plain; from epoch 2 on each epoch runs

- `plain`: dispatch in prompt order, no drafts;
- `spec`: the same order, each request drafted from the previous epoch's responses to its
  prompt (RhymeRL's HistoSpec) and from its group's responses that finished before it in this
  epoch (handed to the running requests as they finish, as the coordinator does: Seer's
  grouped speculation);
- `spec_length_aware`: `spec`, with the longest expected requests dispatched first (expected:
  the previous epoch's mean length of the prompt's responses; RhymeRL's HistoPipe);
- `oracle` (with `--oracle`): each request drafted from its own plain response, every draft
  right: the ceiling of speculation in this engine on this machine; with `--oracle-acceptance
  P`, each token of those drafts is right with probability P (else another token): drafts
  replayed at a given acceptance, for a model that cannot write the task itself (a random
  model of a real architecture, `--shape`, on a GPU: its speed with the task model's
  acceptance).

The variants alternate `--rounds` times each, the best wall time of each kept (other work on
the machine only slows a run). Measured over the epochs from 2 on: `identical_frac` (share of
responses whose tokens equal plain decoding's; exact verification yields the same tokens, up to
float noise landing a draw on another token), `tokens_per_forward` (tokens per request per
forward pass, `spec`), `rollout_speedup` (plain wall time / spec's), `tail_ratio_*` (time to
the epoch's last response / time to its median response, mean over epochs), and the first
epoch's response lengths. One line per epoch, and as its LAST line one JSON object.

    .venv/bin/python bench/long_tail.py                   # builds countdown's base model (~3 min)
    .venv/bin/python bench/long_tail.py --model DIR       # a model already built for the task
    .venv/bin/python bench/long_tail.py --task long_addition --prompts 16 --slots 32
    .venv/bin/python bench/long_tail.py --model DIR --shape qwen2-0.6b --device cuda \
        --variants plain --oracle --oracle-acceptance 0.9    # a real shape, drafts replayed

`--shape` builds a random model of one of bench/trainer.py's shapes with the task model's
tokenizer (`--model`, or the one built): it writes no task's answers, so only `plain` and
`oracle` mean anything on it (its responses run to `--max-new-tokens`: no tail).

Regime: CPU, one torch thread, a small model: a forward pass costs mostly per-step overhead
and, for wide batches, compute; on a GPU decoding is memory-bound and a drafted pass costs
close to a plain one.
"""

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

VARIANTS = ("plain", "spec", "spec_length_aware")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--task", default="countdown", help="task registry name")
    p.add_argument("--task-path", default=None, help="the task's file, where it reads one")
    p.add_argument("--model", default=None, help="model folder (default: build the task's)")
    p.add_argument("--init-steps", type=int, default=None, help="pre-training of a built model")
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--group", type=int, default=4)
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument(
        "--max-new-tokens", type=int, default=None, help="default: the task's `spotrl up` preset's"
    )
    p.add_argument("--draft-tokens", type=int, default=4)
    p.add_argument("--slots", type=int, default=64)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--no-siblings", action="store_true", help="draft from history only")
    p.add_argument(
        "--oracle",
        action="store_true",
        help="also a variant drafted from each request's own plain response: the ceiling of "
        "speculation in this engine on this machine (every draft right)",
    )
    p.add_argument(
        "--oracle-acceptance",
        type=float,
        default=1.0,
        help="each oracle draft token right with this probability (else another token)",
    )
    p.add_argument(
        "--variants",
        default=",".join(VARIANTS),
        help=f"comma-separated, of {','.join(VARIANTS)} (plain always runs)",
    )
    p.add_argument("--shape", default=None, help="a random model of this bench/trainer.py shape")
    p.add_argument("--device", default="cpu", help="the engine's torch device (cpu, cuda)")
    p.add_argument("--rounds", type=int, default=2, help="timed runs of each variant (best)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    if not 0.0 <= args.oracle_acceptance <= 1.0:
        p.error("--oracle-acceptance: a probability, 0 to 1")
    args.variants = ["plain"] + [v for v in args.variants.split(",") if v and v != "plain"]
    unknown = sorted(set(args.variants) - set(VARIANTS))
    if unknown:
        p.error(f"--variants: unknown {unknown}; of {VARIANTS}")
    if args.max_new_tokens is None:
        from services.contracts.runspec import TASK_PRESETS

        args.max_new_tokens = TASK_PRESETS.get(args.task, {}).get("max_new_tokens", 440)
    return args


def build_model(args: argparse.Namespace, folder: Path) -> Path:
    from services.trainer.init_model import InitModelSpec, init_model

    spec = InitModelSpec(task=args.task, task_path=args.task_path)
    if args.init_steps is not None:
        spec = spec.model_copy(update={"pretrain_steps": args.init_steps})
    print(f"building {args.task}'s model: {spec.pretrain_steps} steps", flush=True)
    return init_model(folder / "model", spec)


def shape_model(shape: str, task_model: Path, folder: Path) -> Path:
    """A random model of bench/trainer.py's `shape` that reads `task_model`'s tokenizer (the
    same prompt ids, the same end-of-text token)."""
    import shutil

    from trainer import build_model as build_shape

    params = build_shape(folder, shape)
    config = json.loads((folder / "config.json").read_text())
    task_config = json.loads((task_model / "config.json").read_text())
    for key in ("eos_token_id", "bos_token_id", "pad_token_id"):
        if key in task_config:
            config[key] = task_config[key]
    (folder / "config.json").write_text(json.dumps(config))
    for f in task_model.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
            shutil.copy(f, folder / f.name)
    print(f"a random {shape} model: {params / 1e6:.0f}M parameters", flush=True)
    return folder


def prompt_ids(args: argparse.Namespace, model: Path) -> list[list[int]]:
    from transformers import AutoTokenizer

    from services.tasks import load_task

    tokenizer = AutoTokenizer.from_pretrained(str(model))
    examples = load_task(args.task, args.task_path).examples(args.seed, 0, args.prompts)
    return [list(tokenizer.encode(ex.prompt)) for ex in examples]


def epoch_jobs(args, prompts, epoch: int, stop: list[int]) -> list[Any]:
    from services.contracts.messages import Job
    from services.contracts.sampling import SamplingParams

    sampling = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature)
    return [
        Job(
            run_id="bench",
            request_id=f"{epoch}:{p}:{s}",
            lease=0,
            grant="bench",
            step=epoch,
            prompt_ids=ids,
            remaining_tokens=args.max_new_tokens,
            sampling=sampling,
            seed=(args.seed * 1_000_003 + epoch) * 1_000_003 + p * 1009 + s,
            stop_token_ids=stop,
        )
        for p, ids in enumerate(prompts)
        for s in range(args.group)
    ]


def prompt_of(request_id: str) -> int:
    return int(request_id.split(":")[1])


class Rollout:
    """One variant's run of an epoch's jobs: each response's tokens and when it finished
    (seconds from the start), and the wall time."""

    def __init__(self, engine, jobs, history, siblings: bool, oracle=None) -> None:
        self.engine, self.jobs, self.history, self.siblings = engine, jobs, history, siblings
        self.oracle: dict[str, list[int]] | None = oracle  # request -> its own plain tokens
        self.out: dict[str, list[int]] = {}
        self.finished_s: dict[str, float] = {}
        self.wall_s = 0.0
        self.stats: Any = None  # the engine's speculation counters over this run

    def drafts(self, p: int, done: dict[int, list[list[int]]]) -> list[list[int]]:
        return (self.history.get(p, []) + done.get(p, []))[-16:]

    def run(self) -> "Rollout":
        from services.rollout.engines.speculation import SpecStats

        engine, out = self.engine, self.out
        engine.spec_stats = self.stats = SpecStats()
        done: dict[int, list[list[int]]] = {}
        waiting = list(self.jobs)
        started = time.perf_counter()
        while waiting or engine.active:
            while waiting and engine.active < engine.capacity:
                job = waiting.pop(0)
                if self.oracle is not None:
                    job = job.replace(drafts=[self.oracle[job.request_id]])
                elif self.history is not None:
                    job = job.replace(drafts=self.drafts(prompt_of(job.request_id), done))
                engine.add(job)
            for ev in engine.decode():
                out.setdefault(ev.request_id, []).append(ev.token_id)
                if ev.finish_reason is None:
                    continue
                self.finished_s[ev.request_id] = time.perf_counter() - started
                if self.history is not None and self.siblings:
                    p = prompt_of(ev.request_id)
                    done.setdefault(p, []).append(out[ev.request_id])
                    for rid in engine.seqs:
                        if prompt_of(rid) == p:
                            engine.set_drafts(rid, self.drafts(p, done))
        self.wall_s = time.perf_counter() - started
        return self

    @property
    def tail_ratio(self) -> float:
        """Time to the last response / time to the median response."""
        times = list(self.finished_s.values())
        return max(times) / max(1e-9, statistics.median(times))


def longest_first(jobs: list[Any], history: dict[int, list[list[int]]]) -> list[Any]:
    """The jobs in the order of their prompt's expected length, longest first (stable)."""

    def expected(job) -> float:
        lengths = [len(r) for r in history.get(prompt_of(job.request_id), [])]
        return statistics.mean(lengths) if lengths else 0.0

    return sorted(jobs, key=expected, reverse=True)


def stop_token_ids(model: Path) -> list[int]:
    """The model's end-of-text ids (config.json), the stop tokens the coordinator gives jobs."""
    eos = json.loads((model / "config.json").read_text()).get("eos_token_id")
    return [] if eos is None else [int(e) for e in (eos if isinstance(eos, list) else [eos])]


def percentile(values: list[int], q: float) -> int:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run_epoch(args, engine, jobs, history) -> dict[str, Rollout]:
    """Every variant of one epoch from 2 on, alternated `--rounds` times, the fastest run of
    each kept (their tokens are the same each time)."""
    siblings = not args.no_siblings
    orders = {"plain": (jobs, None), "spec": (jobs, history)}
    orders["spec_length_aware"] = (longest_first(jobs, history), history)
    best: dict[str, Rollout] = {}

    def keep(name: str, run: Rollout) -> None:
        if name not in best or run.wall_s < best[name].wall_s:
            best[name] = run

    for round_ in range(args.rounds):
        for name in args.variants:
            ordered, drafts_from = orders[name]
            keep(name, Rollout(engine, ordered, drafts_from, siblings).run())
        if args.oracle:
            drafts = replayed(best["plain"].out, args.oracle_acceptance, args.seed + round_)
            keep("oracle", Rollout(engine, jobs, None, False, oracle=drafts).run())
    return best


def replayed(plain: dict[str, list[int]], right: float, seed: int) -> dict[str, list[int]]:
    """Each request's own plain tokens as its draft, each token kept with probability `right`
    and else replaced by another (a draft token the engine's draw rejects)."""
    rng = random.Random(seed)
    return {
        rid: [t if rng.random() < right else (t - 1 if t > 0 else 1) for t in tokens]
        for rid, tokens in sorted(plain.items())
    }


def epoch_row(epoch: int, runs: dict[str, Rollout]) -> dict[str, Any]:
    plain = runs["plain"].out
    row: dict[str, Any] = {"epoch": epoch, "responses": len(plain)}
    for name, run in runs.items():
        stats = run.stats
        row[name] = {
            "wall_s": round(run.wall_s, 3),
            "tail_ratio": round(run.tail_ratio, 3),
            "identical": sum(run.out[rid] == plain[rid] for rid in plain),
            "tokens": stats.tokens,
            "forwards": stats.forwards,
            "drafted": stats.drafted,
            "accepted": stats.accepted,
        }
    return row


def summary_of(args, rows: list[dict[str, Any]], lengths: list[int]) -> dict[str, Any]:
    later = rows[1:]

    def total(name: str, field: str) -> float:
        return sum(r[name][field] for r in later)

    def tail(name: str) -> float:
        return round(statistics.mean(r[name]["tail_ratio"] for r in later), 3)

    responses = sum(r["responses"] for r in later)
    out: dict[str, Any] = {
        "task": args.task,
        "model": str(args.model or "built"),
        "shape": args.shape or "the task's",
        "device": device_name(args.device),
        "prompts": args.prompts,
        "group": args.group,
        "epochs": args.epochs,
        "slots": args.slots,
        "draft_tokens": args.draft_tokens,
        "siblings": not args.no_siblings,
        "temperature": args.temperature,
        "tail_ratio_plain": tail("plain"),
        "lengths_first_epoch_p50_p99": [percentile(lengths, 0.5), percentile(lengths, 0.99)],
    }
    if "spec" in args.variants:
        out |= {
            "identical_frac": round(total("spec", "identical") / max(1, responses), 4),
            "tokens_per_forward": round(
                total("spec", "tokens") / max(1, total("spec", "forwards")), 3
            ),
            "acceptance": round(total("spec", "accepted") / max(1, total("spec", "drafted")), 3),
            "rollout_speedup": round(total("plain", "wall_s") / total("spec", "wall_s"), 3),
            "tail_ratio_spec": tail("spec"),
            "per_epoch_tokens_per_forward": [
                round(r["spec"]["tokens"] / max(1, r["spec"]["forwards"]), 3) for r in later
            ],
        }
    if "spec_length_aware" in args.variants:
        out |= {
            "identical_frac_length_aware": round(
                total("spec_length_aware", "identical") / max(1, responses), 4
            ),
            "rollout_speedup_length_aware": round(
                total("plain", "wall_s") / total("spec_length_aware", "wall_s"), 3
            ),
            "tail_ratio_spec_length_aware": tail("spec_length_aware"),
        }
    return out | (oracle_figures(args, later, total) if args.oracle else {})


def device_name(device: str) -> str:
    """The device as its driver names it (a GPU's model), or "cpu"."""
    if device.startswith("cuda"):
        import torch

        return torch.cuda.get_device_name(torch.device(device))
    return device


def oracle_figures(args, later: list[dict[str, Any]], total) -> dict[str, Any]:
    """Every request drafted from its own plain response: what speculation yields here when
    every draft is right (or each draft token with probability `--oracle-acceptance`)."""
    responses = sum(r["responses"] for r in later)
    return {
        "oracle_draft_token_right": args.oracle_acceptance,
        "oracle_acceptance": round(
            total("oracle", "accepted") / max(1, total("oracle", "drafted")), 3
        ),
        "oracle_identical_frac": round(total("oracle", "identical") / max(1, responses), 4),
        "oracle_tokens_per_forward": round(
            total("oracle", "tokens") / max(1, total("oracle", "forwards")), 3
        ),
        "oracle_speedup": round(total("plain", "wall_s") / total("oracle", "wall_s"), 3),
    }


def main() -> None:
    args = parse_args()
    import torch

    from services.rollout.engines.hf import HFEngine

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(args.model) if args.model else build_model(args, Path(tmp))
        prompts = prompt_ids(args, model)
        if args.shape:
            model = shape_model(args.shape, model, Path(tmp) / "shape")
        stop = stop_token_ids(model)
        engine = HFEngine(args.device, slots=args.slots, draft_tokens=args.draft_tokens)
        engine.load_weights(model)
        Rollout(engine, epoch_jobs(args, prompts, 0, stop)[: args.slots], None, False).run()
        history: dict[int, list[list[int]]] = {}
        rows: list[dict[str, Any]] = []
        lengths: list[int] = []
        for epoch in range(1, args.epochs + 1):
            jobs = epoch_jobs(args, prompts, epoch, stop)
            if epoch == 1:
                first = Rollout(engine, jobs, None, False).run()
                plain, lengths = first.out, [len(t) for t in first.out.values()]
                row: dict[str, Any] = {"epoch": 1, "plain_wall_s": round(first.wall_s, 3)}
            else:
                runs = run_epoch(args, engine, jobs, history)
                plain, row = runs["plain"].out, epoch_row(epoch, runs)
            rows.append(row)
            print(json.dumps(row), flush=True)
            history = {}
            for rid in sorted(plain):
                history.setdefault(prompt_of(rid), []).append(plain[rid])
        print(json.dumps(summary_of(args, rows, lengths)))


if __name__ == "__main__":
    main()
