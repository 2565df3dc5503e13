"""The contract of the weight store boundary, between the store (services/weightstore), which
writes and serves manifests, and its client (weights/transfer.py), which commits and reads them:
the manifest of a version (its JSON is what the store's API takes and returns), the content
digest of a version, and the errors of a transfer (one base class: `WeightTransferError`).

A version's content digest (`content_digest`) is the sha256 of its sorted (name, size, sha256)
file triples: what the trainer announces with a version, and what an upload or a pull compares
with the store's manifest. It depends on the files' content only, not on their order, the
metadata or the block hashes.

No I/O here: the store keeps manifests on disk, the client fetches them over HTTP. The store's
own refusals are HTTP statuses (weightstore/storage.py's StorageError), which the client turns
into these errors.
"""

import hashlib
import json
import re
from collections.abc import Iterable
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,199}$")  # a model, file or replica name
MAX_VERSION = 2**31 - 1


SHA256 = r"^[0-9a-f]{64}$"  # lowercase hex


class DeltaRef(BaseModel):
    """How a file was committed: as a sparse delta (services/weights/delta.py) of the file of
    the same name in version `base`. The delta is a file of the version of its own, `name`,
    which pullers fetch whole and check against `sha256`."""

    base: int = Field(ge=0, le=MAX_VERSION)
    name: str = Field(pattern=NAME_RE.pattern)
    size: int = Field(ge=0)
    sha256: str = Field(pattern=SHA256)


class FileEntry(BaseModel):
    """One file of a version."""

    name: str = Field(pattern=NAME_RE.pattern)
    size: int = Field(ge=0)  # bytes
    sha256: str = Field(pattern=SHA256)  # of the whole file
    # sha256 of each `block_size` block, computed by the store: a client pulling ranges of one
    # block each verifies every range as it arrives instead of re-reading the whole file
    block_size: int | None = None
    block_sha256: list[str] = []
    # committed as a delta of an earlier version's file; the file itself (name, size, sha256)
    # is the same either way, and only it counts in the content digest
    delta: DeltaRef | None = None

    def blocks(self) -> tuple[int, list[str]] | None:
        """(block_size, block hashes) when they cover the file, else None (a store without
        block hashes: the file is checked whole)."""
        if not self.block_size or len(self.block_sha256) != -(-self.size // self.block_size):
            return None
        return self.block_size, self.block_sha256


class Manifest(BaseModel):
    """A committed version: which model and version, its files, free metadata."""

    model: str = ""
    version: int = Field(0, ge=0)
    files: list[FileEntry] = Field(min_length=1)
    metadata: dict[str, str | int | float | bool | None] = {}
    # the store keeps every file of this version whole (set by the store at commit: a version
    # with no delta, or one in `full_every`); False: a file with a delta is kept as its delta
    # only, and made whole from the nearest full version when someone asks for it
    full: bool = True

    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    def entry(self, name: str) -> "FileEntry | None":
        return next((f for f in self.files if f.name == name), None)

    def delta_names(self) -> set[str]:
        return {f.delta.name for f in self.files if f.delta is not None}


class ManifestCommit(Manifest):
    """The body of a commit: the files uploaded and the metadata (the store sets the model and
    version from the path). Finite numbers only: JSON has no NaN or Infinity."""

    model_config = ConfigDict(allow_inf_nan=False)
    version: int = Field(0, ge=0, le=MAX_VERSION)
    reuse_version: int | None = Field(
        None,
        ge=0,
        le=MAX_VERSION,
        description="A listed file that was not uploaded is taken from this committed version "
        "of the model, where it has the same name, size and sha256 (a new version rarely "
        "changes the config or the tokenizer).",
    )
    reuse_content: bool = Field(
        False,
        strict=True,  # JSON's true or false, not 0 or "yes"
        description="A listed file neither uploaded nor taken from reuse_version is taken from "
        "any committed version of any model in the store with the same size and sha256: runs "
        "over the same base model store its files once (linked), kept while any version "
        "holds them. POST /v1/content/have says which files the store holds.",
    )


def delta_name(name: str) -> str:
    """The name a version's delta of file `name` is uploaded and served under."""
    return f"{name}.delta"


def content_digest(files: Iterable[tuple[str, int, str]]) -> str:
    """sha256 of the sorted (name, size, sha256) triples of a version's files."""
    triples = sorted((str(name), int(size), str(sha).lower()) for name, size, sha in files)
    return hashlib.sha256(json.dumps(triples, separators=(",", ":")).encode()).hexdigest()


def manifest_digest(manifest: Manifest) -> str:
    """Content digest of a manifest as the weight store serves it."""
    return content_digest((f.name, f.size, f.sha256) for f in manifest.files)


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


# most sha256s one content query names: its body stays within the store's 64 KiB per request
MAX_CONTENT_QUERY = 512


class ContentQuery(BaseModel):
    """Which of these file contents (sha256, hex) does the store hold committed?"""

    sha256: list[Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]] = Field(
        max_length=MAX_CONTENT_QUERY
    )


class ContentHeld(BaseModel):
    sha256: list[str]  # those of the query the store holds, in the query's order
