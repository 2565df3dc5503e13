"""Loads a run's weight version into the worker's engine: pull the exact content the trainer
announced (by digest) from the weight store, then, under the engine lock, drop what is held
and load. Nothing half-pulled or unannounced is ever loaded; a version that cannot be pulled
yet leaves the worker with none, to try again.

LoRA runs (issue 51): a version folder that holds a PEFT adapter (services.weights.adapter) is
served on the run's base, its version 0 (`BASE_VERSION`), a whole Hugging Face folder: handed
to the engine as it is where the engine applies adapters itself (`Engine.max_adapters` > 0:
megabytes read, the base untouched), else merged into the base and loaded as weights.
- The base is pulled like any version, by the digest recorded in `keys.run_digests`: only
  content the trainer announced is ever loaded, the base included (it is most of the weights).
  That hash keeps the newest two versions' digests, so the trainer keeps version 0's digest
  there for the whole run (it never drops it); a worker that finds none refuses the adapter
  and tries again, as for any version announced without a digest. (Asking the store for the
  base's digest, `WeightClient.stored_digest`, would load whatever the store serves.)
- The base's folder stays on the worker while it serves the run (later versions do not remove
  it); it goes once a version of another run is loaded.
- The merged weights (base + scaling * B @ A, computed on the compute thread) are written as
  one safetensors file into a scratch folder beside the version's, with the base tensors of
  every layer they touch (an engine that fuses a layer's tensors, vLLM's, loads whole layers),
  and loaded in place with `changed` naming them. That folder is no whole model: it is handed
  only to an engine that holds the base, so one that holds nothing yet (a fresh engine, a new
  run) or may have dropped its weights (paused: vLLM's sleep) loads the base folder whole
  first. The scratch folder goes once loaded.

It does not choose which version to load (the intake does) and never talks to the coordinator.
"""

import asyncio
import contextlib
import logging
import shutil
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import cast

from prometheus_client import Counter, Histogram
from pydantic import ValidationError

from services.contracts import keys
from services.contracts.messages import ReleaseReason, RequestLease
from services.core.request_table import step_of
from services.infra.compute import compute
from services.infra.redis_streams import text
from services.infra.retry import brief
from services.rollout.context import WorkerContext
from services.rollout.engines.tensors import read_tensors, tensor_files, whole_layers
from services.rollout.peers import Peers
from services.weights.adapter import is_adapter, merged_tensors
from services.weights.contract import Manifest
from services.weights.transfer import (
    PullResult,
    WeightClient,
    WeightConflict,
    WeightTransferError,
)

log = logging.getLogger(__name__)
RETRY_S = 1.0  # after a version could not be pulled
BASE_VERSION = 0  # of a LoRA run: the whole model its adapter versions are merged into
MERGED_FILE = "model.safetensors"  # in a merged scratch folder: the tensors loaded in place
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


@dataclass(frozen=True)
class Merged:
    """An adapter version merged into its base, written for an in-place load."""

    folder: Path  # the scratch folder: one safetensors file, no whole model
    changed: frozenset[str]  # the tensors that differ from what the engine holds
    tensors: int  # written: `changed` and the rest of their layers
    bytes: int  # of the file written


def write_merged(base: Path, adapter: Path, dest: Path, held_merged: frozenset[str]) -> Merged:
    """Merge `adapter` into `base` and write into `dest` what an engine that holds the base,
    with the tensors `held_merged` merged from an earlier adapter, must load: the merged
    tensors, the base's of those held merged that this adapter does not wrap (back to the
    base), and the base's rest of every layer they belong to. Blocking: the compute thread's."""
    from safetensors.torch import save_file

    merged = merged_tensors(base, adapter)
    changed = frozenset(merged) | held_merged
    rest = whole_layers(changed, tensor_files(base)) - merged.keys()
    tensors = merged | dict(read_tensors(base, rest))
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    save_file({name: t.contiguous() for name, t in tensors.items()}, dest / MERGED_FILE)
    return Merged(dest, changed, len(tensors), (dest / MERGED_FILE).stat().st_size)


