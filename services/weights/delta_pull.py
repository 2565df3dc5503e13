"""Pulls that take deltas (issue 42): the cheapest way to a version, verified like any pull.

- A puller holding version h (a folder pulled whole, its marker says which) and wanting t
  takes the deltas h -> h+1 -> ... -> t when every version between was committed so (each
  file unchanged from the version before, or a delta of it; at most MAX_HOPS), applying them
  to its own files: a few percent of the bytes of a full pull.
- A puller holding nothing (a joiner) and wanting a version the store keeps as deltas only
  pulls the nearest full version at or below it in full (peers and store, as any pull) and
  then the deltas after it.
- Each delta is checked against its manifest's sha256 as it arrives, and `apply` checks the
  base it is applied to and the file it makes (services/weights/delta.py); the folder is
  renamed into place only when every file is the target's. Any refusal is the caller's cue to
  pull the version in full (transfer.py), so a wrong or missing delta is never loaded.

`route` is the decision, pure; the rest moves bytes.
"""

import asyncio
import logging
import os
import shutil
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Protocol

import httpx
from prometheus_client import Counter

from services.weights.block_fetch import Swarm
from services.weights.block_sources import ALL
from services.weights.contract import (
    DeltaRef,
    FileEntry,
    Manifest,
    WeightTransferError,
    manifest_digest,
)
from services.weights.delta import DeltaError, read_header
from services.weights.delta_file import copy_file, patch_file
from services.weights.files import fetch_range, read_complete, write_complete
from services.weights.pull import PullResult, check_manifest, prepare_partial


class Client(Protocol):
    """What a pull by deltas asks of the weight client (transfer.WeightClient)."""

    headers: dict[str, str]
    ca_file: Path | str | None

    async def manifest(
        self, model: str, version: int, whole: bool = False, replicas: list[str] | None = None
    ) -> Manifest: ...

    async def delta_source(self, replica: str | None = None) -> tuple[str, str]: ...

    async def pull(
        self, model: str, version: int, dest: Path, attempts: int = 6, *, manifest: Manifest
    ) -> PullResult: ...


log = logging.getLogger(__name__)
REFUSED = Counter(
    "spotrl_weight_deltas_refused_total", "Pulls by deltas refused, then pulled in full"
)
MAX_HOPS = 16  # deltas applied in a row at most; further behind, a full pull is cheaper


def route(
    held: int, held_files: Mapping[str, str], target: int, manifests: Mapping[int, Manifest]
) -> list[int] | None:
    """The versions whose deltas take a puller holding version `held` (its files' sha256 by
    name) to `target`: held+1 .. target, when each of them has every file either unchanged
    from the version before or committed as a delta of it; None when some version between is
    missing or was not committed so."""
    if not held < target <= held + MAX_HOPS:
        return None
    before = dict(held_files)
    for version in range(held + 1, target + 1):
        manifest = manifests.get(version)
        if manifest is None or {f.name for f in manifest.files} != set(before):
            return None
        for entry in manifest.files:
            unchanged = entry.sha256 == before[entry.name]
            if not unchanged and (entry.delta is None or entry.delta.base != version - 1):
                return None
        before = {f.name: f.sha256 for f in manifest.files}
    return list(range(held + 1, target + 1))


def full_base(manifest: Manifest) -> int | None:
    """The version a version kept as deltas only was committed against (None: it is full, or
    its deltas name several bases)."""
    bases = {f.delta.base for f in manifest.files if f.delta is not None}
    return bases.pop() if not manifest.full and len(bases) == 1 else None


async def pull_by_deltas(
    client: Client,
    model: str,
    version: int,
    dest: Path,
    expect: str | None,
    held: Path | None,
    manifest: Manifest | None,
    swarm: Swarm | None = None,
) -> PullResult | None:
    """The version made from the one in `held` and the deltas after it, or for a joiner from
    the nearest full version and the deltas after it; None where there is no such way or a
    delta was refused: the caller pulls the version in full then."""
    try:
        target = manifest or await client.manifest(model, version)
        check_manifest(target, model, version, expect)
        made = await by_deltas(client, model, target, dest, held, swarm) if held else None
        if made is None and not target.full:
            made = await from_full(client, model, target, dest)
        return made
    except (httpx.HTTPError, WeightTransferError, OSError) as exc:
        REFUSED.inc()
        log.warning("%s v%d: deltas refused (%s); pulling it in full", model, version, exc)
        return None


async def by_deltas(
    client: Client,
    model: str,
    target: Manifest,
    dest: Path,
    held: Path,
    swarm: Swarm | None = None,
) -> PullResult | None:
    """`target` made from the version in folder `held` and the deltas after it (None when
    there is no such route); raises when a delta is refused."""
    marker = read_complete(held)
    version, files = marker.get("version"), marker.get("files")
    if not isinstance(version, int) or not isinstance(files, dict):
        return None
    if not version < target.version <= version + MAX_HOPS:
        return None
    manifests = {target.version: target}
    for between in range(version + 1, target.version):
        manifests[between] = await client.manifest(model, between)
    hops = route(version, files, target.version, manifests)
    if hops is None:
        return None
    moved = sum(f.delta.size for v in hops for f in manifests[v].files if f.delta is not None)
    if moved >= target.total_bytes():
        return None  # so many deltas that the version in full is less
    return await _apply_hops(client, model, [manifests[v] for v in hops], held, files, dest, swarm)


