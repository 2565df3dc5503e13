"""Weight store HTTP API: upload files of a version, commit it atomically, read manifests and
files (with HTTP range requests). It knows nothing of runs or training.
"""

import asyncio
import logging
import pathlib
import time
from contextlib import asynccontextmanager
from functools import partial
from typing import Annotated, Any

from fastapi import FastAPI, Header, HTTPException, Path, Query, Request
from fastapi.responses import FileResponse, JSONResponse
from prometheus_client import Counter
from pydantic import BaseModel
from starlette.requests import ClientDisconnect

from services.infra import tls_reload
from services.infra.http_limits import guard_input
from services.infra.scopes import Scope
from services.infra.service import (
    BackgroundTasks,
    add_health_and_metrics,
    auth_for,
    errors,
    tokens_of,
)
from services.weights.block_server import BlockServer
from services.weights.contract import (
    MAX_VERSION,
    ContentHeld,
    ContentQuery,
    FileEntry,
    Manifest,
    ManifestCommit,
)
from services.weightstore.settings import WeightStoreSettings
from services.weightstore.storage import NotFound, StorageError, WeightStorage

log = logging.getLogger(__name__)

# Path parameters: a version is a non-negative 31-bit number; names are checked by the storage
Version = Annotated[int, Path(ge=0, le=MAX_VERSION)]
Name = Annotated[str, Path(min_length=1, max_length=200)]
UPLOAD = "/v1/models/{model}/versions/{version}/files/{name}"
COMMIT = "/v1/models/{model}/versions/{version}/commit"
READERS: tuple[Scope, ...] = ("read", "worker", "trainer")  # who may read the store's files


class ModelList(BaseModel):
    models: list[str]


class VersionList(BaseModel):
    model: str
    versions: list[int]


class BlockPort(BaseModel):
    port: int


def committed_file(
    storage: WeightStorage, model: str, version: int, name: str, start: int, last: int | None
) -> pathlib.Path | None:
    """The committed file the block server answers with (any range of it), or None. A file kept
    as its delta only is not made whole here (it would stall every transfer of this thread):
    a puller asks the API for the version whole first."""
    try:
        return storage.file_path(model, version, name, make=False)
    except StorageError:
        return None


class ShardResponse(FileResponse):
    """FileResponse in 4 MiB reads: starlette's 64 KiB default costs a thread hop per 64 KiB."""

    chunk_size = 4 * 1024 * 1024


BYTES_IN = Counter("spotrl_weightstore_bytes_received_total", "Bytes uploaded")
COMMITS = Counter("spotrl_weightstore_commits_total", "Versions committed")
MANIFESTS = Counter("spotrl_weightstore_manifests_served_total", "Manifests served")


def block_server(settings: WeightStoreSettings, storage: WeightStorage) -> BlockServer | None:
    """The zero-copy block server of the committed files, where the settings ask for one."""
    if not settings.serve_blocks:
        return None
    return BlockServer(
        partial(committed_file, storage),
        settings.host,
        settings.block_port,
        tokens_of(settings) if settings.protect_reads else None,
        settings.max_serving,
        settings.egress_mbps * 1e6 / 8 if settings.egress_mbps else None,
        ssl_context=tls_reload.server_context(settings),
        scopes=frozenset(READERS),
        limits=settings.connection_limits(),
    )


def discard_staging(
    storage: WeightStorage, settings: WeightStoreSettings, model: str, own: bool = False
) -> None:
    """Drop the model's uploads left uncommitted longer than `stale_staging_s` (with `own`,
    this process's too: at start, none of them is still under way)."""
    gone = storage.discard_staging(model, settings.stale_staging_s, time.time(), own)
    if gone:
        log.info("%s: discarded the staging of %s", model, ", ".join(gone))


