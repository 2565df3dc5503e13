"""Client of the weight store: upload a model folder as a version, pull a version into a local
folder with parallel range requests, verifying every sha256 before anything is loaded. The
blocks come from the store's zero-copy block server and, given a swarm, from the peers that
hold them (services.weights.block_fetch).

A pull writes into `{dest}.partial` and renames it to `dest` only when every file checked out,
so a folder named after a version is always complete. On any failure it tries the next replica.

The manifest, the content digest of a version and the errors are the store boundary's contract
(services.weights.contract): an upload or a pull compares the content digest of its files
with the store's manifest's. A version committed with another digest is a `WeightConflict`;
every other failure to move a version is a `WeightTransferError`. This module is the client's
state and its tries over replicas; the requests of one upload are in upload.py, the file work
of one pull in pull.py (and files.py).
"""

import asyncio
import functools
import logging
import os
import shutil
import time
from pathlib import Path
from urllib.parse import urlsplit

import httpx

from services.infra import tls
from services.infra.service import auth_headers
from services.weights.answers import read_manifest
from services.weights.block_fetch import BlockFetch, Swarm
from services.weights.block_sources import plan_blocks
from services.weights.contract import (
    Manifest,
    WeightConflict,
    WeightTransferError,
    manifest_digest,
)
from services.weights.delta_pull import pull_by_deltas
from services.weights.delta_upload import Deltas, make_deltas
from services.weights.files import VersionFiles, read_complete, scan_folder, write_complete
from services.weights.pull import PullResult, check_manifest, fetch_whole, prepare_partial
from services.weights.upload import Earlier, upload_to

log = logging.getLogger(__name__)
# httpx builds a TLS context (reading the CA bundle: ~20 ms of CPU) for every client it makes,
# even one that speaks plain HTTP; one per process is enough
tls_context = functools.cache(httpx.create_ssl_context)


