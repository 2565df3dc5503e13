"""The coordinator's REST API and its dashboard, one router per resource:

- /v1/runs (`runs_router`): submit, list, inspect, cancel runs; read their per-step metrics and
  timeline.
- /v1/workers (`workers_router`): rollout workers register here; operators list them with their
  liveness, order one to give work back, and forget workers that are gone.
- /v1/fleet (`fleet_router`): the deployment's figures for a scaler, the same as the
  coordinator's gauges `spotrl_coordinator_runs_active` and
  `spotrl_coordinator_preemptible_wanted`: how many runs are active and the preemptible pool
  they want.
- `/` (`add_dashboard`): one static page whose script reads the coordinator's own API (runs,
  per-step metrics, timeline) and draws it with uPlot, refreshing itself while a run goes. The
  page is read once and served from memory with its ETag (a reload that has it gets a 304).

Reads are answered from the control plane's read model (`read_model`), with an ETag, never
from Redis directly: a read costs no round trip (a timeline page of an older run, one). Writes
go to Redis and then refresh what they wrote in the model.
"""

import asyncio
import contextlib
import hmac
import time
from pathlib import Path as FilePath
from typing import Annotated, Any

import redis.asyncio as aioredis
from fastapi import APIRouter, FastAPI, HTTPException, Path, Query, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.staticfiles import StaticFiles

from services.contracts import keys
from services.contracts.consumers import jobs_consumer
from services.contracts.messages import Heartbeat, WorkerControl
from services.contracts.records import WorkerRecord
from services.contracts.runspec import ModelFolderError, RunSpec, TaskFileError, place_of
from services.coordinator.api.read_model import ReadModel, RunDocs
from services.coordinator.api.schemas import (
    FleetPublic,
    RunCreated,
    RunMetrics,
    RunPublic,
    RunTimeline,
    WorkerCreate,
    WorkerOrdered,
    WorkerPublic,
    WorkerRegistered,
    WorkerRegistration,
    WorkerRelease,
)
from services.coordinator.scoring.rewards import check_loads
from services.coordinator.settings import CoordinatorSettings
from services.coordinator.workers.fleet import heartbeats, order
from services.coordinator.workers.keys import COORDINATOR
from services.core.run_admission import share_refusal
from services.environments.choice import EnvironmentChoice
from services.infra.read_limit import NOT_MODIFIED, etag_of, revalidated
from services.infra.redis_streams import text
from services.infra.redis_users import drop_worker_user, mint_worker_user
from services.infra.scopes import owner_of
from services.infra.service import Auth, errors
from services.infra.signing import consumer_secret, key_bytes, new_key, registration_proof
from services.state import timeline, worker_record
from services.state.runs import RunNotCancellable, RunNotFound, RunStore
from services.tasks import RewardChoice, TaskError, task_for_spec
from services.tasks.chat import has_chat_template, no_template_error

STATIC = FilePath(__file__).parent.parent / "static"  # the package data of services.coordinator
ENTRY_ID = r"^[0-9]{1,19}-[0-9]{1,19}$"  # 19 digits stay within the u64 Redis wants
RunId = Annotated[str, Path(min_length=1, max_length=100, pattern=r"^[A-Za-z0-9._-]+$")]
WorkerId = Annotated[str, Path(min_length=1, max_length=200, pattern=r"^[A-Za-z0-9._:-]+$")]


def over_step_caps(spec: RunSpec, max_requests: int, max_tokens: int) -> list[dict[str, Any]]:
    """Validation errors (FastAPI's shape) for a spec whose one step is bigger than the
    coordinator takes: requests (prompts x responses) and response tokens bound its memory."""
    requests = spec.training.prompts_per_step * spec.training.group_size
    tokens = requests * spec.sampling.max_new_tokens
    found = []
    if requests > max_requests:
        found.append(
            {
                "loc": ("body", *place_of("prompts_per_step")),
                "msg": f"prompts_per_step x group_size = {requests} requests per step, over "
                f"the coordinator's limit of {max_requests} (SPOTRL_MAX_STEP_REQUESTS)",
                "type": "value_error",
            }
        )
    if tokens > max_tokens:
        found.append(
            {
                "loc": ("body", *place_of("max_new_tokens")),
                "msg": f"prompts_per_step x group_size x max_new_tokens = {tokens} tokens per "
                f"step, over the coordinator's limit of {max_tokens} (SPOTRL_MAX_STEP_TOKENS)",
                "type": "value_error",
            }
        )
    return found


