"""A delta applied to a file (services/weights/delta_file.py): `patch_file` turns a copy of the
base into the exact target, checked by its sha256 or by the store's block hashes, and refuses
(the file removed) whatever would not be the target; `copy_file` copies exactly, in the kernel
or, where the file system has no copy_file_range, by reading and writing."""

import errno
import hashlib
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import save

from services.weights import delta_file
from services.weights.delta import DeltaError, encode, read_header
from services.weights.delta_file import copy_file, patch_file
from services.weightstore.hashing import FileHasher

BLOCK = 2048  # the file below spans 11 blocks, the last one short


def versions() -> tuple[bytes, bytes]:
    """Two bf16 safetensors files of the same layout, 2% of the values of `w1` changed and
    `norm` unchanged."""
    g = torch.Generator().manual_seed(0)
    base = {
        "w1": torch.randn(100, 100, generator=g).to(torch.bfloat16),
        "w2": torch.randn(50, 3, generator=g).to(torch.bfloat16),
        "norm": torch.ones(77, dtype=torch.bfloat16),
    }
    target = {k: t.clone() for k, t in base.items()}
    flat = target["w1"].view(-1)
    picked = torch.rand(flat.numel(), generator=g) < 0.02
    flat[picked] = (flat[picked] * 2 + 1).to(torch.bfloat16)
    target["w2"][0, 0] += 1
    return save(base), save(target)


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def block_hashes(data: bytes) -> list[str]:
    hasher = FileHasher(BLOCK)
    hasher.update(data)
    whole, blocks = hasher.finish()
    assert whole == sha(data)
    return blocks


@pytest.fixture
def files() -> tuple[bytes, bytes, bytes]:
    base, target = versions()
    delta = encode(base, target)
    assert delta is not None and len(delta) < len(target) / 4
    assert len(target) % BLOCK and len(target) // BLOCK >= 8
    return base, target, delta


def copy_of(tmp_path: Path, data: bytes) -> Path:
    path = tmp_path / "model.safetensors.v1"
    path.write_bytes(data)
    return path


def test_patch_file_makes_the_exact_target(tmp_path, files):
    base, target, delta = files
    path = copy_of(tmp_path, base)
    header = patch_file(path, delta, sha(base))
    assert path.read_bytes() == target
    assert header == read_header(delta)
    assert header.target_sha256 == sha(target) and set(header.tensors) == {"w1", "w2"}


def test_patch_file_checked_by_blocks_makes_the_exact_target(tmp_path, files):
    base, target, delta = files
    path = copy_of(tmp_path, base)
    patch_file(path, delta, sha(base), (BLOCK, block_hashes(target)))
    assert path.read_bytes() == target


def refused(
    path: Path, delta: bytes, base_sha: str, blocks=None, match: str = "not its target"
) -> None:
    with pytest.raises(DeltaError, match=match):
        patch_file(path, delta, base_sha, blocks)
    assert not path.exists(), "a refused file stayed"


def test_a_wrong_base_sha256_is_refused(tmp_path, files):
    base, target, delta = files
    refused(copy_of(tmp_path, base), delta, sha(target), match="not the delta's base")


def test_a_file_of_another_size_is_refused(tmp_path, files):
    base, _, delta = files
    refused(copy_of(tmp_path, base + b"\0"), delta, sha(base), match="another size")
    refused(copy_of(tmp_path, base[:-2]), delta, sha(base), match="another size")


def test_a_corrupted_frame_is_refused(tmp_path, files):
    base, _, delta = files
    damaged = bytearray(delta)
    damaged[-20] ^= 0x40  # inside the zstd frame, which ends the delta
    refused(copy_of(tmp_path, base), bytes(damaged), sha(base), match="delta frame")


def test_other_bytes_than_the_base_are_refused_by_the_result(tmp_path, files):
    """The caller's sha256 is the base's, the file on disk is not the base (it rotted): the
    result is not the target, by its sha256 and by its blocks alike."""
    base, target, delta = files
    rotted = bytearray(base)
    rotted[len(base) // 2] ^= 0x01
    refused(copy_of(tmp_path, bytes(rotted)), delta, sha(base), match="not its target")
    blocks = (BLOCK, block_hashes(target))
    refused(copy_of(tmp_path, bytes(rotted)), delta, sha(base), blocks, "not its target")


def test_a_result_whose_blocks_do_not_match_is_refused(tmp_path, files):
    base, target, delta = files
    hashes = block_hashes(target)
    wrong = [*hashes[:3], sha(b"another block"), *hashes[4:]]
    refused(copy_of(tmp_path, base), delta, sha(base), (BLOCK, wrong), "not its target")
    refused(copy_of(tmp_path, base), delta, sha(base), (BLOCK, block_hashes(base)))
    # the target's hashes, but of blocks of another size
    refused(copy_of(tmp_path, base), delta, sha(base), (BLOCK * 2, block_hashes(target)))


def test_a_blocks_list_of_the_wrong_length_is_refused(tmp_path, files):
    base, target, delta = files
    hashes = block_hashes(target)
    refused(copy_of(tmp_path, base), delta, sha(base), (BLOCK, hashes[:-1]), "not its target")
    refused(copy_of(tmp_path, base), delta, sha(base), (BLOCK, [*hashes, hashes[-1]]))
    refused(copy_of(tmp_path, base), delta, sha(base), (BLOCK, []))


@pytest.mark.parametrize("size", [0, 1, 4095, 1 << 20])
def test_copy_file_copies_exactly(tmp_path, size):
    data = os.urandom(size)
    (tmp_path / "src").write_bytes(data)
    (tmp_path / "dst").write_bytes(b"older and longer" * 1000)  # replaced, not kept
    copy_file(tmp_path / "src", tmp_path / "dst")
    assert (tmp_path / "dst").read_bytes() == data


def test_copy_file_falls_back_where_copy_file_range_fails(tmp_path, monkeypatch):
    """A file system without copy_file_range: refused at once, or after moving part of the
    file (the copy starts again from the first byte)."""
    data = os.urandom(300_000)
    (tmp_path / "src").write_bytes(data)
    real = os.copy_file_range
    calls: list[int] = []

    def fails_at_once(src: int, dst: int, count: int, *args) -> int:
        calls.append(count)
        raise OSError(errno.EXDEV, "cross-device")

    monkeypatch.setattr(os, "copy_file_range", fails_at_once)
    copy_file(tmp_path / "src", tmp_path / "a")
    assert calls and (tmp_path / "a").read_bytes() == data

    def fails_the_second_time(src: int, dst: int, count: int, *args) -> int:
        calls.append(count)
        if len(calls) > 2:
            raise OSError(errno.EIO, "gone")
        return real(src, dst, count, *args)

    calls.clear()
    monkeypatch.setattr(os, "copy_file_range", fails_the_second_time)
    monkeypatch.setattr(delta_file, "COPY_BYTES", 100_000)
    copy_file(tmp_path / "src", tmp_path / "b")
    assert len(calls) == 3 and (tmp_path / "b").read_bytes() == data


def test_copy_file_without_a_source_raises_and_makes_nothing(tmp_path):
    with pytest.raises(FileNotFoundError):
        copy_file(tmp_path / "missing", tmp_path / "dst")
    assert not (tmp_path / "dst").exists()
