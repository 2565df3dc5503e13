"""Math word problems from a JSONL file of {"question", "answer"} rows (GSM8K style), scored
with a real math verifier (math-verify).

A GSM8K answer holds its final value after `####`; a response is right when math-verify finds
the same value in it (the last number, a boxed expression, or a LaTeX expression).
"""

import json
import random
from pathlib import Path

from services.common.runspec import shorten_path
from services.common.tasks.base import Example, TaskError

PROMPT_SUFFIX = "\nAnswer:"


def final_answer(answer: str) -> str:
    """The part of a GSM8K answer after `####`, or the whole answer."""
    return answer.rsplit("####", 1)[-1].strip().replace(",", "")


class MathJsonlTask:
    name = "math"

    def __init__(self, path: str | Path) -> None:
        # Error texts name the file and the line, never what is in it.
        name = shorten_path(path)
        try:
            text = Path(path).read_bytes().decode("utf-8")
        except FileNotFoundError:
            raise TaskError(f"math task file {name} does not exist") from None
        except UnicodeDecodeError as exc:
            raise TaskError(
                f"math task file {name} is not UTF-8 text (invalid byte at offset {exc.start})"
            ) from None
        except OSError as exc:
            raise TaskError(f"math task file {name} cannot be read: {exc.strerror}") from None
        rows: list[Example] = []
        for number, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                where = f"{exc.msg} at column {exc.colno}"
                raise TaskError(f"{name}:{number}: not JSON ({where})") from None
            except (ValueError, RecursionError):
                raise TaskError(f"{name}:{number}: not JSON (too large or too deep)") from None
            question = row.get("question") if isinstance(row, dict) else None
            if not isinstance(question, str) or "answer" not in row:
                raise TaskError(f"{name}:{number}: not a row with a string question and an answer")
            answer = row["answer"]
            rows.append(Example(question.strip() + PROMPT_SUFFIX, str(answer)))
        if not rows:
            raise TaskError(f"math task file {name} has no rows")
        self.rows = rows

    def examples(self, seed: int, step: int, count: int) -> list[Example]:
        order = list(range(len(self.rows)))
        random.Random(f"math:{seed}").shuffle(order)
        start = step * count
        return [self.rows[order[(start + i) % len(order)]] for i in range(count)]

    def reward(self, response: str, example: Example) -> float:
        from math_verify import parse, verify

        gold = parse(final_answer(example.answer))
        guess = parse(response)
        if not gold or not guess:
            return 0.0
        return 1.0 if verify(gold, guess) else 0.0

    def corpus(self, seed: int, count: int, label_noise: float) -> list[str]:
        rng = random.Random(f"math-corpus:{seed}")
        texts = []
        for _ in range(count):
            ex = rng.choice(self.rows)
            texts.append(f"{ex.prompt} {final_answer(ex.answer)}")
        return texts
