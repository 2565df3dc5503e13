"""The trainer loop: wait for the active run, publish its base weights as version 0, then for
each step consume the step's B groups as they arrive (backpropagating each on arrival), step the
optimizer once, commit version v+1 to the weight store and announce it.

Groups are acknowledged, and deleted from the stream, only after the version they trained is
committed: until then a restarted trainer finds every group of its step again. What the step took
is kept in the trained ledger (services.common.ledger), and, with `rollouts_dir` set, as JSON
lines on disk.
"""

import asyncio
import logging
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

import redis.asyncio as aioredis
from prometheus_client import Counter, Gauge, Histogram

from services.common import keys, ledger, timeline
from services.common.messages import Group
from services.common.redis_streams import (
    decode_or_park,
    ensure_group,
    park,
    read_group,
    with_reconnect,
)
from services.common.run_state import RunStopped, set_if_live
from services.common.runspec import LIVE_STATES, RunSpec
from services.common.step_metrics import record_step
from services.common.weights import (
    WeightClient,
    WeightConflict,
    WeightTransferError,
    scan_folder,
)
from services.trainer.checkpoint import Checkpoints
from services.trainer.rollouts import write_rollouts
from services.trainer.settings import TrainerSettings

log = logging.getLogger(__name__)
STEPS = Counter("spotrl_trainer_steps_total", "Optimizer steps")
GROUPS = Counter("spotrl_trainer_groups_total", "Groups consumed", ["outcome"])
STEP_S = Histogram("spotrl_trainer_step_seconds", "Wall time of an RL step in the trainer")
WAIT_S = Counter("spotrl_trainer_wait_seconds_total", "Seconds idle waiting for groups")
VERSION = Gauge("spotrl_trainer_weight_version", "Newest version committed")
LAST_WAIT_S = Gauge("spotrl_trainer_last_wait_seconds", "Seconds idle for groups, newest step")
LOSS = Gauge("spotrl_trainer_policy_loss", "Policy loss of the newest step")


