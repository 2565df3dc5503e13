"""The client's pure decisions about sparse deltas (issue 42): which versions' deltas take a
puller from the version it holds to the one it wants (`route`), the version a joiner starts
from (`full_base`), and which files of an upload go as deltas (`make_deltas`)."""

import hashlib

import torch
from safetensors.torch import save

from services.weights.contract import DeltaRef, FileEntry, Manifest, delta_name
from services.weights.delta import apply
from services.weights.delta_pull import MAX_HOPS, full_base, route
from services.weights.delta_upload import make_deltas
from services.weights.files import hash_files_now


def sha_of(name: str, version: int) -> str:
    return hashlib.sha256(f"{name}@{version}".encode()).hexdigest()


def ref(base: int) -> DeltaRef:
    return DeltaRef(base=base, name="w.delta", size=10, sha256="d" * 64)


def entry(name: str, version: int, base: int | None = None) -> FileEntry:
    """File `name` as of `version` (its sha256 says which), sent as a delta of `base`."""
    return FileEntry(
        name=name, size=100, sha256=sha_of(name, version), delta=None if base is None else ref(base)
    )


def manifest(version: int, *files: FileEntry, full: bool = False) -> Manifest:
    return Manifest(model="m", version=version, files=list(files), full=full)


HELD = {"w": sha_of("w", 3), "config": sha_of("config", 0)}


def chain(first: int, last: int) -> dict[int, Manifest]:
    """Versions first..last, each with w a delta of the version before and config unchanged."""
    return {
        v: manifest(v, entry("w", v, v - 1), entry("config", 0)) for v in range(first, last + 1)
    }


# ---- route ----
def test_consecutive_deltas_make_the_route():
    assert route(3, HELD, 4, chain(4, 4)) == [4]
    assert route(3, HELD, 6, chain(4, 6)) == [4, 5, 6]
    # a version whose files are all unchanged is a hop with nothing to fetch
    same = chain(4, 6) | {5: manifest(5, entry("w", 4), entry("config", 0))}
    same[6] = manifest(6, entry("w", 6, 5), entry("config", 0))
    assert route(3, HELD, 6, same) == [4, 5, 6]


def test_no_route_across_a_gap():
    versions = chain(4, 6)
    del versions[5]
    assert route(3, HELD, 6, versions) is None
    assert route(3, HELD, 6, chain(5, 6)) is None  # the first step is missing


def test_no_route_where_a_file_changed_without_a_delta():
    versions = chain(4, 6)
    versions[5] = manifest(5, entry("w", 5, 4), entry("config", 5))  # config changed, whole
    assert route(3, HELD, 6, versions) is None
    versions[5] = manifest(5, entry("w", 5), entry("config", 0))  # w changed, sent whole
    assert route(3, HELD, 6, versions) is None


def test_no_route_where_a_delta_is_against_another_base():
    versions = chain(4, 6)
    versions[6] = manifest(6, entry("w", 6, 4), entry("config", 0))  # against 4, not 5
    assert route(3, HELD, 6, versions) is None
    # the held file differs, but the delta names its base by version: `apply` checks the sha256
    assert route(3, {**HELD, "w": sha_of("w", 2)}, 4, chain(4, 4)) == [4]


def test_no_route_where_the_file_set_differs():
    versions = chain(4, 5)
    versions[5] = manifest(5, entry("w", 5, 4))  # config dropped
    assert route(3, HELD, 5, versions) is None
    versions[5] = manifest(5, entry("w", 5, 4), entry("config", 0), entry("new", 5))
    assert route(3, HELD, 5, versions) is None
    assert route(3, {"w": HELD["w"]}, 4, chain(4, 4)) is None  # held lacks a file


def test_no_route_too_far_or_backwards():
    far = 3 + MAX_HOPS
    assert route(3, HELD, far, chain(4, far)) == list(range(4, far + 1))
    assert route(3, HELD, far + 1, chain(4, far + 1)) is None
    assert route(3, HELD, 3, chain(4, 4)) is None
    assert route(5, HELD, 4, chain(4, 4)) is None


