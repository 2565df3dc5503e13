"""Versioned model files on local disk with atomic commit.

Layout under `root`:
    {model}/staging/{replica}/{version}/{file}  files being uploaded (never served)
    {model}/v{version:08d}/{file}        committed versions, each with manifest.json

A version becomes visible by one rename of its staging folder, after every file in the manifest
was found with the right size and sha256. Retention keeps the newest `keep` versions.
Several replicas may share one folder (a shared volume): each stages its uploads under its own
name (its host name and port: the same when it restarts, different for replicas sharing a host
name, as on the host's network). A replica discards its own cut-off uploads when it starts, and
any replica's staging left untouched for an hour (its replica gone or recreated under another
name) when it starts and after each commit.
"""

import contextlib
import json
import os
import shutil
from collections.abc import AsyncIterator
from pathlib import Path

from services.weights.contract import NAME_RE, FileEntry, Manifest
from services.weights.files import link_or_copy
from services.weightstore import whole
from services.weightstore.hashing import (
    BLOCK_BYTES,
    FileHasher,
    Hashes,
    read_hashes,
    write_hashes,
)

MANIFEST = "manifest.json"


class StorageError(Exception):
    """A request the store refuses; `status` is its HTTP status."""

    status = 400


class NotFound(StorageError):
    status = 404


class Conflict(StorageError):
    """The version is committed: its files cannot change, it cannot be committed again."""

    status = 409


def check_name(kind: str, name: str) -> str:
    if not NAME_RE.match(name) or name == MANIFEST:
        raise StorageError(f"invalid {kind} name {name!r}: use letters, digits, '.', '_', '-'")
    return name


def last_touched(folder: Path) -> float:
    """The newest modification time of `folder` and everything under it (0 when it is gone)."""
    newest = 0.0
    for dirpath, _, files in os.walk(folder):
        for path in (dirpath, *(os.path.join(dirpath, f) for f in files)):
            with contextlib.suppress(OSError):  # removed meanwhile
                newest = max(newest, os.stat(path).st_mtime)
    return newest


