"""The dashboard at `/`: one static page whose script reads the coordinator's own API (runs,
per-step metrics, timeline) and draws it with uPlot, refreshing itself while a run goes."""

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

STATIC = Path(__file__).parent / "static"


def add_dashboard(app: FastAPI) -> None:
    app.mount("/static", StaticFiles(directory=STATIC), name="static")

    @app.get("/", include_in_schema=False)
    async def index() -> FileResponse:
        return FileResponse(STATIC / "index.html", headers={"Cache-Control": "no-cache"})
