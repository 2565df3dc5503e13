"""The dashboard at `/`: one static page whose script reads the coordinator's own API (runs,
per-step metrics, timeline) and draws it with uPlot, refreshing itself while a run goes. The
page is read once and served from memory with its ETag (a reload that has it gets a 304)."""

from pathlib import Path

from fastapi import FastAPI, Request, Response
from fastapi.staticfiles import StaticFiles

from services.infra.read_limit import etag_of, revalidated

STATIC = Path(__file__).parent / "static"


def add_dashboard(app: FastAPI) -> None:
    app.mount("/static", StaticFiles(directory=STATIC), name="static")
    page = (STATIC / "index.html").read_bytes()
    etag = etag_of(page)

    @app.get("/", include_in_schema=False)
    async def index(request: Request) -> Response:
        return revalidated(request, page, etag, media_type="text/html; charset=utf-8")
