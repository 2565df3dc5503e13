"""Collecting a run's token deltas into the steps in flight (one, or with asynchronous RL up to
max_staleness + 1): one read of the deltas stream at a time goes to the step controllers
(`core.step_controller.route_deltas`: each step's `StepController.on_deltas`) and comes back as
one `Effects` value per step; finished responses are scored (`scoring/rewards.py`: a reward that
fails scores 0 and is counted in the step's reward_errors) or, in multi-turn episodes, ended
turns are answered by the environment (`scoring/episodes.py`), each answer handed back to the
controller; then every step's effects are written in one MULTI with the acknowledgement of what
was read (`step/store.py`), and what they say is counted and told (`tell`: migrations,
quarantined groups, fenced leases). Deltas of a step not in flight (finished, or fenced
stragglers) are counted as unknown and dropped with the read.

It decides nothing: what to store, queue, publish, quarantine and fence is the controller's.
It does not drive steps: that is `step/loop.py`, which calls `collect` in its loop (and
`settle` with the effects of a step it opens).
"""

import asyncio
import contextlib
import gc
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import get_args

import redis.asyncio as aioredis
from prometheus_client import Counter, Histogram
from redis.exceptions import OutOfMemoryError
from tokenizers import Tokenizer

from services.contracts import keys
from services.contracts.messages import DeltaBatch, ReleaseReason
from services.contracts.runspec import RunSpec
from services.coordinator.scoring.episodes import EpisodeShell
from services.coordinator.scoring.rewards import RewardRunner
from services.coordinator.step.record import FailureLog, ShardSummary
from services.coordinator.step.store import StepStore, write_staged
from services.coordinator.workers.fleet import crash_reports
from services.coordinator.workers.keys import WorkerKeys
from services.core.episodes import EpisodeStats, EpisodeTable
from services.core.request_table import Applied, RequestTable
from services.core.step_controller import Effects, StepController, route_deltas
from services.infra.redis_streams import (
    Read,
    StagedWrites,
    StreamConsumer,
    ensure_group,
    entry_time_s,
    while_out_of_memory,
)
from services.state import timeline
from services.state.runs import RunFailed, RunStore
from services.tasks import Example

log = logging.getLogger(__name__)
DELTA_ITEMS = Counter("spotrl_coordinator_delta_items_total", "Delta items by outcome", ["outcome"])
OUTCOMES = {a.value: DELTA_ITEMS.labels(a.value) for a in Applied}  # children looked up once
TOKENS = Counter("spotrl_coordinator_tokens_total", "Response tokens collected")
WRONG_GRANT = Counter(
    "spotrl_coordinator_wrong_grant_total",
    "Deltas and releases refused: the request's current lease without its grant (the sender "
    "never read the job)",
    ["kind"],
)
WRONG_GRANT_DELTAS, WRONG_GRANT_RELEASES = (
    WRONG_GRANT.labels("delta"),
    WRONG_GRANT.labels("release"),
)
GROUPS = Counter("spotrl_coordinator_groups_published_total", "Groups handed to the trainer")
LAG_S = Histogram(
    "spotrl_coordinator_delta_lag_seconds",
    "From a worker's flush (its deltas entry's id) to the stored outcome of the read that took it",
    buckets=(0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1, 1.5, 2, 3, 5, 10, 30, 60),
)

MIGRATIONS = Counter("spotrl_coordinator_migrations_total", "Requests migrated", ["cause"])
for _cause in (*get_args(ReleaseReason), "bound"):
    MIGRATIONS.labels(_cause)  # every cause is exported from the start, at 0
QUARANTINED = Counter(
    "spotrl_coordinator_groups_quarantined_total", "Groups dropped for a poison request"
)
ERROR_CHARS = 300  # of the last worker's error quoted in a poison reason