def lifespan_of(
    settings: WeightStoreSettings,
    storage: WeightStorage,
    tasks: BackgroundTasks,
    blocks: BlockServer | None,
):
    """The app's lifespan: staging emptied and the block server started, then stopped."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        # An upload cut off before its commit is never served: staging starts empty.
        for model in storage.models():
            discard_staging(storage, settings, model, own=True)
        if blocks is not None:
            blocks.start()
        yield
        await tasks.stop()
        if blocks is not None:
            blocks.stop()

    return lifespan


def build_app(settings: WeightStoreSettings) -> FastAPI:
    storage = WeightStorage(
        settings.root,
        settings.keep_versions,
        settings.replica_id,
        settings.block_bytes,
        settings.full_every,
    )
    tasks = BackgroundTasks()
    auth = auth_for(settings)
    blocks = block_server(settings, storage)
    lifespan = lifespan_of(settings, storage, tasks, blocks)
    app = FastAPI(title="spotrl weight store", version="1", lifespan=lifespan)
    app.state.storage = storage
    add_health_and_metrics(app, "weightstore", tasks, auth=auth)
    guard_input(
        app,
        tokens_of(settings),
        settings.max_body_bytes,
        {UPLOAD: settings.max_file_bytes, COMMIT: settings.max_manifest_bytes},
    )

    @app.exception_handler(StorageError)
    async def storage_error(request: Request, exc: StorageError) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=exc.status)

    trainer, reader = auth.need("trainer"), auth.need(*READERS)
    write: dict[str, Any] = {
        "dependencies": trainer.dependencies,
        "responses": {**trainer.responses, **errors(400, 409, 413)},
    }
    read: dict[str, Any] = {
        "dependencies": reader.dependencies,
        "responses": {**reader.responses, **errors(400, 404)},
    }

    @app.put(UPLOAD, response_model=FileEntry, **write)
    async def upload_file(
        model: Name,
        version: Version,
        name: Name,
        request: Request,
        x_sha256: Annotated[str | None, Header(max_length=64)] = None,
    ) -> FileEntry:
        async def chunks():
            async for chunk in request.stream():
                BYTES_IN.inc(len(chunk))
                yield chunk

        try:
            return await storage.write_file(model, version, name, chunks(), x_sha256)
        except ClientDisconnect:
            # the client is gone (or was closed for sending too slowly): nothing was kept, and
            # the answer reaches no one; one line, not a traceback per cut upload
            log.info("upload of %s v%d %s cut off before its end", model, version, name)
            raise HTTPException(400, "the upload was cut off before its end") from None

    @app.post(COMMIT, response_model=Manifest, status_code=201, **write)
    async def commit(model: Name, version: Version, manifest: ManifestCommit) -> Manifest:
        # a file sent as a delta is made whole and checked here: seconds for a big one
        committed = await asyncio.to_thread(
            storage.commit,
            model,
            version,
            manifest,
            manifest.reuse_version,
            manifest.reuse_content,
        )
        COMMITS.inc()
        discard_staging(storage, settings, model)
        log.info(
            "committed %s v%d (%d files, %d bytes)",
            model,
            version,
            len(committed.files),
            committed.total_bytes(),
        )
        return committed

    @app.post("/v1/content/have", response_model=ContentHeld, **write)
    async def content_held(query: ContentQuery) -> ContentHeld:
        """Which of these file contents the store holds committed (a commit with
        `reuse_content` takes them without an upload)."""
        held = await asyncio.to_thread(storage.content, set(query.sha256))
        return ContentHeld(sha256=[sha for sha in query.sha256 if sha in held])

    @app.get("/v1/blocks", response_model=BlockPort, **read)
    async def block_port() -> BlockPort:
        """Where this store serves its files with zero copy (same paths, same ranges)."""
        if blocks is None:
            raise NotFound("this store serves its files from its API only")
        return BlockPort(port=blocks.port)

    @app.get("/v1/models", response_model=ModelList, **read)
    async def list_models() -> ModelList:
        return ModelList(models=storage.models())

    @app.get("/v1/models/{model}/versions", response_model=VersionList, **read)
    async def list_versions(model: Name) -> VersionList:
        return VersionList(model=model, versions=storage.versions(model))

    @app.get("/v1/models/{model}/latest", response_model=Manifest, **read)
    async def latest(model: Name) -> Manifest:
        return storage.latest(model)

    @app.get("/v1/models/{model}/versions/{version}/manifest", response_model=Manifest, **read)
    async def manifest(
        model: Name,
        version: Version,
        whole: Annotated[
            bool, Query(description="Make every file whole first (a full pull follows).")
        ] = False,
    ) -> Manifest:
        if whole:
            served = await asyncio.to_thread(storage.make_whole, model, version)
        else:
            served = storage.manifest(model, version)
        MANIFESTS.inc()
        return served

    @app.get(
        "/v1/models/{model}/versions/{version}/files/{name}",
        response_class=ShardResponse,
        dependencies=reader.dependencies,
        responses={
            **reader.responses,
            **errors(400, 404, 416),
            200: {"content": {"application/octet-stream": {}}, "description": "File bytes."},
            206: {"content": {"application/octet-stream": {}}, "description": "A byte range."},
        },
    )
    async def read_file(model: Name, version: Version, name: Name) -> FileResponse:
        return ShardResponse(await asyncio.to_thread(storage.file_path, model, version, name))

    return app
