"""How sure is a `countdown` base model at temperature 1 (issue 50)? Drafts from history are
kept about as often as a redraw repeats a token, so this samples each of 8 prompts twice and
reports how often the two samples agree, how often they are right, and the mean top
probability of the tokens drawn.

    .venv/bin/python -m services.cli.main init-model --task countdown M     # ~3-4 min
    .venv/bin/python bench/countdown_probe.py --model M

Prints, as its LAST line, one JSON object.
"""

import argparse
import json

import repo_root  # noqa: F401  (the repository root on sys.path)
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from services.tasks.countdown import count_from

PROMPT_STARTS = (5, 9, 14, 23, 31, 47, 60, 88)


def sampled(model, tok, prompt: str, seed: int) -> tuple[str, list[float]]:
    """One response at temperature 1 and each drawn token's top probability."""
    ids = torch.tensor([tok.encode(prompt)])
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
    top = [torch.softmax(s[0], -1).max().item() for s in out.scores]
    return tok.decode(out.sequences[0, ids.shape[1] :], skip_special_tokens=True), top


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--model", required=True, help="a folder `init-model --task countdown` built"
    )
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    same = right = 0
    top: list[float] = []
    for start in PROMPT_STARTS:
        first, top_first = sampled(model, tok, f"{start}:", seed=0)
        second, top_second = sampled(model, tok, f"{start}:", seed=1)
        top += top_first + top_second
        same += first == second
        right += first == count_from(start)
    print(
        json.dumps(
            {
                "task": "countdown",
                "samples_equal": f"{same}/{len(PROMPT_STARTS)}",
                "right": f"{right}/{len(PROMPT_STARTS)}",
                "mean_top_prob": round(sum(top) / len(top), 4),
                "share_top_prob_over_0.99": round(sum(p > 0.99 for p in top) / len(top), 3),
            }
        )
    )


if __name__ == "__main__":
    main()
