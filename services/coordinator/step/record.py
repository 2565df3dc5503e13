"""What a step leaves on record: once its rollout is over, its metrics row (rollout fields), the
rollout gauges and a `rollout_done` event; once the trainer committed the next version, the
seeding update (`core.seeding.after_step`: T_seed moved, N_prem worked out) in its row and in
the run's hash. And the deployment's gauges a scaler reads (`publish_fleet`: the active runs and
the pool they want), set from the run records whenever a step updates a figure and whenever the
scheduler starts, activates or ends a run, so that a restarted coordinator restores them and a
run's end clears them.

It does not decide anything itself: the update comes from the leader's `Lead`
(`core.step_controller`: `core.seeding`'s Algorithm 1 and pool sizer), the figures from the
step's request table and times.
"""

import logging
import math
import time
from dataclasses import replace

import msgspec
import redis.asyncio as aioredis
from prometheus_client import Gauge, Histogram

from services.contracts.fleet import FleetFigures, fleet_figures
from services.contracts.runspec import LIVE_STATES
from services.core.call_errors import CallCount
from services.core.episodes import EpisodeStats, EpisodeTable
from services.core.request_table import Applied, RequestTable
from services.core.seeding import StepTimes, train_compute_s
from services.core.step_controller import Lead
from services.state import run_record, timeline
from services.state.redis_figures import RedisMemory, run_streams, stream_lengths
from services.state.run_state import active_runs
from services.state.step_metrics import StepRow, read_step, record_step

log = logging.getLogger(__name__)
ROLLOUT_S = Histogram(
    "spotrl_coordinator_rollout_seconds",
    "Rollout time of a step",
    buckets=(0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600, 1800),
)
N_PREM = Gauge("spotrl_coordinator_n_prem_recommended", "Preemptible pool size worth having")
WANTED = Gauge(
    "spotrl_coordinator_preemptible_wanted",
    "Preemptible workers the active runs want (0: no run, or no figure yet: see runs_active)",
)
RUNS_ACTIVE = Gauge(
    "spotrl_coordinator_runs_active", "Runs active: running or stalled (0: none, pool to its min)"
)
REWARD = Gauge("spotrl_coordinator_reward_mean", "Mean reward of the newest rollout step")
STEP_TOK_S = Gauge(
    "spotrl_coordinator_step_tokens_per_second", "Rollout tokens/s of the newest step (all pools)"
)


class ShardSummary(msgspec.Struct, frozen=True, kw_only=True):
    """What a step's metrics row takes from the request table of one coordinator shard, or of
    all of them added up (`contracts.shards`)."""

    requests: int
    response_tokens: int
    trained: int  # scored responses of the groups that go to the trainer
    reward_sum: float  # their rewards added up
    stale_deltas: int
    tokens_received: int
    tokens_discarded: int
    migrations: dict[str, int]
    groups_quarantined: int
    reward_errors: int  # reward calls that failed and scored 0
    # multi-turn runs (`core.episodes`): tokens the model did not generate (in response_tokens),
    # turns answered, episodes over, tool calls and their errors, environment calls that
    # failed, environment time
    observed_tokens: int = 0
    turns: int = 0
    episodes: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    environment_errors: int = 0
    environment_s: float = 0.0
    reward_calls: int = 0  # reward calls made (single-turn runs)
    first_errors: dict[str, str] = {}  # the first failure of each kind (`core.call_errors`)
    max_turns: int = 0  # the most model turns of an episode (multi-turn runs)
    # speculative decoding (`RequestTable.drafted`)
    draft_forwards: int = 0
    drafted: int = 0
    accepted: int = 0

    @classmethod
    def of(
        cls,
        table: RequestTable,
        reward_errors: int,
        episodes: EpisodeStats | None = None,
        reward_calls: int = 0,
        first_errors: dict[str, str] | None = None,
    ) -> "ShardSummary":
        trained = [
            r.reward
            for r in table.requests.values()
            if r.reward is not None and r.prompt_index not in table.quarantined
        ]
        return cls(
            requests=len(table.requests),
            response_tokens=table.response_tokens,
            trained=len(trained),
            reward_sum=sum(trained),
            stale_deltas=table.stats[Applied.STALE_LEASE.value],
            tokens_received=table.tokens_received,
            tokens_discarded=table.tokens_discarded,
            migrations=dict(table.migrations),
            groups_quarantined=len(table.quarantined),
            reward_errors=reward_errors,
            observed_tokens=sum(n for r in table.requests.values() for _, n in r.observed),
            **(_episode_counts(episodes) if episodes is not None else {}),
            reward_calls=reward_calls,
            first_errors=dict(first_errors or {}),
            max_turns=table.max_turns if isinstance(table, EpisodeTable) else 0,
            **{name: getattr(table, name) for name in DRAFT_COUNTS},
        )

    @classmethod
    def total(cls, parts: list["ShardSummary"]) -> "ShardSummary":
        migrations: dict[str, int] = {}
        for part in parts:
            for cause, n in part.migrations.items():
                migrations[cause] = migrations.get(cause, 0) + n
        return cls(
            requests=sum(p.requests for p in parts),
            response_tokens=sum(p.response_tokens for p in parts),
            trained=sum(p.trained for p in parts),
            reward_sum=sum(p.reward_sum for p in parts),
            stale_deltas=sum(p.stale_deltas for p in parts),
            tokens_received=sum(p.tokens_received for p in parts),
            tokens_discarded=sum(p.tokens_discarded for p in parts),
            migrations=migrations,
            groups_quarantined=sum(p.groups_quarantined for p in parts),
            reward_errors=sum(p.reward_errors for p in parts),
            **{name: sum(getattr(p, name) for p in parts) for name in EPISODE_COUNTS},
            reward_calls=sum(p.reward_calls for p in parts),
            first_errors={k: v for p in reversed(parts) for k, v in p.first_errors.items()},
            max_turns=max((p.max_turns for p in parts), default=0),
            **{name: sum(getattr(p, name) for p in parts) for name in DRAFT_COUNTS},
        )

    @property
    def mean_reward(self) -> float:
        return self.reward_sum / max(1, self.trained)

    def call_counts(self) -> dict[str, CallCount]:
        """The step's calls of user code and their failures, by kind (`core.call_errors`)."""
        first = self.first_errors
        return {
            "environment": CallCount(
                self.turns, self.environment_errors, first.get("environment", "")
            ),
            "reward": CallCount(self.reward_calls, self.reward_errors, first.get("reward", "")),
        }


