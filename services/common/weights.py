"""Client of the weight store: upload a model folder as a version, pull a version into a local
folder with parallel range requests, verifying every sha256 before anything is loaded.

A pull writes into `{dest}.partial` and renames it to `dest` only when every file checked out,
so a folder named after a version is always complete. On any failure it tries the next replica.

A version's content digest (`content_digest`) is the sha256 of its sorted (name, size, sha256)
file triples: what the trainer announces with a version, and what an upload or a pull compares
with the store's manifest. A version committed with another digest is a `WeightConflict`.
"""

import asyncio
import hashlib
import http.client
import json
import logging
import os
import shutil
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import httpx

from services.common.service import auth_headers

log = logging.getLogger(__name__)
CHUNK_BYTES = 32 * 1024 * 1024  # bytes per range request
UPLOAD_BLOCK = 1024 * 1024
STREAM_BLOCK = 4 * 1024 * 1024
COMPLETE = ".complete"  # written last into a pulled folder: {"version": v, "digest": d}


class WeightTransferError(RuntimeError):
    """A version could not be uploaded or pulled intact."""


class WeightConflict(WeightTransferError):
    """The store holds the version with other content than expected (someone else committed it,
    or it is not the one announced). Versions are immutable: retrying cannot fix it."""

    def __init__(
        self,
        model: str,
        version: int,
        what: str,
        stored: str = "",
        expected: str = "",
        expected_as: str = "expected",
    ) -> None:
        self.model, self.version, self.stored, self.expected = model, version, stored, expected
        digests = f" (digest {stored[:16]} != {expected_as} {expected[:16]})" if stored else ""
        super().__init__(f"weight version {version} of {model} {what}{digests}")


@dataclass
class PullResult:
    folder: Path
    version: int
    bytes: int
    seconds: float
    digest: str  # content digest of the files pulled


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(UPLOAD_BLOCK):
            digest.update(block)
    return digest.hexdigest()


def content_digest(files: Iterable[tuple[str, int, str]]) -> str:
    """The digest of a version: sha256 of its sorted (name, size, sha256) triples, so that it
    depends on the files' content only (not their order, the metadata or the block hashes)."""
    triples = sorted((str(name), int(size), str(sha).lower()) for name, size, sha in files)
    return hashlib.sha256(json.dumps(triples, separators=(",", ":")).encode()).hexdigest()


def manifest_digest(manifest: dict) -> str:
    """Content digest of a manifest as the weight store serves it."""
    return content_digest((f["name"], f["size"], f["sha256"]) for f in manifest["files"])


@dataclass
class FolderFiles:
    """The files of a local folder as a version of it lists them, hashed once."""

    files: list[Path]
    sha256: dict[str, str]  # file name -> sha256
    digest: str  # content digest of the version they make


async def scan_folder(folder: Path) -> FolderFiles:
    """Hash every file of `folder` (the files an upload of it sends)."""
    files = sorted(p for p in Path(folder).iterdir() if p.is_file())
    sha = {p.name: await asyncio.to_thread(sha256_file, p) for p in files}
    digest = content_digest((p.name, p.stat().st_size, sha[p.name]) for p in files)
    return FolderFiles(files, sha, digest)


def _read_complete(dest: Path) -> dict | None:
    try:
        done = json.loads((dest / COMPLETE).read_text())
    except (OSError, ValueError):
        return None
    return done if isinstance(done, dict) else None


