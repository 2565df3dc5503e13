"""The dashboard in a real headless browser (Debian's chromium through chromedriver) against
running services: loaded while a run goes, it refreshes itself, and once the run is over every
plot has data and has drawn it. Where no browser is installed the test skips, except in CI
(`make test` installs one), where it fails."""

import os
import signal
import time

import pytest

from services.cli.browser import BrowserUnavailable, open_browser, screenshot, wait_for
from services.cli.deploy import DeploymentConfig

from .conftest import small_spec, wait_final

STEPS = 5
PLOTS = ("reward", "throughput", "pool", "churn", "tseed", "trainer")


@pytest.fixture(scope="module")
def deployment_config(tmp_path_factory) -> DeploymentConfig:
    return DeploymentConfig(
        tmp_path_factory.mktemp("dashboard"),
        reserved=1,
        preemptible=2,
        worker_slots=16,
        flush_tokens=2,
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
        if os.environ.get("CI"):
            pytest.fail(f"CI must run the browser test: {exc}")
        pytest.skip(str(exc))
    yield driver
    driver.quit()


def test_dashboard_draws_a_run_as_it_goes(deployment, client, tiny_model, browser, tmp_path):
    run_id = client.submit(small_spec(tiny_model, steps=STEPS, max_new_tokens=6))
    browser.get(f"{deployment.coordinator_url}/?refresh_ms=500")
    # while the run goes, the page refreshes and its plots grow
    first = wait_for(browser, lambda s: s["run"] == run_id and s["charts"]["reward"]["points"] >= 1)
    assert first["state"] == "running" and first["error"] == ""
    preemptible = [p for n, p in deployment.procs.items() if n.startswith("rollout-preemptible")]
    preemptible[0].popen.send_signal(signal.SIGTERM)  # a preemption with notice, mid-run
    run = wait_final(client, deployment, run_id)
    assert run["state"] == "succeeded"
    time.sleep(1.5)  # a last refresh after the final state
    last = wait_for(
        browser,
        lambda s: s["state"] == "succeeded" and s["charts"]["reward"]["points"] == STEPS,
        timeout_s=30,
    )
    assert last["refreshes"] > first["refreshes"]
    assert last["step"] == f"{STEPS} / {STEPS}"
    for name in PLOTS:
        chart = last["charts"][name]
        assert chart["points"] > 0, (name, last)
        assert chart["inked_pixels"] > 1000, (name, last)  # the canvas was drawn on
    assert last["charts"]["throughput"]["points"] == STEPS
    assert last["events"] >= 2 * STEPS  # rollout_done and trained per step, and more
    page = browser.page_source
    assert "worker_left" in page and "cause=notice" in page
    shot = screenshot(browser, tmp_path / "dashboard.png")
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
