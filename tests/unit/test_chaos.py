import random

import pytest

from services.cli.chaos import held, plan
from services.infra.traces import TraceError, TracePoint, load_trace, worker_targets

TRACES = __import__("pathlib").Path(__file__).resolve().parents[3] / "shared" / "traces"


def test_targets_scale_time_and_fleet_and_collapse_instant_changes():
    trace = [
        TracePoint(0, 8),
        TracePoint(100, 8),
        TracePoint(100, 4),
        TracePoint(300, 0),
        TracePoint(400, 8),
    ]
    assert worker_targets(trace, time_scale=100, max_workers=2) == [
        (0.0, 2),
        (1.0, 1),
        (3.0, 0),
        (4.0, 2),
    ]
    assert worker_targets(trace, 100, 2, hours=200 / 3600) == [(0.0, 2), (1.0, 1)]


def test_plan_starts_or_picks_victims_with_the_mix():
    rng = random.Random(0)
    assert plan(["a"], 3, rng, 0.5).start == 2
    change = plan(["a", "b", "c", "d"], 0, rng, 1.0)
    assert sorted(change.sigterm) == ["a", "b", "c", "d"] and not change.sigkill
    change = plan(["a", "b"], 1, rng, 0.0)
    assert len(change.sigkill) == 1 and not change.sigterm


def test_a_scaler_holds_what_is_offered_and_no_more_than_is_wanted():
    assert held(offered=8, wanted=None) == 8  # nothing asked yet: hold what the cloud gives
    assert held(8, 5) == 5
    assert held(3, 5) == 3  # the cloud offers fewer than wanted


def test_bad_traces_are_refused_with_the_line(tmp_path):
    bad = tmp_path / "t.csv"
    bad.write_text("seconds,available\n0,2\n5,x\n")
    with pytest.raises(TraceError, match="t.csv:3"):
        load_trace(bad)
    bad.write_text("time,count\n0,1\n")
    with pytest.raises(TraceError, match="header"):
        load_trace(bad)
    with pytest.raises(TraceError, match="does not exist"):
        load_trace(tmp_path / "none.csv")


@pytest.mark.skipif(not TRACES.is_dir(), reason="shared traces not beside the checkout")
def test_shared_traces_load():
    for path in TRACES.glob("*.csv"):
        points = load_trace(path)
        assert points and max(p.available for p in points) > 0


def test_targets_can_start_inside_the_trace():
    trace = [TracePoint(0, 0), TracePoint(50, 4), TracePoint(150, 2)]
    assert worker_targets(trace, 10, 4, start_s=100) == [(0.0, 4), (5.0, 2)]