class WeightClient:
    def __init__(self, urls: list[str], token: str | None = None, parallel: int = 8) -> None:
        if not urls:
            raise ValueError("at least one weight store URL is needed")
        self.urls = urls
        self.headers = auth_headers(token)
        self.parallel = parallel
        self._next = 0

    def _replicas(self) -> list[str]:
        """Replicas in round-robin order, so pulls spread over them."""
        start = self._next % len(self.urls)
        self._next += 1
        return self.urls[start:] + self.urls[:start]

    # ---- upload ----
    async def upload_folder(
        self,
        folder: Path,
        model: str,
        version: int,
        metadata: dict | None = None,
        scanned: FolderFiles | None = None,
    ) -> dict:
        """Upload and commit a version on every replica; fails only if no replica has it.
        A replica holding the version with other content raises WeightConflict at once."""
        local = scanned or await scan_folder(folder)
        committed, errors = None, []
        async with httpx.AsyncClient(timeout=httpx.Timeout(60.0), headers=self.headers) as http:
            for base in self.urls:
                try:
                    manifest = await self._upload_to(
                        http, base, local, model, version, metadata or {}
                    )
                    committed = committed or manifest
                except WeightConflict:
                    raise
                except (httpx.HTTPError, WeightTransferError) as exc:
                    log.warning("upload of %s v%d to %s failed: %s", model, version, base, exc)
                    errors.append(f"{base}: {exc}")
        if committed is None:
            raise WeightTransferError(f"no replica took {model} v{version}: {'; '.join(errors)}")
        return committed

    async def _upload_to(
        self, http, base: str, local: FolderFiles, model: str, version: int, metadata: dict
    ) -> dict:
        prefix = f"{base}/v1/models/{model}/versions/{version}"
        entries = []
        for path in local.files:

            async def body(p: Path = path):
                with open(p, "rb") as fh:
                    while block := fh.read(UPLOAD_BLOCK):
                        yield block

            resp = await http.put(
                f"{prefix}/files/{path.name}",
                content=body(),
                headers={"x-sha256": local.sha256[path.name]},
            )
            if resp.status_code == 409:
                return await self._already_committed(http, prefix, local, model, version)
            if resp.status_code != 200:
                raise WeightTransferError(f"upload {path.name}: {resp.status_code} {resp.text}")
            entries.append(resp.json())
        resp = await http.post(f"{prefix}/commit", json={"files": entries, "metadata": metadata})
        if resp.status_code == 409:
            return await self._already_committed(http, prefix, local, model, version)
        if resp.status_code != 201:
            raise WeightTransferError(f"commit v{version}: {resp.status_code} {resp.text}")
        return resp.json()

    @staticmethod
    async def _already_committed(
        http, prefix: str, local: FolderFiles, model: str, version: int
    ) -> dict:
        """The store has the version: ours (an earlier attempt) only with our content digest."""
        resp = await http.get(f"{prefix}/manifest")
        if resp.status_code != 200:
            raise WeightTransferError(f"manifest of v{version}: {resp.status_code} {resp.text}")
        manifest = resp.json()
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

    async def stored_digest(self, model: str, version: int) -> str | None:
        """Content digest of a committed version, from the first replica that has it; None when
        no replica that answered has it (an error when none answered)."""
        answered = False
        for base in self._replicas():
            try:
                async with httpx.AsyncClient(timeout=10.0, headers=self.headers) as http:
                    resp = await http.get(f"{base}/v1/models/{model}/versions/{version}/manifest")
            except httpx.HTTPError as exc:
                log.warning("weight store %s unreachable: %s", base, exc)
                continue
            if resp.status_code == 200:
                return manifest_digest(resp.json())
            answered = answered or resp.status_code == 404
        if not answered:
            raise WeightTransferError(f"no weight store replica answered for {model} v{version}")
        return None

    # ---- pull ----
    async def versions(self, model: str) -> list[int]:
        """Committed versions of `model`, from the first replica that answers."""
        for base in self._replicas():
            try:
                async with httpx.AsyncClient(timeout=10.0, headers=self.headers) as http:
                    resp = await http.get(f"{base}/v1/models/{model}/versions")
                if resp.status_code == 200:
                    return list(resp.json()["versions"])
            except httpx.HTTPError as exc:
                log.warning("weight store %s unreachable: %s", base, exc)
        raise WeightTransferError(f"no weight store replica answered for {model}")

    async def latest_version(self, model: str) -> int | None:
        versions = await self.versions(model)
        return versions[-1] if versions else None

    async def pull(
        self,
        model: str,
        version: int,
        dest: Path,
        attempts: int = 6,
        expect_digest: str | None = None,
    ) -> PullResult:
        """Download and verify a version into `dest`, retrying over replicas with backoff.
        With `expect_digest`, a replica serving other content is skipped (nothing of it is
        downloaded); WeightConflict when every replica does."""
        done = _read_complete(dest) or {}
        cached = done.get("version") == version and expect_digest in (None, done.get("digest"))
        if cached:
            return PullResult(dest, version, 0, 0.0, done.get("digest", ""))
        shutil.rmtree(dest, ignore_errors=True)
        last_error: Exception | None = None
        conflicts: dict[str, WeightConflict] = {}
        for attempt in range(attempts):
            for base in self._replicas():
                if base in conflicts:
                    continue  # versions are immutable: that replica will not change its mind
                try:
                    return await self._pull_from(base, model, version, dest, expect_digest)
                except WeightConflict as exc:
                    conflicts[base] = last_error = exc
                    log.error("pull %s v%d from %s refused: %s", model, version, base, exc)
                except (httpx.HTTPError, WeightTransferError, OSError) as exc:
                    last_error = exc
                    log.warning("pull %s v%d from %s failed: %s", model, version, base, exc)
            if len(conflicts) == len(self.urls):
                raise next(iter(conflicts.values()))
            await asyncio.sleep(min(0.2 * 2**attempt, 5.0))
        raise WeightTransferError(f"pull {model} v{version} failed: {last_error}")

    async def _pull_from(
        self, base: str, model: str, version: int, dest: Path, expect_digest: str | None
    ) -> PullResult:
        started = time.monotonic()
        async with httpx.AsyncClient(timeout=httpx.Timeout(60.0), headers=self.headers) as http:
            resp = await http.get(f"{base}/v1/models/{model}/versions/{version}/manifest")
        if resp.status_code != 200:
            raise WeightTransferError(f"manifest: {resp.status_code} {resp.text}")
        manifest = resp.json()
        named = (
            (manifest.get("model"), manifest.get("version")) if isinstance(manifest, dict) else ()
        )
        if named != (model, version):
            raise WeightTransferError(f"asked for {model} v{version}, the manifest names {named}")
        digest = manifest_digest(manifest)
        if expect_digest is not None and digest != expect_digest:
            raise WeightConflict(
                model,
                version,
                "in the store is not the one announced",
                digest,
                expect_digest,
                "announced",
            )
        partial = dest.with_name(dest.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        gate = asyncio.Semaphore(self.parallel)
        jobs, whole_file_checks = [], []
        for entry in manifest["files"]:
            path = partial / entry["name"]
            with open(path, "wb") as fh:
                fh.truncate(entry["size"])
            url = f"{base}/v1/models/{model}/versions/{version}/files/{entry['name']}"
            block, hashes = entry.get("block_size"), entry.get("block_sha256") or []
            if not block or len(hashes) != -(-entry["size"] // block):
                block, hashes = CHUNK_BYTES, []
                whole_file_checks.append(entry)
            for i, start in enumerate(range(0, entry["size"], block)):
                end = min(start + block, entry["size"]) - 1
                expect = hashes[i] if hashes else None
                jobs.append(self._fetch_range(gate, url, path, start, end, expect, self.headers))
        await asyncio.gather(*jobs)
        for entry in whole_file_checks:  # stores without block hashes: one pass over the file
            got = await asyncio.to_thread(sha256_file, partial / entry["name"])
            if got != entry["sha256"]:
                raise WeightTransferError(f"{entry['name']}: sha256 mismatch (corrupt transfer)")
        (partial / COMPLETE).write_text(json.dumps({"version": version, "digest": digest}))
        shutil.rmtree(dest, ignore_errors=True)
        os.replace(partial, dest)
        total = sum(e["size"] for e in manifest["files"])
        return PullResult(dest, version, total, time.monotonic() - started, digest)

    @staticmethod
    async def _fetch_range(
        gate, url: str, path: Path, start: int, end: int, sha256: str | None, headers: dict
    ):
        async with gate:
            await asyncio.to_thread(fetch_range, url, path, start, end, sha256, headers)


def fetch_range(
    url: str,
    path: Path,
    start: int,
    end: int,
    sha256: str | None = None,
    headers: dict[str, str] | None = None,
) -> None:
    """Copy bytes [start, end] of `url` into `path` at their offset, in blocks read straight
    into one buffer, checking their sha256 when given (the stdlib client in a thread moves
    several GB/s; httpx's async streaming tops out near 0.3 GB/s here)."""
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
    digest = hashlib.sha256()
    try:
        # the bearer token too: a store with protected reads guards its files
        conn.request(
            "GET", parts.path, headers={**(headers or {}), "Range": f"bytes={start}-{end}"}
        )
        resp = conn.getresponse()
        if resp.status not in (200, 206):
            raise WeightTransferError(f"{url}: {resp.status} {resp.read(500)!r}")
        view = memoryview(bytearray(STREAM_BLOCK))
        offset = start
        fd = os.open(path, os.O_WRONLY)
        try:
            while offset <= end and (n := resp.readinto(view)):
                digest.update(view[:n])
                os.pwrite(fd, view[:n], offset)
                offset += n
        finally:
            os.close(fd)
    except (OSError, http.client.HTTPException) as exc:
        raise WeightTransferError(f"{url}: {exc}") from exc
    finally:
        conn.close()
    if offset != end + 1:
        raise WeightTransferError(f"{url}: short read {offset - start} of {end - start + 1}")
    if sha256 is not None and digest.hexdigest() != sha256:
        raise WeightTransferError(f"{url} bytes {start}-{end}: sha256 mismatch (corrupt transfer)")
