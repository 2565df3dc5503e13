"""A small synchronous client of the coordinator API, for the CLI and the tests."""

import os
import time
from pathlib import Path

import httpx

from services.infra.service import auth_headers
from services.infra.settings import CommonSettings, env_name
from services.infra.tls import ca_verify

RETRIES_503 = 5
RETRIES_429 = 20  # a read over this client's rate waits its Retry-After, at most this often


class CoordinatorError(RuntimeError):
    pass


class CoordinatorClient:
    def __init__(
        self,
        url: str,
        token: str | None = None,
        timeout_s: float = 30.0,
        ca_file: Path | str | None = None,
    ) -> None:
        """An https:// coordinator is verified against `ca_file`, else the CA that
        SPOTRL_TLS_CA_FILE names (as the CLI reads SPOTRL_API_TOKEN), else the system's."""
        ca_file = ca_file or os.environ.get(env_name(CommonSettings, "tls_ca_file"))
        self.http = httpx.Client(
            base_url=url.rstrip("/"),
            headers=auth_headers(token),
            timeout=timeout_s,
            verify=ca_verify(ca_file),
        )

    def _send(self, method: str, path: str, **kwargs) -> httpx.Response:
        """One request; a read answered 503 (Redis restarting) is tried again after its
        Retry-After, a few times, and so is one answered 429 (over this client's read rate).
        Writes are not: the caller decides."""
        unavailable = throttled = 0
        while True:
            resp = self.http.request(method, path, **kwargs)
            if method != "GET" or resp.status_code not in (429, 503):
                return resp
            if resp.status_code == 503:
                unavailable += 1
                if unavailable >= RETRIES_503:
                    return resp
            else:
                throttled += 1
                if throttled >= RETRIES_429:
                    return resp
            time.sleep(min(float(resp.headers.get("retry-after", "1")), 5.0))

    def _json(self, resp: httpx.Response, ok: tuple[int, ...] = (200,)):
        if resp.status_code not in ok:
            raise CoordinatorError(
                f"{resp.request.method} {resp.request.url.path}: {resp.status_code} {resp.text}"
            )
        return resp.json()

    def submit(self, spec: dict) -> str:
        return self._json(self._send("POST", "/v1/runs", json=spec), (201,))["id"]

    def run(self, run_id: str) -> dict:
        return self._json(self._send("GET", f"/v1/runs/{run_id}"))

    def runs(self) -> list[dict]:
        return self._json(self._send("GET", "/v1/runs"))

    def metrics(self, run_id: str) -> list[dict]:
        return self._json(self._send("GET", f"/v1/runs/{run_id}/metrics"))["steps"]

    def prometheus(self) -> str:
        """The coordinator's /metrics (Prometheus text: its own and its data plane's)."""
        resp = self._send("GET", "/metrics")
        if resp.status_code != 200:
            raise CoordinatorError(f"GET /metrics: {resp.status_code} {resp.text[:200]}")
        return resp.text

    def cancel(self, run_id: str) -> dict:
        return self._json(self._send("POST", f"/v1/runs/{run_id}/cancel"))

    def order(self, run_id: str, order: str) -> dict:
        """POST /v1/runs/{id}/{order}: "pause" or "resume"."""
        return self._json(self._send("POST", f"/v1/runs/{run_id}/{order}"))

    def timeline(self, run_id: str, after_event: str | None = None) -> dict:
        params = {"after_event": after_event} if after_event else {}
        return self._json(self._send("GET", f"/v1/runs/{run_id}/timeline", params=params))

    def workers(self) -> list[dict]:
        return self._json(self._send("GET", "/v1/workers"))

    def fleet(self) -> dict:
        return self._json(self._send("GET", "/v1/fleet"))

    def __enter__(self) -> "CoordinatorClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.http.close()