class WeightStorage:
    def __init__(
        self,
        root: str | Path,
        keep: int,
        replica: str = "local",
        block_bytes: int = BLOCK_BYTES,
        full_every: int = 8,
    ) -> None:
        self.root = Path(root)
        self.keep, self.full_every = keep, full_every
        self.block_bytes = block_bytes
        self.replica = check_name("replica", replica)
        self.root.mkdir(parents=True, exist_ok=True)

    # ---- paths ----
    def _model_dir(self, model: str) -> Path:
        return self.root / check_name("model", model)

    def _staging(self, model: str, version: int) -> Path:
        return self._model_dir(model) / "staging" / self.replica / str(version)

    def committed_dir(self, model: str, version: int) -> Path:
        return self._model_dir(model) / f"v{version:08d}"

    def is_committed(self, model: str, version: int) -> bool:
        return (self.committed_dir(model, version) / MANIFEST).is_file()

    # ---- writes ----
    async def write_file(
        self, model: str, version: int, name: str, chunks: AsyncIterator[bytes], sha256: str | None
    ) -> FileEntry:
        """Stream one file into staging; the file appears under its name only when complete."""
        check_name("file", name)
        if self.is_committed(model, version):
            raise Conflict(f"{model} version {version} is committed; its files cannot change")
        staging = self._staging(model, version)
        made = self._first_missing(staging)
        staging.mkdir(parents=True, exist_ok=True)
        part = staging / f".{name}.part"
        hasher = FileHasher(self.block_bytes)
        try:
            with open(part, "wb") as fh:
                async for chunk in chunks:
                    fh.write(chunk)
                    hasher.update(chunk)
            got, block_hashes = hasher.finish()
            if sha256 is not None and sha256.lower() != got:
                raise StorageError(f"{name}: sha256 of the bytes received is {got}, not {sha256}")
            os.replace(part, staging / name)
        except BaseException:
            part.unlink(missing_ok=True)
            self._prune_empty(staging, made)  # a refused upload leaves no new folder behind
            raise
        finally:
            part.unlink(missing_ok=True)
        write_hashes(staging, name, got, block_hashes, self.block_bytes)
        return FileEntry(
            name=name,
            size=hasher.size,
            sha256=got,
            block_size=self.block_bytes,
            block_sha256=block_hashes,
        )

    def commit(
        self,
        model: str,
        version: int,
        manifest: Manifest,
        reuse_version: int | None = None,
        reuse_content: bool = False,
    ) -> Manifest:
        """Make a version visible, all or nothing. Listed files not uploaded are taken from
        committed `reuse_version` where it holds them with the same content, and, with
        `reuse_content`, from any committed version of any model that does."""
        if self.is_committed(model, version):
            raise Conflict(f"{model} version {version} is already committed")
        staging = self._staging(model, version)
        # every sha256 a committed manifest lists is that of bytes this store received (here
        # or, for a file taken from `reuse_version`, for that version): a version's content
        # digest is computed from them; block hashes always come from the store too
        known = self._take_unchanged(model, reuse_version, staging, manifest)
        if reuse_content:
            known |= self._take_content(staging, manifest)
        made, problems = whole.make_whole(self, model, staging, manifest)
        known |= made
        files = []
        for entry in manifest.files:
            path = staging / entry.name
            if not path.is_file():
                problems.append(f"{entry.name}: not uploaded")
                continue
            if path.stat().st_size != entry.size:
                problems.append(
                    f"{entry.name}: size {path.stat().st_size}, manifest says {entry.size}"
                )
            sha256, hashes, block = known.get(entry.name) or read_hashes(staging, entry.name)
            if sha256 != entry.sha256:
                problems.append(f"{entry.name}: sha256 differs from the manifest")
            files.append(
                entry.model_copy(
                    update={"block_size": block if hashes else None, "block_sha256": hashes}
                )
            )
        if problems:
            raise StorageError(f"cannot commit {model} v{version}: " + "; ".join(problems))
        final = manifest.model_copy(update={"model": model, "version": version, "files": files})
        final.full = whole.is_full(final, self.full_every)
        listed = {e.name for e in manifest.files} | manifest.delta_names()
        for extra in staging.iterdir():
            if extra.name not in listed:
                extra.unlink()
        (staging / MANIFEST).write_text(final.model_dump_json(indent=1))
        try:
            os.replace(staging, self.committed_dir(model, version))
        except OSError as exc:  # another replica on the same volume committed it first
            raise Conflict(f"{model} version {version} is already committed") from exc
        whole.thin(self, model, version)
        self._apply_retention(model)
        return final

    def write_whole(self, staging: Path, name: str, data: bytes | bytearray) -> Hashes:
        """A file made whole from its delta, staged as if it was uploaded: its hashes."""
        hasher = FileHasher(self.block_bytes)
        hasher.update(data)
        sha256, blocks = hasher.finish()
        aside = staging / f".{name}.part"
        aside.write_bytes(data)
        os.replace(aside, staging / name)
        write_hashes(staging, name, sha256, blocks, self.block_bytes)
        return sha256, blocks, self.block_bytes

    def _take_unchanged(
        self, model: str, reuse_version: int | None, staging: Path, manifest: Manifest
    ) -> dict[str, Hashes]:
        """Link into `staging` each listed file it lacks that committed `reuse_version` has
        with the same name, size and sha256; the sha256 and block hashes of each file linked,
        as that version's manifest lists them."""
        if reuse_version is None or not self.is_committed(model, reuse_version):
            return {}  # the missing files stay missing: the commit says which
        earlier = {e.name: e for e in self.manifest(model, reuse_version).files}
        taken: dict[str, Hashes] = {}
        for entry in manifest.files:
            old = earlier.get(entry.name)
            if old is None or (old.size, old.sha256) != (entry.size, entry.sha256):
                continue
            if (staging / f".{entry.name}.hashes").exists():
                continue  # uploaded: the upload is what this version holds
            path = staging / entry.name
            staging.mkdir(parents=True, exist_ok=True)
            path.unlink(missing_ok=True)  # linked by an attempt that was refused
            try:
                link_or_copy(self.committed_dir(model, reuse_version) / entry.name, path)
            except OSError:  # retention took that version meanwhile: the file stays missing
                continue
            taken[entry.name] = (old.sha256, old.block_sha256 or [], old.block_size)
        return taken

    def content(self, wanted: set[str] | None = None) -> dict[str, tuple[Path, FileEntry]]:
        """Committed file contents by sha256 (those of `wanted`; None: all): where one is kept
        whole and its manifest entry. Read from the committed manifests, so what retention
        removed is gone from it; a file kept as its delta only is not offered."""
        found: dict[str, tuple[Path, FileEntry]] = {}
        for model in self.models():
            for version in self.versions(model):
                try:
                    entries = self.manifest(model, version).files
                except (NotFound, OSError, ValueError):
                    continue  # retention took it meanwhile
                folder = self.committed_dir(model, version)
                for entry in entries:
                    if wanted is not None and entry.sha256 not in wanted:
                        continue
                    if entry.sha256 not in found and (folder / entry.name).is_file():
                        found[entry.sha256] = (folder / entry.name, entry)
        return found

    def _take_content(self, staging: Path, manifest: Manifest) -> dict[str, Hashes]:
        """Link into `staging` each listed file it lacks that a committed version of any model
        holds with the same size and sha256 (one copy on disk, kept while any version links
        it); the hashes of each file linked, as its manifest lists them."""
        missing = [e for e in manifest.files if not (staging / e.name).exists()]
        held = self.content({e.sha256 for e in missing}) if missing else {}
        taken: dict[str, Hashes] = {}
        for entry in missing:
            source = held.get(entry.sha256)
            if source is None or source[1].size != entry.size:
                continue
            path, old = source
            staging.mkdir(parents=True, exist_ok=True)
            try:
                link_or_copy(path, staging / entry.name)
            except OSError:  # retention took it meanwhile: the file stays missing
                continue
            taken[entry.name] = (old.sha256, old.block_sha256 or [], old.block_size)
        return taken

    @staticmethod
    def _first_missing(folder: Path) -> Path | None:
        """The outermost of `folder` and its parents that does not exist yet."""
        missing = None
        while not folder.exists():
            missing, folder = folder, folder.parent
        return missing

    @staticmethod
    def _prune_empty(folder: Path, top: Path | None) -> None:
        """Remove `folder` and its parents up to `top` while they are empty."""
        if top is None:
            return
        while folder.is_relative_to(top):
            try:
                folder.rmdir()
            except OSError:  # not empty: another upload of the version is using it
                return
            folder = folder.parent

    def _apply_retention(self, model: str) -> None:
        """Keep the newest `keep` versions and the versions their deltas go back through."""
        versions = self.versions(model)
        kept = whole.kept_versions(versions, self.keep, lambda v: self.manifest(model, v))
        for version in versions:
            if version not in kept:
                shutil.rmtree(self.committed_dir(model, version), ignore_errors=True)

    def discard_staging(
        self, model: str, stale_after_s: float, now: float, own: bool = False
    ) -> list[str]:
        """Drop any replica's staging untouched for `stale_after_s` (an upload writes to its
        files all along: one that long quiet was cut off, its replica gone or recreated under a
        new name) and, with `own` (this replica starting), all of this replica's. Returns the
        replicas whose staging went."""
        top = self._model_dir(model) / "staging"
        gone = []
        for area in sorted(top.iterdir()) if top.is_dir() else []:
            if (own and area.name == self.replica) or last_touched(area) < now - stale_after_s:
                shutil.rmtree(area, ignore_errors=True)
                gone.append(area.name)
        return gone

    # ---- reads ----
    def models(self) -> list[str]:
        return sorted(p.name for p in self.root.iterdir() if p.is_dir() and NAME_RE.match(p.name))

    def versions(self, model: str) -> list[int]:
        folder = self._model_dir(model)
        if not folder.is_dir():
            return []
        found = []
        for p in folder.iterdir():
            if p.name.startswith("v") and p.name[1:].isdigit() and (p / MANIFEST).is_file():
                found.append(int(p.name[1:]))
        return sorted(found)

    def manifest(self, model: str, version: int) -> Manifest:
        path = self.committed_dir(model, version) / MANIFEST
        if not path.is_file():
            raise NotFound(f"{model} has no committed version {version}")
        return Manifest.model_validate(json.loads(path.read_text()))

    def latest(self, model: str) -> Manifest:
        versions = self.versions(model)
        if not versions:
            raise NotFound(f"model {model!r} has no committed version")
        return self.manifest(model, versions[-1])

    def file_path(self, model: str, version: int, name: str, make: bool = True) -> Path:
        """A committed file (a version's file, or the delta it was committed as). A file kept
        as its delta only is made whole first (blocking: seconds for a big one), or without
        `make` is NotFound."""
        check_name("file", name)
        manifest = self.manifest(model, version)
        if name in manifest.delta_names():
            return self.committed_dir(model, version) / name
        if manifest.entry(name) is None:
            raise NotFound(f"{model} v{version} has no file {name!r}")
        path = self.committed_dir(model, version) / name
        if path.is_file():
            return path
        if not make:
            raise NotFound(f"{model} v{version} keeps {name!r} as its delta only")
        try:
            return whole.whole_path(self, model, version, name)
        except whole.NotWhole as exc:
            raise NotFound(str(exc)) from exc

    def make_whole(self, model: str, version: int) -> Manifest:
        """Make every file of a version whole (a pull of it in full follows); its manifest."""
        manifest = self.manifest(model, version)
        for entry in manifest.files:
            self.file_path(model, version, entry.name)
        return manifest
