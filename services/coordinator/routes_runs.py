"""/v1/runs: submit, list, inspect, cancel runs; read their per-step metrics and timeline.
Reads are answered from the control plane's read model (`read_model`), never from Redis
directly: a read costs no round trip (a timeline page of an older run, one)."""

import asyncio
from typing import Annotated, Any

from fastapi import APIRouter, HTTPException, Path, Query, Request, Response
from fastapi.exceptions import RequestValidationError

from services.contracts.runspec import ModelFolderError, RunSpec, TaskFileError, place_of
from services.coordinator.read_model import ReadModel
from services.coordinator.read_views import RunDocs
from services.coordinator.reward_runner import check_loads
from services.coordinator.runs import RunNotCancellable, RunNotFound, RunStore
from services.coordinator.schemas import RunCreated, RunMetrics, RunPublic, RunTimeline
from services.coordinator.settings import CoordinatorSettings
from services.environments.choice import EnvironmentChoice
from services.infra.read_limit import NOT_MODIFIED, revalidated
from services.infra.service import Auth, errors
from services.state import timeline
from services.tasks import RewardChoice, TaskError, task_for_spec
from services.tasks.chat import has_chat_template, no_template_error

ENTRY_ID = r"^[0-9]{1,19}-[0-9]{1,19}$"  # 19 digits stay within the u64 Redis wants
RunId = Annotated[str, Path(min_length=1, max_length=100, pattern=r"^[A-Za-z0-9._-]+$")]


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


def build_router(
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
    async def submit(spec: RunSpec) -> RunCreated:
        """Queue a run. Refused: a step over the coordinator's caps (422), a model folder or
        task file that is missing, unreadable, too large or not UTF-8 (400), a task that does
        not load: a dataset, a reward module not on the allow list or that does not import, a
        chat template the model lacks (422)."""
        too_big = over_step_caps(spec, settings.max_step_requests, settings.max_step_tokens)
        if too_big:
            raise RequestValidationError(too_big)
        try:
            await asyncio.to_thread(check_files, spec, settings.max_task_file_bytes)
        except (ModelFolderError, TaskFileError) as exc:
            raise HTTPException(400, str(exc)) from None
        problems = await task_problems(spec, settings, dataset_loads)
        if problems:
            raise RequestValidationError(problems)
        run_id = await store.submit(spec)
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

    return router
