"""A delta applied to a file (services/weights/delta.py has the encoding): what a puller does
with the version it holds. The base is copied by the kernel (`copy_file`: no pass through
Python, and it can run while the delta is on its way), the changed values are written into the
copy through a memory map (`patch_file`), and the copy is
hashed once: the one full pass over the file that checking the result needs. Given the block
hashes the store computed for the file, its blocks are checked instead, on two threads at once
(as a pull in full checks them).
"""

import hashlib
import mmap
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from services.weights.delta import (
    DeltaError,
    DeltaHeader,
    parse,
    payload_of,
    read_header,
    scatter,
)

COPY_BYTES = 1 << 30  # the most one copy_file_range call is asked to move


def copy_file(src: Path, dst: Path) -> None:
    """`dst` with `src`'s bytes, copied inside the kernel where it can."""
    with open(src, "rb") as a, open(dst, "wb") as b:
        size = os.fstat(a.fileno()).st_size
        done = 0
        try:
            while done < size:
                moved = os.copy_file_range(a.fileno(), b.fileno(), COPY_BYTES)
                if moved == 0:
                    break
                done += moved
        except OSError:  # a file system without it: an ordinary copy
            a.seek(0)
            b.seek(0)
            b.truncate()
            while block := a.read(64 << 20):
                b.write(block)
            done = size
        if done != size:
            raise DeltaError(f"{src}: copied {done} of {size} bytes")


def patch_file(
    path: Path,
    delta: bytes,
    base_sha256: str,
    blocks: tuple[int, list[str]] | None = None,
) -> DeltaHeader:
    """Turn `path`, a copy of the file whose sha256 the caller checked (`base_sha256`), into
    the delta's target, in place; DeltaError, and `path` removed, when the delta is not of
    that base, is malformed, or does not make its target (its sha256, or with `blocks`, the
    block size and hashes of the target, each block's)."""
    view = memoryview(delta)
    try:
        header, frame_at = parse(view)
        if header["base_sha256"] != base_sha256:
            raise DeltaError("the file is not the delta's base (sha256)")
        if path.stat().st_size != header["target_size"]:
            raise DeltaError("the file is not the delta's base (another size)")
        index_bytes, listed = header["index_bytes"], header["tensors"]
        expected = sum(t["changed"] * (index_bytes + t["width"]) for t in listed)
        payload = payload_of(view[frame_at:], expected)
        with open(path, "r+b") as fh, mmap.mmap(fh.fileno(), 0) as mapped:
            scatter(mapped, listed, index_bytes, payload)  # type: ignore[arg-type]
            if not is_target(mapped, header["target_sha256"], blocks):
                raise DeltaError("the delta's result is not its target (sha256)")
    except BaseException:
        path.unlink(missing_ok=True)
        raise
    return read_header(view)


def is_target(data: mmap.mmap, sha256: str, blocks: tuple[int, list[str]] | None) -> bool:
    """Whether `data` hashes to `sha256`, or with `blocks` (size, hashes) to those blocks."""
    with memoryview(data) as view:
        if blocks is None:
            return hashlib.sha256(view).hexdigest() == sha256
        size, hashes = blocks
        if len(hashes) != -(-len(view) // size):
            return False
        with ThreadPoolExecutor(2) as pool:  # hashlib lets go of the GIL on big buffers
            made = pool.map(
                lambda i: hashlib.sha256(view[i * size : (i + 1) * size]).hexdigest(),
                range(len(hashes)),
            )
            return list(made) == hashes
