"""How an exception raised in a user's code (an environment, a reward) is told: the frame of
the user's code it came from, and its traceback cut to a bounded size, so that the run's log
and record point at the user's line rather than at ours.

A frame is the user's when its file is neither spotrl's own (`services/`) nor the standard
library's or an installed package's; with none, the deepest frame is taken.
"""

import inspect
import sysconfig
import traceback
from pathlib import Path

MAX_TRACE_CHARS = 4000  # a traceback kept longer than this keeps its last lines
_OURS = str(Path(__file__).resolve().parents[1])  # services/
_LIBRARIES = tuple(
    str(Path(p).resolve())
    for p in {sysconfig.get_paths()[k] for k in ("stdlib", "purelib", "platlib")}
)


def _is_user_file(filename: str) -> bool:
    path = str(Path(filename).resolve()) if not filename.startswith("<") else filename
    return not path.startswith(_OURS) and not path.startswith(_LIBRARIES)


def _where(frame: traceback.FrameSummary) -> str:
    return f"{Path(frame.filename).name}:{frame.lineno} in {frame.name}"


def user_frame(exc: BaseException) -> str:
    """`file.py:LINE in function` of the deepest frame of the user's code in `exc`'s
    traceback (the deepest frame when none is the user's; "" with no traceback)."""
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return ""
    users = [f for f in frames if _is_user_file(f.filename)]
    return _where(users[-1] if users else frames[-1])


def trace_text(exc: BaseException) -> str:
    """`exc`'s traceback as Python prints it, its last MAX_TRACE_CHARS characters."""
    text = "".join(traceback.format_exception(exc)).rstrip()
    return text if len(text) <= MAX_TRACE_CHARS else "..." + text[-MAX_TRACE_CHARS:]


def defined_at(function: object) -> str:
    """`file.py:LINE in name` where a function (a user's method) is defined; "" if unknown.
    For a wrong value returned, where no frame raised."""
    try:
        target = inspect.unwrap(function)  # type: ignore[arg-type]
        filename = inspect.getsourcefile(target)  # type: ignore[arg-type]
        _, line = inspect.getsourcelines(target)  # type: ignore[arg-type]
    except (TypeError, OSError):
        return ""
    name = getattr(target, "__qualname__", getattr(target, "__name__", "?"))
    return f"{Path(filename or '?').name}:{line} in {name}"
