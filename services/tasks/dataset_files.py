"""Reading a dataset's rows: a JSONL file (one JSON object a line), a Parquet file (pyarrow), or
a name the `datasets` library loads, where it is installed.

Bounded: a file over `max_bytes` (Parquet: its data uncompressed too) or with more than
`max_rows` rows is refused before its rows are built. Errors name the file and the line or row,
never what is in them. Values that msgpack cannot carry (dates, decimals) become strings, so a
row travels to a reward process as it is.
"""

import datetime
import decimal
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.contracts.runspec import shorten_path
from services.tasks.base import TaskError

FILE_SUFFIXES = (".jsonl", ".parquet")
MAX_ERROR_CHARS = 300


@dataclass(frozen=True)
class DatasetLimits:
    max_bytes: int = 256 * 1024 * 1024  # of a file (the coordinator's max_task_file_bytes)
    max_rows: int = 1_000_000
    max_prompt_chars: int = 65_536  # of one prompt, after its template


@dataclass(frozen=True)
class Rows:
    """A dataset's rows, each with where it came from for error messages."""

    name: str  # the file or dataset, cut short
    rows: list[dict[str, Any]]
    numbers: list[int]  # JSONL: each row's line; else its position, from 1
    by_line: bool

    def where(self, i: int) -> str:
        """`file.jsonl:12`, `file.parquet row 12`: where row `i` is."""
        n = self.numbers[i]
        return f"{self.name}:{n}" if self.by_line else f"{self.name} row {n}"


def read_rows(source: str, split: str, limits: DatasetLimits) -> Rows:
    """The rows of a .jsonl or .parquet file, or of split `split` of a `datasets` dataset."""
    suffix = Path(source).suffix.lower()
    if suffix == ".jsonl":
        return read_jsonl(source, limits)
    if suffix == ".parquet":
        return read_parquet(source, limits)
    return read_hf_dataset(source, split, limits)


def _read_text(path: str, name: str, max_bytes: int) -> str:
    try:
        size = Path(path).stat().st_size
        if size > max_bytes:
            raise TaskError(
                f"{name} is {size} bytes, over the limit of {max_bytes} bytes "
                "(SPOTRL_MAX_TASK_FILE_BYTES)"
            )
        return Path(path).read_bytes().decode("utf-8")
    except FileNotFoundError:
        raise TaskError(f"{name} does not exist") from None
    except IsADirectoryError:
        raise TaskError(f"{name} is a directory, not a file") from None
    except UnicodeDecodeError as exc:
        raise TaskError(f"{name} is not UTF-8 text (invalid byte at offset {exc.start})") from None
    except OSError as exc:
        raise TaskError(f"{name} cannot be read: {exc.strerror}") from None


def read_jsonl(path: str | Path, limits: DatasetLimits, what: str = "dataset file") -> Rows:
    """One JSON object per line; blank lines are skipped."""
    name = shorten_path(path)
    text = _read_text(str(path), f"{what} {name}", limits.max_bytes)
    rows: list[dict[str, Any]] = []
    numbers: list[int] = []
    # split on \n only: a JSON string may hold U+2028, which str.splitlines splits on
    for number, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        if len(rows) == limits.max_rows:
            raise TaskError(f"{what} {name} has more than {limits.max_rows} rows")
        try:
            row = json.loads(line, parse_int=_int_or_text)
        except json.JSONDecodeError as exc:
            raise TaskError(
                f"{name}:{number}: not JSON ({exc.msg} at column {exc.colno})"
            ) from None
        except (ValueError, RecursionError):
            raise TaskError(f"{name}:{number}: not JSON (too large or too deep)") from None
        if not isinstance(row, dict):
            raise TaskError(f"{name}:{number}: not a JSON object")
        rows.append(row)
        numbers.append(number)
    if not rows:
        raise TaskError(f"{what} {name} has no rows")
    return Rows(name, rows, numbers, by_line=True)


