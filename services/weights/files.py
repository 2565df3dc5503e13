"""The local side of a weight transfer: hashing the files of a version (what an upload sends,
from a folder or from memory), copying one byte range of a file the weight store serves into a
local file (what a pull is made of), and the marker written last into a folder pulled whole.

Blocking file and socket work: the weight client runs these in threads.
"""

import asyncio
import contextlib
import hashlib
import http.client
import json
import os
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from services.infra import tls
from services.weights.contract import FileEntry, WeightTransferError, content_digest

UPLOAD_BLOCK = 1024 * 1024  # bytes read at a time to hash or upload a file
STREAM_BLOCK = 4 * 1024 * 1024  # bytes read at a time from a range response
COMPLETE = ".complete"  # written last into a pulled folder: {"version": v, "digest": d}


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(UPLOAD_BLOCK):
            digest.update(block)
    return digest.hexdigest()


@dataclass
class VersionFiles:
    """The files of a version as an upload sends them, each hashed once: by name (in name
    order), its bytes in memory or the local file that holds them."""

    content: dict[str, bytes | Path]
    sha256: dict[str, str]  # file name -> sha256
    digest: str  # content digest of the version they make

    def size(self, name: str) -> int:
        return _size(self.content[name])


def _size(content: bytes | Path) -> int:
    return len(content) if isinstance(content, bytes) else content.stat().st_size


def _version_files(content: Mapping[str, bytes | Path], sha: dict[str, str]) -> VersionFiles:
    ordered = dict(sorted(content.items()))
    digest = content_digest((n, _size(c), sha[n]) for n, c in ordered.items())
    return VersionFiles(ordered, {n: sha[n] for n in ordered}, digest)


async def scan_folder(folder: Path) -> VersionFiles:
    """Hash every file of `folder` (the files an upload of it sends)."""
    files = {p.name: p for p in Path(folder).iterdir() if p.is_file()}
    sha = {name: await asyncio.to_thread(sha256_file, p) for name, p in files.items()}
    return _version_files(files, sha)


def hash_files_now(content: dict[str, bytes]) -> VersionFiles:
    """Hash files held in memory (blocking)."""
    sha = {name: hashlib.sha256(data).hexdigest() for name, data in content.items()}
    return _version_files(dict(content), sha)


async def hash_files(content: dict[str, bytes]) -> VersionFiles:
    """Hash files held in memory (one thread hop for them all)."""
    return await asyncio.to_thread(hash_files_now, content)


def read_complete(dest: Path) -> dict:
    """The marker of a folder pulled whole ({} when there is none or it is unreadable)."""
    try:
        done = json.loads((dest / COMPLETE).read_text())
    except (OSError, ValueError):
        return {}
    return done if isinstance(done, dict) else {}


def write_complete(
    folder: Path, version: int, digest: str, files: dict[str, str] | None = None
) -> None:
    """Mark a folder pulled whole: its version, content digest and each file's sha256."""
    marker = {"version": version, "digest": digest, "files": files or {}}
    (folder / COMPLETE).write_text(json.dumps(marker))


def reusable(folder: Path | None, entries: list[FileEntry]) -> dict[str, Path]:
    """The files of `entries` that `folder`, an earlier version pulled whole, holds with the
    same content (its marker's sha256, and the size on disk agrees), by name."""
    if folder is None:
        return {}
    files = read_complete(folder).get("files")
    if not isinstance(files, dict):
        return {}
    same = {}
    for entry in entries:
        path = folder / entry.name
        with contextlib.suppress(OSError):
            if files.get(entry.name) == entry.sha256 and path.stat().st_size == entry.size:
                same[entry.name] = path
    return same


def link_or_copy(src: Path, dst: Path) -> None:
    """`dst` with `src`'s content: a hard link where the file system allows, else a copy."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copyfile(src, dst)


class SourceBusy(WeightTransferError):
    """The source answered 503: it serves as much as it may now; another can serve the range."""


class SourceLacks(WeightTransferError):
    """The source answered 404: it does not hold the range (a peer that dropped the version,
    or moved its folder as its pull completed)."""


def fetch_range(
    url: str,
    path: Path,
    start: int,
    end: int,
    sha256: str | None = None,
    headers: dict[str, str] | None = None,
    timeout: float = 60.0,
    ca_file: Path | str | None = None,
) -> None:
    """Copy bytes [start, end] of `url` into `path` at their offset, in blocks read straight
    into one buffer, checking their sha256 when given (the stdlib client in a thread moves
    several GB/s; httpx's async streaming tops out near 0.3 GB/s here). An https:// URL is
    verified against `ca_file` (None: the system's CAs)."""
    parts = urlsplit(url)
    conn: http.client.HTTPConnection
    if parts.scheme == "https":
        context = tls.client_context(ca_file)
        conn = http.client.HTTPSConnection(
            parts.hostname or "", parts.port, timeout=timeout, context=context
        )
    else:
        conn = http.client.HTTPConnection(parts.hostname or "", parts.port, timeout=timeout)
    digest = hashlib.sha256()
    try:
        # the bearer token too: a store with protected reads guards its files
        conn.request(
            "GET", parts.path, headers={**(headers or {}), "Range": f"bytes={start}-{end}"}
        )
        resp = conn.getresponse()
        if resp.status == 503:
            raise SourceBusy(f"{url}: busy")
        if resp.status == 404:
            raise SourceLacks(f"{url}: 404 {resp.read(500)!r}")
        if resp.status not in (200, 206):
            raise WeightTransferError(f"{url}: {resp.status} {resp.read(500)!r}")
        view = memoryview(bytearray(min(STREAM_BLOCK, end - start + 1)))
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
