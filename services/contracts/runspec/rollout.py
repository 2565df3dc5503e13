"""The run spec's `rollout` section (how the coordinator collects a step's responses from the
workers: migration, staleness, shards, reads, seeding, the pool it asks for) and its `faults`
section (what a stalled run and a request that crashes workers do)."""

from typing import Literal

from pydantic import Field

from services.contracts.runspec.base import Section
from services.contracts.shards import MAX_COORDINATOR_SHARDS


class RolloutSection(Section):
    migration: bool = Field(
        True,
        description="Continue a preempted response from its collected tokens (False: restart it).",
    )
    max_staleness: int = Field(
        0,
        ge=0,
        le=8,
        description="Asynchronous RL with bounded staleness k: the prompts of steps s+1..s+k "
        "are generated while step s trains, each token by a version >= its step - k (0: "
        "synchronous, on-policy). Stale tokens take the decoupled PPO loss (behaviour_cap).",
    )
    coordinator_shards: int = Field(
        1,
        ge=1,
        le=MAX_COORDINATOR_SHARDS,
        description="Coordinator processes that collect the run's token deltas, each the groups "
        "of its share of every step's prompts (prompt index mod shards), with its own deltas "
        "stream and durable request table; the first also schedules. Fixed for the run.",
    )
    share: float = Field(
        1.0,
        gt=0,
        le=1000,
        description="The run's weight among the active runs sharing the fleet (docs/many_runs.md):"
        " with work waiting, it holds slots in proportion to it (max-min fair). Used only where "
        "the coordinator keeps several runs active.",
    )
    fair_reads: bool = Field(
        True,
        description="Each worker holds at most an equal share of a step's unfinished requests "
        "among the workers serving or loading its version, and the balancer evens executing "
        "requests out (False: a worker reads up to its plateau batch size, as in the paper).",
    )
    seeding_wait_share: float = Field(
        0.05,
        ge=0.0,
        le=1.0,
        description="T_seed grows while the trainer waits for groups after the seeding window "
        "longer than this share of its compute time, and shrinks below it.",
    )
    seeding_backoff: float = Field(
        0.1,
        ge=0.0,
        lt=1.0,
        description="Share of the seeding window dropped after a step whose trainer waited "
        "less than seeding_wait_share (a longer window only delays training).",
    )
    pool_headroom: float = Field(
        1.1,
        ge=1.0,
        le=10.0,
        description="The preemptible pool size the coordinator asks a scaler for "
        "(`preemptible_wanted` in the run's status): N_prem, the size past which the step gets "
        "no shorter (mean of the last 3 steps), times this, rounded up.",
    )
    drafts: Literal["history", "off"] = Field(
        "off",
        description="Draft references a job carries for exact speculative decoding (off by "
        "default until a fresh-clone CI with it on passes: one had two failures not yet "
        "found; issue 50): its "
        "group's finished siblings and the last responses to the same prompt earlier in the "
        "run ('history'; the engine verifies every draft against its own seeded draws, so the "
        "tokens are those plain decoding makes), or none ('off': jobs as without speculation).",
    )
    length_aware: bool = Field(
        False,
        description="Queue a step's first jobs longest expected response first (the mean "
        "length of the same prompt's earlier responses in the run; prompts without history "
        "keep their order, after those with), so that the tail starts early (False: prompt "
        "order).",
    )


class FaultsSection(Section):
    stall_timeout_s: float | None = Field(
        None,
        gt=0,
        le=30 * 86400,
        description="Fail the run once it has been stalled this long (None: stay stalled, "
        "waiting for workers, for as long as it takes).",
    )
    max_request_crashes: int = Field(
        3, ge=1, le=100, description="A request that crashed this many workers is quarantined."
    )
    on_poison: Literal["drop_group", "fail_run"] = Field(
        "drop_group",
        description="What a quarantined request does: drop its group from the step (counted "
        "in groups_quarantined) or fail the run.",
    )
    max_error_share: float = Field(
        0.5,
        ge=0.0,
        le=1.0,
        description="Fail the run when, in one step, more than this share of its environment "
        "step() calls or of its reward calls failed (raised, timed out, crashed or returned a "
        "bad value): such a step trains on zero rewards. Failures at or under it leave the run "
        "going, its summary marked degraded with the shares (1.0: never fail for this).",
    )