DELTA_BATCH = 256


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """No cyclic garbage collection inside (unless it was off already). A read decodes about
    three objects per delta item, alive until the read is stored and then freed by reference
    counting; collections they triggered on the way walked them again and again, and moved
    them to the old generation, whose full collections then walked the request tables too:
    most of the decode's time, under load. What is left to collect is collected after.
    The switch is the whole process's: hold it over CPU work and short round trips only, never
    across a wait of unbounded length (over the blocking read it was off for every other task
    nearly all the time; a reward may take seconds)."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


@dataclass
class LiveStep:
    """A step whose rollout is in flight: its controller (what its deltas are applied to) and
    its stored state."""

    control: StepController
    store: StepStore
    examples: list[Example]
    reward_errors: int = 0  # reward calls that scored 0
    reward_calls: int = 0  # reward calls made
    first_errors: dict[str, str] = field(default_factory=dict)  # by kind (`core.call_errors`):
    # the step's first failure of the user's code on this shard, in short form
    episode_stats: EpisodeStats = field(default_factory=EpisodeStats)  # multi-turn runs
    changed: asyncio.Event = field(default_factory=asyncio.Event)  # set after each apply

    @property
    def table(self) -> RequestTable:
        return self.control.table

    def summary(self) -> ShardSummary:
        """This shard's part of the step's metrics row, once its groups are published."""
        return ShardSummary.of(
            self.table, self.reward_errors, self.episode_stats, self.reward_calls, self.first_errors
        )


class DeltaCollector:
    """Reads the run's deltas (first, after `replay`, those read before a restart and never
    acknowledged) and scores finished responses with the run's reward."""

    def __init__(
        self,
        r: aioredis.Redis,
        run_id: str,
        spec: RunSpec,
        runs: RunStore,
        tokenizer: Tokenizer,
        stop_ids: list[int],
        rewards: RewardRunner,
        shard: int = 0,
        episodes: EpisodeShell | None = None,
        signatures: WorkerKeys | None = None,
    ) -> None:
        """Of the requests of coordinator shard `shard` (`contracts.shards`), read from its own
        deltas stream. With `signatures` (`worker_redis_users` on), a batch not signed by the
        worker it names is parked, never applied (`workers/keys.py`)."""
        self.r, self.run_id, self.spec, self.runs = r, run_id, spec, runs
        self.signatures = signatures
        self.tokenizer, self.stop_ids, self.rewards = tokenizer, stop_ids, rewards
        self.episodes = episodes  # a run with an environment: its turns are answered
        self.deltas = StreamConsumer(
            r, keys.deltas_stream(run_id, shard), keys.COORDINATOR_GROUP, "coordinator", DeltaBatch
        )
        self.oom_stalled = False  # marked stalled because Redis refused a batch for memory
        self.failures = FailureLog(r, run_id)

    async def start(self) -> None:
        """Create the deltas stream's consumer group if missing."""
        await ensure_group(self.r, self.deltas.stream, keys.COORDINATOR_GROUP)

    def replay(self) -> None:
        """Read first the deltas read before a restart and never acknowledged."""
        self.deltas.replay()

    def decode(self, table: RequestTable, rids: list[str]) -> list[str]:
        """The finished responses' texts, stop tokens left out (CPU-bound: in a thread)."""
        stop = set(self.stop_ids)
        return self.tokenizer.decode_batch(
            [[t for t in table.requests[rid].token_ids if t not in stop] for rid in rids]
        )

    async def score(self, live: LiveStep, rids: list[str]) -> dict[str, float]:
        """Decode and score finished responses, off the event loop; count failed rewards."""
        if not rids:
            return {}
        table = live.table
        texts = await asyncio.to_thread(self.decode, table, rids)
        calls = [
            (live.examples[table.requests[rid].prompt_index], t)
            for rid, t in zip(rids, texts, strict=True)
        ]
        outcomes = await self.rewards.score(calls)
        live.reward_calls += len(outcomes)
        failed = [o for o in outcomes if o.error]
        if failed:  # counted in the step's row and log line; the first told with its traceback
            live.reward_errors += len(failed)
            first = failed[0]
            short = f"{first.error}: {first.detail}" + (f" (at {first.at})" if first.at else "")
            await self.failures.tell(live.first_errors, table.step, "reward", short, first.trace)
        return {rid: o.value for rid, o in zip(rids, outcomes, strict=True)}

    async def collect(self, live: dict[int, LiveStep], block_ms: int) -> None:
        """One read of delta batches (waiting up to `block_ms` for one) to the steps in flight;
        their effects written with the acknowledgement and deletion of the read's entries
        (what they carried is in the request tables from then on): `settle`."""
        with gc_paused():  # deltas waiting now: the reply is big and comes at once
            entries = await self.deltas.fetch(DELTA_BATCH, None)
        if not entries:  # none: wait for some, with the GC on
            entries = await self.deltas.fetch(DELTA_BATCH, block_ms)
        if not entries:
            return
        with gc_paused():
            read = self.deltas.decode(entries)
            if self.signatures is not None:  # a key read at most once: a short round trip
                await self.signatures.screen(read)
            applied = self._apply(live, read.messages)
        await self.settle(applied, read)

    async def settle(
        self, applied: list[tuple["LiveStep", Effects]], read: Read[DeltaBatch] | None = None
    ) -> None:
        """What follows the controllers' effects of one read (or of a step opened, `read`
        None): finished responses scored, or in multi-turn episodes ended turns answered by the
        environment, each handed back to the controller; then in one MULTI every step's effects
        and the acknowledgement of `read`; then what they say, counted and told."""
        for into, effects in applied:
            await self._answer(into, effects)
        staged = StagedWrites()
        with gc_paused():
            for into, effects in applied:
                into.store.stage(staged, into.table, effects)
        if read is not None:
            self.deltas.stage_ack(staged, read.ids, delete=True)
        if staged.ops:
            await while_out_of_memory(lambda: self._store(staged), "store deltas", self._say_oom)
        stored = time.time()
        for entry_id in read.ids if read is not None else ():
            LAG_S.observe(max(0.0, stored - entry_time_s(entry_id)))
        if self.oom_stalled:
            self.oom_stalled = False
            await self.runs.mark_running(self.run_id, "redis takes writes again")
        for into, effects in applied:
            into.control.stored(effects)
            await self._after(into, effects)
        if read is not None:
            await self.deltas.park(read, keys.parked_stream(self.run_id), "deltas")

    async def _answer(self, into: "LiveStep", effects: Effects) -> None:
        """The responses that finished, scored; or in multi-turn episodes the turns that ended
        answered by the environment (the next turns' jobs and the episodes over, which hold
        their turns' rewards): each back to the controller."""
        table = into.table
        if self.episodes is None:
            if effects.score:
                into.control.on_scores(await self.score(into, effects.score))
            return
        if not effects.turns or not isinstance(table, EpisodeTable):
            return
        jobs, over, failed = await self.episodes.answer(
            table, into.examples, effects.turns, into.episode_stats
        )
        if failed:
            await self.failures.tell(
                into.first_errors, table.step, "environment", failed[0].short, failed[0].trace
            )
        effects.merge(into.control.on_answers(jobs, over))

    async def _store(self, staged: StagedWrites) -> None:
        """One attempt at the read's MULTI; packing it allocates much, and its round trip is
        short: the GC stays paused over both."""
        with gc_paused():
            await write_staged(self.r, staged)

    def _apply(
        self, live: dict[int, "LiveStep"], messages: list[tuple[bytes, DeltaBatch]]
    ) -> list[tuple["LiveStep", Effects]]:
        """A read's batches to the controllers of their steps (CPU only)."""
        steps = {step: into.control for step, into in live.items()}
        applied, unknown = route_deltas(steps, [batch for _, batch in messages])
        if unknown:  # of steps not in flight: nothing of them is applied any more
            OUTCOMES[Applied.UNKNOWN.value].inc(unknown)
        return [(live[control.step], effects) for control, effects in applied]

    async def _after(self, into: "LiveStep", effects: Effects) -> None:
        """What follows a step's effects once they are stored: counted and told."""
        table = into.table
        await tell(self.r, table, effects)
        GROUPS.inc(len(effects.publish))
        outcome = effects.read
        if outcome is not None:
            TOKENS.inc(outcome.tokens_appended)
            for applied, n in outcome.applied.items():
                OUTCOMES[applied].inc(n)
            if outcome.forged:
                self._say_forged(table, effects)
        into.changed.set()

    def _say_forged(self, table: RequestTable, effects: Effects) -> None:
        """Count and log (one line per read) the deltas and releases refused for their grant."""
        outcome = effects.read
        assert outcome is not None
        deltas = outcome.applied[Applied.WRONG_GRANT.value]
        WRONG_GRANT_DELTAS.inc(deltas)
        WRONG_GRANT_RELEASES.inc(outcome.forged_releases)
        log.warning(
            "run %s step %d: refused %d deltas and %d releases without their lease's grant (%s)",
            self.run_id,
            table.step,
            deltas,
            outcome.forged_releases,
            ", ".join(f"{worker} {n}" for worker, n in outcome.forged.most_common(5)),
        )

    async def _say_oom(self, reason: str) -> None:
        """Redis refuses writes for memory: the run is stalled, saying so, where Redis takes
        that small write (else the log and the memory gauges say it)."""
        try:
            self.oom_stalled = await self.runs.mark_stalled(self.run_id, reason, time.time())
        except OutOfMemoryError as exc:
            log.warning("run %s: could not record the memory stall: %s", self.run_id, exc)