def report(
    run_id: str,
    result: PullResult,
    merge: tuple[PullResult, Merged] | None,
    took_s: float,
    base: PullResult | None = None,
) -> None:
    """The metrics and the log line of a version loaded: the bytes pulled (the base's too,
    where it was pulled for an adapter) and how it was made and loaded."""
    pulled, from_peers, how = result.bytes, result.from_peers, "in full"
    if result.deltas:
        how = f"made from the deltas of {result.deltas} versions"
    if base is not None:
        pulled, from_peers = pulled + base.bytes, from_peers + base.from_peers
        how += (
            f", an adapter the engine applies on v{BASE_VERSION}"
            f" ({base.bytes} bytes of them the base's)"
        )
    if merge is not None:
        base, merged = merge
        pulled, from_peers = pulled + base.bytes, from_peers + base.from_peers
        how += (
            f", an adapter merged into v{BASE_VERSION} ({base.bytes} bytes of them the base's):"
            f" {len(merged.changed)} tensors loaded in place"
            f" ({merged.tensors} written, {merged.bytes} bytes)"
        )
    PULL_S.observe(took_s)
    PULL_BYTES.inc(pulled)
    PEER_BYTES.inc(from_peers)
    log.info(
        "loaded %s v%d (%d bytes, %d of them from peers) in %.2fs, %s",
        run_id,
        result.version,
        pulled,
        from_peers,
        took_s,
        how,
    )


Release = Callable[[list[RequestLease], ReleaseReason], Awaitable[int]]
Held = Callable[[], list[RequestLease]]