EPISODE_COUNTS = (
    "observed_tokens",
    "turns",
    "episodes",
    "tool_calls",
    "tool_errors",
    "environment_errors",
    "environment_s",
)

DRAFT_COUNTS = ("draft_forwards", "drafted", "accepted")


def _episode_counts(stats: EpisodeStats) -> dict:
    return {
        "turns": stats.turns,
        "episodes": stats.episodes,
        "tool_calls": stats.tool_calls,
        "tool_errors": stats.tool_errors,
        "environment_errors": stats.errors,
        "environment_s": stats.seconds,
    }


def episode_fields(summary: ShardSummary) -> dict:
    """A multi-turn step's fields of its metrics row (none for a single-turn step)."""
    if not summary.episodes:
        return {}
    return {
        "turns_mean": summary.turns / summary.episodes,
        "tool_calls": summary.tool_calls,
        "tool_errors": summary.tool_errors,
        "environment_errors": summary.environment_errors,
        "environment_calls": summary.turns,
        "environment_error_first": summary.first_errors.get("environment"),
        "max_turns": summary.max_turns,
        "environment_s": summary.environment_s,
        "observed_tokens": summary.observed_tokens,
    }


def draft_fields(summary: ShardSummary) -> dict:
    """A step's speculative decoding fields of its metrics row (none where nothing was
    drafted: speculation off, or an engine without it)."""
    if not summary.draft_forwards:
        return {}
    return {
        "drafted_tokens": summary.drafted,
        "accepted_tokens": summary.accepted,
        "wasted_tokens": summary.drafted - summary.accepted,
        "accepted_per_forward": summary.accepted / summary.draft_forwards,
    }


def rollout_row(
    version: int,
    summary: ShardSummary,
    times: StepTimes,
    window: float,
    pools: dict[str, int],
    redis_mem_mib: float,
    lengths: dict[str, int],
) -> StepRow:
    """The rollout fields of a step's metrics row."""
    rollout_s = times.rollout_end - times.started
    tokens = summary.response_tokens
    generated = tokens - summary.observed_tokens
    seed_end = times.seed_end if times.seed_end is not None else times.rollout_end
    return StepRow(
        version=version,
        reward_mean=summary.mean_reward,
        response_tokens=tokens,
        response_len_mean=tokens / max(1, summary.requests),
        rollout_s=rollout_s,
        tokens_per_s=generated / max(rollout_s, 1e-9),
        stale_deltas=summary.stale_deltas,
        tokens_received=summary.tokens_received,
        tokens_discarded=summary.tokens_discarded,
        regenerated_tokens=summary.tokens_received - generated,
        migrations=summary.migrations,
        t_seed_s=window,  # inf (no window) is stored as null
        seed_s=seed_end - times.started,
        workers_reserved=pools["reserved"],
        workers_preemptible=pools["preemptible"],
        groups_quarantined=summary.groups_quarantined,
        reward_errors=summary.reward_errors,
        reward_calls=summary.reward_calls,
        reward_error_first=summary.first_errors.get("reward"),
        redis_mem_mib=round(redis_mem_mib, 1),
        stream_lengths=lengths,
        **episode_fields(summary),
        **draft_fields(summary),
    )


