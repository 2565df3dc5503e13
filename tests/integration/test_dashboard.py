"""The dashboard in a real headless browser (Debian's chromium through chromedriver) against
running services: loaded while a run goes, it refreshes itself, and once the run is over every
plot has data and has drawn it; its fleet card shows the active run, and draws two runs' shares
and use from given answers with their ids as text. Where no browser is installed the test
skips, except in CI (CI=true: `.ci/run` installs one), where it fails."""

import os
import signal

import pytest

from services.contracts.runspec import LIVE_STATES
from tests.harness.browser import (
    BrowserUnavailable,
    dashboard_state,
    open_browser,
    render_fleet,
    screenshot,
    wait_for,
)
from tests.harness.deploy import DeploymentConfig

from .conftest import deploy_config, small_spec, wait_final, wait_until

STEPS = 5
PLOTS = ("reward", "throughput", "pool", "churn", "tseed", "trainer")


@pytest.fixture(scope="module")
def deployment_config(tmp_path_factory) -> DeploymentConfig:
    return deploy_config(
        tmp_path_factory.mktemp("dashboard"),
        preemptible=2,
        extra_env={
            "SPOTRL_OBSERVE_S": "0.3",
            "SPOTRL_HEARTBEAT_TTL_S": "2",
            "SPOTRL_STEP_DELAY_MS": "60",
        },
    )


@pytest.fixture(scope="module")
def browser():
    try:
        driver = open_browser()
    except BrowserUnavailable as exc:
        reason = f"chromium/chromedriver not found: make setup-browser (apt-get, needs root): {exc}"
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(f"CI must run the browser test: {reason}")
        pytest.skip(reason)
    yield driver
    driver.quit()


def test_dashboard_draws_a_run_as_it_goes(deployment, client, tiny_model, browser, tmp_path):
    run_id = client.submit(small_spec(tiny_model, steps=STEPS, max_new_tokens=6))
    browser.get(f"{deployment.coordinator_url}/?refresh_ms=500")
    # while the run goes, the page refreshes and its plots grow
    first = wait_for(browser, lambda s: s["run"] == run_id and s["state"] in LIVE_STATES)
    assert first["error"] == ""
    # the fleet card: the one active run, all the shares its own, and the fleet's workers
    card = wait_for(browser, lambda s: [r[0] for r in s["fleet"]["runs"]] == [run_id])["fleet"]
    assert card["runs"][0][1:3] == ["1.0", "100%"], card
    assert card["note"] == "one run active: the fleet is its own", card
    assert card["total"].startswith("fleet: 3 alive workers, 48 slots, "), card
    preemptible = [p for n, p in deployment.procs.items() if n.startswith("rollout-preemptible")]
    preemptible[0].popen.send_signal(signal.SIGTERM)  # a preemption with notice, mid-run
    run = wait_final(client, deployment, run_id)
    assert run["state"] == "succeeded"
    wait_until(
        lambda: any(
            e["kind"] == "worker_left" and e["worker"] == preemptible[0].name
            for e in client.timeline(run_id)["events"]
        ),
        "the worker preempted with notice never left the run's timeline",
        30,
        0.2,
    )
    # a refresh that started after the final state and the last event were recorded
    seen = dashboard_state(browser)["refreshes"]
    last = wait_for(
        browser,
        lambda s: (
            s["state"] == "succeeded"
            and s["charts"]["reward"]["points"] == STEPS
            and s["refreshes"] >= seen + 2
        ),
        timeout_s=30,
    )
    assert last["refreshes"] > first["refreshes"]
    assert last["charts"]["reward"]["points"] > first["charts"]["reward"]["points"]
    assert last["step"] == f"{STEPS} / {STEPS}"
    for name in PLOTS:
        chart = last["charts"][name]
        assert chart["points"] > 0, (name, last)
        assert chart["inked_pixels"] > 1000, (name, last)  # the canvas was drawn on
    assert last["charts"]["throughput"]["points"] == STEPS
    assert last["events"] >= 2 * STEPS  # rollout_done and trained per step, and more
    page = browser.page_source
    assert "worker_left" in page and "cause=notice" in page
    # the size of the newest version the trainer committed (a full-weight run: the model's)
    assert browser.find_element("id", "s-version").text.endswith(("kB", "MB")), page[-2000:]
    shot = screenshot(browser, tmp_path / "dashboard.png")
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_fleet_card_shows_each_runs_share_and_use(deployment, browser):
    """Two active runs drawn from given answers: their fair parts of the shares, their use of
    the fleet's active requests, the busy workers; a run id is text, never markup."""
    browser.get(f"{deployment.coordinator_url}/?refresh_ms=60000")
    wait_for(browser, lambda s: s["refreshes"] >= 1)
    hostile = '<img src=x onerror="window.pwned=1">'
    fleet = {
        "runs": [
            {"id": hostile, "share": 2.0, "workers": 2, "slots": 32, "active": 30},
            {"id": "b", "share": 1.0, "workers": 1, "slots": 16, "active": 10},
        ]
    }
    workers = [
        {"alive": True, "slots": 16, "active": 20},
        {"alive": True, "slots": 16, "active": 10},
        {"alive": True, "slots": 16, "active": 10},
        {"alive": True, "slots": 16, "active": 0},
        {"alive": False, "slots": 16, "active": 5},  # a dead worker counts for nothing
    ]
    card = render_fleet(browser, fleet, workers)
    assert card["runs"] == [
        [hostile, "2.0", "67%", "2", "32", "30", "75%"],
        ["b", "1.0", "33%", "1", "16", "10", "25%"],
    ]
    assert card["note"] == ""
    assert (
        card["total"]
        == "fleet: 4 alive workers, 64 slots, 40 active requests, 75% of the workers busy"
    )
    assert browser.find_elements("css selector", "#fleet-runs img") == []
    assert browser.execute_script("return window.pwned === undefined")
    none = render_fleet(browser, {"runs": []}, [])
    assert none["runs"] == [] and none["note"] == "no run active"
    assert none["total"] == "fleet: 0 alive workers, 0 slots, 0 active requests, –"
