"""The scaler's pure decision (`cli.scale_decision.decide`), table-driven, with no run and with
runs; the deployment's figures from its active runs (`contracts.fleet.fleet_figures`); the command
lines `spotrl scale` gives Swarm and Compose; its settings' validation."""

import subprocess
import sys
from itertools import product

import pytest
from pydantic import ValidationError

from services.cli.scale import one_line
from services.cli.scale_decision import (
    DOWN,
    DOWN_NO_RUN,
    HOLD_AT_MAX,
    HOLD_AT_MIN,
    HOLD_COOLDOWN,
    HOLD_NO_FIGURE,
    HOLD_NO_RUN,
    HOLD_STEADY,
    UP,
    BoundsError,
    ScalePolicy,
    decide,
)
from services.cli.scale_settings import ScaleSettings
from services.cli.scale_targets import (
    ComposeService,
    ScaleTargetError,
    ScaleTargetMissing,
    SwarmService,
    compose_base,
    compose_count_command,
    compose_scale_command,
    run_engine_command,
    swarm_inspect_command,
    swarm_scale_command,
)
from services.contracts.fleet import FleetFigures, fleet_figures

POLICY = ScalePolicy(min_replicas=1, max_replicas=8, up_cooldown_s=30, down_cooldown_s=120)
MAX_WHEN_UNKNOWN = ScalePolicy(1, 8, 30, 120, when_unknown="max")

# policy, wanted, current, last change (None: never), now -> target, reason
CASES = [
    # follows the figure, within bounds
    ("up", POLICY, 5, 2, None, 1000.0, 5, UP),
    ("down", POLICY, 3, 6, None, 1000.0, 3, DOWN),
    ("equal: no-op", POLICY, 4, 4, None, 1000.0, 4, HOLD_STEADY),
    # bounds
    ("above max: to max", POLICY, 20, 3, None, 1000.0, 8, UP),
    ("above max, at max", POLICY, 20, 8, None, 1000.0, 8, HOLD_AT_MAX),
    ("over max: down to max", POLICY, 20, 12, None, 1000.0, 8, DOWN),
    ("below min, at min", ScalePolicy(2, 8), 1, 2, None, 1000.0, 2, HOLD_AT_MIN),
    ("below min: up to min", ScalePolicy(2, 8), 1, 0, None, 1000.0, 2, UP),
    ("max 0: pool off", ScalePolicy(0, 0), 5, 3, None, 1000.0, 0, DOWN),
    # cooldowns count from the last change, each direction its own
    ("up in cooldown", POLICY, 5, 2, 990.0, 1000.0, 2, HOLD_COOLDOWN),
    ("up after cooldown", POLICY, 5, 2, 970.0, 1000.0, 5, UP),
    ("down in cooldown", POLICY, 2, 5, 950.0, 1000.0, 5, HOLD_COOLDOWN),
    ("down after cooldown", POLICY, 2, 5, 880.0, 1000.0, 2, DOWN),
    ("equal in cooldown", POLICY, 4, 4, 999.0, 1000.0, 4, HOLD_STEADY),
    # no figure: null, and 0 (the gauge's null: "0: all")
    ("null: hold", POLICY, None, 3, None, 1000.0, 3, HOLD_NO_FIGURE),
    ("0: hold", POLICY, 0, 3, None, 1000.0, 3, HOLD_NO_FIGURE),
    ("null, below min: to min", ScalePolicy(2, 8), None, 0, None, 1000.0, 2, UP),
    ("null, above max: to max", POLICY, None, 11, None, 1000.0, 8, DOWN),
    ("null, max: to max", MAX_WHEN_UNKNOWN, None, 3, None, 1000.0, 8, UP),
    ("0, max: to max", MAX_WHEN_UNKNOWN, 0, 3, None, 1000.0, 8, UP),
    ("null, max, at max", MAX_WHEN_UNKNOWN, None, 8, None, 1000.0, 8, HOLD_STEADY),
    ("null, max, in cooldown", MAX_WHEN_UNKNOWN, None, 3, 990.0, 1000.0, 3, HOLD_COOLDOWN),
]