def test_full_base_is_the_single_base_of_a_version_kept_as_deltas():
    assert full_base(manifest(9, entry("w", 9, 8), entry("config", 0))) == 8
    assert full_base(manifest(8, entry("w", 8, 7), full=True)) is None  # kept whole
    assert full_base(manifest(9, entry("w", 9, 8), entry("x", 9, 7))) is None  # two bases
    assert full_base(manifest(9, entry("w", 9))) is None  # no delta (a store sets it full)


# ---- make_deltas ----
def weights(seed: int = 0, changed: float = 0.0) -> bytes:
    """A bf16 safetensors file; with `changed`, that share of its elements moved."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(64, 64, generator=g).to(torch.bfloat16)
    if changed:
        mask = torch.rand(w.shape, generator=torch.Generator().manual_seed(1)) < changed
        w = torch.where(mask, w + 1.0, w).to(torch.bfloat16)
    return save({"w": w})


def test_only_changed_safetensors_files_with_a_delta_that_pays_are_deltas():
    old, new = weights(), weights(changed=0.02)
    before = hash_files_now(
        {
            "a.safetensors": old,
            "same.safetensors": weights(seed=3),
            "dense.safetensors": old,
            "config.json": b"{}",
            "w.bin": old,
        }
    )
    after = hash_files_now(
        {
            "a.safetensors": new,
            "same.safetensors": weights(seed=3),
            "dense.safetensors": weights(changed=0.9),
            "config.json": b'{"x": 1}',
            "w.bin": new,  # a safetensors file under another name
            "new.safetensors": weights(seed=4),
        }
    )
    made = make_deltas(before, 7, after)
    assert made is not None and made.base == 7
    assert made.of == {"a.safetensors": delta_name("a.safetensors")}
    assert list(made.files.content) == ["a.safetensors.delta"]
    delta = made.files.content["a.safetensors.delta"]
    assert isinstance(delta, bytes) and len(delta) <= 0.5 * len(new)
    assert apply(old, delta) == new
    assert made.files.sha256["a.safetensors.delta"] == hashlib.sha256(delta).hexdigest()


def test_no_deltas_when_nothing_pays():
    old = weights()
    same = hash_files_now({"a.safetensors": old})
    assert make_deltas(same, 1, same) is None
    dense = hash_files_now({"a.safetensors": weights(changed=0.9)})
    assert make_deltas(same, 1, dense) is None
    other_shape = hash_files_now(
        {"a.safetensors": save({"w": torch.zeros(3, dtype=torch.bfloat16)})}
    )
    assert make_deltas(same, 1, other_shape) is None


def test_files_on_disk_make_deltas_too(tmp_path):
    old, new = weights(), weights(changed=0.01)
    (tmp_path / "old").write_bytes(old)
    (tmp_path / "new").write_bytes(new)
    before = hash_files_now({"a.safetensors": old})
    before.content["a.safetensors"] = tmp_path / "old"
    after = hash_files_now({"a.safetensors": new})
    after.content["a.safetensors"] = tmp_path / "new"
    made = make_deltas(before, 2, after)
    assert made is not None
    assert apply(old, made.files.content["a.safetensors.delta"]) == new  # type: ignore[arg-type]


def test_deltas_entry_names_the_file_and_the_delta_it_went_as():
    made = make_deltas(
        hash_files_now({"a.safetensors": weights()}),
        5,
        hash_files_now({"a.safetensors": weights(changed=0.02)}),
    )
    assert made is not None
    delta = made.files.content["a.safetensors.delta"]
    assert isinstance(delta, bytes)
    uploaded = FileEntry(
        name="a.safetensors.delta",
        size=len(delta),
        sha256=hashlib.sha256(delta).hexdigest(),
        block_size=4096,
        block_sha256=["e" * 64],
    )
    new = weights(changed=0.02)
    got = made.entry("a.safetensors", uploaded, len(new), hashlib.sha256(new).hexdigest())
    assert got.name == "a.safetensors" and got.size == len(new)
    assert got.sha256 == hashlib.sha256(new).hexdigest()
    assert got.delta == DeltaRef(
        base=5, name="a.safetensors.delta", size=len(delta), sha256=uploaded.sha256
    )
    assert got.block_sha256 == []  # the store computes the whole file's block hashes
