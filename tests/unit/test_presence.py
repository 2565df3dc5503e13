"""A worker's registration (services.rollout.presence.register) against a real HTTP server: a
coordinator that says "not now" (503: its Redis away; 429) is asked again, a refusal is not."""

import asyncio
import threading

import pytest
import uvicorn
from fastapi import FastAPI, Response

from services.cli.procs import free_port
from services.rollout.presence import register
from services.rollout.settings import RolloutSettings


def serve(answers: list[int]) -> tuple[str, list[int], uvicorn.Server]:
    """A coordinator whose POST /v1/workers answers `answers` in turn (then 201)."""
    app, seen = FastAPI(), []

    @app.post("/v1/workers")
    async def workers() -> Response:
        code = answers[len(seen)] if len(seen) < len(answers) else 201
        seen.append(code)
        return Response('{"detail": "x"}', status_code=code, headers={"Retry-After": "1"})

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        threading.Event().wait(0.01)
    return f"http://127.0.0.1:{port}", seen, server


def settings(url: str) -> RolloutSettings:
    return RolloutSettings(coordinator_url=url, worker_id="w1", pool="preemptible")


def test_a_coordinator_that_says_not_now_is_asked_again():
    url, seen, server = serve([503, 429, 503])
    try:
        asyncio.run(register(settings(url)))
    finally:
        server.should_exit = True
    assert seen == [503, 429, 503, 201]


def test_a_refusal_is_not_asked_again():
    url, seen, server = serve([422])
    try:
        with pytest.raises(RuntimeError, match="registration refused: 422"):
            asyncio.run(register(settings(url)))
    finally:
        server.should_exit = True
    assert seen == [422]


def test_an_id_still_alive_is_asked_again_until_its_heartbeat_expires():
    url, seen, server = serve([409, 409, 201])  # an earlier process under the id times out
    try:
        asyncio.run(register(settings(url)))
    finally:
        server.should_exit = True
    assert seen == [409, 409, 201]
