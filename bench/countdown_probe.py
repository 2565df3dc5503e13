"""A probe for issue 50's open part: is there a long-response task whose base model, built in
minutes on 2 cores, is confident enough at temperature 1 for drafts from history to pay?

The task probed: count down from N, `47:47,46,...,0;`, N from 3 to 100 skewed short (responses
~10 to ~290 tokens, p50 ~40). Every token is decided by the few before it (a copy of the prompt's
number, then one less each time), what a small model learns fast. It builds the embedded
default's architecture (`services.trainer.init_model`) on that corpus, then samples each of 8
prompts twice at temperature 1 and reports how often the two samples agree, how often they are
right, and the mean top probability of the tokens drawn (history drafts are accepted about as
often as a redraw repeats a token).

    .venv/bin/python bench/countdown_probe.py [--steps 1500]

Not a task of the registry yet: what it would take is in docs/benchmarks.md, "The long tail".
Prints, as its LAST line, one JSON object.
"""

import argparse
import json
import random
import time

import repo_root  # noqa: F401  (the repository root on sys.path)
import torch

from services.trainer.init_model import InitModelSpec, build_model, pretrain, train_tokenizer

PROMPT_NS = (5, 9, 14, 23, 31, 47, 60, 88)


def n_drawn(rng: random.Random) -> int:
    return 3 + int(97 * rng.random() ** 3)


def text(n: int) -> str:
    return f"{n}:" + ",".join(str(i) for i in range(n, -1, -1)) + ";"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rng = random.Random(0)
    corpus = [text(n_drawn(rng)) for _ in range(20000)]
    tok = train_tokenizer(corpus, 320)
    spec = InitModelSpec(pretrain_steps=args.steps, batch_size=32, group_by_length=True)
    model = build_model(spec, tok)
    t0 = time.monotonic()
    loss = pretrain(model, tok, corpus, spec)
    pretrain_s = time.monotonic() - t0
    lengths = sorted(len(tok.encode(c)) for c in corpus[:2000])
    model.eval()
    same = right = 0
    top: list[float] = []
    for n in PROMPT_NS:
        prompt = f"{n}:"
        ids = torch.tensor([tok.encode(prompt)])
        outs = []
        for seed in range(2):
            torch.manual_seed(seed)
            out = model.generate(
                ids,
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                max_new_tokens=400,
                eos_token_id=tok.eos_token_id,
                pad_token_id=tok.pad_token_id,
                output_scores=True,
                return_dict_in_generate=True,
            )
            top += [torch.softmax(s[0], -1).max().item() for s in out.scores]
            outs.append(tok.decode(out.sequences[0, ids.shape[1] :], skip_special_tokens=True))
        same += outs[0] == outs[1]
        right += outs[0] == text(n)[len(prompt) :]
    print(
        json.dumps(
            {
                "task": "countdown (probe)",
                "pretrain_steps": args.steps,
                "pretrain_s": round(pretrain_s, 1),
                "loss": round(loss, 4),
                "lengths_p50_p99": [lengths[len(lengths) // 2], lengths[int(0.99 * len(lengths))]],
                "samples_equal": f"{same}/{len(PROMPT_NS)}",
                "right": f"{right}/{len(PROMPT_NS)}",
                "mean_top_prob": round(sum(top) / len(top), 4),
                "share_top_prob_over_0.99": round(sum(p > 0.99 for p in top) / len(top), 3),
            }
        )
    )


if __name__ == "__main__":
    main()
