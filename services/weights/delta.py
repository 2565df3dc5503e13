"""A version's safetensors file as a sparse, verified delta of the one before: at RL learning
rates most bf16 values do not change between consecutive versions (the update is below the
rounding step), so a version travels as the positions and new values of the elements that did.
Pure functions on bytes; the store and its client decide when to send a delta and what to do
when one is refused (send the file whole).

The delta encoding (format 1):

- A safetensors file is an 8-byte little-endian header length N, N bytes of JSON header
  (tensor name -> {"dtype", "shape", "data_offsets": [begin, end]} relative to the data buffer,
  optional "__metadata__"), then the data buffer. Two files share a layout when they have the
  same length and the same first 8 + N bytes; then only the data region differs, and only
  such a pair has a delta (`encode` answers None otherwise, and the file is sent whole).
- Each tensor is compared element-wise as little-endian unsigned integers of its dtype's width
  (BF16/F16/I16/U16: 2 bytes; F32/I32/U32: 4; F64/I64/U64: 8; anything else, BOOL, U8, I8,
  F8_* included: 1): bitwise, so NaN payloads and -0.0 are exact.
- A delta is `SPOTDLT1` (8 bytes), a u32 little-endian length L, L bytes of JSON header, then
  ONE zstd frame (with its content size and checksum) and nothing after it. The JSON header is
  {"format": 1, "base_sha256": sha256 hex of the file the delta applies to, "target_sha256":
  of the file it makes, "target_size": its length in bytes, "elements": elements of all the
  file's tensors, "index_bytes": 4, or 8 when some tensor has >= 2**32 elements, "tensors":
  [{"name", "start", "end": absolute byte offsets of the tensor's data in the file, "width":
  bytes per element, "changed": elements changed}, ...]}, listing only the tensors with a
  change, in the order of their data in the file.
- The frame decompresses to, per listed tensor in the header's order: `changed` positions as
  gaps (the first is the first changed index, each next one the difference to the previous
  index), little-endian unsigned ints of `index_bytes`; then the `changed` new values, `changed`
  x `width` bytes. Its length is therefore sum(changed x (index_bytes + width)).
- To apply: check sha256(base) == base_sha256, copy the base, write each tensor's values at
  the cumulative sums of its gaps (element indices in [0, (end - start) / width)), check
  sha256(result) == target_sha256.

`apply` never returns bytes that are not the target: a wrong base, a malformed, truncated or
corrupt delta, an index out of its tensor and a result of another sha256 are `DeltaError`s.
"""

import hashlib
import json
import struct
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import zstandard

from services.weights.contract import WeightTransferError

MAGIC = b"SPOTDLT1"
FORMAT = 1
MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit on its JSON header
_WIDTHS = {"BF16": 2, "F16": 2, "I16": 2, "U16": 2, "F32": 4, "I32": 4, "U32": 4}
_WIDTHS |= {"F64": 8, "I64": 8, "U64": 8}
_UINTS: dict[int, np.dtype] = {w: np.dtype(f"<u{w}") for w in (1, 2, 4, 8)}
_SHA_RE_LEN = 64


class DeltaError(WeightTransferError):
    """A delta that is malformed, or whose base or result is not the one it names."""


@dataclass(frozen=True)
class DeltaHeader:
    base_sha256: str  # sha256 of the file the delta applies to
    target_sha256: str  # sha256 of the file it makes
    target_size: int  # bytes
    tensors: dict[str, int]  # tensor name -> elements changed (only tensors with changes)
    changed: int  # elements changed, all tensors
    elements: int  # elements in the file, all tensors


@dataclass(frozen=True)
class _Tensor:
    name: str
    start: int  # absolute byte offset of its data in the file
    end: int
    width: int  # bytes per element

    @property
    def elements(self) -> int:
        return (self.end - self.start) // self.width

    def view(self, buf: memoryview | bytearray) -> np.ndarray:
        dtype = _UINTS[self.width]
        return np.frombuffer(buf, dtype, self.elements, self.start)


def _layout(buf: memoryview) -> tuple[int, list[_Tensor]] | None:
    """(8 + N, the tensors in data order) of a safetensors file; None when it is not one (a
    header that does not parse, offsets outside the file, a size not a whole of elements)."""
    if len(buf) < 8:
        return None
    (n,) = struct.unpack_from("<Q", buf)
    if n > min(MAX_HEADER_BYTES, len(buf) - 8):
        return None
    try:
        header = json.loads(bytes(buf[8 : 8 + n]))
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
    if not isinstance(header, dict):
        return None
    tensors = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            begin, end = (int(x) for x in info["data_offsets"])
            width = _WIDTHS.get(str(info["dtype"]), 1)
        except (TypeError, KeyError, ValueError):
            return None
        start, end = 8 + n + begin, 8 + n + end
        if not 8 + n <= start <= end <= len(buf) or (end - start) % width:
            return None
        tensors.append(_Tensor(name, start, end, width))
    return 8 + n, sorted(tensors, key=lambda t: t.start)


def _sha256(buf: memoryview | bytearray) -> str:
    return hashlib.sha256(buf).hexdigest()


