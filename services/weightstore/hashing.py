"""What the weight store computes over a file's bytes as they arrive: the sha256 of the whole
file and of each block (what pullers check each range against), kept beside the staged file
until the commit reads them.
"""

import hashlib
import json
from pathlib import Path

BLOCK_BYTES = 32 * 1024 * 1024  # default: a block is what a puller fetches and checks at once


class FileHasher:
    """sha256 of a stream and of each consecutive `block` bytes of it, in one pass while the
    stream fits in one block (most files do: then the two are the same hash)."""

    def __init__(self, block: int) -> None:
        self.block, self.size, self.filled = block, 0, 0
        self.current = hashlib.sha256()  # of the block being filled
        self.whole: hashlib._Hash | None = None  # of the stream, from its second block on
        self.done: list[str] = []

    def update(self, data: bytes | bytearray) -> None:
        view = memoryview(data)
        self.size += len(view)
        while view:
            if self.filled == self.block:  # a second block begins: hash the stream apart
                if self.whole is None:
                    self.whole = self.current.copy()
                self.done.append(self.current.hexdigest())
                self.current, self.filled = hashlib.sha256(), 0
            take = min(len(view), self.block - self.filled)
            self.current.update(view[:take])
            if self.whole is not None:
                self.whole.update(view[:take])
            self.filled += take
            view = view[take:]

    def finish(self) -> tuple[str, list[str]]:
        """The stream's sha256 and its blocks' (none for an empty stream)."""
        if self.filled:
            self.done.append(self.current.hexdigest())
        whole = self.whole if self.whole is not None else self.current
        return whole.hexdigest(), self.done


Hashes = tuple[str | None, list[str], int | None]  # sha256, block hashes, block size


def write_hashes(staging: Path, name: str, sha256: str, blocks: list[str], size: int) -> None:
    """Keep what the store computed over an uploaded file's bytes beside it, for the commit."""
    kept = {"sha256": sha256, "blocks": blocks, "block_size": size}
    (staging / f".{name}.hashes").write_text(json.dumps(kept))


def read_hashes(staging: Path, name: str) -> Hashes:
    """The sha256, block hashes and block size `write_hashes` kept; (None, [], None) where there
    are none."""
    try:
        kept = json.loads((staging / f".{name}.hashes").read_text())
    except (OSError, ValueError):
        return None, [], None
    return kept.get("sha256"), kept.get("blocks") or [], kept.get("block_size") or BLOCK_BYTES