def field_error(field: str, exc: Exception) -> list[dict[str, Any]]:
    """One validation error (FastAPI's shape) on a field of the spec, named by its place."""
    return [{"loc": ("body", *place_of(field)), "msg": str(exc), "type": "value_error"}]


async def task_problems(
    spec: RunSpec, settings: CoordinatorSettings, loads: asyncio.Semaphore
) -> list[dict[str, Any]]:
    """Validation errors for a spec's task, cheapest check first: a reward or environment
    module not on the allow list, a chat template the model lacks, a dataset that does not
    load (read and checked off the event loop, `loads` at a time), a reward that does not
    import (in a reward process: never in this one)."""
    choice = RewardChoice.from_spec(spec)
    try:
        choice.check_allowed(settings.reward_modules)
    except TaskError as exc:
        return field_error("reward", exc)
    if spec.episode.environment is not None:  # imported by the environment's processes only
        try:
            EnvironmentChoice(spec.episode.environment).check_allowed(settings.environment_modules)
        except TaskError as exc:
            return field_error("environment", exc)
    if spec.data.chat_template and not await asyncio.to_thread(has_chat_template, spec.model):
        return field_error("chat_template", no_template_error(spec.model))
    try:
        async with loads:
            await asyncio.to_thread(task_for_spec, spec, settings.dataset_limits())
    except TaskError as exc:
        return field_error("dataset" if spec.data.task == "dataset" else "task_path", exc)
    try:
        await check_loads(choice)
    except TaskError as exc:
        return field_error("reward", exc)
    return []


def check_files(spec: RunSpec, max_task_file_bytes: int) -> None:
    """Every file a spec names is there and readable (ModelFolderError, TaskFileError)."""
    spec.check_model_folder()
    spec.check_task_file(max_task_file_bytes)