@pytest.mark.parametrize(
    ("policy", "wanted", "current", "last_change", "now", "target", "reason"),
    [c[1:] for c in CASES],
    ids=[c[0] for c in CASES],
)
def test_decision(policy, wanted, current, last_change, now, target, reason):
    decision = decide(policy, wanted, current, last_change, now)
    assert (decision.target, decision.reason) == (target, reason)
    assert decision.changes == (target != current)
    assert decision.wanted == wanted and decision.current == current


def test_cooldown_says_how_long_is_left():
    decision = decide(POLICY, 5, 2, 990.0, 1000.0)
    assert decision.reason == HOLD_COOLDOWN and decision.cooldown_left_s == pytest.approx(20.0)
    assert decide(POLICY, 5, 2, 990.0, 1020.0).reason == UP  # exactly at its end


def test_a_hold_never_moves_the_count():
    grid = product((None, 0, 1, 3, 8, 50), range(0, 12), (None, 999.0), (True, False))
    for wanted, current, last, active in grid:
        d = decide(POLICY, wanted, current, last, 1000.0, active)
        if d.reason.startswith("hold"):
            assert d.target == current, d
        else:
            assert POLICY.min_replicas <= d.target <= POLICY.max_replicas, d


# no run active: the lower bound, whatever the figure, after the cooldown of the way it goes;
# policy, wanted, current, last change, now -> target, reason
NO_RUN_CASES = [
    ("down to min", POLICY, None, 6, None, 1000.0, 1, DOWN_NO_RUN),
    ("a stale figure is ignored", POLICY, 7, 6, None, 1000.0, 1, DOWN_NO_RUN),
    ("min 0: pool off", ScalePolicy(0, 8), 3, 5, None, 1000.0, 0, DOWN_NO_RUN),
    ("at min", POLICY, None, 1, None, 1000.0, 1, HOLD_NO_RUN),
    ("at min 0", ScalePolicy(0, 8), None, 0, 999.0, 1000.0, 0, HOLD_NO_RUN),
    ("below min: up to min", ScalePolicy(2, 8), None, 0, None, 1000.0, 2, UP),
    ("down in cooldown", POLICY, None, 6, 950.0, 1000.0, 6, HOLD_COOLDOWN),
    ("down after cooldown", POLICY, None, 6, 880.0, 1000.0, 1, DOWN_NO_RUN),
    ("when_unknown max changes nothing", MAX_WHEN_UNKNOWN, None, 6, None, 1000.0, 1, DOWN_NO_RUN),
]


@pytest.mark.parametrize(
    ("policy", "wanted", "current", "last_change", "now", "target", "reason"),
    [c[1:] for c in NO_RUN_CASES],
    ids=[c[0] for c in NO_RUN_CASES],
)
def test_with_no_run_the_pool_goes_to_its_minimum(
    policy, wanted, current, last_change, now, target, reason
):
    decision = decide(policy, wanted, current, last_change, now, run_active=False)
    assert (decision.target, decision.reason) == (target, reason)
    assert decision.changes == (target != current)


def test_a_run_without_a_figure_holds_where_no_run_goes_to_the_minimum():
    assert decide(POLICY, 0, 6, None, 1000.0).reason == HOLD_NO_FIGURE
    assert decide(POLICY, 0, 6, None, 1000.0, run_active=False).target == 1


@pytest.mark.parametrize(
    ("wanted_by_run", "runs_active", "wanted"),
    [
        ([], 0, 0),  # no run: 0 and 0
        ([None], 1, 0),  # a run without a figure yet
        ([0], 1, 0),  # the same, as the gauge writes it
        ([4], 1, 4),
        ([4, 3], 2, 7),  # several runs add up
        ([4, None], 2, 0),  # one without a figure: hold until each has one
    ],
)
def test_the_fleets_figures_from_its_active_runs(wanted_by_run, runs_active, wanted):
    assert fleet_figures(wanted_by_run) == FleetFigures(runs_active, wanted)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((3, 2), "min replicas 3 > max 2"),
        ((-1, 2), "min replicas -1 < 0"),
        ((0, 10**6), "> 10000"),
        ((0, 2, -1.0), "cooldowns"),
    ],
)
def test_bad_bounds_are_refused(args, message):
    with pytest.raises(BoundsError, match=message):
        ScalePolicy(*args)