class WeightClient:
    def __init__(
        self,
        urls: list[str],
        token: str | None = None,
        parallel: int = 8,
        ca_file: Path | str | None = None,
        deltas: bool = False,
    ) -> None:
        """`ca_file`: https:// replicas and peers are verified against this CA (the setting
        `tls_ca_file`); None: the system's trust store. `deltas`: an upload sends each changed
        safetensors file as a sparse delta of the version this client uploaded before, where
        that pays (services/weights/delta_upload.py)."""
        if not urls:
            raise ValueError("at least one weight store URL is needed")
        self.urls = urls
        self.headers = auth_headers(token)
        self.parallel = parallel
        self.ca_file = ca_file
        self._next = 0
        self._block_sources: dict[str, str] = {}  # replica -> where it serves its files
        self._block_misses: dict[str, int] = {}  # replica -> attempts failed in a row on it
        # (replica, model) -> the version this client last committed there, its files' sha256
        self._uploaded: dict[tuple[str, str], Earlier] = {}
        self.deltas = deltas
        self._sent: dict[str, tuple[int, VersionFiles]] = {}  # model -> last version uploaded

    def _http(self, timeout: float) -> httpx.AsyncClient:
        verify = tls.ca_context(str(self.ca_file)) if self.ca_file else tls_context()
        return httpx.AsyncClient(
            timeout=httpx.Timeout(timeout), headers=self.headers, verify=verify
        )

    def _replicas(self) -> list[str]:
        """Replicas in round-robin order, so pulls spread over them."""
        start = self._next % len(self.urls)
        self._next += 1
        return self.urls[start:] + self.urls[:start]

    # ---- upload ----
    async def upload_folder(
        self, folder: Path, model: str, version: int, metadata: dict | None = None
    ) -> Manifest:
        """Upload and commit a folder's files as a version (see `upload`)."""
        return await self.upload(await scan_folder(folder), model, version, metadata)

    async def upload(
        self, local: VersionFiles, model: str, version: int, metadata: dict | None = None
    ) -> Manifest:
        """Upload and commit a version on every replica; fails only if no replica has it.
        A replica holding the version with other content raises WeightConflict at once."""
        committed, errors = None, []
        deltas = await self._deltas(model, version, local)
        async with self._http(60.0) as http:
            for base in self.urls:
                try:
                    earlier = self._earlier(base, model, version)
                    manifest = await upload_to(
                        http, base, local, (model, version), metadata or {}, earlier, deltas
                    )
                    self._uploaded[base, model] = (version, dict(local.sha256))
                    committed = committed or manifest
                except WeightConflict:
                    raise
                except (httpx.HTTPError, WeightTransferError) as exc:
                    log.warning("upload of %s v%d to %s failed: %s", model, version, base, exc)
                    errors.append(f"{base}: {exc}")
        if committed is None:
            raise WeightTransferError(f"no replica took {model} v{version}: {'; '.join(errors)}")
        if self.deltas:
            self._sent[model] = (version, local)
        return committed

    async def _deltas(self, model: str, version: int, local: VersionFiles) -> Deltas | None:
        """With `deltas` on, the deltas of `local` against the version this client uploaded
        last (made once for every replica)."""
        previous = self._sent.get(model) if self.deltas else None
        if previous is None or previous[0] >= version:
            return None
        return await asyncio.to_thread(make_deltas, previous[1], previous[0], local)

    def _earlier(self, base: str, model: str, version: int) -> Earlier | None:
        """The version this client last committed to the replica before `version`, and its
        files' sha256."""
        earlier = self._uploaded.get((base, model))
        return earlier if earlier is not None and earlier[0] < version else None

    async def stored_digest(self, model: str, version: int) -> str | None:
        """Content digest of a committed version, from the first replica that has it; None when
        no replica that answered has it (an error when none answered)."""
        answered = False
        for base in self._replicas():
            try:
                async with self._http(10.0) as http:
                    resp = await http.get(f"{base}/v1/models/{model}/versions/{version}/manifest")
            except httpx.HTTPError as exc:
                log.warning("weight store %s unreachable: %s", base, exc)
                continue
            if resp.status_code == 200:
                return manifest_digest(read_manifest(resp, f"{model} v{version}"))
            answered = answered or resp.status_code == 404
        if not answered:
            raise WeightTransferError(f"no weight store replica answered for {model} v{version}")
        return None

    # ---- pull ----
    async def versions(self, model: str) -> list[int]:
        """Committed versions of `model`, from the first replica that answers."""
        for base in self._replicas():
            try:
                async with self._http(10.0) as http:
                    resp = await http.get(f"{base}/v1/models/{model}/versions")
                if resp.status_code == 200:
                    return list(resp.json()["versions"])
            except httpx.HTTPError as exc:
                log.warning("weight store %s unreachable: %s", base, exc)
        raise WeightTransferError(f"no weight store replica answered for {model}")

    async def pull(
        self,
        model: str,
        version: int,
        dest: Path,
        attempts: int = 6,
        expect_digest: str | None = None,
        reuse: Path | None = None,
        manifest: Manifest | None = None,
        swarm: Swarm | None = None,
    ) -> PullResult:
        """Download and verify a version into `dest`, retrying over replicas with backoff.
        With `expect_digest`, a replica serving other content is skipped (nothing of it is
        downloaded); WeightConflict when every replica does. Files that `reuse` (an earlier
        version pulled whole) holds with the same sha256 are linked from it, not downloaded:
        a new version changes the weights, rarely the config or the tokenizer. `manifest`, the
        version's manifest as announced, spares the first attempt asking a replica for it
        (checked against `expect_digest` the same; every later attempt asks). With `swarm`,
        blocks come from the peers that hold them too, verified all the same (block_fetch)."""
        done = read_complete(dest)
        cached = done.get("version") == version and expect_digest in (None, done.get("digest"))
        if cached:
            return PullResult(dest, version, 0, 0.0, done.get("digest", ""))
        if self.deltas:
            made = await pull_by_deltas(
                self, model, version, dest, expect_digest, reuse, manifest, swarm
            )
            if made is not None:
                return made
        shutil.rmtree(dest, ignore_errors=True)
        if manifest is not None and expect_digest not in (None, manifest_digest(manifest)):
            log.warning(
                "%s v%d: the manifest announced is not of its digest; asking", model, version
            )
            manifest = None
        last_error: Exception | None = None
        conflicts: dict[str, WeightConflict] = {}
        for attempt in range(attempts):
            for base in self._replicas():
                if base in conflicts:
                    continue  # versions are immutable: that replica will not change its mind
                try:
                    return await self._pull_from(
                        base, model, version, dest, expect_digest, reuse, manifest, swarm
                    )
                except WeightConflict as exc:
                    conflicts[base] = last_error = exc
                    log.error("pull %s v%d from %s refused: %s", model, version, base, exc)
                except (httpx.HTTPError, WeightTransferError, OSError) as exc:
                    last_error = exc
                    self._missed(base)
                    log.warning("pull %s v%d from %s failed: %s", model, version, base, exc)
                manifest = None  # the replicas' own from now on
            if len(conflicts) == len(self.urls):
                raise next(iter(conflicts.values()))
            await asyncio.sleep(min(0.2 * 2**attempt, 5.0))
        raise WeightTransferError(f"pull {model} v{version} failed: {last_error}")

    async def _pull_from(
        self,
        base: str,
        model: str,
        version: int,
        dest: Path,
        expect_digest: str | None,
        reuse: Path | None,
        manifest: Manifest | None = None,
        swarm: Swarm | None = None,
    ) -> PullResult:
        started = time.monotonic()
        if manifest is None or not manifest.full:  # a version kept as deltas: made whole first
            manifest = await self.manifest(model, version, whole=True, replicas=[base])
        digest = check_manifest(manifest, model, version, expect_digest)
        partial, same = prepare_partial(dest, reuse, manifest.files)
        blocks = plan_blocks(manifest.files)
        files_path = f"/v1/models/{model}/versions/{version}/files"
        fetch = BlockFetch(
            await self._block_source(base),
            files_path,
            partial,
            self.headers,
            self.parallel,
            swarm,
            self.ca_file,
        )
        try:
            if swarm is not None:
                await swarm.begin(partial, blocks)
                await swarm.verified([b for b in blocks if b.name in same])
            await asyncio.gather(
                fetch.run([b for b in blocks if b.name not in same]),
                fetch_whole(
                    fetch.store + files_path,
                    partial,
                    manifest.files,
                    same,
                    self.parallel,
                    self.headers,
                    self.ca_file,
                ),
            )
            write_complete(partial, version, digest, {e.name: e.sha256 for e in manifest.files})
            shutil.rmtree(dest, ignore_errors=True)
            os.replace(partial, dest)
            if swarm is not None:
                await swarm.complete(dest)
        except BaseException:
            if swarm is not None:
                await swarm.abandon()
            raise
        if fetch.store != base:
            self._block_misses.pop(base, None)  # its block server answers this client
        fetched = fetch.from_store + fetch.from_peers
        return PullResult(
            dest, version, fetched, time.monotonic() - started, digest, fetch.from_peers
        )

    async def manifest(
        self, model: str, version: int, whole: bool = False, replicas: list[str] | None = None
    ) -> Manifest:
        """A version's manifest, from the first of `replicas` (default: all) that has it; with
        `whole`, once that replica made every file of it whole (from deltas: seconds)."""
        error: Exception | None = None
        for base in replicas or self._replicas():
            try:
                async with self._http(600.0 if whole else 10.0) as http:
                    resp = await http.get(
                        f"{base}/v1/models/{model}/versions/{version}/manifest",
                        params={"whole": "true"} if whole else None,
                    )
                return read_manifest(resp, f"{model} v{version}")
            except (httpx.HTTPError, WeightTransferError) as exc:
                error = exc
        raise WeightTransferError(f"no replica gave {model} v{version}: {error}")

    async def delta_source(self, replica: str | None = None) -> tuple[str, str]:
        """The next replica and where it serves files; given `replica` (a fetch from it failed:
        it may have moved), where it serves them now."""
        if replica is not None:
            self._missed(replica)
        replica = replica or self._replicas()[0]
        return replica, await self._block_source(replica)

    def _missed(self, base: str) -> None:
        """An attempt on `base` failed: ask where it serves its blocks again (a replica that
        restarted bound another port); after two failures in a row on its block server, take
        the blocks from its API (a block port this client cannot reach, e.g. one Compose does
        not publish to the host)."""
        served_apart = self._block_sources.pop(base, base) != base
        if served_apart:
            self._block_misses[base] = self._block_misses.get(base, 0) + 1

    async def _block_source(self, base: str) -> str:
        """Where a replica serves its files with zero copy (its block server, on a port of its
        own, which `GET /v1/blocks` names); the replica's API itself where it has none."""
        if self._block_misses.get(base, 0) >= 2:
            return base
        if base not in self._block_sources:
            self._block_sources[base] = await self._ask_block_source(base)
        return self._block_sources[base]

    async def _ask_block_source(self, base: str) -> str:
        async with self._http(10.0) as http:
            resp = await http.get(f"{base}/v1/blocks")
        port = resp.json().get("port") if resp.status_code == 200 else None
        if isinstance(port, int) and 0 < port < 65536:
            parts = urlsplit(base)
            return f"{parts.scheme}://{parts.hostname}:{port}"
        return base
