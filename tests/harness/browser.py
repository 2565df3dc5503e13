"""A real headless browser on the dashboard: Debian's chromium driven through chromedriver
(selenium). For the dashboard test and the screenshot in the docs; `make setup-browser`
installs both. Nothing is downloaded at run time: the binaries are named explicitly, so
selenium's own driver manager never runs.
"""

import os
import shutil
import time
from pathlib import Path

CHROMIUM = ("chromium", "chromium-browser", "google-chrome")
DRIVER = ("chromedriver", "chromium-driver")


class BrowserUnavailable(RuntimeError):
    pass


def _which(names: tuple[str, ...], env: str) -> str:
    if os.environ.get(env):
        return os.environ[env]
    for name in names:
        found = shutil.which(name)
        if found:
            return found
    raise BrowserUnavailable(f"none of {names} on PATH (make setup-browser, or set {env})")


def open_browser(width: int = 1400, height: int = 1500):
    """A headless chromium; the caller quits it."""
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError as exc:
        raise BrowserUnavailable(f"selenium is not installed: {exc}") from None
    options = webdriver.ChromeOptions()
    options.binary_location = _which(CHROMIUM, "SPOTRL_CHROMIUM")
    for flag in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--disable-background-networking",
        "--disable-extensions",
        "--no-first-run",
        f"--window-size={width},{height}",
    ):
        options.add_argument(flag)
    service = Service(executable_path=_which(DRIVER, "SPOTRL_CHROMEDRIVER"))
    return webdriver.Chrome(service=service, options=options)


# the "Runs on the fleet" card: its fleet line, its note ('' when hidden), a row of cell texts
# per run
FLEET_CARD_JS = """
function fleetCard() {
  const note = document.getElementById('fleet-note');
  return {
    total: document.getElementById('fleet-total').textContent,
    note: note.hidden ? '' : note.textContent,
    runs: [...document.querySelectorAll('#fleet-runs tbody tr')].map(
      (tr) => [...tr.cells].map((td) => td.textContent)),
  };
}
"""

CHART_STATE_JS = (
    FLEET_CARD_JS
    + """
const d = window.spotrlDashboard;
if (!d) return null;
const charts = {};
const errorEl = document.getElementById('error');
for (const el of document.querySelectorAll('.chart')) {
  const name = el.id.replace('chart-', '');
  const canvas = el.querySelector('canvas');
  let inked = 0;
  if (canvas && canvas.width && canvas.height) {
    const px = canvas.getContext('2d').getImageData(0, 0, canvas.width, canvas.height).data;
    for (let i = 3; i < px.length; i += 4) if (px[i] > 0) inked++;
  }
  charts[name] = {points: Number(el.dataset.points || 0), inked_pixels: inked};
}
return {
  refreshes: d.refreshes,
  run: d.runId,
  charts: charts,
  state: document.getElementById('s-state').textContent,
  step: document.getElementById('s-step').textContent,
  error: errorEl.hidden ? '' : errorEl.textContent,
  events: document.querySelectorAll('#events tbody tr').length,
  fleet: fleetCard(),
};
"""
)


def dashboard_state(driver) -> dict | None:
    """What the page shows: per chart the data points it drew and the pixels its canvas inked."""
    return driver.execute_script(CHART_STATE_JS)


def render_fleet(driver, fleet: dict, workers: list[dict]) -> dict:
    """Draw the fleet card from the given GET /v1/fleet and GET /v1/workers answers (the page's
    own `fleetFigures` and `renderFleet`) and return what it shows; the next refresh redraws it."""
    script = FLEET_CARD_JS + "renderFleet(fleetFigures(arguments[0], arguments[1]));"
    return driver.execute_script(script + "return fleetCard();", fleet, workers)


def wait_for(driver, predicate, timeout_s: float = 60.0, poll_s: float = 0.5) -> dict:
    """Poll the page's state until `predicate(state)` holds; return that state."""
    deadline = time.monotonic() + timeout_s
    state = None
    while time.monotonic() < deadline:
        state = dashboard_state(driver)
        if state is not None and predicate(state):
            return state
        time.sleep(poll_s)
    raise TimeoutError(f"dashboard never reached the expected state; last: {state}")


def screenshot(driver, out: Path, max_height: int | None = None) -> Path:
    """The page, as tall as its content (or `max_height` pixels of it)."""
    height = driver.execute_script("return document.body.scrollHeight") + 120
    width = driver.execute_script("return document.body.scrollWidth")
    driver.set_window_size(max(width, 1200), min(height, max_height or height))
    out.parent.mkdir(parents=True, exist_ok=True)
    driver.save_screenshot(str(out))
    return out
