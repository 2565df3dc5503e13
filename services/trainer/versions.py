"""The trainer's side of a run's weight versions: commit the policy's weights as a version to the
weight store, announce it, and load a committed version back into the policy.

Versions are immutable and loaded only with the content digest recorded for them in Redis: the
digest is recorded before the commit, and a version already in the store is ours only with that
digest. A version someone else committed, or a store serving other content than recorded, fails
the run (`fail_run`); a store that cannot be reached is tried again until it answers.
"""

import asyncio
import logging
import shutil
import time
from pathlib import Path
from typing import Any, NoReturn

import redis.asyncio as aioredis
from prometheus_client import Gauge

from services.contracts import keys
from services.infra.compute import compute
from services.infra.redis_failover import ReplicaWait
from services.infra.redis_streams import text
from services.infra.retry import retry
from services.state import run_record
from services.state.run_state import RunStopped
from services.weights.adapter import ADAPTER_CONFIG
from services.weights.contract import Manifest, WeightConflict, WeightTransferError
from services.weights.files import hash_files
from services.weights.transfer import WeightClient

log = logging.getLogger(__name__)
VERSION = Gauge("spotrl_trainer_weight_version", "Newest version committed")
FIRST_RETRY_S, MAX_RETRY_S = 0.5, 10.0  # while no weight store replica answers


async def fail_run(r: aioredis.Redis, run_id: str, reason: str) -> NoReturn:
    """Fail the run (a cancel that landed first stays) and stop training it; the coordinator
    releases what the run held once it sees it ended."""
    log.error("run %s failed: %s", run_id, reason)
    await run_record.finish(r, run_id, "failed", reason)
    raise RunStopped(f"failed: {reason}")


class VersionPublisher:
    """Commits, announces and takes the weight versions of the runs one trainer trains."""

    def __init__(
        self,
        r: aioredis.Redis,
        weights: WeightClient,
        work_dir: Path,
        wait_replicas: int = 0,
        wait_timeout_ms: int = 1000,
    ) -> None:
        self.r, self.weights, self.work_dir = r, weights, work_dir
        # the replicas that hold a version's digest before its weights go to the store
        self.replicated = ReplicaWait(wait_replicas, wait_timeout_ms)
        self.committed: tuple[int, str] | None = None  # (version, digest) of the newest commit
        self.manifest: Manifest | None = None  # what the store answered that commit with
        self.keeps_base = False  # whether the newest commit is an adapter of version 0 (LoRA)
        self.version_bytes = 0  # of the newest commit's files (an adapter's alone, in LoRA)

    async def commit(self, run_id: str, policy: Any, version: int) -> float:
        """Commit the policy's weights as `version`, recording their digest first; a version
        already in the store is ours only with that digest, else the run fails. The seconds
        it took."""
        t0 = time.monotonic()
        files = await compute(policy.export_files, version)
        self.version_bytes = sum(len(data) for data in files.values())
        local = await hash_files(files)
        # an adapter's base is the run's version 0: the store keeps it while the adapter stays,
        # and its digest stays for workers that join later
        adapter = ADAPTER_CONFIG in files
        self.keeps_base = adapter
        earlier = text(await self.r.hget(keys.run_digests(run_id), version))
        # an attempt before a restart exported other weights as this version: if that commit
        # landed, train on from exactly what the workers will pull (versions are immutable)
        if earlier not in (None, local.digest) and (
            await self._stored_digest(run_id, version) == earlier
        ):
            await self.take(run_id, policy, version, earlier)
            self.committed, self.manifest = (version, earlier), None
            log.warning("run %s: version %d was already committed; took it", run_id, version)
            return time.monotonic() - t0
        # on the replicas before the store has it: a failover then keeps the digest, the
        # step's ledger and the groups it trained on (all written before it)
        await self.replicated.write(
            self.r,
            lambda pipe: pipe.hset(keys.run_digests(run_id), version, local.digest),
            f"run {run_id}: digest of v{version}",
        )

        async def upload() -> WeightConflict | Manifest:
            """One attempt; a conflict is returned, not raised: trying again cannot fix it."""
            try:
                meta: dict = {"run_id": run_id} | ({"base_version": 0} if adapter else {})
                return await self.weights.upload(local, run_id, version, meta)
            except WeightConflict as exc:
                return exc

        # until a replica has it: a weight store may be restarting
        answer = await retry(
            upload,
            f"run {run_id}: commit of v{version}",
            (WeightTransferError,),
            first_delay_s=FIRST_RETRY_S,
            max_delay_s=MAX_RETRY_S,
        )
        if isinstance(answer, WeightConflict):
            await fail_run(self.r, run_id, str(answer))
        self.committed, self.manifest = (version, local.digest), answer
        return time.monotonic() - t0

    async def _stored_digest(self, run_id: str, version: int) -> str | None:
        """Digest of `version` in the weight store (None: not committed), retried while no
        replica answers."""
        return await retry(
            lambda: self.weights.stored_digest(run_id, version),
            f"run {run_id}: digest of v{version} (weight store unreachable)",
            (WeightTransferError,),
            first_delay_s=FIRST_RETRY_S,
            max_delay_s=MAX_RETRY_S,
        )

    async def announce(self, run_id: str, version: int) -> None:
        """Publish `version` with its digest (and the store's manifest of it, where this
        trainer committed it) in one transaction: a reader that sees the version finds its
        digest. Digests and manifests older than the one before are dropped."""
        committed, digest = self.committed or (None, "")
        if committed != version:
            raise RuntimeError(f"announcing v{version}, but the last commit was v{committed}")
        async with self.r.pipeline(transaction=True) as pipe:
            pipe.hset(keys.run_digests(run_id), version, digest)
            if self.manifest is not None:
                pipe.hset(keys.run_manifests(run_id), version, self.manifest.model_dump_json())
            pipe.set(keys.run_version(run_id), version)
            pipe.xadd(
                keys.version_announced(run_id), {"version": version}, maxlen=1, approximate=False
            )
            if version >= 2:
                if version > 2 or not self.keeps_base:
                    pipe.hdel(keys.run_digests(run_id), version - 2)
                pipe.hdel(keys.run_manifests(run_id), version - 2)
            await pipe.execute()
        VERSION.set(version)
        log.info("run %s: version %d committed and announced (%s)", run_id, version, digest[:16])

    async def take(self, run_id: str, policy: Any, version: int, digest: str | None = None) -> None:
        """Load a committed version's weights from the store into the policy: only the content
        with `digest` (default: the one recorded for the version in Redis)."""
        if digest is None:
            digest = text(await self.r.hget(keys.run_digests(run_id), version))
            if digest is None:
                await fail_run(self.r, run_id, f"weight version {version} has no recorded digest")
        folder = self.work_dir / run_id / f"take-v{version}"
        try:
            await self.weights.pull(run_id, version, folder, expect_digest=digest)
        except WeightConflict as exc:
            await fail_run(self.r, run_id, str(exc))
        await compute(policy.load_weights, folder)
        await asyncio.to_thread(shutil.rmtree, folder, True)