async def tell(r: aioredis.Redis, table: RequestTable, effects: Effects) -> None:
    """What a step's stored effects say, counted and told: the poison requests (their groups
    quarantined, or the run failed: RunFailed), the requests migrated, the leases fenced."""
    if effects.poisoned:
        await report_poison(r, table, effects.poisoned, effects.poison_fails)
    for cause, n in effects.migrated.items():
        if n:
            MIGRATIONS.labels(cause).inc(n)
            await timeline.emit(r, table.run_id, "migrated", cause=cause, count=n, step=table.step)
    for worker_id, pairs in effects.fences.items():
        await timeline.emit(r, table.run_id, "fenced", worker=worker_id, count=len(pairs))
        log.info("fenced %d requests on %s", len(pairs), worker_id)


async def report_poison(
    r: aioredis.Redis, table: RequestTable, poisoned: list[tuple[str, str]], fails: bool
) -> None:
    """Say which requests (each with the worker it crashed last) were quarantined and why (a
    request released with reason "crash" counts the worker it crashed: `collect.note_crash`);
    with on_poison=fail_run (`fails`) raise RunFailed instead."""
    reports = await crash_reports(r, sorted({w for _, w in poisoned}))
    for rid, worker_id in poisoned:
        req = table.requests[rid]
        error = str(reports.get(worker_id, {}).get("error", "unknown"))
        reason = (
            f"request {rid} (step {table.step}, prompt {req.prompt_index}) crashed "
            f"{len(req.crashed_on)} workers ({', '.join(req.crashed_on)}); last error: "
            f"{worker_id}: {error[:ERROR_CHARS]}"
        )
        if fails:
            raise RunFailed(reason)
        QUARANTINED.inc()
        log.warning("step %d: group %d dropped: %s", table.step, req.prompt_index, reason)
        await timeline.emit(
            r,
            table.run_id,
            "quarantined",
            step=table.step,
            prompt_index=req.prompt_index,
            request=rid,
            workers=req.crashed_on,
            reason=reason,
        )
