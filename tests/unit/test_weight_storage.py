import asyncio
import hashlib
import os
import time

import pytest

from services.weights.contract import Manifest
from services.weightstore.storage import Conflict, NotFound, StorageError, WeightStorage


async def chunks(data: bytes):
    for i in range(0, len(data), 3):
        yield data[i : i + 3]


def put(store, model, version, name, data, sha=None):
    return asyncio.run(store.write_file(model, version, name, chunks(data), sha))


def manifest(*entries):
    return Manifest(files=[e.model_dump() for e in entries])


def test_version_is_invisible_until_committed(tmp_path):
    store = WeightStorage(tmp_path, keep=3)
    entry = put(store, "m", 1, "a.safetensors", b"hello")
    assert entry.sha256 == hashlib.sha256(b"hello").hexdigest() and entry.size == 5
    assert store.versions("m") == []
    with pytest.raises(NotFound):
        store.latest("m")
    store.commit("m", 1, manifest(entry))
    assert store.versions("m") == [1]
    assert store.file_path("m", 1, "a.safetensors").read_bytes() == b"hello"


def test_commit_refuses_missing_or_mismatched_files_and_changes_nothing(tmp_path):
    store = WeightStorage(tmp_path, keep=3)
    entry = put(store, "m", 1, "a.bin", b"hello")
    missing = entry.model_copy(update={"name": "b.bin"})
    with pytest.raises(StorageError, match="b.bin: not uploaded"):
        store.commit("m", 1, manifest(entry, missing))
    wrong = entry.model_copy(update={"sha256": "0" * 64})
    with pytest.raises(StorageError, match="sha256 differs"):
        store.commit("m", 1, manifest(wrong))
    assert store.versions("m") == []
    store.commit("m", 1, manifest(entry))


def test_committed_version_is_immutable(tmp_path):
    store = WeightStorage(tmp_path, keep=3)
    entry = put(store, "m", 1, "a.bin", b"x")
    store.commit("m", 1, manifest(entry))
    with pytest.raises(Conflict):
        put(store, "m", 1, "a.bin", b"y")
    with pytest.raises(Conflict):
        store.commit("m", 1, manifest(entry))


def test_upload_checksum_mismatch_is_refused(tmp_path):
    store = WeightStorage(tmp_path, keep=3)
    with pytest.raises(StorageError, match="sha256"):
        put(store, "m", 1, "a.bin", b"x", sha="0" * 64)
    assert not list((tmp_path / "m" / "staging" / "local" / "1").glob("a.bin"))


def test_retention_keeps_newest_versions(tmp_path):
    store = WeightStorage(tmp_path, keep=2)
    for v in range(4):
        store.commit("m", v, manifest(put(store, "m", v, "w.bin", bytes([v]))))
    assert store.versions("m") == [2, 3]
    assert store.latest("m").version == 3


@pytest.mark.parametrize("name", ["../x", "a/b", ".hidden", "manifest.json", ""])
def test_bad_names_are_refused(tmp_path, name):
    store = WeightStorage(tmp_path, keep=2)
    with pytest.raises(StorageError):
        put(store, "m", 1, name, b"x")


def test_replicas_on_one_volume_keep_their_own_staging(tmp_path):
    a = WeightStorage(tmp_path, keep=3, replica="a")
    b = WeightStorage(tmp_path, keep=3, replica="b")
    entry = put(a, "m", 1, "w.bin", b"x")
    put(b, "m", 2, "w.bin", b"y")
    assert b.discard_staging("m", 3600, time.time(), own=True) == ["b"]  # b restarted
    a.commit("m", 1, manifest(entry))  # a's upload in flight survived it
    assert b.versions("m") == [1]  # visible through every replica
    with pytest.raises(Conflict):
        b.commit("m", 1, manifest(entry))