def runs_router(
    store: RunStore, model: ReadModel, auth: Auth, settings: CoordinatorSettings
) -> APIRouter:
    """The routes of /v1/runs. Reads answer from the read model (`model`), with an ETag; writes
    go to Redis and then refresh the run they wrote in the model."""
    router = APIRouter(prefix="/v1/runs", tags=["runs"])
    admin, read = auth.need("admin"), auth.need("read")
    dataset_loads = asyncio.Semaphore(1)  # a dataset check holds its rows in memory
    read_one = {**read.responses, **NOT_MODIFIED, **errors(404, 429, 503)}

    def ready() -> None:
        if not model.fresh:
            raise HTTPException(503, "redis unavailable", {"Retry-After": "2"})

    async def held(run_id: str) -> RunDocs:
        ready()
        docs = await model.run(run_id)
        if docs is None:
            raise HTTPException(404, f"run {run_id} does not exist")
        return docs

    @router.post(
        "",
        status_code=201,
        response_model=RunCreated,
        dependencies=admin.dependencies,
        responses={**admin.responses, **errors(400, 413)},
    )
    async def submit(spec: RunSpec, request: Request) -> RunCreated:
        """Queue a run, counted under the token it comes with (the per-token limits). Refused:
        a step over the coordinator's caps or a share above a token's most (422), a model
        folder or task file that is missing, unreadable, too large or not UTF-8 (400), a task
        that does not load: a dataset, a reward module not on the allow list or that does not
        import, a chat template the model lacks (422)."""
        too_big = over_step_caps(spec, settings.max_step_requests, settings.max_step_tokens)
        share_over = share_refusal(spec.rollout.share, settings.token_limits())
        if share_over is not None:
            too_big.append(
                {"loc": ("body", *place_of("share")), "msg": share_over, "type": "value_error"}
            )
        if too_big:
            raise RequestValidationError(too_big)
        try:
            await asyncio.to_thread(check_files, spec, settings.max_task_file_bytes)
        except (ModelFolderError, TaskFileError) as exc:
            raise HTTPException(400, str(exc)) from None
        problems = await task_problems(spec, settings, dataset_loads)
        if problems:
            raise RequestValidationError(problems)
        run_id = await store.submit(spec, owner_of(request.headers.get("authorization", "")))
        await model.load(run_id, written=True)
        return RunCreated(id=run_id, state="queued")

    @router.get(
        "",
        response_model=list[RunPublic],
        dependencies=read.dependencies,
        responses={**read.responses, **NOT_MODIFIED, **errors(429, 503)},
    )
    async def list_runs(
        request: Request, limit: Annotated[int, Query(ge=1, le=1000)] = 100
    ) -> Response:
        ready()
        doc = model.run_list(limit)
        return revalidated(request, doc.body, doc.etag)

    @router.get(
        "/{run_id}", response_model=RunPublic, dependencies=read.dependencies, responses=read_one
    )
    async def get_run(request: Request, run_id: RunId) -> Response:
        doc = (await held(run_id)).public
        return revalidated(request, doc.body, doc.etag)

    @router.get(
        "/{run_id}/metrics",
        response_model=RunMetrics,
        dependencies=read.dependencies,
        responses=read_one,
    )
    async def metrics(request: Request, run_id: RunId) -> Response:
        doc = (await held(run_id)).metrics
        return revalidated(request, doc.body, doc.etag)

    @router.get(
        "/{run_id}/timeline",
        response_model=RunTimeline,
        dependencies=read.dependencies,
        responses=read_one,
    )
    async def run_timeline(
        run_id: RunId,
        after_event: Annotated[str | None, Query(pattern=ENTRY_ID)] = None,
        after_sample: Annotated[str | None, Query(pattern=ENTRY_ID)] = None,
        count: Annotated[int, Query(ge=1, le=timeline.READ_MAX)] = timeline.READ_MAX,
    ) -> Response:
        """Events and pool samples after the given entry ids (all of them when omitted):
        a client polls with the last ids it has."""
        await held(run_id)
        body = await model.timeline(run_id, after_event, after_sample, count)
        return Response(body, media_type="application/json")

    @router.post(
        "/{run_id}/cancel",
        response_model=RunPublic,
        dependencies=admin.dependencies,
        responses={**admin.responses, **errors(404, 409)},
    )
    async def cancel(run_id: RunId) -> Response:
        try:
            await store.cancel(run_id)
        except RunNotFound:
            raise HTTPException(404, f"run {run_id} does not exist") from None
        except RunNotCancellable as exc:
            raise HTTPException(409, str(exc)) from None
        docs = await model.load(run_id, written=True)
        if docs is None:  # gone between the cancel and the read
            raise HTTPException(404, f"run {run_id} does not exist")
        return Response(docs.public.body, media_type="application/json")

    async def paused_or_resumed(run_id: str, pause: bool) -> Response:
        try:
            live = await (store.pause(run_id) if pause else store.resume(run_id))
        except RunNotFound:
            raise HTTPException(404, f"run {run_id} does not exist") from None
        docs = await model.load(run_id, written=True)
        if docs is None:  # gone between the change and the read
            raise HTTPException(404, f"run {run_id} does not exist")
        if not live:
            state = (await store.get(run_id)).state
            raise HTTPException(409, f"run {run_id} is {state}: only an active run pauses")
        return Response(docs.public.body, media_type="application/json")

    @router.post(
        "/{run_id}/pause",
        response_model=RunPublic,
        dependencies=admin.dependencies,
        responses={**admin.responses, **errors(404, 409)},
    )
    async def pause(run_id: RunId) -> Response:
        """Pause an active run: no new step opens until it is resumed; the steps in flight
        finish, and then its part of the fleet goes to the other runs. It keeps its trainer.
        Refused for a run that is queued or over (409)."""
        return await paused_or_resumed(run_id, pause=True)

    @router.post(
        "/{run_id}/resume",
        response_model=RunPublic,
        dependencies=admin.dependencies,
        responses={**admin.responses, **errors(404, 409)},
    )
    async def resume(run_id: RunId) -> Response:
        """Let a paused run open steps again (a run not paused: nothing changes). Refused
        for a run that is queued or over (409)."""
        return await paused_or_resumed(run_id, pause=False)

    return router


