"""Math word problems from a JSONL file of {"question", "answer"} rows (GSM8K style): a dataset
whose prompt is the question followed by `\\nAnswer:` and whose reference answer is the final
value after `####`, scored by the built-in boxed_match (math-verify).
"""

from pathlib import Path

from services.tasks.base import TaskError
from services.tasks.dataset import DatasetRows, RowFormat, build_examples
from services.tasks.dataset_files import DatasetLimits, read_jsonl

PROMPT_TEMPLATE = "{question}\nAnswer:"
SAMPLE_MATH_FILE = Path(__file__).parent / "data" / "gsm8k_sample.jsonl"


def final_answer(answer: object) -> str:
    """The part of a GSM8K answer after `####`, or the whole answer."""
    return str(answer).rsplit("####", 1)[-1].strip().replace(",", "")


def math_rows(
    path: str | Path = SAMPLE_MATH_FILE, shuffle: bool = True, limits: DatasetLimits | None = None
) -> DatasetRows:
    limits = limits or DatasetLimits()
    rows = read_jsonl(path, limits, what="math task file")
    for i, row in enumerate(rows.rows):
        if not isinstance(row.get("question"), str) or "answer" not in row:
            raise TaskError(f"{rows.where(i)}: not a row with a string question and an answer")
    fmt = RowFormat(template=PROMPT_TEMPLATE, answer_field="answer", answer_of=final_answer)
    return DatasetRows(build_examples(rows, fmt, limits), shuffle, key="math")