def test_staging_of_a_replica_gone_is_discarded_once_stale(tmp_path):
    """A replica recreated under a new name leaves its cut-off upload behind: whichever replica
    starts or commits next removes it once untouched for the limit, never one in use."""
    gone = WeightStorage(tmp_path, keep=3, replica="gone-1")
    alive = WeightStorage(tmp_path, keep=3, replica="alive-2")
    put(gone, "m", 1, "w.bin", b"x")
    entry = put(alive, "m", 2, "w.bin", b"y")
    now = time.time()
    assert alive.discard_staging("m", 3600, now) == []  # both fresh: kept, alive's own too
    assert alive.discard_staging("m", 3600, now + 3601) == ["alive-2", "gone-1"]
    put(alive, "m", 2, "w.bin", b"y")
    old = now - 7200
    for path in (tmp_path / "m" / "staging").rglob("*"):
        os.utime(path, (old, old))
    put(gone, "m", 3, "w.bin", b"z")  # an upload just written to: fresh again
    assert alive.discard_staging("m", 3600, now) == ["alive-2"]
    assert (tmp_path / "m" / "staging" / "gone-1" / "3").is_dir()
    put(alive, "m", 2, "w.bin", b"y")
    alive.commit("m", 2, manifest(entry))


@pytest.mark.parametrize("size", [0, 1, 999, 1000, 1001, 2000, 2560])
@pytest.mark.parametrize("piece", [1, 77, 1000, 4096])
def test_the_file_and_block_hashes_are_those_of_the_bytes(size, piece):
    """One pass while the file fits a block; the whole-file hash apart from the second block."""
    from services.weightstore.hashing import FileHasher

    data = (bytes(range(256)) * 11)[:size]
    hasher = FileHasher(1000)
    for i in range(0, len(data), piece):
        hasher.update(data[i : i + piece])
    expected = [hashlib.sha256(data[i : i + 1000]).hexdigest() for i in range(0, len(data), 1000)]
    assert hasher.finish() == (hashlib.sha256(data).hexdigest(), expected)
    assert hasher.size == size


def test_a_commit_takes_unchanged_files_from_the_version_it_names(tmp_path):
    """A new version rarely changes the config: the client sends the weights alone and names
    the version to take the rest from. Only a file with the same name, size and sha256 is
    taken; any other stays missing and the commit says so."""
    store = WeightStorage(tmp_path, keep=3)
    config = put(store, "m", 1, "config.json", b'{"a": 1}')
    weights = put(store, "m", 1, "w.bin", b"one" * 1000)
    store.commit("m", 1, manifest(config, weights))
    new_weights = put(store, "m", 2, "w.bin", b"two" * 1000)
    listed = config.model_copy(update={"block_size": None, "block_sha256": []})
    committed = store.commit("m", 2, manifest(listed, new_weights), reuse_version=1)
    assert store.file_path("m", 2, "config.json").read_bytes() == b'{"a": 1}'
    assert committed.files[0].block_sha256 == config.block_sha256  # as if uploaded
    other = listed.model_copy(update={"sha256": hashlib.sha256(b"{}").hexdigest(), "size": 2})
    with pytest.raises(StorageError, match="config.json: not uploaded"):
        store.commit("m", 3, manifest(other, put(store, "m", 3, "w.bin", b"three")), 2)
    with pytest.raises(StorageError, match="not uploaded"):  # no such version to take from
        store.commit("m", 3, manifest(listed, put(store, "m", 3, "w.bin", b"three")), 7)
    assert store.versions("m") == [1, 2]


def test_a_commit_refused_after_taking_files_can_be_made_again(tmp_path):
    """The files a refused commit took from the earlier version stay in staging with no hashes
    of their own: the next commit takes them again, with that version's hashes."""
    store = WeightStorage(tmp_path, keep=3)
    config = put(store, "m", 1, "config.json", b'{"a": 1}')
    store.commit("m", 1, manifest(config, put(store, "m", 1, "w.bin", b"one" * 1000)))
    listed = config.model_copy(update={"block_size": None, "block_sha256": []})
    weights = put(store, "m", 2, "w.bin", b"two" * 1000)
    missing = weights.model_copy(update={"name": "extra.bin"})
    with pytest.raises(StorageError, match="extra.bin: not uploaded"):
        store.commit("m", 2, manifest(listed, weights, missing), reuse_version=1)
    committed = store.commit("m", 2, manifest(listed, weights), reuse_version=1)
    assert committed.files[0].sha256 == config.sha256
    assert committed.files[0].block_sha256 == config.block_sha256
    assert sorted(p.name for p in store.committed_dir("m", 2).iterdir()) == [
        "config.json",
        "manifest.json",
        "w.bin",
    ]
