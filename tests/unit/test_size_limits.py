"""tools/size_limits.py: the services' files and functions within the limits, its rules (route
tables, the NOT_YET_SPLIT list that cannot rot) on small made-up trees."""

import textwrap
from pathlib import Path

from tools import size_limits


def test_the_services_are_within_the_limits():
    problems = size_limits.check()
    assert not problems, "\n".join(problems)


def write(root: Path, rel: str, text: str) -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))


def long_body(n: int, indent: str = "    ") -> str:
    return "".join(f"{indent}x{i} = {i}\n" for i in range(n))


OVER = size_limits.MAX_FILE_LINES + 1  # one line over the file bound


def test_a_long_function_and_a_long_file_are_offenders(tmp_path):
    write(tmp_path, "services/a.py", "def f():\n" + long_body(60) + "\n" * (OVER - 61))
    write(tmp_path, "services/b.py", "class C:\n    def m(self):\n" + long_body(59, " " * 8))
    assert size_limits.check(tmp_path, ()) == [
        f"services/a.py:1 (file) {OVER} lines",
        "services/a.py:1 f 61 lines",
    ]


def test_route_declarations_do_not_count_toward_a_route_table(tmp_path):
    routes = "".join(
        f"    @app.get('/r{i}')\n    async def r{i}() -> int:\n" + long_body(10, " " * 8)
        for i in range(10)
    )
    write(tmp_path, "services/app.py", "def build_app(app):\n" + long_body(50) + routes)
    assert size_limits.check(tmp_path, ()) == []
    # logic beside the routes still counts, and so does a long route of its own
    long_route = "    @app.post('/long')\n    async def long() -> None:\n" + long_body(60, " " * 8)
    write(tmp_path, "services/app.py", "def build_app(app):\n" + long_body(60) + long_route)
    assert size_limits.check(tmp_path, ()) == [
        "services/app.py:1 build_app 61 lines",
        "services/app.py:63 build_app.long 62 lines",
    ]


def test_an_allowed_file_must_still_be_over_the_limits(tmp_path):
    write(tmp_path, "services/big.py", "\n" * OVER)
    write(tmp_path, "services/small.py", "x = 1\n")
    assert size_limits.check(tmp_path, ("services/big.py",)) == []
    assert size_limits.check(tmp_path, ("services/big.py", "services/small.py")) == [
        "services/small.py: in NOT_YET_SPLIT but within the limits: remove it"
    ]
    assert size_limits.check(tmp_path, ("services/gone.py",)) == [
        f"services/big.py:1 (file) {OVER} lines",
        "services/gone.py: in NOT_YET_SPLIT but not a file under services/: remove it",
    ]


def test_the_command_line_fails_with_one_line_per_offender(capsys, monkeypatch, tmp_path):
    write(tmp_path, "services/big.py", "\n" * OVER)
    monkeypatch.setattr(size_limits, "ROOT", tmp_path)
    monkeypatch.setattr(size_limits, "NOT_YET_SPLIT", ())
    assert size_limits.main([]) == 1
    assert capsys.readouterr().out == f"services/big.py:1 (file) {OVER} lines\n"
    assert size_limits.main(["--allow", "services/big.py"]) == 0
