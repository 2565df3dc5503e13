"""The requests of one upload to one weight store replica: the files, then the commit of the
version's manifest, and the check of a version the replica already holds (ours only with our
content digest). Which files to send and the retries over replicas are the client's
(transfer.py); these functions speak to one replica over one HTTP client.
"""

import asyncio
from pathlib import Path

import httpx
from pydantic import ValidationError

from services.infra.retry import brief
from services.weights.answers import parse_answer, read_manifest
from services.weights.contract import (
    FileEntry,
    Manifest,
    ManifestCommit,
    WeightConflict,
    WeightTransferError,
    manifest_digest,
)
from services.weights.files import UPLOAD_BLOCK, VersionFiles


async def put_files(
    http: httpx.AsyncClient, prefix: str, local: VersionFiles, names: list[str]
) -> dict[str, FileEntry] | None:
    """Upload the files `names` at once (most are small: one at a time, each costs a round
    trip); the store's entry of each, or None if the version is committed already."""

    async def put(name: str) -> httpx.Response:
        data = local.content[name]

        async def blocks(path: Path):
            with open(path, "rb") as fh:
                while block := fh.read(UPLOAD_BLOCK):
                    yield block

        return await http.put(
            f"{prefix}/files/{name}",
            content=data if isinstance(data, bytes) else blocks(data),
            headers={"x-sha256": local.sha256[name]},
        )

    answers = await asyncio.gather(*(put(name) for name in names))
    entries = {}
    for name, resp in zip(names, answers, strict=True):
        if resp.status_code == 409:
            return None
        if resp.status_code != 200:
            raise WeightTransferError(f"upload {name}: {resp.status_code} {resp.text}")
        entries[name] = parse_answer(FileEntry, resp, f"upload {name}")
    return entries


async def post_commit(
    http: httpx.AsyncClient,
    prefix: str,
    entries: list[FileEntry],
    metadata: dict,
    reuse: int | None,
) -> httpx.Response:
    """Commit the version's manifest (naming, with `reuse`, the version the replica takes the
    files not sent from)."""
    try:
        commit = ManifestCommit(files=entries, metadata=metadata, reuse_version=reuse)
    except ValidationError as exc:
        raise WeightTransferError(f"commit {prefix}: {brief(exc)}") from exc
    body = commit.model_dump(mode="json", include={"files", "metadata", "reuse_version"})
    return await http.post(f"{prefix}/commit", json=body)


async def already_committed(
    http: httpx.AsyncClient, prefix: str, local: VersionFiles, model: str, version: int
) -> Manifest:
    """The store has the version: ours (an earlier attempt) only with our content digest."""
    manifest = read_manifest(await http.get(f"{prefix}/manifest"), f"v{version}")
    stored = manifest_digest(manifest)
    if stored != local.digest:
        raise WeightConflict(
            model,
            version,
            "in the store was committed by someone else",
            stored,
            local.digest,
            "ours",
        )
    return manifest
