"""Request and response bodies of the coordinator's REST API (one schema per use)."""

from typing import Any, Literal

from pydantic import BaseModel, Field, SerializerFunctionWrapHandler, model_serializer

from services.contracts.messages import Pool
from services.contracts.runspec import RunSpec, RunState


class RunCreated(BaseModel):
    id: str
    state: RunState


class RunPublic(BaseModel):
    id: str
    state: RunState
    spec: RunSpec
    step: int = Field(description="RL steps trained so far (= newest weight version).")
    steps: int
    weight_version: int | None
    reward_mean: float | None = Field(description="Mean reward of the newest rollout step.")
    tokens_per_s: float | None = Field(description="Rollout tokens/s of the newest step.")
    groups_incomplete: int = Field(description="Groups the trainer got with != n responses.")
    t_seed_s: float | None = Field(None, description="Seeding window of the next step.")
    n_prem_recommended: float | None = Field(
        None, description="Preemptible pool size past which the step gets no shorter."
    )
    preemptible_wanted: int | None = Field(
        None,
        description="Preemptible workers a scaler should hold: N_prem times the spec's "
        "rollout.pool_headroom, rounded up (null until a step is trained: hold what you can get).",
    )
    created_at: float
    started_at: float | None
    finished_at: float | None
    error: str = ""
    stall_reason: str = Field(
        "", description="Why the run cannot progress (state stalled); empty otherwise."
    )
    stalled_since: float | None = Field(None, description="When the run last became stalled.")
    paused_at: float | None = Field(
        None,
        description="Paused by an operator since then (POST .../pause): no new step opens "
        "until it is resumed; null when not paused.",
    )
    owner: str = Field(
        "",
        description="The token it was submitted with: the first 16 hex digits of the token's "
        "SHA-256 (the per-token limits count by it); empty for a run submitted without one.",
    )
    groups_quarantined: int = Field(
        0, description="Groups dropped because one of their requests crashed too many workers."
    )
    reward_errors: int = Field(
        0,
        description="Reward calls of the run that raised, hung or returned no finite number "
        "(each scored 0).",
    )
    health: Literal["ok", "degraded", "failed"] = Field(
        "ok",
        description="What the failures of the run's user code (environment step() calls, "
        "reward calls) say: failed when one step's share of one kind was over "
        "faults.max_error_share (the run then fails), degraded when some failed, else ok.",
    )
    health_reason: str = Field("", description="What failed, how often, and the first error.")
    errors: dict[str, dict[str, Any]] = Field(
        default_factory=dict,
        description="By kind (environment, reward): calls, failed, share (failed per call) "
        "over the run, and the first failure in short form (error line and where in the "
        "user's code; its traceback is in the run's log).",
    )
    max_turns: int | None = Field(
        None,
        description="The most model turns of an episode (multi-turn runs): the spec's "
        "episode.max_turns when set, else the environment's own.",
    )


class FleetRunPublic(BaseModel):
    """One active run on the fleet: its weight and what it holds."""

    id: str
    share: float = Field(description="The run's weight among the active runs (rollout.share).")
    workers: int = Field(description="Alive workers serving the run now.")
    slots: int = Field(description="Their slots, added up.")
    active: int = Field(description="Requests of the run they execute now.")


class FleetPublic(BaseModel):
    """GET /v1/fleet: what a scaler of the whole deployment reads (the same figures as the
    gauges `spotrl_coordinator_runs_active` and `spotrl_coordinator_preemptible_wanted`)."""

    runs_active: int = Field(
        description="Runs running or stalled (0: none; a scaler holds the pool's minimum)."
    )
    preemptible_wanted: int = Field(
        description="Preemptible workers the active runs want, added up (0: no run, or a run "
        "without a figure yet: hold what runs)."
    )
    active_runs: list[str] = Field(description="The active runs' ids, newest first.")
    runs: list[FleetRunPublic] = Field(
        default_factory=list,
        description="Each active run's share of the fleet and its use of it now, newest first.",
    )