def _done(value: str) -> Future[str]:
    known: Future[str] = Future()  # holds a hash the caller knew
    known.set_result(value)
    return known


def _bytes(data: bytes | bytearray | memoryview) -> memoryview:
    view = memoryview(data)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def _shared_layout(old: memoryview, new: memoryview) -> list[_Tensor] | None:
    """The tensors of two files of one layout whose bytes outside the tensors are equal (only
    tensor data can travel in a delta); else None."""
    layout = _layout(old)
    if layout is None or len(old) != len(new):
        return None
    head, tensors = layout
    if old[:head] != new[:head]:
        return None
    pos = head  # bytes between and after the tensors, if any, must not differ
    for t in tensors:
        if t.start > pos and old[pos : t.start] != new[pos : t.start]:
            return None
        pos = max(pos, t.end)
    if old[pos:] != new[pos:]:
        return None
    return tensors


def _changes(
    tensors: list[_Tensor], old: memoryview, new: memoryview
) -> Iterator[tuple[_Tensor, np.ndarray]]:
    """(tensor, changed indices) of each tensor, in data order."""
    for t in tensors:
        yield t, np.flatnonzero(t.view(old) != t.view(new))


def tensor_changes(
    old: bytes | bytearray | memoryview, new: bytes | bytearray | memoryview
) -> dict[str, tuple[int, int]]:
    """Tensor name -> (elements changed, elements) between two safetensors files of one
    layout, every tensor; ValueError when their layouts differ."""
    a, b = _bytes(old), _bytes(new)
    tensors = _shared_layout(a, b)
    if tensors is None:
        raise ValueError("not two safetensors files of the same layout")
    return {t.name: (int(np.count_nonzero(t.view(a) != t.view(b))), t.elements) for t in tensors}


def changed_fraction(
    old: bytes | bytearray | memoryview, new: bytes | bytearray | memoryview
) -> tuple[int, int]:
    """(elements changed, elements) between two safetensors files of one layout, for
    measurements; ValueError when their layouts differ."""
    counts = tensor_changes(old, new).values()
    return sum(c for c, _ in counts), sum(n for _, n in counts)


def encode(
    old: bytes | bytearray | memoryview,
    new: bytes | bytearray | memoryview,
    level: int = 3,
    shas: tuple[str, str] | None = None,
) -> bytes | None:
    """The delta that turns safetensors file `old` into `new`; None when either is not a
    safetensors file or their headers differ (other names, dtypes, shapes or offsets: a delta
    cannot say that; send the file whole). `shas`: the sha256 of `old` and `new` where the
    caller has them already (they are not computed again)."""
    a, b = _bytes(old), _bytes(new)
    tensors = _shared_layout(a, b)
    if tensors is None:
        return None
    index_bytes = 8 if any(t.elements >= 2**32 for t in tensors) else 4
    index_dtype = _UINTS[index_bytes]
    listed, pieces = [], []
    # hashlib and numpy's comparisons release the GIL: the two hashes overlap the comparing
    with ThreadPoolExecutor(2) as pool:
        if shas is None:
            base_sha, target_sha = pool.submit(_sha256, a), pool.submit(_sha256, b)
        else:
            base_sha, target_sha = _done(shas[0]), _done(shas[1])
        for t, idx in _changes(tensors, a, b):
            if not len(idx):
                continue
            gaps = np.empty(len(idx), index_dtype)
            gaps[0] = idx[0]
            np.subtract(idx[1:], idx[:-1], out=gaps[1:], casting="unsafe")
            pieces += [gaps, t.view(b)[idx]]
            listed.append(
                {"name": t.name, "start": t.start, "end": t.end, "width": t.width}
                | {"changed": len(idx)}
            )
    size = sum(p.nbytes for p in pieces)
    compressor = zstandard.ZstdCompressor(level=level, write_checksum=True)
    stream = compressor.compressobj(size=size)
    frame = [stream.compress(p.data) for p in pieces]
    frame.append(stream.flush())
    header = {
        "format": FORMAT,
        "base_sha256": base_sha.result(),
        "target_sha256": target_sha.result(),
        "target_size": len(b),
        "elements": sum(t.elements for t in tensors),
        "index_bytes": index_bytes,
        "tensors": listed,
    }
    head = json.dumps(header, separators=(",", ":")).encode()
    return b"".join([MAGIC, struct.pack("<I", len(head)), head, *frame])


def parse(delta: memoryview) -> tuple[dict, int]:
    """The delta's JSON header, checked, and the offset of its frame."""
    if len(delta) < len(MAGIC) + 4 or delta[: len(MAGIC)] != MAGIC:
        raise DeltaError("not a weight delta (no SPOTDLT1 magic)")
    (n,) = struct.unpack_from("<I", delta, len(MAGIC))
    body = len(MAGIC) + 4
    if n > len(delta) - body:
        raise DeltaError("truncated weight delta header")
    try:
        header = json.loads(bytes(delta[body : body + n]))
        _check(header)
    except (UnicodeDecodeError, json.JSONDecodeError, TypeError, KeyError, ValueError) as e:
        raise DeltaError(f"malformed weight delta header: {e}") from e
    return header, body + n


