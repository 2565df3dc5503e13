"""The dashboard in a real headless browser (Debian's chromium through chromedriver) against
running services: loaded while a run goes, it refreshes itself, and once the run is over every
plot has data and has drawn it. Where no browser is installed the test skips, except in CI
(CI=true: `.ci/run` installs one), where it fails."""

import os
import signal

import pytest

from services.contracts.runspec import LIVE_STATES
from tests.harness.browser import (
    BrowserUnavailable,
    dashboard_state,
    open_browser,
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