class WorkerCreate(BaseModel):
    id: str = Field(min_length=1, max_length=200, pattern=r"^[A-Za-z0-9._:-]+$")
    pool: Pool
    engine: str = Field(min_length=1, max_length=50)
    slots: int = Field(ge=1, le=100000)
    url: str = Field("", max_length=2048)


class WorkerRegistration(WorkerCreate):
    """A registration: the worker, and, from a worker registering again while its heartbeat is
    alive (its jobs task restarted), the proof that it holds its current signing key."""

    proof: str | None = Field(
        None,
        pattern=r"^[0-9a-f]{64}$",
        description="HMAC-SHA256 of 'register <id>' under the worker's current signing key "
        "(services.infra.signing.registration_proof); needed only to register an id that is "
        "alive where the coordinator mints workers' users.",
    )


class WorkerRunPublic(BaseModel):
    """What an alive worker holds of one run it serves."""

    version: int | None = Field(None, description="The run's weight version loaded.")
    active: int = Field(0, description="The run's requests it executes now.")
    paused: bool = Field(False, description="Stepped aside from the run for this version.")


class WorkerPublic(WorkerCreate):
    alive: bool
    run_id: str | None = None
    version: int | None = None
    active: int = 0
    runs: dict[str, WorkerRunPublic] = Field(
        default_factory=dict,
        description="Each run it serves now (several where one engine serves several runs; "
        "`run_id` is then the first, `version` its version and `active` their sum).",
    )
    tokens_generated: int = 0
    last_error: str = Field(
        "", description="The last error that stopped this worker (its crash report), if any."
    )


MINTED = ("redis_username", "redis_password", "signing_key", "consumer")


class WorkerRegistered(WorkerPublic):
    """The answer to a registration: the worker, and, where the coordinator gives each worker
    its own Redis user (`worker_redis_users`), that user's credentials and the key the worker
    signs its delta batches with. Those three are left out of the answer otherwise."""

    redis_username: str | None = Field(
        None, description="The worker's own Redis user (spotrl-worker-<id>), to connect as."
    )
    redis_password: str | None = Field(
        None, description="That user's password, new at every registration."
    )
    signing_key: str | None = Field(
        None,
        description="Hex (32 bytes), new at every registration: the worker signs each delta "
        "batch with it (field `s`, HMAC-SHA256 of field `m`).",
    )
    consumer: str | None = Field(
        None,
        description="The consumer name the worker reads its jobs as (`<id>#<secret>`, the same "
        "at each registration of the id): no other worker can read the jobs pending under it.",
    )

    @model_serializer(mode="wrap")
    def _minted_only(self, handler: SerializerFunctionWrapHandler) -> Any:
        data = handler(self)
        for name in MINTED:
            if data.get(name) is None:
                data.pop(name, None)
        return data


class RunMetrics(BaseModel):
    run_id: str
    steps: list[dict[str, Any]] = Field(
        description="One row per RL step: `step`, then the fields of "
        "services.state.step_metrics.StepRow written so far: rollout and seeding fields "
        "(coordinator) and training fields (trainer)."
    )


class RunTimeline(BaseModel):
    run_id: str
    events: list[dict[str, Any]] = Field(
        description="What happened, oldest first: each has id, at (unix s), kind and details."
    )
    pool: list[dict[str, Any]] = Field(
        description="Pool samples, oldest first: id, at, step, workers and tokens_per_s by pool."
    )


class WorkerRelease(BaseModel):
    count: int = Field(ge=1, le=100000, description="Executing requests to give back.")
    run_id: str | None = Field(
        None,
        min_length=1,
        max_length=100,
        pattern=r"^[A-Za-z0-9._-]+$",
        description="The run whose requests to give back: needed where the worker serves "
        "several runs; by default the one it serves.",
    )


class WorkerOrdered(BaseModel):
    worker_id: str
    run_id: str
    action: str
    count: int
