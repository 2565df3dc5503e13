"""/v1/runs: submit, list, inspect, cancel runs; read their per-step metrics and timeline."""

import asyncio
import json
from typing import Annotated, Any

from fastapi import APIRouter, HTTPException, Path, Query
from fastapi.exceptions import RequestValidationError

from services.contracts import keys
from services.contracts.runspec import ModelFolderError, RunSpec, TaskFileError
from services.coordinator.reward_runner import check_loads
from services.coordinator.runs import RunNotCancellable, RunNotFound, RunStore
from services.coordinator.schemas import RunCreated, RunMetrics, RunPublic, RunTimeline
from services.coordinator.settings import CoordinatorSettings
from services.infra.service import Auth, errors
from services.state import timeline
from services.state.step_metrics import StepRow
from services.tasks import RewardChoice, TaskError, task_for_spec
from services.tasks.chat import has_chat_template, no_template_error

ENTRY_ID = r"^[0-9]{1,19}-[0-9]{1,19}$"  # 19 digits stay within the u64 Redis wants
RunId = Annotated[str, Path(min_length=1, max_length=100, pattern=r"^[A-Za-z0-9._-]+$")]


def over_step_caps(spec: RunSpec, max_requests: int, max_tokens: int) -> list[dict[str, Any]]:
    """Validation errors (FastAPI's shape) for a spec whose one step is bigger than the
    coordinator takes: requests (prompts x responses) and response tokens bound its memory."""
    requests = spec.prompts_per_step * spec.group_size
    tokens = requests * spec.max_new_tokens
    found = []
    if requests > max_requests:
        found.append(
            {
                "loc": ("body", "prompts_per_step"),
                "msg": f"prompts_per_step x group_size = {requests} requests per step, over "
                f"the coordinator's limit of {max_requests} (SPOTRL_MAX_STEP_REQUESTS)",
                "type": "value_error",
            }
        )
    if tokens > max_tokens:
        found.append(
            {
                "loc": ("body", "max_new_tokens"),
                "msg": f"prompts_per_step x group_size x max_new_tokens = {tokens} tokens per "
                f"step, over the coordinator's limit of {max_tokens} (SPOTRL_MAX_STEP_TOKENS)",
                "type": "value_error",
            }
        )
    return found


def field_error(field: str, exc: Exception) -> list[dict[str, Any]]:
    """One validation error (FastAPI's shape) on a field of the spec."""
    return [{"loc": ("body", field), "msg": str(exc), "type": "value_error"}]


async def task_problems(
    spec: RunSpec, settings: CoordinatorSettings, loads: asyncio.Semaphore
) -> list[dict[str, Any]]:
    """Validation errors for a spec's task, cheapest check first: a reward module not on the
    allow list, a chat template the model lacks, a dataset that does not load (read and checked
    off the event loop, `loads` at a time), a reward that does not import (in a reward process:
    never in this one)."""
    choice = RewardChoice.from_spec(spec)
    try:
        choice.check_allowed(settings.reward_modules)
    except TaskError as exc:
        return field_error("reward", exc)
    if spec.chat_template and not await asyncio.to_thread(has_chat_template, spec.model):
        return field_error("chat_template", no_template_error(spec.model))
    try:
        async with loads:
            await asyncio.to_thread(task_for_spec, spec, settings.dataset_limits())
    except TaskError as exc:
        return field_error("dataset" if spec.task == "dataset" else "task_path", exc)
    try:
        await check_loads(choice)
    except TaskError as exc:
        return field_error("reward", exc)
    return []


def check_files(spec: RunSpec, max_task_file_bytes: int) -> None:
    """Every file a spec names is there and readable (ModelFolderError, TaskFileError)."""
    spec.check_model_folder()
    spec.check_task_file(max_task_file_bytes)