def workers_router(
    r: aioredis.Redis, model: ReadModel, auth: Auth, mint_users: bool = False
) -> APIRouter:
    """With `mint_users` (the setting `worker_redis_users`), a worker registering gets its own
    Redis user and a key to sign its delta batches with, new at each registration (a restart);
    forgetting a worker drops both."""
    router = APIRouter(prefix="/v1/workers", tags=["workers"])
    admin, worker, read = auth.need("admin"), auth.need("worker"), auth.need("read")
    change = {**admin.responses, **errors(400, 404, 409, 413)}

    @router.post(
        "",
        status_code=201,
        response_model=WorkerRegistered,
        dependencies=worker.dependencies,
        responses={**worker.responses, **errors(400, 413)},
    )
    async def register(registration: WorkerRegistration) -> WorkerRegistered:
        worker = WorkerCreate(**registration.model_dump(exclude={"proof"}))
        record = WorkerRecord(**worker.model_dump(), registered_at=time.time())
        minted: dict[str, str] = {}
        if mint_users:  # the key is stored before the worker can write anything with it
            kept = await check_alive_registration(r, worker.id, registration.proof)
            minted["consumer"] = jobs_consumer(worker.id, await consumer_secret_of(worker.id))
            # the same key to an alive worker registering again: a batch it signed just before
            # still checks out (a parked one would leave a gap in its requests)
            minted["signing_key"] = kept or new_key()
            try:
                username, password = await mint_worker_user(r, worker.id)
            except ValueError as exc:  # an id that cannot name a Redis user
                raise HTTPException(400, str(exc)) from exc
            minted.update(redis_username=username, redis_password=password)
        await worker_record.register(r, record, minted.get("signing_key"))
        return WorkerRegistered(**worker.model_dump(), alive=False, **minted)

    @router.get(
        "",
        response_model=list[WorkerPublic],
        dependencies=read.dependencies,
        responses={**read.responses, **NOT_MODIFIED, **errors(429, 503)},
    )
    async def list_workers(request: Request, alive: bool | None = None) -> Response:
        if not model.fresh:
            raise HTTPException(503, "redis unavailable", {"Retry-After": "2"})
        doc = model.workers[alive]
        return revalidated(request, doc.body, doc.etag)

    @router.post(
        "/{worker_id}/release",
        status_code=202,
        response_model=WorkerOrdered,
        dependencies=admin.dependencies,
        responses=change,
    )
    async def release(worker_id: WorkerId, body: WorkerRelease) -> WorkerOrdered:
        """Order an alive worker to give `count` executing requests of a run back (`run_id`,
        needed where it serves several); they continue on other workers from the tokens already
        generated (a migration with cause "release")."""
        if not await r.exists(keys.worker(worker_id)):
            raise HTTPException(404, f"worker {worker_id} is not registered")
        beat = (await heartbeats(r)).get(worker_id)
        run_id = release_run(worker_id, beat, body.run_id)
        control = WorkerControl(action="release", run_id=run_id, count=body.count)
        await order(r, worker_id, control)
        return WorkerOrdered(worker_id=worker_id, run_id=run_id, action="release", count=body.count)

    @router.delete(
        "/{worker_id}", status_code=204, dependencies=admin.dependencies, responses=change
    )
    async def forget(worker_id: WorkerId) -> Response:
        """Remove a worker that is gone from the list (an alive one: 409), with its own Redis
        user and signing key where workers get them."""
        if not await r.exists(keys.worker(worker_id)):
            raise HTTPException(404, f"worker {worker_id} is not registered")
        if await r.exists(keys.worker_heartbeat(worker_id)):
            raise HTTPException(409, f"worker {worker_id} is alive")
        await worker_record.forget(r, worker_id, drop_key=mint_users)
        if mint_users:
            with contextlib.suppress(ValueError):  # an id that never could have a user
                await drop_worker_user(r, worker_id)
        return Response(status_code=204)

    async def consumer_secret_of(worker_id: str) -> str:
        """The secret of the worker's jobs consumer name, under the coordinator's own key (made
        by the first coordinator process that needs it)."""
        await r.hsetnx(keys.WORKER_KEYS, COORDINATOR, new_key())
        coordinator_key = await r.hget(keys.WORKER_KEYS, COORDINATOR)
        if not coordinator_key:  # deleted in between: the worker's retry makes it again
            raise HTTPException(503, "the coordinator's key is being made", {"Retry-After": "1"})
        return consumer_secret(key_bytes(coordinator_key), worker_id)

    return router


