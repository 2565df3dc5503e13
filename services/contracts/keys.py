"""Every Redis key and stream name spotrl uses, in one place.

Keys are grouped by owner. A run's keys all start with `spotrl:run:{run_id}:` so that a run can be
inspected (or deleted) with one SCAN pattern. Nothing outside this module builds a key by hand.
"""

from services.contracts.shards import MAX_COORDINATOR_SHARDS

PREFIX = "spotrl"

# ---- runs (owned by the coordinator) ----
RUN_QUEUE = f"{PREFIX}:runs:queue"  # list of run ids waiting, FIFO (RPUSH / LPOP)
RUN_INDEX = f"{PREFIX}:runs:index"  # sorted set run_id -> created_at, for listing
ACTIVE_RUN = f"{PREFIX}:runs:active"  # string: id of the oldest active run, absent when idle
# Sorted set run_id -> activated_at: every active run (one, unless the coordinator's
# max_active_runs lets several share the fleet); ACTIVE_RUN is the oldest of them
ACTIVE_RUNS = f"{PREFIX}:runs:active-set"
# Set of the ids of the trainers of the pool (each beats at trainer_heartbeat); the coordinator
# activates a second run only for an idle trainer
TRAINERS = f"{PREFIX}:trainers"
# Stream, capped (FLEET_DEMAND_MAXLEN): a run's demand on the fleet changed (field "run"): wakes
# the fleet's placer at once rather than at its next period
FLEET_DEMAND = f"{PREFIX}:fleet:demand"
FLEET_DEMAND_MAXLEN = 64
# String (a FleetAllotment), with a TTL: the fleet's slots and each active run's part of them,
# written by the placer at each pass while several runs are active; a worker serving several
# runs at once reads at most its slots' part of each run's (absent: no bound)
FLEET_ALLOT = f"{PREFIX}:fleet:allot"


def run(run_id: str) -> str:
    """Hash: spec (json), state, created_at, started_at, finished_at, error; stall_reason and
    stalled_since while stalled; groups_quarantined."""
    return f"{PREFIX}:run:{run_id}"


def run_version(run_id: str) -> str:
    """String: the newest weight version committed for the run (written by the trainer)."""
    return f"{PREFIX}:run:{run_id}:version"


def run_staleness(run_id: str) -> str:
    """String: the run's max_staleness (spec.rollout), written with the run: what a worker needs
    of the spec to know which steps' jobs it may read (it may not read the spec itself, which
    holds the prompts)."""
    return f"{PREFIX}:run:{run_id}:staleness"


def run_drafts(run_id: str) -> str:
    """String "history", written with the run when its spec's rollout.drafts is (absent: off):
    a worker shares a finished response with its running siblings as drafts only then (it may
    not read the spec itself)."""
    return f"{PREFIX}:run:{run_id}:drafts"


def run_base(run_id: str) -> str:
    """String: a LoRA run's base model (its spec's `model`), written with the run; absent for
    a run that trains every weight. A worker serves several runs at once on one engine only
    where each is a LoRA run on the same base (`rollout.lanes`); it may not read the spec."""
    return f"{PREFIX}:run:{run_id}:base"


def version_announced(run_id: str) -> str:
    """Stream of one entry: the trainer adds one as it announces a version (in the transaction
    that sets `run_version`), so a service waiting for a version blocks on it rather than
    polling; `run_version` stays the truth."""
    return f"{PREFIX}:run:{run_id}:version:announced"


def run_manifests(run_id: str) -> str:
    """Hash: weight version -> the manifest (JSON) the weight store answered the trainer's
    commit of it with, announced with the version, so that a worker pulls the version without
    asking the store for its manifest first (it checks the manifest against the digest all the
    same). Kept for the newest two versions; a version missing here is asked of the store."""
    return f"{PREFIX}:run:{run_id}:manifests"


def run_digests(run_id: str) -> str:
    """Hash: weight version -> content digest (services.weights.transfer.content_digest) of the
    files the trainer commits as that version, written before the version is committed and
    announced; a version is loaded only with this digest. Kept for the newest two versions."""
    return f"{PREFIX}:run:{run_id}:digests"


def run_step(run_id: str, step: int) -> str:
    """Hash: one row of per-step metrics (rollout fields: coordinator; training: trainer)."""
    return f"{PREFIX}:run:{run_id}:step:{step}"


def run_steps_done(run_id: str) -> str:
    """Sorted set of step indices that have a metrics row."""
    return f"{PREFIX}:run:{run_id}:steps"


def _shard(shard: int) -> str:
    """The suffix of a coordinator shard's keys: none for shard 0 (the names of one shard)."""
    return f":shard:{shard}" if shard else ""


