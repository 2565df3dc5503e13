"""The content digest of a weight version: stable, independent of file order, metadata and
block hashes, and the same whether computed from a local folder or from the store's manifest."""

import asyncio
import hashlib

import pytest

from services.weights.contract import Manifest, content_digest, manifest_digest
from services.weights.transfer import scan_folder
from services.weightstore.storage import StorageError, WeightStorage

A = ("a.safetensors", 5, hashlib.sha256(b"hello").hexdigest())
B = ("config.json", 2, hashlib.sha256(b"{}").hexdigest())


async def chunks(data: bytes):
    yield data


def test_digest_is_stable_and_order_independent():
    assert content_digest([A, B]) == content_digest([B, A]) == content_digest(iter([A, B]))
    # a known value: the sha256 of the canonical JSON of the sorted triples
    assert content_digest([A]) == hashlib.sha256(f'[["{A[0]}",5,"{A[2]}"]]'.encode()).hexdigest()
    assert content_digest([A, B]) == content_digest([(A[0], A[1], A[2].upper()), B])


def test_digest_changes_with_any_name_size_or_sha256():
    base = content_digest([A, B])
    assert content_digest([A]) != base
    assert content_digest([("b.safetensors", 5, A[2]), B]) != base
    assert content_digest([(A[0], 6, A[2]), B]) != base
    assert content_digest([(A[0], 5, "0" * 64), B]) != base


def test_manifest_digest_ignores_metadata_and_block_hashes_and_matches_the_folder(tmp_path):
    folder = tmp_path / "src"
    folder.mkdir()
    (folder / "a.safetensors").write_bytes(b"hello")
    (folder / "config.json").write_bytes(b"{}")
    store = WeightStorage(tmp_path / "store", keep=3)
    entries = [
        asyncio.run(store.write_file("m", 3, p.name, chunks(p.read_bytes()), None))
        for p in sorted(folder.iterdir())
    ]
    committed = store.commit("m", 3, Manifest(files=entries, metadata={"run_id": "x"}))
    served = committed.model_dump()
    assert served["files"][0]["block_sha256"]  # the store adds block hashes
    local = asyncio.run(scan_folder(folder))
    assert manifest_digest(Manifest(**served)) == local.digest == content_digest([A, B])
    served["metadata"] = {"run_id": "other"}
    served["files"][0]["block_sha256"] = ["0" * 64]
    assert manifest_digest(Manifest(**served)) == local.digest


def test_commit_refuses_a_file_whose_sha256_was_never_checked(tmp_path):
    store = WeightStorage(tmp_path, keep=3)
    entry = asyncio.run(store.write_file("m", 1, "a.bin", chunks(b"x"), None))
    (tmp_path / "m" / "staging" / "local" / "1" / ".a.bin.hashes").unlink()
    with pytest.raises(StorageError, match="sha256 differs"):
        store.commit("m", 1, Manifest(files=[entry]))
    assert store.versions("m") == []