def release_run(worker_id: str, beat: Heartbeat | None, named: str | None) -> str:
    """The run a release order to the worker names: the one asked for, or the one it serves
    alone. 409 where it is not alive on a run; 400 where it serves several and none is named,
    or the one named is not among them."""
    if beat is None or beat.run_id is None:
        raise HTTPException(409, f"worker {worker_id} is not alive on a run")
    served = beat.served_runs
    if named is None and len(served) > 1:
        raise HTTPException(400, f"worker {worker_id} serves several runs: name one (run_id)")
    if named is not None and named not in served:
        raise HTTPException(400, f"worker {worker_id} does not serve run {named}")
    return named or served[0]


async def check_alive_registration(
    r: aioredis.Redis, worker_id: str, proof: str | None
) -> str | None:
    """A worker id that is alive registers again only with the proof that it holds the id's
    current key (its jobs task restarted): anyone else with the worker token would take over
    its user, its key and its consumer name. 409 otherwise: a new process under that id waits
    for the old one's heartbeat to expire. The key it keeps (hex), or None: not alive."""
    if not await r.exists(keys.worker_heartbeat(worker_id)):
        return None
    current = text(await r.hget(keys.WORKER_KEYS, worker_id))
    if current and proof and registration_matches(key_bytes(current), worker_id, proof):
        return current
    raise HTTPException(
        409,
        f"worker {worker_id} is alive: registering it again needs its current key's proof "
        "(a new process under its id registers once its heartbeat expires)",
    )


def registration_matches(key: bytes, worker_id: str, proof: str) -> bool:
    return hmac.compare_digest(registration_proof(key, worker_id), proof)


def fleet_router(model: ReadModel, auth: Auth) -> APIRouter:
    router = APIRouter(prefix="/v1/fleet", tags=["fleet"])
    read = auth.need("read")

    @router.get(
        "",
        response_model=FleetPublic,
        dependencies=read.dependencies,
        responses={**read.responses, **NOT_MODIFIED, **errors(429, 503)},
    )
    async def fleet(request: Request) -> Response:
        """The active runs (running or stalled) and the preemptible pool they want: no run
        (`runs_active` 0) means the pool's minimum; a run with `preemptible_wanted` 0 has no
        figure yet (hold what runs)."""
        if not model.fresh:
            raise HTTPException(503, "redis unavailable", {"Retry-After": "2"})
        doc = model.fleet
        return revalidated(request, doc.body, doc.etag)

    return router


def add_dashboard(app: FastAPI) -> None:
    app.mount("/static", StaticFiles(directory=STATIC), name="static")
    page = (STATIC / "index.html").read_bytes()
    etag = etag_of(page)

    @app.get("/", include_in_schema=False)
    async def index(request: Request) -> Response:
        return revalidated(request, page, etag, media_type="text/html; charset=utf-8")