async def record_rollout(
    r: aioredis.Redis,
    run_id: str,
    step: int,
    version: int,
    summary: ShardSummary,
    times: StepTimes,
    window: float,
    pools: dict[str, int],
) -> None:
    """The step's rollout is over: its metrics row, gauges, event and log line, from the
    `summary` of its request tables (every shard's)."""
    rollout_s = times.rollout_end - times.started
    ROLLOUT_S.observe(rollout_s)
    tokens, mean_reward = summary.response_tokens, summary.mean_reward
    reward_errors = summary.reward_errors
    used_mib = (await RedisMemory(r).read()).used_mib
    lengths = await stream_lengths(r, run_streams(run_id, step))
    row = rollout_row(version, summary, times, window, pools, used_mib, lengths)
    await record_step(r, run_id, step, row)
    REWARD.set(mean_reward)
    STEP_TOK_S.set(tokens / max(rollout_s, 1e-9))
    await timeline.emit(
        r,
        run_id,
        "rollout_done",
        step=step,
        reward_mean=mean_reward,
        tokens=tokens,
        rollout_s=rollout_s,
        reward_errors=reward_errors,
    )
    log.info(
        "step %d: rollout done in %.2fs, %d tokens, reward %.3f (%s)",
        step,
        rollout_s,
        tokens,
        mean_reward,
        ", ".join(
            f"{c.failed} of {c.calls} {kind} calls failed"
            for kind, c in summary.call_counts().items()
            if c.calls or c.failed
        )
        or "no user code called",
    )


async def adapt(
    r: aioredis.Redis,
    run_id: str,
    lead: Lead,
    step: int,
    times: StepTimes,
) -> None:
    """After the trainer committed the version trained on `step` (whose rollout took `times`):
    move T_seed (Algorithm 1), work out the preemptible pool size worth having and the pool a
    scaler should hold (`preemptible_wanted`)."""
    trained = await read_step(r, run_id, step)
    train_wait_s = trained.train_wait_s or 0.0
    compute_s = train_compute_s(trained.train_s or 0.0, train_wait_s, trained.seed_wait_s or 0.0)
    times = replace(
        times,
        committed=time.monotonic(),
        train_compute_s=compute_s,
        train_wait_s=train_wait_s,
    )
    update, wanted = lead.trained(times)
    n_prem = None if math.isinf(update.n_prem_recommended) else update.n_prem_recommended
    row = StepRow(
        t_remote_wait_s=update.t_remote_wait_s,
        t_seed_next_s=update.t_seed_next_s,
        n_prem_recommended=update.n_prem_recommended,
    )
    await record_step(r, run_id, step, row)
    await run_record.set_seeding(r, run_id, update.t_seed_next_s, update.n_prem_recommended, wanted)
    N_PREM.set(n_prem or 0)
    await publish_fleet(r)


async def publish_fleet(r: aioredis.Redis) -> FleetFigures:
    """Set the gauges of the active runs and the pool they want from their records in Redis
    (`contracts.fleet.fleet_figures`): 0 and 0 with no run."""
    fields = ("state", "preemptible_wanted")
    records = [await run_record.read(r, run_id, *fields) for run_id in await active_runs(r)]
    live = [rec for rec in records if rec is not None and rec.state in LIVE_STATES]
    figures = fleet_figures([run.preemptible_wanted for run in live])
    RUNS_ACTIVE.set(figures.runs_active)
    WANTED.set(figures.preemptible_wanted)
    return figures


# Telling the failures of a run's user code (its environment's calls, its reward's): the first
# failure of each kind is written to the coordinator's log with its traceback and to the run's
# timeline (`spotrl logs`, kind `user_code_failed`), once per kind and coordinator process; each
# step keeps its own first failure in short form for its metrics row. Later failures are only
# counted: the step's log line says how many (`record_rollout`).
#
# It decides nothing: whether the failures end the run is `core.call_errors`'.
log = logging.getLogger(__name__)


class FailureLog:
    """The failures told so far by this process, for one run."""

    def __init__(self, r: aioredis.Redis, run_id: str) -> None:
        self.r, self.run_id = r, run_id
        self.told: set[str] = set()  # kinds whose first failure is in the log

    async def tell(
        self, firsts: dict[str, str], step: int, kind: str, short: str, trace: str
    ) -> None:
        """A failure of `kind` in `step` (`short`: one line; `trace`: its traceback, "" when
        nothing raised): kept as the step's first of its kind in `firsts`; the run's first of
        its kind is logged and put on the timeline."""
        firsts.setdefault(kind, short)
        if kind in self.told:
            return
        self.told.add(kind)
        trace = trace or "(no traceback: the call did not raise)"
        log.error("run %s step %d: first %s failure: %s\n%s", self.run_id, step, kind, short, trace)
        await timeline.emit(
            self.r,
            self.run_id,
            "user_code_failed",
            source=kind,
            step=step,
            error=short,
            trace=trace,
        )