def _check(header: dict) -> None:
    """ValueError (or KeyError, TypeError) unless the header is well formed and each tensor
    lies in the target."""
    if header["format"] != FORMAT:
        raise ValueError(f"format {header['format']!r}, not {FORMAT}")
    for key in ("base_sha256", "target_sha256"):
        if not isinstance(header[key], str) or len(header[key]) != _SHA_RE_LEN:
            raise ValueError(f"{key} is not a sha256")
    size, elements = header["target_size"], header["elements"]
    if not all(type(x) is int and x >= 0 for x in (size, elements)):
        raise ValueError("target_size and elements are counts")
    if header["index_bytes"] not in (4, 8):
        raise ValueError("index_bytes is 4 or 8")
    for t in header["tensors"]:
        start, end, width, changed = t["start"], t["end"], t["width"], t["changed"]
        if not isinstance(t["name"], str) or width not in _UINTS:
            raise ValueError("a tensor has no name or an unknown width")
        if not all(type(x) is int for x in (start, end, changed)):
            raise ValueError("tensor offsets and counts are integers")
        if not 0 <= start <= end <= size or (end - start) % width:
            raise ValueError(f"tensor {t['name']!r} lies outside the target")
        if not 0 < changed <= (end - start) // width:
            raise ValueError(f"tensor {t['name']!r} changes more elements than it has")


def read_header(delta: bytes | bytearray | memoryview) -> DeltaHeader:
    """What a delta says it is; DeltaError when malformed."""
    header, _ = parse(_bytes(delta))
    tensors = {t["name"]: t["changed"] for t in header["tensors"]}
    return DeltaHeader(
        base_sha256=header["base_sha256"],
        target_sha256=header["target_sha256"],
        target_size=header["target_size"],
        tensors=tensors,
        changed=sum(tensors.values()),
        elements=header["elements"],
    )


def payload_of(frame: memoryview, expected: int) -> bytes:
    """The decompressed frame, exactly `expected` bytes long. The frame must declare that size
    (ours always do), so a hostile delta cannot make it allocate more: zstd refuses content
    longer than the frame declares."""
    try:
        claimed = zstandard.frame_content_size(frame)
        if claimed != expected:
            raise DeltaError(f"delta frame declares {claimed} bytes, its header says {expected}")
        stream = zstandard.ZstdDecompressor().decompressobj()
        payload = stream.decompress(frame)
    except zstandard.ZstdError as e:
        raise DeltaError(f"corrupt delta frame: {e}") from e
    if not stream.eof or stream.unused_data:
        raise DeltaError("truncated delta frame, or bytes after it")
    if len(payload) != expected:
        raise DeltaError(f"delta frame holds {len(payload)} bytes, its header says {expected}")
    return payload


def apply(
    old: bytes | bytearray | memoryview,
    delta: bytes | bytearray | memoryview,
    base_sha256: str | None = None,
) -> bytearray:
    """`new`, made from `old` and the delta; DeltaError when `old` is not the delta's base
    (sha256), the delta is malformed, truncated or corrupt, or the result's sha256 is not the
    delta's target. Never returns bytes that are not the target. `base_sha256`: the sha256 of
    `old` where the caller knows it (a file it checked before): compared with the delta's base
    instead of hashing `old` again."""
    base, d = _bytes(old), _bytes(delta)
    header, frame_at = parse(d)
    if len(base) != header["target_size"]:
        raise DeltaError("the file is not the delta's base (another size)")
    index_bytes = header["index_bytes"]
    listed = header["tensors"]
    expected = sum(t["changed"] * (index_bytes + t["width"]) for t in listed)
    with ThreadPoolExecutor(1) as pool:  # the base's hash overlaps the copy and the scatter
        base_sha = pool.submit(_sha256, base) if base_sha256 is None else _done(base_sha256)
        payload = payload_of(d[frame_at:], expected)
        out = bytearray(base)
        scatter(out, listed, index_bytes, payload)
        if base_sha.result() != header["base_sha256"]:
            raise DeltaError("the file is not the delta's base (sha256)")
        if _sha256(out) != header["target_sha256"]:
            raise DeltaError("the delta's result is not its target (sha256)")
    return out


def scatter(out: bytearray, listed: list[dict], index_bytes: int, payload: bytes) -> None:
    """Write each listed tensor's new values at the cumulative sums of its gaps."""
    pos = 0
    for t in listed:
        tensor = _Tensor(t["name"], t["start"], t["end"], t["width"])
        changed = t["changed"]
        gaps = np.frombuffer(payload, _UINTS[index_bytes], changed, pos)
        pos += changed * index_bytes
        values = np.frombuffer(payload, _UINTS[tensor.width], changed, pos)
        pos += changed * tensor.width
        idx = np.cumsum(gaps, dtype=np.uint64)
        # unsigned: a wrapped sum is huge, so the largest index bounds them all
        if int(idx.max()) >= tensor.elements:
            raise DeltaError(f"delta index out of tensor {tensor.name!r}")
        tensor.view(out)[idx.astype(np.intp)] = values
