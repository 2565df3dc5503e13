"""Size limits of the services' code: no file over MAX_FILE_LINES lines and no function over
MAX_FUNCTION_LINES lines, route tables aside. STYLE.md lets cohesion decide where a file ends
(one concept, one file: most under ~300 lines, up to ~600 where a split would need mixins or
hook templates) and asks for functions that do one thing; this makes the outer bounds a check.
The file bound is the ceiling of one cohesive concept, not a target: a file near it that holds
two concepts is still split by concept, never by a line count.

A route table is a function that declares routes: nested functions decorated with
`@<router>.get(...)`, `.post`, `.put`, `.patch`, `.delete`, `.api_route`, `.websocket` ...
(`build_app`, `build_router`). The lines of those route functions do not count toward it (each
is checked as a function of its own); the rest of it must fit the function limit like any
other. Non-route logic grown into an app factory is thus still caught.

Files in NOT_YET_SPLIT may be over the limits while their split is pending; an entry that no
longer needs to be there is an error too, so the list only shrinks. `--allow PATH` adds one for
a single invocation.

    .venv/bin/python -m tools.size_limits            # exit 1 and one line per offender
"""

import argparse
import ast
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAX_FILE_LINES = 600  # one concept, one file (STYLE.md 7)
MAX_FUNCTION_LINES = 60
# decorator attributes that declare a route (FastAPI's APIRouter and app, Starlette)
ROUTE_METHODS = frozenset(
    {"get", "post", "put", "patch", "delete", "head", "options", "trace", "api_route", "route"}
    | {"websocket", "websocket_route"}
)
# Over the limits today, each split by someone at work on it; emptied when they are done.
NOT_YET_SPLIT: tuple[str, ...] = ()


@dataclass(frozen=True)
class Offence:
    path: str  # relative to the repository root
    line: int
    name: str  # a function's qualified name, or "(file)"
    lines: int

    def __str__(self) -> str:
        return f"{self.path}:{self.line} {self.name} {self.lines} lines"


def is_route(node: ast.AST) -> bool:
    """A function declared as a route: a decorator `@x.get(...)`, `@x.post(...)` ..."""
    if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
        return False
    return any(
        isinstance(d, ast.Call)
        and isinstance(d.func, ast.Attribute)
        and d.func.attr in ROUTE_METHODS
        for d in node.decorator_list
    )


def span(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Lines of a function, its decorators included."""
    first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
    return (node.end_lineno or node.lineno) - first + 1


def counted_lines(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """A function's lines less those of the routes it declares (none but in a route table)."""
    routes = [child for child in ast.walk(node) if child is not node and is_route(child)]
    return span(node) - sum(
        span(r) for r in routes if isinstance(r, ast.FunctionDef | ast.AsyncFunctionDef)
    )


def functions(
    tree: ast.AST, prefix: str = ""
) -> Iterator[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    """Every function and method, nested ones included, with a qualified name."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            name = f"{prefix}{node.name}"
            yield name, node
            yield from functions(node, f"{name}.")
        elif isinstance(node, ast.ClassDef):
            yield from functions(node, f"{prefix}{node.name}.")
        else:
            yield from functions(node, prefix)


def offences(path: Path, root: Path = ROOT) -> list[Offence]:
    """What of one file is over the limits."""
    text = path.read_text()
    rel = path.relative_to(root).as_posix()
    found = []
    n_lines = len(text.splitlines())
    if n_lines > MAX_FILE_LINES:
        found.append(Offence(rel, 1, "(file)", n_lines))
    for name, node in functions(ast.parse(text, filename=rel)):
        n = counted_lines(node)
        if n > MAX_FUNCTION_LINES:
            found.append(Offence(rel, node.lineno, name, n))
    return found


def check(root: Path = ROOT, allowed: tuple[str, ...] = NOT_YET_SPLIT) -> list[str]:
    """One line per offender under services/, and one per allowed path that is not one."""
    by_file = {
        p.relative_to(root).as_posix(): offences(p, root)
        for p in sorted((root / "services").rglob("*.py"))
    }
    lines = [str(o) for rel, found in by_file.items() if rel not in allowed for o in found]
    for rel in allowed:
        if rel not in by_file:
            lines.append(f"{rel}: in NOT_YET_SPLIT but not a file under services/: remove it")
        elif not by_file[rel]:
            lines.append(f"{rel}: in NOT_YET_SPLIT but within the limits: remove it")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--allow",
        action="append",
        default=[],
        metavar="PATH",
        help="a file (relative to the repository root) that may be over the limits, "
        "besides NOT_YET_SPLIT",
    )
    args = p.parse_args(argv)
    problems = check(ROOT, (*NOT_YET_SPLIT, *args.allow))
    for line in problems:
        print(line)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