class VersionLoader:
    def __init__(
        self,
        ctx: WorkerContext,
        held: Held | None = None,
        release: Release | None = None,
        peers: Peers | None = None,
    ) -> None:
        self.ctx = ctx
        self.weights = WeightClient(
            ctx.s.weightstore_urls(),
            ctx.s.outgoing_token(),
            ca_file=ctx.s.tls_ca_file,
            deltas=ctx.s.weight_deltas,
        )
        self.held, self.release = held, release  # the flusher's: requests handed back
        self.peers = peers  # the worker's, where it serves its weights to peers (`s.p2p`)
        self.base_run: str | None = None  # the LoRA run whose base folder is kept
        self.held_merged: frozenset[str] = frozenset()  # tensors the engine holds merged
        self.staleness = 0  # the run's max_staleness (the intake's): adapters needed at once

    async def load(self, run_id: str, version: int) -> None:
        ctx = self.ctx
        ctx.w.state = "loading"
        started = time.monotonic()
        previous = ctx.version  # its folder lends the new version the files they share
        result = await self._pull(run_id, version, previous)
        merge, base = None, None
        if result is not None and is_adapter(result.folder):
            if ctx.engine.max_adapters:  # the engine applies the adapter on the base it holds
                base = await self._base(run_id, result.version)
                if previous is None:
                    self._check_room()
            else:
                merge = await self._merge(run_id, result, previous)
            if merge is None and base is None:
                result = None
        if result is None:
            ctx.version = None
            await asyncio.sleep(RETRY_S)
            return
        async with ctx.engine_lock:
            base_before = ctx.w.engine.base_folder  # another run's, maybe, that it goes on from
            # A version is published once the step before it is complete: what is still held
            # of that step or an earlier one was migrated away (or is about to be), never to be
            # finished here. Requests of later steps (asynchronous RL) go back to the
            # coordinator with their tokens, and continue under the new weights (here or on
            # another worker: a continuation re-reads its tokens so far as its context), but
            # where the engine applies adapters on the base it keeps: there they go on under
            # the adapter they started with, as many versions as the engine holds.
            if base is not None and self._holds_base(previous):
                await self._keep_running(version)
            else:
                await self._release_later_steps(version)
                ctx.drop_held()
            served = True
            if base is not None:
                served = await self._load_adapter(base, result, previous)
            elif merge is not None:
                await self._load_merged(*merge, previous)
            else:
                await self._load_weights(result, previous)
            ctx.version = version if served else None
            if base_before not in (None, ctx.w.engine.base_folder):
                await self._forget_base(cast(Path, base_before))
        if not served:
            await asyncio.sleep(RETRY_S)
            return
        if merge is not None:
            await asyncio.to_thread(shutil.rmtree, merge[1].folder, True)
        await ctx.r.sadd(keys.worker_loads(run_id, ctx.s.worker_id), version)
        report(run_id, result, merge, time.monotonic() - started, base)
        adapter = merge is not None or base is not None
        await self._forget(run_id, version, previous, adapter=adapter)

    async def _load_weights(self, result: PullResult, previous: int | None) -> None:
        """Load a version of weights (no adapter). A version made from deltas of the one the
        engine holds says what changed: only that is loaded, in place (all of it where the
        engine holds merged tensors: the deltas were of the adapter's files). A run's version
        0 loaded whole is its base: nothing loads where the engine holds it (for another run)."""
        whole = previous is None or self.held_merged
        if whole and result.version == BASE_VERSION:
            await self.ctx.engine.load_base(result.folder, result.digest)
        else:
            await self.ctx.engine.load(result.folder, None if whole else result.changed)
        self.held_merged = frozenset()

    def _check_room(self) -> None:
        """Say, as a LoRA run starts here, when the engine holds fewer adapters than the run
        can have in flight at once (max_staleness + 1): requests of the oldest are then
        handed back at each version, as full-weight runs do, and what to set."""
        needed, held = self.staleness + 1, self.ctx.engine.max_adapters
        if held < needed:
            log.warning(
                "this engine holds %d LoRA adapters (SPOTRL_MAX_LORAS) and the run has "
                "max_staleness %d: set SPOTRL_MAX_LORAS to at least %d so that a request goes "
                "on under the adapter it started with; until then the oldest are handed back",
                held,
                self.staleness,
                needed,
            )

    def _holds_base(self, previous: int | None) -> bool:
        """Whether the engine holds the run's base as it was pulled, with adapters applied on
        it, none merged into it (not a fresh engine, not asleep since)."""
        paused = self.ctx.paused_version == previous
        return previous is not None and not paused and not self.held_merged

    async def _release_later_steps(self, version: int) -> None:
        if self.held is not None and self.release is not None:
            live = [lease for lease in self.held() if step_of(lease.request_id) >= version]
            if live:
                await self.release(live, "swap")

    async def _keep_running(self, version: int) -> None:
        """Before adapter `version` loads: the requests of later steps go on under their
        adapters, as far as the engine has room for them beside the new one (`max_loras`);
        those of the oldest adapters past that go back to the coordinator, as on a swap."""
        ctx = self.ctx
        ctx.drop_steps_before(version)
        in_use = sorted(ctx.buffer.versions() - {BASE_VERSION})  # the base needs no adapter
        excess = set(in_use[: max(0, len(in_use) - (ctx.engine.max_adapters - 1))])
        if excess and self.release is not None:
            pending = ctx.buffer.pending
            leases = [r for r in ctx.buffer.running() if pending[r.request_id].version in excess]
            log.warning(
                "%d requests of adapters %s handed back: the engine holds %d adapters "
                "(SPOTRL_MAX_LORAS); a run with max_staleness k needs k + 1",
                len(leases),
                sorted(excess),
                ctx.engine.max_adapters,
            )
            await self.release(leases, "swap")

    async def _base(self, run_id: str, version: int) -> PullResult | None:
        """The base of adapter `version`, pulled (or found pulled); None when it cannot be
        pulled yet. The base kept for the LoRA run served before (or served beside it, on
        the engine) lends it the files they share (runs over the same base model: nothing
        pulled but what differs)."""
        lender = self.ctx.w.engine.base_folder  # another run's, on the engine now
        if self.base_run is not None and self.base_run != run_id:
            lender = self._folder(self.base_run, BASE_VERSION)
        base = await self._pull(run_id, BASE_VERSION, None, lender)
        if base is None:
            log.warning("%s v%d is an adapter, its base is not here yet", run_id, version)
        return base

    async def _load_adapter(self, base: PullResult, adapter: PullResult, previous: int | None):
        """Hand the adapter to the engine, which applies it on the base it holds: the base is
        loaded whole first where the engine may hold none (as for a merged load). False, the
        version refused, where the engine cannot apply it (it says why)."""
        engine = self.ctx.engine
        if not self._holds_base(previous):
            # nothing loaded where the engine holds that base for another run already
            await engine.load_base(base.folder, base.digest)
            self.held_merged = frozenset()
        try:
            await engine.load_adapter(adapter.version, adapter.folder)
        except ValueError as exc:
            log.error("refusing %s v%d: %s; not loading it", self.ctx.run_id, adapter.version, exc)
            return False
        return True

    async def _merge(
        self, run_id: str, adapter: PullResult, previous: int | None
    ) -> tuple[PullResult, Merged] | None:
        """The run's base, pulled (or found pulled), and the adapter merged into it, written
        beside the version's folder; None when the base cannot be pulled (yet) or the adapter
        cannot be merged into it."""
        base = await self._base(run_id, adapter.version)
        if base is None:
            return None
        dest = adapter.folder.with_name(f"{adapter.folder.name}-merged")
        held = self.held_merged if previous is not None else frozenset()
        try:
            merged = await compute(write_merged, base.folder, adapter.folder, dest, held)
        except ValueError as exc:
            log.error("refusing %s v%d: %s; not loading it", run_id, adapter.version, exc)
            return None
        return base, merged

    async def _load_merged(self, base: PullResult, merged: Merged, previous: int | None) -> None:
        """Load the merged tensors in place, into the base loaded whole first where the engine
        may hold no base: nothing loaded for this run yet, or paused since its last load
        (vLLM's sleep drops the weights)."""
        engine = self.ctx.engine
        if previous is None or self.ctx.paused_version == previous:
            await engine.load_base(base.folder, base.digest)
        await engine.load(merged.folder, merged.changed)
        self.held_merged = merged.changed

    async def _forget_base(self, folder: Path) -> None:
        """A base the engine held until now: its folder goes, unless its run is served."""
        run_id = folder.parent.name
        if run_id in self.ctx.w.lanes:
            return
        if self.peers is not None:
            await self.peers.forget(self.ctx.r, run_id, BASE_VERSION)
        await asyncio.to_thread(_remove, folder)

    async def _forget(self, run_id: str, version: int, previous: int | None, adapter: bool) -> None:
        """Remove the folders no longer needed once `version` is served: the version served
        before, and a base kept for adapters, unless it is the base of this adapter."""
        held = {(run_id, previous)} if previous is not None else set()
        if self.base_run is not None:
            held.add((self.base_run, BASE_VERSION))
        needed = {(run_id, version)} | ({(run_id, BASE_VERSION)} if adapter else set())
        self.base_run = run_id if adapter else None
        for run, old in sorted(held - needed):
            if self.peers is not None:
                await self.peers.forget(self.ctx.r, run, old)
            await asyncio.to_thread(shutil.rmtree, self._folder(run, old), True)

    async def _pull(
        self, run_id: str, version: int, previous: int | None, lender: Path | None = None
    ) -> PullResult | None:
        """The pulled version, or None when it cannot be loaded (yet). The files it shares
        with the `previous` version's folder (or `lender`) are linked from there."""
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
            reuse = self._folder(run_id, previous) if previous is not None else lender
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


def _remove(folder: Path) -> None:
    """A version's folder, and its run's once that holds nothing more."""
    shutil.rmtree(folder, ignore_errors=True)
    with contextlib.suppress(OSError):
        folder.parent.rmdir()
