"""Versions committed as sparse deltas (issue 42): which files the store keeps whole, and how it
makes a file whole from its delta.

- At commit, a file uploaded as a delta of the same file in an earlier version (its `DeltaRef`)
  is applied to that version's whole file, and the result is checked like any upload: the
  store computes its sha256 and block hashes, and the commit is refused where they are not the
  manifest's. A delta that does not make the announced file never becomes a version.
- A version is *full* when none of its files came as a delta, or its number is a multiple of
  `full_every`: the store keeps its files whole for good. Of the other versions it keeps the
  delta, and the whole file only while the version is the newest (the base of the next
  delta, and what most pulls ask for); older ones are thinned to their deltas.
- A whole file asked for later is made again from the nearest full version and the deltas
  after it, written aside and renamed into place, checked against the manifest's sha256.
- Retention keeps the newest versions and every version their deltas go back through, down to
  a full one, and the base a kept version names in its metadata (`base_version`: the version
  0 of a LoRA run, whose later versions are adapters of it).

Blocking file work: the API runs it in threads; one lock orders the materialisations.
"""

import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from services.weights.contract import Manifest
from services.weights.delta import DeltaError, apply, read_header
from services.weightstore.hashing import Hashes, read_hashes


class Store(Protocol):
    """What this module asks of the store's storage (storage.WeightStorage)."""

    def committed_dir(self, model: str, version: int) -> Path: ...

    def manifest(self, model: str, version: int) -> Manifest: ...

    def versions(self, model: str) -> list[int]: ...

    def write_whole(self, staging: Path, name: str, data: bytes | bytearray) -> Hashes: ...


MAKING = threading.RLock()  # one whole file is made at a time (each may make its base first)


class NotWhole(Exception):
    """A file cannot be made whole (its base is gone, or a delta does not apply)."""


def is_full(manifest: Manifest, full_every: int) -> bool:
    """Whether a version is kept whole for good: none of its files came as a delta, or its
    number is a multiple of `full_every`."""
    return all(f.delta is None for f in manifest.files) or manifest.version % full_every == 0


def kept_versions(versions: list[int], keep: int, manifest: Callable[[int], Manifest]) -> set[int]:
    """The newest `keep` of `versions`, every version the deltas of those go back through,
    down to full ones (or to bases that are gone already), and the version each kept one
    names as its `base_version` (an int in its metadata: the base model a LoRA adapter is
    merged into, kept while any kept adapter uses it)."""
    held = set(versions)
    kept: set[int] = set()
    todo = list(versions[-keep:])
    while todo:
        version = todo.pop()
        if version not in held or version in kept:
            continue
        kept.add(version)
        shown = manifest(version)
        if not shown.full:
            todo += [f.delta.base for f in shown.files if f.delta is not None]
        base = shown.metadata.get("base_version")
        if isinstance(base, int) and not isinstance(base, bool):
            todo.append(base)
    return kept


def make_whole(
    storage: Store, model: str, staging: Path, manifest: Manifest
) -> tuple[dict[str, Hashes], list[str]]:
    """Apply the deltas uploaded into `staging` for the files of `manifest` that name one: the
    hashes of each file made (it replaces whatever was staged under its name: the delta is
    what the version says it is made of), and what could not be made."""
    made: dict[str, Hashes] = {}
    problems = []
    for entry in manifest.files:
        ref = entry.delta
        if ref is None:
            continue
        sha, _, _ = read_hashes(staging, ref.name)
        if not (staging / ref.name).is_file() or sha != ref.sha256:
            problems.append(f"{entry.name}: its delta {ref.name} was not uploaded as named")
            continue
        try:
            base = whole_path(storage, model, ref.base, entry.name)
            known = base_sha256(storage, model, ref.base, entry.name)
            data = apply(base.read_bytes(), (staging / ref.name).read_bytes(), known)
        except (NotWhole, DeltaError, OSError) as exc:
            problems.append(f"{entry.name}: delta against v{ref.base} refused: {exc}")
            continue
        made[entry.name] = storage.write_whole(staging, entry.name, data)
    return made, problems


def base_sha256(storage: Store, model: str, version: int, name: str) -> str | None:
    """The sha256 the store checked file `name` of a committed version against (None: not
    listed)."""
    entry = storage.manifest(model, version).entry(name)
    return entry.sha256 if entry is not None else None


def whole_path(storage: Store, model: str, version: int, name: str) -> Path:
    """The whole file `name` of a committed version, made from its delta where the store kept
    only that (NotWhole where it cannot be made)."""
    path = storage.committed_dir(model, version) / name
    if path.is_file():
        return path
    with MAKING:
        if path.is_file():  # made meanwhile
            return path
        try:
            entry = storage.manifest(model, version).entry(name)
        except Exception as exc:  # the version went (retention) or never was
            raise NotWhole(f"{model} v{version} is not held") from exc
        if entry is None or entry.delta is None:
            raise NotWhole(f"{model} v{version} has no whole {name!r}")
        base = whole_path(storage, model, entry.delta.base, name)
        try:
            delta = (storage.committed_dir(model, version) / entry.delta.name).read_bytes()
            if read_header(delta).target_sha256 != entry.sha256:  # `apply` checks the rest
                raise DeltaError("its delta does not make the manifest's file")
            data = apply(
                base.read_bytes(), delta, base_sha256(storage, model, entry.delta.base, name)
            )
        except (DeltaError, OSError) as exc:
            raise NotWhole(f"{model} v{version} {name}: {exc}") from exc
        aside = path.with_name(f".{name}.making")
        aside.write_bytes(data)
        os.replace(aside, path)
    return path


def thin(storage: Store, model: str, newest: int) -> None:
    """Drop the whole files of the versions before `newest` that are not full, where a delta
    stands for them (they are made again if asked for)."""
    with MAKING:
        for version in storage.versions(model):
            if version >= newest:
                continue
            shown = storage.manifest(model, version)
            if shown.full:
                continue
            for entry in shown.files:
                if entry.delta is not None:
                    (storage.committed_dir(model, version) / entry.name).unlink(missing_ok=True)
