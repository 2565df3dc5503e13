"""The observer's pure part (tokens/s from heartbeats, joins and leaves), the CLI's renderings,
and that the dashboard's files ship with the package."""

import tomllib
from fnmatch import fnmatch
from pathlib import Path

import pytest
from rich.console import Console

from services.cli.follow import event_line, progress_info, runs_table
from services.contracts.messages import Heartbeat
from services.coordinator.workers.observer import RateTracker, pool_rates
from tests import factories

ROOT = Path(__file__).resolve().parents[2]


def beat(worker: str, at: float, tokens: int, pool: str = "preemptible") -> Heartbeat:
    return factories.beat(
        worker, pool, run_id="r", active=1, slots=4, tokens_generated=tokens, at=at
    )


def test_rates_come_from_the_workers_own_clock_and_counter():
    tracker = RateTracker(window_s=10.0)
    first = tracker.update({"a": beat("a", 100.0, 0), "b": beat("b", 100.0, 0, "reserved")})
    assert first.joined == ["a", "b"] and first.rates == {"a": 0.0, "b": 0.0}
    tracker.update({"a": beat("a", 101.0, 50), "b": beat("b", 101.0, 200, "reserved")})
    later = tracker.update({"a": beat("a", 102.0, 100), "b": beat("b", 102.0, 400, "reserved")})
    assert later.rates == pytest.approx({"a": 50.0, "b": 200.0})
    beats = {"a": beat("a", 102.0, 100), "b": beat("b", 102.0, 400, "reserved")}
    assert pool_rates(later, beats) == pytest.approx({"reserved": 200.0, "preemptible": 50.0})


def test_the_window_slides_and_a_stale_heartbeat_adds_no_point():
    tracker = RateTracker(window_s=2.0)
    for t, n in [(0.0, 0), (1.0, 1000), (2.0, 1010), (3.0, 1020), (4.0, 1030)]:
        changes = tracker.update({"a": beat("a", t, n)})
    assert changes.rates["a"] == pytest.approx(10.0)  # the burst at t=1 fell out of the window
    again = tracker.update({"a": beat("a", 4.0, 1030)})  # the same heartbeat read twice
    assert again.rates["a"] == pytest.approx(10.0)


def test_leaving_and_restarting_workers():
    tracker = RateTracker()
    tracker.update({"a": beat("a", 0.0, 500), "b": beat("b", 0.0, 0)})
    gone = tracker.update({"a": beat("a", 1.0, 600)})
    assert list(gone.left) == ["b"] and gone.left["b"].pool == "preemptible"
    restarted = tracker.update({"a": beat("a", 2.0, 10)})  # counter went back: a new process
    assert restarted.rates["a"] == 0.0
    back = tracker.update({"a": beat("a", 3.0, 40), "b": beat("b", 3.0, 0)})
    assert back.joined == ["b"] and back.rates["a"] == pytest.approx(30.0)


def test_event_lines_and_progress_text():
    line = event_line(
        {"id": "1-0", "at": 0.0, "kind": "worker_left", "worker": "w1", "cause": "lost", "x": 0.5}
    )
    assert line.split()[1:] == ["worker_left", "worker=w1", "cause=lost", "x=0.500"]
    run = {"state": "running", "reward_mean": None, "tokens_per_s": 1234.4}
    assert progress_info(run, 3) == "running  reward -  tok/s 1234  workers 3"


def test_the_dashboard_ships_with_the_package():
    static = ROOT / "services" / "coordinator" / "static"
    globs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-data"
    ]["services.coordinator"]
    files = [p.relative_to(static.parent).as_posix() for p in static.rglob("*") if p.is_file()]
    assert {"static/index.html", "static/dashboard.js", "static/vendor/uPlot.iife.min.js"} <= set(
        files
    )
    for f in files:
        assert any(fnmatch(f, g) for g in globs), f"{f} is not in the package data"
    index = (static / "index.html").read_text()
    for ref in (
        "/static/vendor/uPlot.iife.min.js",
        "/static/dashboard.js",
        "/static/dashboard.css",
    ):
        assert ref in index and (static.parent / ref.lstrip("/")).is_file()


def test_the_progress_bar_shows_failed_calls_of_user_code_with_their_share():
    run = {"state": "running", "reward_mean": 0.5, "tokens_per_s": 10.0, "errors": {}}
    assert progress_info(run, 1) == "running  reward 0.500  tok/s 10  workers 1"
    run["errors"] = {
        "environment": {"calls": 96, "failed": 12, "share": 0.125},
        "reward": {"calls": 0, "failed": 0, "share": 0.0},
    }
    assert progress_info(run, 1).endswith("workers 1  env errors 12/96 (12.5%)")


def test_the_runs_table_shows_each_active_runs_share_and_workers():
    run = {"step": 1, "steps": 4, "reward_mean": 0.5, "tokens_per_s": 10.0, "t_seed_s": 1.0}
    run |= {"error": "", "stall_reason": ""}
    runs = [run | {"id": "a", "state": "running"}, run | {"id": "b", "state": "succeeded"}]
    fleet = {"runs": [{"id": "a", "share": 2.0, "workers": 3, "slots": 24, "active": 7}]}
    console = Console(width=200, record=True)
    console.print(runs_table(runs, fleet))
    lines = {line.split()[1]: line for line in console.export_text().splitlines() if "│" in line}
    assert "2.0" in lines["a"] and "3 (7/24)" in lines["a"]
    assert "(" not in lines["b"]  # an ended run holds no share