def build_router(store: RunStore, auth: Auth, settings: CoordinatorSettings) -> APIRouter:
    router = APIRouter(prefix="/v1/runs", tags=["runs"])
    write, read = auth.write, auth.read
    dataset_loads = asyncio.Semaphore(1)  # a dataset check holds its rows in memory
    read_one = {**auth.read_errors, **errors(404)}

    async def public(run_id: str) -> RunPublic:
        try:
            run = await store.get(run_id)
        except RunNotFound:
            raise HTTPException(404, f"run {run_id} does not exist") from None
        spec = RunSpec.model_validate_json(run["spec"])
        version = await store.version(run_id)
        rows = await store.steps(run_id)
        # the newest step whose rollout is done
        last = next((row for row in reversed(rows) if row.reward_mean is not None), StepRow())
        incomplete = await store.r.hget(keys.trainer_state(run_id), "groups_incomplete")
        return RunPublic(
            id=run_id,
            state=run["state"],
            spec=spec,
            step=version or 0,
            steps=spec.steps,
            weight_version=version,
            reward_mean=last.reward_mean,
            tokens_per_s=last.tokens_per_s,
            groups_incomplete=int(incomplete or 0),
            t_seed_s=float(run["t_seed_s"]) if "t_seed_s" in run else None,
            n_prem_recommended=json.loads(run.get("n_prem_recommended", "null")),
            preemptible_wanted=json.loads(run.get("preemptible_wanted", "null")),
            created_at=float(run["created_at"]),
            started_at=float(run["started_at"]) if "started_at" in run else None,
            finished_at=float(run["finished_at"]) if "finished_at" in run else None,
            error=run.get("error", ""),
            stall_reason=run.get("stall_reason", "") if run["state"] == "stalled" else "",
            stalled_since=float(run["stalled_since"]) if "stalled_since" in run else None,
            groups_quarantined=int(run.get("groups_quarantined", 0)),
            reward_errors=sum(row.reward_errors or 0 for row in rows),
        )

    @router.post(
        "",
        status_code=201,
        response_model=RunCreated,
        dependencies=write,
        responses={**auth.write_errors, **errors(400, 413)},
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
        return RunCreated(id=run_id, state="queued")

    @router.get("", response_model=list[RunPublic], dependencies=read, responses=auth.read_errors)
    async def list_runs(limit: Annotated[int, Query(ge=1, le=1000)] = 100) -> list[RunPublic]:
        return [await public(run_id) for run_id in await store.list_ids(limit)]

    @router.get("/{run_id}", response_model=RunPublic, dependencies=read, responses=read_one)
    async def get_run(run_id: RunId) -> RunPublic:
        return await public(run_id)

    @router.get(
        "/{run_id}/metrics", response_model=RunMetrics, dependencies=read, responses=read_one
    )
    async def metrics(run_id: RunId) -> RunMetrics:
        await public(run_id)
        return RunMetrics(run_id=run_id, steps=await store.metrics(run_id))

    @router.get(
        "/{run_id}/timeline", response_model=RunTimeline, dependencies=read, responses=read_one
    )
    async def run_timeline(
        run_id: RunId,
        after_event: Annotated[str | None, Query(pattern=ENTRY_ID)] = None,
        after_sample: Annotated[str | None, Query(pattern=ENTRY_ID)] = None,
        count: Annotated[int, Query(ge=1, le=timeline.READ_MAX)] = timeline.READ_MAX,
    ) -> RunTimeline:
        """Events and pool samples after the given entry ids (all of them when omitted):
        a client polls with the last ids it has."""
        await public(run_id)
        return RunTimeline(
            run_id=run_id,
            events=await timeline.read_events(store.r, run_id, after_event, count),
            pool=await timeline.read_pool(store.r, run_id, after_sample, count),
        )

    @router.post(
        "/{run_id}/cancel",
        response_model=RunPublic,
        dependencies=write,
        responses={**auth.write_errors, **errors(404, 409)},
    )
    async def cancel(run_id: RunId) -> RunPublic:
        try:
            await store.cancel(run_id)
        except RunNotFound:
            raise HTTPException(404, f"run {run_id} does not exist") from None
        except RunNotCancellable as exc:
            raise HTTPException(409, str(exc)) from None
        return await public(run_id)

    return router
