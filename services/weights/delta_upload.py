"""The deltas an upload sends: each safetensors file of a new version that changed since the
version the client uploaded before, encoded as a sparse delta of that version's file
(services/weights/delta.py), where the delta is small enough to pay.

The content digest and the manifest still name the whole files: the store makes each whole
from its delta and checks it before the commit, and a puller checks what it makes the same.
"""

from dataclasses import dataclass
from pathlib import Path

from services.weights.contract import NAME_RE, DeltaRef, FileEntry, delta_name
from services.weights.delta import encode
from services.weights.files import VersionFiles, hash_files_now

DELTA_PAYS = 0.5  # a file goes as a delta only when the delta is at most this share of it


@dataclass
class Deltas:
    """The deltas of one version against the version `base` (by the name of the file each
    makes), as files to upload (by their own names)."""

    base: int
    files: VersionFiles
    of: dict[str, str]  # file name -> its delta's name

    def entry(self, name: str, uploaded: FileEntry, size: int, sha256: str) -> FileEntry:
        """The manifest entry of file `name` sent as its delta, which the store took as
        `uploaded`."""
        ref = DeltaRef(
            base=self.base, name=uploaded.name, size=uploaded.size, sha256=uploaded.sha256
        )
        return FileEntry(name=name, size=size, sha256=sha256, delta=ref)


def _read(content: bytes | Path) -> bytes:
    return content if isinstance(content, bytes) else content.read_bytes()


def make_deltas(previous: VersionFiles, base: int, local: VersionFiles) -> Deltas | None:
    """The deltas that turn `previous` (version `base`) into `local`, for the files that
    changed and have one that pays; None where none does. Blocking (seconds for big files)."""
    made: dict[str, bytes] = {}
    of: dict[str, str] = {}
    for name, content in local.content.items():
        old = previous.content.get(name)
        if old is None or previous.sha256[name] == local.sha256[name]:
            continue  # new, or unchanged: sent whole, or taken from the version before
        if not name.endswith(".safetensors") or not NAME_RE.match(delta_name(name)):
            continue
        new = _read(content)
        delta = encode(_read(old), new, shas=(previous.sha256[name], local.sha256[name]))
        if delta is not None and len(delta) <= DELTA_PAYS * len(new):
            made[delta_name(name)], of[name] = delta, delta_name(name)
    if not made:
        return None
    return Deltas(base, hash_files_now(made), of)