def test_settings_refuse_bad_bounds_and_a_missing_name_in_one_line():
    base = {"url": "http://127.0.0.1:1", "target": "swarm", "service": "rollout"}
    with pytest.raises(ValidationError) as exc:
        ScaleSettings(**base, min_replicas=4, max_replicas=2)
    assert one_line(exc.value) == "--min 4 > --max 2"
    with pytest.raises(ValidationError) as exc:
        ScaleSettings(**base | {"target": "k8s"}, max_replicas=2)
    assert one_line(exc.value) == "--target k8s needs --deployment"
    with pytest.raises(ValidationError) as exc:
        ScaleSettings(**base, max_replicas=2, interval_s=0)
    assert one_line(exc.value).startswith("interval_s: ")
    ok = ScaleSettings(**base, max_replicas=2)
    assert ok.policy() == ScalePolicy(0, 2, 60.0, 300.0, "hold")


def test_swarm_command_lines():
    assert swarm_inspect_command("spotrl_rollout-spot") == [
        "docker",
        "service",
        "inspect",
        "--format",
        "{{if .Spec.Mode.Replicated}}{{.Spec.Mode.Replicated.Replicas}}{{else}}global{{end}}",
        "spotrl_rollout-spot",
    ]
    assert swarm_scale_command("spotrl_rollout-spot", 3) == [
        "docker",
        "service",
        "update",
        "--replicas",
        "3",
        "--no-resolve-image",  # no registry lookup
        "--detach",
        "spotrl_rollout-spot",
    ]


def test_compose_command_lines():
    base = compose_base(["/bin/docker-compose"], "spotrl", ["a.yml", "b.yml"])
    files = ["--file", "a.yml", "--file", "b.yml"]
    assert base == ["/bin/docker-compose", "--project-name", "spotrl", *files]
    assert compose_count_command(base, "rollout") == [*base, "ps", "--quiet", "rollout"]
    assert compose_scale_command(base, "rollout", 4) == [
        *base,
        "up",
        "--detach",
        "--no-recreate",
        "--no-deps",
        "--no-build",
        "--scale",
        "rollout=4",
        "rollout",
    ]
    assert compose_base(["docker", "compose"], None, []) == ["docker", "compose"]


def test_engine_errors_are_one_line_and_no_such_service_is_missing():
    script = "import sys; sys.stderr.write('\\nError: No such service: x\\nmore\\n'); sys.exit(1)"
    with pytest.raises(ScaleTargetMissing, match=r"^inspect: Error: No such service: x$"):
        run_engine_command([sys.executable, "-c", script], "inspect")
    with pytest.raises(ScaleTargetError, match=r"^ps: .* not found$"):
        run_engine_command(["/nonexistent/docker"], "ps")
    assert run_engine_command([sys.executable, "-c", "print(3)"], "x") == "3\n"


@pytest.mark.skipif(
    subprocess.run(["which", "docker"], capture_output=True).returncode != 0,
    reason="no docker CLI",
)
def test_a_daemon_that_is_not_there_is_an_engine_error(tmp_path, monkeypatch):
    """The real docker CLI (and compose binary) pointed at a socket nobody serves."""
    monkeypatch.setenv("DOCKER_HOST", f"unix://{tmp_path / 'none.sock'}")
    for target in (SwarmService("rollout"), ComposeService("rollout", "spotrl")):
        with pytest.raises(ScaleTargetError, match="Cannot connect to the Docker daemon") as exc:
            target.replicas()
        assert not isinstance(exc.value, ScaleTargetMissing)
        assert "\n" not in str(exc.value)
