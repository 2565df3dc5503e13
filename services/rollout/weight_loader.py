"""Loads a run's weight version into the worker's engine: pull the exact content the trainer
announced (by digest) from the weight store, then, under the engine lock, drop what is held
and load. Nothing half-pulled or unannounced is ever loaded; a version that cannot be pulled
yet leaves the worker with none, to try again.

It does not choose which version to load (the intake does) and never talks to the coordinator.
"""

import asyncio
import logging
import shutil
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from prometheus_client import Counter, Histogram
from pydantic import ValidationError

from services.contracts import keys
from services.contracts.messages import ReleaseReason, RequestLease
from services.core.request_table import step_of
from services.infra.redis_streams import text
from services.infra.retry import brief
from services.rollout.context import WorkerContext
from services.rollout.peers import Peers
from services.weights.contract import Manifest
from services.weights.transfer import (
    PullResult,
    WeightClient,
    WeightConflict,
    WeightTransferError,
)

log = logging.getLogger(__name__)
RETRY_S = 1.0  # after a version could not be pulled
PULL_S = Histogram(
    "spotrl_rollout_weight_pull_seconds",
    "Weight pull + load time",
    buckets=(0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300),
)
PULL_BYTES = Counter("spotrl_rollout_weight_pull_bytes_total", "Weight bytes pulled")
PEER_BYTES = Counter(
    "spotrl_rollout_weight_pull_peer_bytes_total", "Weight bytes pulled from peers (of the above)"
)


def announced_manifest(raw: bytes | None) -> Manifest | None:
    """The manifest announced with a version; None where there is none or it does not parse
    (the store is asked for it then)."""
    if raw is None:
        return None
    try:
        return Manifest.model_validate_json(raw)
    except ValidationError as exc:
        log.warning("announced manifest ignored: %s", brief(exc))
        return None


Release = Callable[[list[RequestLease], ReleaseReason], Awaitable[int]]
Held = Callable[[], list[RequestLease]]


class VersionLoader:
    def __init__(
        self, ctx: WorkerContext, held: Held | None = None, release: Release | None = None
    ) -> None:
        self.ctx = ctx
        self.weights = WeightClient(
            ctx.s.weightstore_urls(),
            ctx.s.outgoing_token(),
            ca_file=ctx.s.tls_ca_file,
            deltas=ctx.s.weight_deltas,
        )
        self.held, self.release = held, release  # the flusher's: requests handed back
        self.peers = Peers(ctx.s) if ctx.s.p2p else None

    async def load(self, run_id: str, version: int) -> None:
        ctx = self.ctx
        ctx.state = "loading"
        started = time.monotonic()
        previous = ctx.version  # its folder lends the new version the files they share
        result = await self._pull(run_id, version, previous)
        if result is None:
            ctx.version = None
            await asyncio.sleep(RETRY_S)
            return
        async with ctx.engine_lock:
            # A version is published once the step before it is complete: what is still held
            # of that step or an earlier one was migrated away (or is about to be), never to be
            # finished here. Requests of later steps (asynchronous RL) go back to the
            # coordinator with their tokens, and continue under the new weights (here or on
            # another worker: a continuation re-reads its tokens so far as its context).
            if self.held is not None and self.release is not None:
                live = [lease for lease in self.held() if step_of(lease.request_id) >= version]
                if live:
                    await self.release(live, "swap")
            ctx.drop_held()
            # a version made from deltas of the one the engine holds says what changed: only
            # that is loaded, in place
            await ctx.engine.load(result.folder, result.changed if previous is not None else None)
            ctx.version = version
        await ctx.r.sadd(keys.worker_loads(run_id, ctx.s.worker_id), version)
        took_s = time.monotonic() - started
        PULL_S.observe(took_s)
        PULL_BYTES.inc(result.bytes)
        PEER_BYTES.inc(result.from_peers)
        log.info(
            "loaded %s v%d (%d bytes, %d of them from peers) in %.2fs, %s",
            run_id,
            version,
            result.bytes,
            result.from_peers,
            took_s,
            f"made from the deltas of {result.deltas} versions" if result.deltas else "in full",
        )
        if previous is not None and previous != version:
            if self.peers is not None:
                await self.peers.forget(ctx.r, run_id, previous)
            await asyncio.to_thread(shutil.rmtree, self._folder(run_id, previous), True)

    async def _pull(self, run_id: str, version: int, previous: int | None) -> PullResult | None:
        """The pulled version, or None when it cannot be loaded (yet)."""
        # Only the content the trainer announced with the version is ever loaded.
        async with self.ctx.r.pipeline(transaction=False) as pipe:
            pipe.hget(keys.run_digests(run_id), version)
            pipe.hget(keys.run_manifests(run_id), version)
            raw_digest, raw_manifest = await pipe.execute()
        digest = text(raw_digest)
        dest = self._folder(run_id, version)
        try:
            if digest is None:
                raise WeightConflict(run_id, version, "was announced without a digest")
            reuse = self._folder(run_id, previous) if previous is not None else None
            return await self.weights.pull(
                run_id,
                version,
                dest,
                expect_digest=digest,
                reuse=reuse,
                manifest=announced_manifest(raw_manifest),
                swarm=self.peers.swarm(self.ctx.r, run_id, version) if self.peers else None,
            )
        except WeightConflict as exc:
            log.error("refusing %s v%d: %s; not loading it", run_id, version, exc)
        except WeightTransferError as exc:
            # Nothing half-pulled is ever loaded: keep no version and try again.
            log.warning("could not pull %s v%d yet: %s", run_id, version, exc)
        return None

    def _folder(self, run_id: str, version: int) -> Path:
        return self.ctx.s.cache_dir / self.ctx.s.worker_id / run_id / f"v{version}"
