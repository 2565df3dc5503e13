"""The sparse weight delta (services/weights/delta.py): bit-exact round trips over real
safetensors files, None for what a delta cannot say, and a refusal for every delta that would
not make its target."""

import hashlib
import json
import struct

import numpy as np
import pytest
import torch
import zstandard
from safetensors.torch import save

from services.weights.contract import WeightTransferError
from services.weights.delta import (
    MAGIC,
    DeltaError,
    apply,
    changed_fraction,
    encode,
    read_header,
    tensor_changes,
)


def tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "a.bf16": torch.randn(64, 48, generator=g).to(torch.bfloat16),
        "b.fp32": torch.randn(300, generator=g),
        "c.int64": torch.randint(-(2**40), 2**40, (7, 9), generator=g),
        "d.int8": torch.randint(-128, 127, (50,), generator=g, dtype=torch.int8),
        "e.bool": torch.rand(33, generator=g) > 0.5,
        "f.fp16": torch.randn(5, 6, generator=g).to(torch.float16),
        "same": torch.randn(40, generator=g),
        "empty": torch.zeros(0, 4),
        "scalar": torch.tensor(2.5),
    }


def changed_copy(base: dict[str, torch.Tensor], share: float, seed: int = 1) -> dict:
    """`base` with about `share` of the elements of each tensor but "same" changed."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in base.items():
        t = t.clone()
        if name != "same" and t.numel():
            flat = t.view(-1)
            picked = torch.rand(flat.numel(), generator=g) < share
            picked[0] = True  # at least one
            flat[picked] = (
                (flat[picked] + 1).to(t.dtype) if t.dtype != torch.bool else ~flat[picked]
            )
        out[name] = t
    return out


def file_of(ts: dict[str, torch.Tensor]) -> bytes:
    return save(ts, metadata={"format": "pt"})


def test_round_trip_mixed_dtypes_is_bit_exact():
    base = tensors()
    new = changed_copy(base, 0.1)
    old_b, new_b = file_of(base), file_of(new)
    delta = encode(old_b, new_b)
    assert delta is not None and delta.startswith(MAGIC)
    assert apply(old_b, delta) == new_b
    assert apply(memoryview(old_b), memoryview(delta)) == new_b
    header = read_header(delta)
    assert header.base_sha256 == hashlib.sha256(old_b).hexdigest()
    assert header.target_sha256 == hashlib.sha256(new_b).hexdigest()
    assert header.target_size == len(new_b)
    assert set(header.tensors) == set(base) - {"same", "empty"}
    assert header.tensors["scalar"] == 1
    assert header.elements == sum(t.numel() for t in base.values())
    assert header.changed == sum(header.tensors.values())
    assert (header.changed, header.elements) == changed_fraction(old_b, new_b)
    expected = sum(
        int((base[k].view(-1) != new[k].view(-1)).sum()) for k in base if base[k].numel()
    )
    assert header.changed == expected
    per_tensor = tensor_changes(old_b, new_b)
    assert per_tensor["same"] == (0, 40) and per_tensor["empty"] == (0, 0)
    assert {k: c for k, (c, _) in per_tensor.items() if c} == header.tensors


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int32])
def test_round_trip_single_dtype(dtype):
    g = torch.Generator().manual_seed(3)
    base = {"w": (torch.randn(128, 40, generator=g) * 100).to(dtype), "v": torch.ones(3, 3)}
    new = {"w": base["w"].clone(), "v": base["v"]}
    new["w"][5, 7] += 1
    new["w"][127, 39] += 1
    delta = encode(file_of(base), file_of(new))
    assert delta is not None
    assert apply(file_of(base), delta) == file_of(new)
    assert read_header(delta).tensors == {"w": 2}


def test_nan_payloads_and_negative_zero_are_exact():
    bits = torch.tensor([0x7FC00000, 0x7FC00001, 0x00000000, 0x3F800000], dtype=torch.int32)
    base = {"x": bits.view(torch.float32).clone()}
    new_bits = torch.tensor([0x7FC00002, 0x7FC00001, -(2**31), 0x3F800000], dtype=torch.int32)
    new = {"x": new_bits.view(torch.float32).clone()}  # other NaN payload, -0.0 for +0.0
    old_b, new_b = file_of(base), file_of(new)
    assert changed_fraction(old_b, new_b) == (2, 4)  # NaN != NaN and 0 == -0 do not fool it
    delta = encode(old_b, new_b)
    assert delta is not None and apply(old_b, delta) == new_b


def test_identical_files_make_a_tiny_delta_that_applies():
    data = file_of(tensors())
    delta = encode(data, data)
    assert delta is not None and len(delta) < 300
    assert read_header(delta).changed == 0 and read_header(delta).tensors == {}
    assert apply(data, delta) == data


def test_no_delta_between_other_layouts_or_non_safetensors():
    base = tensors()
    data = file_of(base)
    other_shape = dict(base, same=torch.randn(41))
    other_dtype = dict(base, same=base["same"].to(torch.float64))
    renamed = {("z" if k == "same" else k): v for k, v in base.items()}
    for other in (other_shape, other_dtype, renamed):
        assert encode(data, file_of(other)) is None
        with pytest.raises(ValueError):
            changed_fraction(data, file_of(other))
    assert encode(data, data + b"x") is None
    assert encode(b"not a safetensors file", b"not a safetensors file") is None
    assert encode(b"", b"") is None
    assert encode(data, b"\x00" * len(data)) is None


def pair() -> tuple[bytes, bytes, bytes]:
    base = tensors()
    old_b, new_b = file_of(base), file_of(changed_copy(base, 0.2))
    delta = encode(old_b, new_b)
    assert delta is not None
    return old_b, new_b, delta


def test_refuses_a_file_that_is_not_its_base():
    old_b, new_b, delta = pair()
    assert issubclass(DeltaError, WeightTransferError)
    with pytest.raises(DeltaError, match="base"):
        apply(new_b, delta)
    with pytest.raises(DeltaError, match="base"):
        apply(old_b[:-1] + bytes([old_b[-1] ^ 1]), delta)


def test_refuses_truncated_and_corrupt_deltas():
    old_b, _, delta = pair()
    (n,) = struct.unpack_from("<I", delta, len(MAGIC))
    frame_at = len(MAGIC) + 4 + n
    for cut in (1, 10, frame_at - 1):
        with pytest.raises(DeltaError):
            read_header(delta[:cut])
    for cut in (1, 10, frame_at - 1, frame_at, frame_at + 5, len(delta) - 8, len(delta) - 1):
        with pytest.raises(DeltaError):
            apply(old_b, delta[:cut])
    with pytest.raises(DeltaError):
        apply(old_b, delta + b"\x00")  # bytes after the frame
    for at in (frame_at + 20, (frame_at + len(delta)) // 2, len(delta) - 2):
        flipped = bytearray(delta)
        flipped[at] ^= 0x10
        with pytest.raises(DeltaError):
            apply(old_b, bytes(flipped))
    with pytest.raises(DeltaError, match="magic"):
        read_header(b"SPOTDLT2" + delta[8:])


def hand_built(header: dict, payload: bytes) -> bytes:
    head = json.dumps(header).encode()
    frame = zstandard.ZstdCompressor(write_checksum=True).compress(payload)
    return MAGIC + struct.pack("<I", len(head)) + head + frame


def test_refuses_an_index_out_of_its_tensor_and_a_wrong_target():
    base = {"w": torch.zeros(10, dtype=torch.float32), "v": torch.zeros(4, dtype=torch.float32)}
    old_b = file_of(base)
    start = 8 + struct.unpack_from("<Q", old_b)[0]
    w_at = start + json.loads(old_b[8:start])["w"]["data_offsets"][0]
    new = dict(base, w=base["w"].clone())
    new["w"][9] = 1.0
    header = {
        "format": 1,
        "base_sha256": hashlib.sha256(old_b).hexdigest(),
        "target_sha256": hashlib.sha256(file_of(new)).hexdigest(),
        "target_size": len(old_b),
        "elements": 14,
        "index_bytes": 4,
        "tensors": [{"name": "w", "start": w_at, "end": w_at + 40, "width": 4, "changed": 1}],
    }
    one = struct.pack("<f", 1.0)
    assert apply(old_b, hand_built(header, struct.pack("<I", 9) + one)) == file_of(new)
    with pytest.raises(DeltaError, match="out of tensor"):
        apply(old_b, hand_built(header, struct.pack("<I", 10) + one))  # into "v"
    wrapped = dict(header, tensors=[dict(header["tensors"][0], changed=2)])
    with pytest.raises(DeltaError, match="out of tensor"):  # 5 + (2**32 - 1) wraps in u32
        apply(old_b, hand_built(wrapped, struct.pack("<II", 5, 2**32 - 1) + one + one))
    with pytest.raises(DeltaError, match="target"):
        apply(old_b, hand_built(header, struct.pack("<I", 8) + one))
    outside = dict(header, tensors=[dict(header["tensors"][0], end=len(old_b) + 4)])
    with pytest.raises(DeltaError, match="malformed"):
        apply(old_b, hand_built(outside, struct.pack("<I", 9) + one))
    with pytest.raises(DeltaError, match="declares"):
        apply(old_b, hand_built(header, struct.pack("<I", 9) + one + b"\x00"))


def test_gaps_compress_well():
    w = np.random.default_rng(0).standard_normal(200_000).astype(np.float32)
    base = {"w": torch.from_numpy(w).to(torch.bfloat16)}
    new = {"w": base["w"].clone()}
    new["w"][::50] += 1  # 2%, evenly spaced: the gaps are all equal
    delta = encode(file_of(base), file_of(new))
    assert delta is not None
    assert len(delta) < 4000 * 2 + 1000  # ~ the values alone; the 16 kB of gaps nearly vanish
    assert apply(file_of(base), delta) == file_of(new)