class TrainerLoop:
    def __init__(
        self,
        settings: TrainerSettings,
        r: aioredis.Redis,
        policy_factory: Callable[[Path, RunSpec, str], Any] | None = None,
    ) -> None:
        self.settings = settings
        # builds the policy of a run (model folder, spec, device); benchmarks pass a stand-in
        self.policy_factory = policy_factory
        self.r = r
        self.weights = WeightClient(settings.weightstore_urls(), settings.api_token)
        self.status: dict = {"run_id": None, "step": None, "state": "idle"}
        self.weights_of = 0
        self.replaying = False
        self.committed: tuple[int, str] | None = None  # (version, digest) of the newest commit

    async def forever(self) -> None:
        while True:
            run_id = await with_reconnect(lambda: self.r.get(keys.ACTIVE_RUN), "active run")
            if run_id is None:
                self.status = {"run_id": None, "step": None, "state": "idle"}
                await asyncio.sleep(self.settings.poll_s)
                continue
            run_id = run_id.decode()
            try:
                await self.train_run(run_id)
            except RunStopped as exc:
                log.info("run %s stopped: %s", run_id, exc)
            # wait for the coordinator to move on from this run
            while await self.r.get(keys.ACTIVE_RUN) == run_id.encode():
                await asyncio.sleep(self.settings.poll_s)

    async def _check_running(self, run_id: str) -> None:
        state = await self.r.hget(keys.run(run_id), "state")
        if state is None or state.decode() not in LIVE_STATES:  # a stalled run is still live
            raise RunStopped(state.decode() if state else "deleted")

    async def train_run(self, run_id: str) -> None:
        spec = RunSpec.model_validate_json(await self.r.hget(keys.run(run_id), "spec"))
        self.status = {"run_id": run_id, "step": 0, "state": "loading"}
        factory = self.policy_factory
        if factory is None:
            from services.trainer.policy import Policy as factory
        policy = await asyncio.to_thread(factory, Path(spec.model), spec, self.settings.device)
        groups_stream = keys.groups_stream(run_id)
        await ensure_group(self.r, groups_stream, keys.TRAINER_GROUP)
        ckpts = Checkpoints(
            self.settings.work_dir / run_id / "checkpoints", self.settings.keep_checkpoints
        )
        version = await self.r.get(keys.run_version(run_id))
        if version is None:
            await self._commit(run_id, policy, 0)
            await self._announce(run_id, 0)
            step = 0
        else:
            step = await self._resume(run_id, policy, ckpts, int(version))
        self.weights_of = step  # the version the policy's weights are
        self.replaying = True  # first the groups read before a restart and not acknowledged
        try:
            while step < spec.steps:
                await self._check_running(run_id)
                self.status = {"run_id": run_id, "step": step, "state": "training"}
                await self._train_step(run_id, spec, policy, step, ckpts)
                step += 1
        finally:
            # at exit too (SIGTERM cancels this task): the state of the newest version
            latest = ckpts.latest()
            if latest is None or latest.step < self.weights_of:
                ckpts.save(self.weights_of, policy.state(), {"run_id": run_id, "at_exit": True})
                log.info("run %s: checkpointed version %d at exit", run_id, self.weights_of)
        self.status = {"run_id": run_id, "step": step, "state": "done"}
        log.info("run %s: trained %d steps", run_id, step)

    async def _resume(self, run_id: str, policy, ckpts: Checkpoints, version: int) -> int:
        """A run already under way: continue from the newest checkpoint and the announced
        version; the step to train next."""
        ckpt = ckpts.latest()
        if ckpt is not None:
            policy.load_state(await asyncio.to_thread(ckpt.load))
        if ckpt is not None and ckpt.step == version + 1:
            # step `version` was trained and checkpointed; its version was never announced (a
            # commit of it before the crash is taken only with the digest recorded for it)
            await self._commit(run_id, policy, version + 1)
            await self._ack_pending(run_id)
            await record_step(self.r, run_id, version, {"trainer_resumed": True})
            await self.r.hset(keys.trainer_state(run_id), "steps_trained", version + 1)
            await self._announce(run_id, version + 1)
            log.info("run %s: resumed after step %d from its checkpoint", run_id, version)
            return version + 1
        if ckpt is None or ckpt.step < version:
            # behind the announced version: take that version's weights, what workers hold
            await self._take_version(run_id, policy, version)
            log.warning(
                "run %s: resumed at version %d from the weight store (checkpoint: %s)",
                run_id,
                version,
                "none" if ckpt is None else f"step {ckpt.step}, optimizer state from then",
            )
        else:
            log.info("run %s: resumed at step %d from its checkpoint", run_id, version)
        return version

    async def _ack_pending(self, run_id: str) -> None:
        stream = keys.groups_stream(run_id)
        pending = await self.r.xpending_range(
            stream, keys.TRAINER_GROUP, min="-", max="+", count=100_000, consumername="trainer"
        )
        if pending:
            await self._retire(stream, [p["message_id"] for p in pending])

    async def _retire(self, stream: str, entry_ids: list[bytes]) -> None:
        """The groups trained into a committed version: acknowledged and deleted at once."""
        if not entry_ids:
            return
        async with self.r.pipeline(transaction=True) as pipe:
            pipe.xack(stream, keys.TRAINER_GROUP, *entry_ids)
            pipe.xdel(stream, *entry_ids)
            await pipe.execute()

    async def _train_step(
        self, run_id: str, spec: RunSpec, policy, step: int, ckpts: Checkpoints
    ) -> None:
        stream = keys.groups_stream(run_id)
        started = time.monotonic()
        wait_s = 0.0
        consumed = 0
        dropped = 0  # quarantined groups: part of the step's B, trained on never
        taken = ledger.StepLedger()
        kept: list[Group] = []  # what the step took, for the rollout dump
        entry_ids: list[bytes] = []
        seed_wait_s = await self._wait_seeding(run_id, step)
        last_check = time.monotonic()
        replayed = "0"  # the entries given before a restart come again after this id, once each
        while consumed + dropped < spec.prompts_per_step:
            t0 = time.monotonic()
            want = spec.prompts_per_step - consumed - dropped
            start = replayed if self.replaying else ">"
            entries = await with_reconnect(
                lambda n=want, s=start: read_group(
                    self.r, stream, keys.TRAINER_GROUP, "trainer", n, 100, s
                ),
                "read groups",
            )
            if not entries and self.replaying:
                self.replaying = False
                continue
            if entries and self.replaying:
                last = entries[-1][0]
                replayed = last.decode() if isinstance(last, bytes) else last
            if not entries:
                wait_s += time.monotonic() - t0
                if time.monotonic() - last_check > 0.5:
                    await self._check_running(run_id)
                    last_check = time.monotonic()
                continue
            parked: list[tuple[bytes, str]] = []
            good: list[Group] = []
            for entry in entries:
                entry_ids.append(entry[0])
                group = decode_or_park(Group, entry, parked)
                if group is None:
                    continue
                if group.step != step:
                    parked.append((entry[0], f"group of step {group.step} during step {step}"))
                    continue
                if taken.seen(group.prompt_index):
                    taken.duplicates += 1
                    GROUPS.labels("duplicate").inc()
                    parked.append((entry[0], f"group {group.prompt_index} came twice"))
                    continue
                if group.quarantined:
                    taken.quarantined.add(group.prompt_index)
                    kept.append(group)
                    dropped += 1
                    GROUPS.labels("quarantined").inc()
                    log.warning(
                        "run %s step %d: group %d was quarantined", run_id, step, group.prompt_index
                    )
                    continue
                if len(group.responses) != spec.group_size:
                    taken.incomplete += 1
                    GROUPS.labels("incomplete").inc()
                    parked.append(
                        (entry[0], f"{len(group.responses)} responses, want n={spec.group_size}")
                    )
                    continue
                taken.add(group)
                good.append(group)
            await park(self.r, keys.parked_stream(run_id), "groups", parked, entries)
            consumed += len(good)
            GROUPS.labels("trained").inc(len(good))
            kept += good
            if good:
                await asyncio.to_thread(policy.accumulate, good)
        WAIT_S.inc(wait_s)
        incomplete = taken.incomplete
        await ledger.write_step(self.r, run_id, step, taken)
        if self.settings.rollouts_dir is not None:
            folder = self.settings.rollouts_dir / run_id
            await asyncio.to_thread(write_rollouts, folder, step, kept)
        stats = await asyncio.to_thread(policy.optimizer_step)
        self.weights_of = step + 1
        if (step + 1) % self.settings.checkpoint_every == 0:
            meta = {"run_id": run_id, "last_group": entry_ids[-1].decode() if entry_ids else None}
            await asyncio.to_thread(ckpts.save, step + 1, policy.state(), meta)
        train_s = time.monotonic() - started
        publish_s = await self._commit(run_id, policy, step + 1)
        await self._retire(stream, entry_ids)
        await self.r.hincrby(keys.trainer_state(run_id), "groups_incomplete", incomplete)
        await self.r.hincrby(keys.trainer_state(run_id), "groups_trained", consumed)
        await self.r.hset(keys.trainer_state(run_id), "steps_trained", step + 1)
        STEP_S.observe(train_s)
        STEPS.inc()
        # the row is complete before the version is announced: the coordinator reads it then
        await record_step(
            self.r,
            run_id,
            step,
            stats
            | {
                "train_s": train_s,
                "train_wait_s": wait_s,
                "seed_wait_s": seed_wait_s,
                "publish_s": publish_s,
                "groups_incomplete": incomplete,
            },
        )
        await self._announce(run_id, step + 1)
        LAST_WAIT_S.set(wait_s)
        LOSS.set(stats["policy_loss"])
        await timeline.emit(
            self.r,
            run_id,
            "trained",
            step=step,
            train_s=train_s,
            wait_s=wait_s,
            policy_loss=stats["policy_loss"],
        )
        log.info(
            "run %s step %d: trained %d groups in %.2fs (waited %.2fs after %.2fs of "
            "seeding), loss %.4f",
            run_id,
            step,
            consumed,
            train_s,
            wait_s,
            seed_wait_s,
            stats["policy_loss"],
        )

    async def _wait_seeding(self, run_id: str, step: int) -> float:
        """The reserved pool generates first (it shares this hardware): wait for it to step
        aside before consuming groups."""
        started = time.monotonic()
        while not await self.r.exists(keys.seed_done(run_id, step)):
            await self._check_running(run_id)
            await asyncio.sleep(0.02)
        return time.monotonic() - started

    async def _take_version(
        self, run_id: str, policy, version: int, digest: str | None = None
    ) -> None:
        """Load a committed version's weights from the store into the policy: only the content
        with `digest` (default: the one recorded for the version in Redis)."""
        if digest is None:
            raw = await self.r.hget(keys.run_digests(run_id), version)
            if raw is None:
                await self._fail_run(run_id, f"weight version {version} has no recorded digest")
            digest = raw.decode()
        folder = self.settings.work_dir / run_id / f"take-v{version}"
        try:
            await self.weights.pull(run_id, version, folder, expect_digest=digest)
        except WeightConflict as exc:
            await self._fail_run(run_id, str(exc))
        await asyncio.to_thread(policy.load_weights, folder)
        await asyncio.to_thread(shutil.rmtree, folder, True)

    async def _commit(self, run_id: str, policy, version: int) -> float:
        """Commit the policy's weights as `version`, recording their digest first; a version
        already in the store is ours only with that digest, else the run fails."""
        t0 = time.monotonic()
        folder = self.settings.work_dir / run_id / f"v{version}"
        await asyncio.to_thread(policy.export, folder)
        local = await scan_folder(folder)
        raw = await self.r.hget(keys.run_digests(run_id), version)
        earlier = raw.decode() if raw is not None else None
        # an attempt before a restart exported other weights as this version: if that commit
        # landed, train on from exactly what the workers will pull (versions are immutable)
        if earlier not in (None, local.digest) and (
            await self._stored_digest(run_id, version) == earlier
        ):
            await self._take_version(run_id, policy, version, earlier)
            await asyncio.to_thread(shutil.rmtree, folder, True)
            self.committed = (version, earlier)
            log.warning("run %s: version %d was already committed; took it", run_id, version)
            return time.monotonic() - t0
        await self.r.hset(keys.run_digests(run_id), version, local.digest)
        delay = 0.5
        while True:  # until a replica has it: a weight store may be restarting
            try:
                await self.weights.upload_folder(
                    folder, run_id, version, {"run_id": run_id}, scanned=local
                )
                break
            except WeightConflict as exc:
                await asyncio.to_thread(shutil.rmtree, folder, True)
                await self._fail_run(run_id, str(exc))
            except WeightTransferError as exc:
                log.warning("run %s: commit of v%d failed (%s); retrying", run_id, version, exc)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 10.0)
        await asyncio.to_thread(shutil.rmtree, folder, True)
        self.committed = (version, local.digest)
        return time.monotonic() - t0

    async def _stored_digest(self, run_id: str, version: int) -> str | None:
        """Digest of `version` in the weight store (None: not committed), retried while no
        replica answers."""
        delay = 0.5
        while True:
            try:
                return await self.weights.stored_digest(run_id, version)
            except WeightTransferError as exc:
                log.warning("run %s: weight store unreachable (%s); retrying", run_id, exc)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 10.0)

    async def _fail_run(self, run_id: str, reason: str) -> NoReturn:
        """Fail the run (as the coordinator's RunStore.finish does) and stop training it."""
        log.error("run %s failed: %s", run_id, reason)
        fields = {"state": "failed", "finished_at": time.time(), "error": reason}
        if await set_if_live(self.r, run_id, fields):  # a cancel that landed first stays
            await timeline.emit(self.r, run_id, "state", state="failed", error=reason)
        raise RunStopped(f"failed: {reason}")

    async def _announce(self, run_id: str, version: int) -> None:
        """Publish `version` with its digest in one transaction: a reader that sees the version
        finds its digest. Digests older than the one before are dropped."""
        committed, digest = self.committed or (None, "")
        if committed != version:
            raise RuntimeError(f"announcing v{version}, but the last commit was v{committed}")
        async with self.r.pipeline(transaction=True) as pipe:
            pipe.hset(keys.run_digests(run_id), version, digest)
            pipe.set(keys.run_version(run_id), version)
            if version >= 2:
                pipe.hdel(keys.run_digests(run_id), version - 2)
            await pipe.execute()
        VERSION.set(version)
        log.info("run %s: version %d committed and announced (%s)", run_id, version, digest[:16])