async def from_full(client: Client, model: str, target: Manifest, dest: Path) -> PullResult | None:
    """For a joiner: the nearest full version at or below `target`, pulled in full, then the
    deltas after it (None when the deltas do not lead back to a full version)."""
    chain, manifest = 0, target
    while (base := full_base(manifest)) is not None and chain < MAX_HOPS:
        manifest, chain = await client.manifest(model, base), chain + 1
    if not manifest.full or manifest.version == target.version:
        return None
    start = dest.with_name(dest.name + ".base")
    try:
        first = await client.pull(model, manifest.version, start, manifest=manifest)
        made = await by_deltas(client, model, target, dest, start)
    finally:
        await asyncio.to_thread(shutil.rmtree, start, True)
    if made is not None:
        made.bytes += first.bytes
        made.from_peers += first.from_peers
        made.changed = None  # from a version the puller did not hold
    return made


class DeltaFetch:
    """Where one pull's deltas come from: for the version pulled, the peers that hold it whole
    (they keep the deltas that made it beside its files), else the store; every delta checked
    against its manifest's sha256 whoever served it."""

    def __init__(
        self, client: Client, replica: str, store: str, model: str, swarm: Swarm | None
    ) -> None:
        self.client, self.model, self.swarm = client, model, swarm
        self.replica, self.store = replica, store  # a store replica, where it serves its files
        self.from_peers = 0

    async def get(self, version: int, entry: FileEntry, folder: Path, keep: bool) -> bytes:
        """The delta `entry` of `version` was committed as, into `folder`. With `keep` (a
        delta of the version pulled, the swarm's) it may come from peers and stays in the
        folder under its name for others; else it is hidden there, then removed."""
        ref = entry.delta
        if ref is None:
            raise WeightTransferError(f"{entry.name} v{version} has no delta")
        path = folder / (ref.name if keep else f".{ref.name}.v{version}")
        for source in await self._peers() if keep else []:
            try:
                data = await self._fetch(source, version, ref, path)
                self.from_peers += len(data)
                return data
            except WeightTransferError as exc:  # that peer cannot serve it: another can
                log.info("delta %s v%d from peer %s: %s", ref.name, version, source, exc)
        try:
            return await self._fetch(self.store, version, ref, path)
        except WeightTransferError as exc:  # a store that restarted serves on another port
            log.info("delta %s v%d from %s: %s; asking again", ref.name, version, self.store, exc)
            self.replica, self.store = await self.client.delta_source(self.replica)
            return await self._fetch(self.store, version, ref, path)

    async def _peers(self) -> list[str]:
        if self.swarm is None:
            return []
        holders = await self.swarm.holders()
        return [url for url, holding in holders.items() if holding is ALL]

    async def _fetch(self, source: str, version: int, ref: DeltaRef, path: Path) -> bytes:
        path.write_bytes(b"")
        os.truncate(path, ref.size)
        url = f"{source}/v1/models/{self.model}/versions/{version}/files/{ref.name}"
        headers, ca_file = self.client.headers, self.client.ca_file
        try:
            await asyncio.to_thread(
                fetch_range, url, path, 0, ref.size - 1, ref.sha256, headers, 60.0, ca_file
            )
            return await asyncio.to_thread(path.read_bytes)
        except BaseException:
            path.unlink(missing_ok=True)
            raise
        finally:
            if path.name.startswith("."):
                path.unlink(missing_ok=True)


async def _apply_hops(
    client: Client,
    model: str,
    hops: list[Manifest],
    held: Path,
    held_files: Mapping[str, str],
    dest: Path,
    swarm: Swarm | None,
) -> PullResult:
    """The last of `hops` made in `dest` from the folder `held` (its files' sha256 by name,
    as its marker says) and the deltas of each hop."""
    started = time.monotonic()
    target = hops[-1]
    partial, same = prepare_partial(dest, held, target.files)
    fetch = DeltaFetch(client, *await client.delta_source(), model, swarm)
    fetched, changed = 0, set()
    for entry in target.files:
        if entry.name in same:
            continue
        current, sha = held / entry.name, held_files.get(entry.name)  # as its pull checked
        for manifest in hops:
            step = manifest.entry(entry.name)
            if step is None or step.delta is None:
                continue  # unchanged in this version (the route checked)
            made = partial / f".{entry.name}.v{manifest.version}"
            copying = asyncio.create_task(asyncio.to_thread(copy_file, current, made))
            try:  # the base is copied while its delta is on its way
                delta = await fetch.get(manifest.version, step, partial, manifest is target)
            finally:
                await copying
            fetched += len(delta)
            header = read_header(delta)
            if sha is None or header.target_sha256 != step.sha256:
                raise DeltaError(f"{entry.name} v{manifest.version}: not the manifest's file")
            await asyncio.to_thread(patch_file, made, delta, sha, step.blocks())
            if current.parent == partial:
                current.unlink()  # a version between: only the last one is kept
            current, sha = made, step.sha256
            changed |= set(header.tensors)
        os.replace(current, partial / entry.name)
    digest = manifest_digest(target)
    write_complete(partial, target.version, digest, {e.name: e.sha256 for e in target.files})
    shutil.rmtree(dest, ignore_errors=True)
    os.replace(partial, dest)
    if swarm is not None:
        await swarm.complete(dest)  # peers may take the version, and its deltas, from here
    took = time.monotonic() - started
    return PullResult(
        dest, target.version, fetched, took, digest, fetch.from_peers, len(hops), frozenset(changed)
    )
