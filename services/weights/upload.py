"""The requests of one upload to one weight store replica: the files, then the commit of the
version's manifest, and the check of a version the replica already holds (ours only with our
content digest), and `upload_to`, which of them one version's upload to one replica makes:
files held already are named, changed ones sent whole or as deltas. The retries over replicas
are the client's (transfer.py); these functions speak to one replica over one HTTP client.
"""

import asyncio
from pathlib import Path

import httpx
from pydantic import ValidationError

from services.infra.retry import brief
from services.weights.answers import parse_answer, read_manifest
from services.weights.contract import (
    MAX_CONTENT_QUERY,
    ContentHeld,
    FileEntry,
    Manifest,
    ManifestCommit,
    WeightConflict,
    WeightTransferError,
    manifest_digest,
)
from services.weights.delta_upload import Deltas
from services.weights.files import UPLOAD_BLOCK, VersionFiles

Earlier = tuple[int, dict[str, str]]  # a version committed to a replica, its files' sha256


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


async def held_content(
    http: httpx.AsyncClient, base: str, local: VersionFiles, names: list[str]
) -> set[str]:
    """Which of the files `names` the replica at `base` holds committed already, by content
    (another run's version over the same base model); none where it cannot say (an older
    store, an error: they are uploaded)."""
    shas = sorted({local.sha256[n] for n in names})
    held: set[str] = set()
    for at in range(0, len(shas), MAX_CONTENT_QUERY):
        query = {"sha256": shas[at : at + MAX_CONTENT_QUERY]}
        try:
            resp = await http.post(f"{base}/v1/content/have", json=query)
            if resp.status_code != 200:
                return set()
            held |= set(parse_answer(ContentHeld, resp, "content held").sha256)
        except (httpx.HTTPError, WeightTransferError):
            return set()
    return {n for n in names if local.sha256[n] in held}


async def post_commit(
    http: httpx.AsyncClient,
    prefix: str,
    entries: list[FileEntry],
    metadata: dict,
    reuse: int | None,
    reuse_content: bool = False,
) -> httpx.Response:
    """Commit the version's manifest (naming, with `reuse`, the version the replica takes the
    files not sent from; with `reuse_content`, it takes them from any version that has them)."""
    try:
        commit = ManifestCommit(
            files=entries, metadata=metadata, reuse_version=reuse, reuse_content=reuse_content
        )
    except ValidationError as exc:
        raise WeightTransferError(f"commit {prefix}: {brief(exc)}") from exc
    fields = {"files", "metadata", "reuse_version"}
    if reuse_content:  # named only when asked: a store older than it refuses the field
        fields.add("reuse_content")
    body = commit.model_dump(mode="json", include=fields)
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


async def send_deltas(
    http: httpx.AsyncClient,
    prefix: str,
    local: VersionFiles,
    deltas: Deltas | None,
    names: dict[str, str],
) -> dict[str, FileEntry] | None:
    """Upload the deltas of the files `names` (file -> its delta's name); the manifest entry
    of each file sent so, or None if the version is committed already."""
    if deltas is None or not names:
        return {}
    sent = await put_files(http, prefix, deltas.files, list(names.values()))
    if sent is None:
        return None
    return {n: deltas.entry(n, sent[d], local.size(n), local.sha256[n]) for n, d in names.items()}


async def upload_to(
    http: httpx.AsyncClient,
    base: str,
    local: VersionFiles,
    name: tuple[str, int],
    metadata: dict,
    earlier: Earlier | None,
    deltas: Deltas | None,
) -> Manifest:
    """Upload version `name` (model, version) to the replica at `base` and commit it: the
    files it holds already in `earlier` (the version this client committed to it last) are
    named, not sent; with `deltas` against that version, the files they make are sent as
    their deltas. With no `earlier`, the files the replica holds by content (another run over
    the same base model) are named, not sent. A replica that refuses that commit (it lost the
    version, or a delta does not apply) gets every file whole."""
    model, version = name
    prefix = f"{base}/v1/models/{model}/versions/{version}"
    reuse = earlier[0] if earlier is not None else None
    unchanged = {n for n, sha in local.sha256.items() if earlier and earlier[1].get(n) == sha}
    by_delta = {}
    if deltas is not None and deltas.base == reuse:
        by_delta = {n: d for n, d in deltas.of.items() if n not in unchanged}
    entries: dict[str, FileEntry] = {
        n: FileEntry(name=n, size=local.size(n), sha256=local.sha256[n]) for n in unchanged
    }
    rest = [n for n in local.content if n not in unchanged and n not in by_delta]
    shared = await held_content(http, base, local, rest) if earlier is None else set()
    entries |= {n: FileEntry(name=n, size=local.size(n), sha256=local.sha256[n]) for n in shared}
    whole = [n for n in rest if n not in shared]
    sent = await put_files(http, prefix, local, whole)
    sent_deltas = await send_deltas(http, prefix, local, deltas, by_delta)
    if sent is None or sent_deltas is None:
        return await already_committed(http, prefix, local, model, version)
    entries |= sent | sent_deltas
    listed = [entries[n] for n in local.content]
    resp = await post_commit(http, prefix, listed, metadata, reuse, bool(shared))
    if resp.status_code == 400 and (unchanged or by_delta or shared):
        sent = await put_files(http, prefix, local, [*unchanged, *by_delta, *shared])
        if sent is None:
            return await already_committed(http, prefix, local, model, version)
        entries |= sent
        resp = await post_commit(http, prefix, [entries[n] for n in local.content], metadata, None)
    if resp.status_code == 409:
        return await already_committed(http, prefix, local, model, version)
    if resp.status_code != 201:
        raise WeightTransferError(f"commit v{version}: {resp.status_code} {resp.text}")
    return parse_answer(Manifest, resp, f"commit v{version}")