def step_meta(run_id: str, step: int, shard: int = 0) -> str:
    """Hash: queued (the shard's jobs of the step are on their stream), started_at (unix s)."""
    return f"{PREFIX}:run:{run_id}:step:{step}:meta{_shard(shard)}"


def step_requests(run_id: str, step: int, shard: int = 0) -> str:
    """Hash: request id -> "lease|finish_reason|crashed|grant" (a coordinator shard's durable
    request table)."""
    return f"{PREFIX}:run:{run_id}:step:{step}:requests{_shard(shard)}"


def step_shards(run_id: str, step: int) -> str:
    """Hash, with coordinator shards: "{shard}:unfinished" -> the shard's unfinished requests
    of the step, "{shard}:done" -> its summary (JSON, `coordinator.step.record.ShardSummary`)
    once it has published all its groups. Read by shard 0, which schedules and records the step."""
    return f"{PREFIX}:run:{run_id}:step:{step}:shards"


def step_episodes(run_id: str, step: int, shard: int = 0) -> str:
    """Hash: request id -> its multi-turn episode as JSON (`core.episodes.Episode`: turns,
    rewards, observations, the spans of tokens not generated, whether a turn awaits the
    environment); only in runs with an environment."""
    return f"{PREFIX}:run:{run_id}:step:{step}:episodes{_shard(shard)}"


def step_log(run_id: str, step: int, shard: int = 0) -> str:
    """List: one record per coordinator read that changed the shard's requests of the step:
    their new tokens, logprobs and weight versions (`coordinator.step.store`); replayed in order
    they give every request's arrays."""
    return f"{PREFIX}:run:{run_id}:step:{step}:log{_shard(shard)}"


def step_published(run_id: str, step: int, shard: int = 0) -> str:
    """Set of prompt indices (of a shard) whose group was handed to the trainer."""
    return f"{PREFIX}:run:{run_id}:step:{step}:published{_shard(shard)}"


def step_quarantined(run_id: str, step: int, shard: int = 0) -> str:
    """Set of prompt indices (of a shard) whose group was dropped: a request of it crashed too
    many workers."""
    return f"{PREFIX}:run:{run_id}:step:{step}:quarantined{_shard(shard)}"


def seed_done(run_id: str, step: int) -> str:
    """String set when step's seeding window is over: the trainer may start consuming groups."""
    return f"{PREFIX}:run:{run_id}:seed_done:{step}"


def seeding_over(run_id: str) -> str:
    """Stream of one entry: the coordinator adds one as it sets a step's `seed_done` (in one
    transaction), so the trainer waiting for it blocks on it rather than polling."""
    return f"{PREFIX}:run:{run_id}:seeding:over"


def draft_history(run_id: str) -> str:
    """Hash: prompt digest -> the last responses to that prompt in the run (msgpack token
    lists, oldest first), which its later jobs draft from (`coordinator.step.history`);
    bounded by prompts (`draft_history_order`), responses and tokens."""
    return f"{PREFIX}:run:{run_id}:drafts:history"


def draft_history_order(run_id: str) -> str:
    """Sorted set: prompt digest -> the step that last wrote its `draft_history`; the prompts
    written longest ago are trimmed past the bound, with their history."""
    return f"{PREFIX}:run:{run_id}:drafts:order"


def read_cap(run_id: str, step: int) -> str:
    """String: the most requests of the step one worker should hold (`core.balancer.read_cap`),
    kept current by the coordinator; absent: a worker reads up to its plateau."""
    return f"{PREFIX}:run:{run_id}:step:{step}:read_cap"


def jobs_stream(run_id: str, version: int) -> str:
    """Stream of token-level jobs that only workers holding `version` read."""
    return f"{PREFIX}:run:{run_id}:jobs:v{version}"


def deltas_stream(run_id: str, shard: int = 0) -> str:
    """Stream of token deltas from workers to a coordinator shard (of the requests it owns,
    `contracts.shards`). An entry is deleted in the transaction that stores what it carried (the
    shard's request table)."""
    return f"{PREFIX}:run:{run_id}:deltas{_shard(shard)}"


def shard_metrics(run_id: str) -> str:
    """Hash: coordinator shard (1..K-1) -> the URL of its Prometheus metrics (a process of its
    own; shard 0's are the coordinator's /metrics)."""
    return f"{PREFIX}:run:{run_id}:shard_metrics"


def all_deltas_streams(run_id: str) -> list[str]:
    """The deltas stream of every shard a run may have (those of a run with fewer are absent)."""
    return [deltas_stream(run_id, shard) for shard in range(MAX_COORDINATOR_SHARDS)]


def groups_stream(run_id: str) -> str:
    """Stream of finished groups from the coordinator to the trainer. The groups of a step are
    deleted once the version trained on them is committed (keys.run_trained keeps the record)."""
    return f"{PREFIX}:run:{run_id}:groups"


