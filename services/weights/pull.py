"""The file work of one pull from one replica, around the block transfer (block_fetch.py): the
manifest checked against what was asked for, the `.partial` folder laid out (files an earlier
version holds with the same sha256 linked from it, the others preallocated), and the files
without block hashes (an older store's) fetched in ranges and checked whole; and what a pull
gives (`PullResult`). The retries over replicas are the client's (transfer.py).
"""

import asyncio
import shutil
from dataclasses import dataclass
from pathlib import Path

from services.weights.contract import (
    FileEntry,
    Manifest,
    WeightConflict,
    WeightTransferError,
    manifest_digest,
)
from services.weights.files import fetch_range, link_or_copy, reusable, sha256_file

CHUNK_BYTES = 32 * 1024 * 1024  # bytes per range request of a file with no block hashes


@dataclass
class PullResult:
    folder: Path
    version: int
    bytes: int  # downloaded (files reused from an earlier version not counted)
    seconds: float
    digest: str  # content digest of the files pulled
    from_peers: int = 0  # of `bytes`, those that other pullers served (the rest: the store)
    deltas: int = 0  # versions whose deltas made it (0: pulled in full)
    changed: frozenset[str] | None = None  # tensors unlike the version held (None: unknown)


def check_manifest(manifest: Manifest, model: str, version: int, expect: str | None) -> str:
    """The manifest's content digest, once it names `model` v`version` and, with `expect`,
    holds that content (else WeightConflict: the replica serves other weights)."""
    named = (manifest.model, manifest.version)
    if named != (model, version):
        raise WeightTransferError(f"asked for {model} v{version}, the manifest names {named}")
    digest = manifest_digest(manifest)
    if expect is not None and digest != expect:
        raise WeightConflict(
            model, version, "in the store is not the one announced", digest, expect, "announced"
        )
    return digest


def prepare_partial(
    dest: Path, reuse: Path | None, entries: list[FileEntry]
) -> tuple[Path, dict[str, Path]]:
    """An empty `{dest}.partial` with every file of the version: linked from `reuse` where it
    holds it with the same sha256, else preallocated. The folder and the files reused (name
    -> where from)."""
    partial = dest.with_name(dest.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    same = reusable(reuse, entries)
    for entry in entries:
        path = partial / entry.name
        if entry.name in same:
            link_or_copy(same[entry.name], path)
            continue
        with open(path, "wb") as fh:
            fh.truncate(entry.size)
    return partial, same


async def fetch_whole(
    files_url: str,
    folder: Path,
    entries: list[FileEntry],
    same: dict[str, Path],
    parallel: int,
    headers: dict[str, str],
    ca_file: Path | str | None = None,
) -> None:
    """The files without block hashes (an older store's), from the store in ranges of
    CHUNK_BYTES, `parallel` at a time, each checked whole once it is in (https: verified
    against `ca_file`)."""
    gate = asyncio.Semaphore(parallel)
    whole = [e for e in entries if e.blocks() is None and e.name not in same]

    async def chunk(entry: FileEntry, start: int) -> None:
        end = min(start + CHUNK_BYTES, entry.size) - 1
        async with gate:
            await asyncio.to_thread(
                fetch_range,
                f"{files_url}/{entry.name}",
                folder / entry.name,
                start,
                end,
                None,
                headers,
                60.0,
                ca_file,
            )

    await asyncio.gather(
        *(chunk(e, start) for e in whole for start in range(0, e.size, CHUNK_BYTES))
    )
    for entry in whole:
        got = await asyncio.to_thread(sha256_file, folder / entry.name)
        if got != entry.sha256:
            raise WeightTransferError(f"{entry.name}: sha256 mismatch (corrupt transfer)")