def read_parquet(path: str, limits: DatasetLimits) -> Rows:
    import pyarrow as pa
    import pyarrow.parquet as pq

    name = f"dataset file {shorten_path(path)}"
    try:
        if Path(path).stat().st_size > limits.max_bytes:
            raise TaskError(f"{name} is over the limit of {limits.max_bytes} bytes")
        with pq.ParquetFile(path) as parquet:
            meta = parquet.metadata
            data_bytes = sum(meta.row_group(i).total_byte_size for i in range(meta.num_row_groups))
            if meta.num_rows > limits.max_rows:
                raise TaskError(f"{name} has {meta.num_rows} rows, over {limits.max_rows}")
            if data_bytes > limits.max_bytes:
                raise TaskError(
                    f"{name} holds {data_bytes} bytes of data uncompressed, over the limit of "
                    f"{limits.max_bytes} bytes (SPOTRL_MAX_TASK_FILE_BYTES)"
                )
            table = parquet.read()
    except FileNotFoundError:
        raise TaskError(f"{name} does not exist") from None
    except IsADirectoryError:
        raise TaskError(f"{name} is a directory, not a file") from None
    except OSError as exc:  # also pyarrow's ArrowIOError
        raise TaskError(f"{name} cannot be read: {exc.strerror or type(exc).__name__}") from None
    except pa.ArrowException as exc:  # not Parquet, corrupt: its message may quote data
        raise TaskError(f"{name} is not a readable Parquet file ({type(exc).__name__})") from None
    return _positional(shorten_path(path), [plain_row(r) for r in table.to_pylist()], name)


def read_hf_dataset(source: str, split: str, limits: DatasetLimits) -> Rows:
    name = f"dataset {shorten_path(source)}"
    if source.startswith(("/", ".", "~")) and not Path(source).expanduser().exists():
        raise TaskError(f"{name} does not exist")  # a path: the hub is no place to look
    try:
        import datasets
    except ImportError:
        raise TaskError(
            f"{name} is not a .jsonl or .parquet file, and the `datasets` library that would "
            "load it by name is not installed"
        ) from None
    # one row past the limit tells that there are too many (a split may slice itself: train[:90%])
    sliced = split if "[" in split else f"{split}[:{limits.max_rows + 1}]"
    try:
        loaded = datasets.load_dataset(source, split=sliced)
    except Exception as exc:  # the library raises many kinds (missing, offline, bad split)
        detail = f"{type(exc).__name__}: {exc}"[:MAX_ERROR_CHARS]
        raise TaskError(f"{name} (split {split!r}) cannot be loaded: {detail}") from None
    if len(loaded) > limits.max_rows:
        raise TaskError(f"{name} has more than {limits.max_rows} rows")
    return _positional(shorten_path(source), [plain_row(r) for r in loaded], name)


def _positional(short: str, rows: list[dict[str, Any]], name: str) -> Rows:
    if not rows:
        raise TaskError(f"{name} has no rows")
    return Rows(short, rows, list(range(1, len(rows) + 1)), by_line=False)


def _int_or_text(digits: str) -> int | str:
    """A JSON integer; past 64 bits (msgpack's range) its digits as a string."""
    return int(digits) if len(digits.lstrip("-")) < 19 else digits


def plain_row(row: dict[str, Any]) -> dict[str, Any]:
    return {str(k): plain(v) for k, v in row.items()}


def plain(value: Any) -> Any:
    """A value msgpack can carry: JSON's types and bytes as they are, dates in ISO form,
    anything else as its string."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value if -(2**63) <= value < 2**63 else str(value)
    if value is None or isinstance(value, (bool, float, str, bytes)):
        return value
    if isinstance(value, dict):
        return plain_row(value)
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, (datetime.date, datetime.time)):
        return value.isoformat()
    if isinstance(value, decimal.Decimal):
        return str(value)
    return str(value)