def weight_holders(run_id: str, version: int) -> str:
    """Hash: worker id -> which blocks of the run's weight version it holds verified and serves
    to its peers, and where (JSON, services.rollout.peers); it expires an hour after its last
    change, and a worker removes its entry when it drops the version."""
    return f"{PREFIX}:run:{run_id}:holders:{version}"


def worker_loads(run_id: str, worker_id: str) -> str:
    """Set of weight versions a worker has loaded for a run (audit trail)."""
    return f"{PREFIX}:run:{run_id}:loads:{worker_id}"


def run_trained(run_id: str) -> str:
    """Hash: step -> the compact record (JSON, services.state.ledger) of what the trainer took
    for that step; what audits read once the groups themselves are deleted."""
    return f"{PREFIX}:run:{run_id}:trained"


def trainer_state(run_id: str) -> str:
    """Hash: the trainer's view of a run (steps trained, groups consumed, groups incomplete)."""
    return f"{PREFIX}:run:{run_id}:trainer"


def run_trainer_lease(run_id: str) -> str:
    """String with a TTL: the id of the trainer that trains the run, renewed while it does; a
    trainer of the pool takes a run whose lease is free (or its own)."""
    return f"{PREFIX}:run:{run_id}:trainer-lease"


def run_demand(run_id: str) -> str:
    """String with a TTL ("UNFINISHED TAIL SHARE"): the rollout slots the run could fill now
    (its steps' unfinished requests), whether its oldest step waits only on its last requests
    (1 or 0) and the run's share, written by the run's step loop at each tick; what the fleet's
    shares are allotted from when several runs are active."""
    return f"{PREFIX}:run:{run_id}:demand"


def run_events(run_id: str) -> str:
    """Stream of things that happened to a run (workers joining and leaving, migrations, steps,
    state changes), for `spotrl logs` and the dashboard. Capped."""
    return f"{PREFIX}:run:{run_id}:events"


def run_pool(run_id: str) -> str:
    """Stream of periodic samples of the worker pool and its tokens/s, written by the coordinator's
    observer. Capped."""
    return f"{PREFIX}:run:{run_id}:pool"


def parked_stream(run_id: str) -> str:
    """Stream where malformed messages are parked for a person to look at."""
    return f"{PREFIX}:run:{run_id}:parked"


# ---- workers (registered through the coordinator, heartbeat written by the worker) ----
WORKER_INDEX = f"{PREFIX}:workers"  # set of worker ids ever registered
# Hash: worker id -> the key (hex) its delta batches are signed with, given to it at
# registration; the coordinator's alone (no other role's Redis user may read it).
WORKER_KEYS = f"{PREFIX}:workers:keys"
# Hash: worker id -> the SHA-256 (hex) of its Redis user's password, written as the user is
# minted: Redis replicates data, not users, so a replica promoted by a failover lacks the users
# minted on the old primary until the coordinator makes them again from here.
WORKER_USERS = f"{PREFIX}:workers:users"
# String: the Redis primary (host:port, Sentinel's) the users of WORKER_USERS were made on last
WORKER_USERS_ON = f"{PREFIX}:workers:users:primary"


def worker(worker_id: str) -> str:
    """Hash: id, pool, engine, slots, url, registered_at."""
    return f"{PREFIX}:worker:{worker_id}"


def worker_control(worker_id: str) -> str:
    """Stream of WorkerControl orders to one worker (read without a group)."""
    return f"{PREFIX}:worker:{worker_id}:control"


def worker_heartbeat(worker_id: str) -> str:
    """String (msgpack Heartbeat) with a short TTL: present while the worker is alive."""
    return f"{PREFIX}:worker:{worker_id}:hb"


def worker_crash(worker_id: str) -> str:
    """String (JSON: at, error, run_id, version, requests) with a TTL, written by a worker whose
    task died of an error, before it exits: why it died and the requests it was running."""
    return f"{PREFIX}:worker:{worker_id}:crash"


def worker_leaving(worker_id: str) -> str:
    """String set (with a TTL) by a worker that got its preemption notice and released its work:
    the coordinator tells a notice from a sudden death by it. Its value: when the notice came
    (unix seconds)."""
    return f"{PREFIX}:worker:{worker_id}:leaving"


def trainer_heartbeat(trainer_id: str) -> str:
    """String (JSON {"run_id": the run it trains, or null}) with a short TTL: present while the
    trainer of the pool is alive."""
    return f"{PREFIX}:trainer:{trainer_id}:hb"


# ---- consumer groups ----
WORKERS_GROUP = "workers"  # on every jobs stream
COORDINATOR_GROUP = "coordinator"  # on the deltas stream
TRAINER_GROUP = "trainer"  # on the groups stream
