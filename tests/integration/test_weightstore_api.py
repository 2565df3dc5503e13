"""The weight store over real HTTP in its own process: uploads, atomic commit, range reads,
clear 4xx errors that change nothing, auth, and the client's verified parallel pull."""

import asyncio
import functools
import hashlib

import httpx
import pytest

from services.weights.transfer import WeightClient, WeightTransferError
from tests.integration import conftest

TOKEN = "s3cret"


# a weight store with the token, its data and log under a folder, healthy; the caller stops it
start_store = functools.partial(conftest.start_store, name="weightstore", api_token=TOKEN)


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    root = tmp_path_factory.mktemp("ws")
    proc = start_store(root, keep_versions=3)
    yield proc.url, root
    proc.stop()


def auth():
    return {"Authorization": f"Bearer {TOKEN}"}


def upload(url, model, version, name, data, headers=None):
    return httpx.put(
        f"{url}/v1/models/{model}/versions/{version}/files/{name}",
        content=data,
        headers=(headers if headers is not None else auth())
        | {"x-sha256": hashlib.sha256(data).hexdigest()},
    )


def commit(url, model, version, files):
    return httpx.post(
        f"{url}/v1/models/{model}/versions/{version}/commit", json={"files": files}, headers=auth()
    )


def test_upload_commit_and_range_read(store):
    url, _ = store
    data = bytes(range(256)) * 100
    entry = upload(url, "m1", 1, "w.safetensors", data).json()
    assert httpx.get(f"{url}/v1/models/m1/versions").json()["versions"] == []
    assert commit(url, "m1", 1, [entry]).status_code == 201
    assert httpx.get(f"{url}/v1/models/m1/latest").json()["version"] == 1
    part = httpx.get(
        f"{url}/v1/models/m1/versions/1/files/w.safetensors", headers={"range": "bytes=10-19"}
    )
    assert part.status_code == 206 and part.content == data[10:20]


def test_errors_are_clear_and_change_nothing(store):
    url, _ = store
    data = b"abc"
    entry = upload(url, "m2", 1, "a.bin", data).json()
    missing = entry | {"name": "b.bin"}
    resp = commit(url, "m2", 1, [entry, missing])
    assert resp.status_code == 400 and "b.bin: not uploaded" in resp.json()["detail"]
    resp = commit(url, "m2", 1, [entry | {"sha256": "0" * 64}])
    assert resp.status_code == 400 and "sha256" in resp.json()["detail"]
    assert httpx.get(f"{url}/v1/models/m2/versions").json()["versions"] == []
    assert commit(url, "m2", 1, [entry]).status_code == 201
    resp = upload(url, "m2", 1, "a.bin", b"other")
    assert resp.status_code == 409
    assert httpx.get(f"{url}/v1/models/m2/versions/1/files/a.bin").content == data
    assert httpx.get(f"{url}/v1/models/m2/versions/7/manifest").status_code == 404
    assert httpx.get(f"{url}/v1/models/nope/latest").status_code == 404
    bad = httpx.put(
        f"{url}/v1/models/m2/versions/2/files/x.bin",
        content=b"x",
        headers=auth() | {"x-sha256": "f" * 64},
    )
    assert bad.status_code == 400


def test_writes_need_the_token(store):
    url, _ = store
    assert upload(url, "m3", 1, "a.bin", b"x", headers={}).status_code == 401
    wrong = {"Authorization": "Bearer nope"}
    assert upload(url, "m3", 1, "a.bin", b"x", headers=wrong).status_code == 401
    assert httpx.get(f"{url}/v1/models/m3/versions").json()["versions"] == []


def test_client_uploads_and_pulls_a_folder_verified(store, tmp_path):
    url, _ = store
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text("{}")
    (src / "model.safetensors").write_bytes(bytes(range(256)) * 40000)  # ~10 MB: several ranges
    client = WeightClient([url], TOKEN, parallel=4)
    asyncio.run(client.upload_folder(src, "m4", 0))
    result = asyncio.run(client.pull("m4", 0, tmp_path / "dst"))
    assert (result.folder / "model.safetensors").read_bytes() == (
        src / "model.safetensors"
    ).read_bytes()
    assert result.bytes == 10240000 + 2
    assert not (tmp_path / "dst.partial").exists()


def test_a_pull_takes_the_files_an_earlier_version_shares_from_its_folder(store, tmp_path):
    """Only what changed moves: v1 shares config.json with v0, so a pull of v1 beside v0's
    folder downloads the weights alone and links the config; the result is v1, verified."""
    url, _ = store
    client = WeightClient([url], TOKEN)
    for version, weights in ((0, b"a" * 5000), (1, b"b" * 7000)):
        src = tmp_path / f"src{version}"
        src.mkdir()
        (src / "config.json").write_text('{"same": true}')
        (src / "model.safetensors").write_bytes(weights)
        asyncio.run(client.upload_folder(src, "m5", version))
    v0 = asyncio.run(client.pull("m5", 0, tmp_path / "v0"))
    assert v0.bytes == 5000 + 14
    v1 = asyncio.run(client.pull("m5", 1, tmp_path / "v1", reuse=v0.folder))
    assert v1.bytes == 7000  # the config came from v0's folder
    assert (v1.folder / "model.safetensors").read_bytes() == b"b" * 7000
    assert (v1.folder / "config.json").read_text() == '{"same": true}'
    # a file whose size no longer agrees with the marker is not trusted: downloaded again
    (v1.folder / "config.json").write_text("{}")
    again = asyncio.run(client.pull("m5", 0, tmp_path / "v0-again", reuse=v1.folder))
    assert again.bytes == 5000 + 14
    assert (again.folder / "config.json").read_text() == '{"same": true}'


def received(url: str) -> float:
    """The store's count of bytes uploaded to it."""
    for line in httpx.get(
        f"{url}/metrics", headers={"Authorization": f"Bearer {TOKEN}"}
    ).text.splitlines():
        if line.startswith("spotrl_weightstore_bytes_received_total "):
            return float(line.split()[1])
    raise AssertionError("no bytes_received metric")


def test_an_upload_sends_only_what_changed_since_the_clients_last_commit(store, tmp_path):
    """The second version's config is the first's: only the weights travel, the commit names
    v0 for the rest. A replica that cannot take them from there (here: one told of a version
    it never had) gets every file after all; both versions pull whole. (Contents no other test
    of the module's store uploads: a store holding them committed takes them from there.)"""
    url, _ = store
    client = WeightClient([url], TOKEN)
    src = tmp_path / "src"
    src.mkdir()
    config = '{"same": true, "test": "sends only what changed"}'
    (src / "config.json").write_text(config)
    for version, weights in ((0, b"a" * 5001), (1, b"b" * 7001)):
        (src / "model.safetensors").write_bytes(weights)
        before = received(url)
        asyncio.run(client.upload_folder(src, "m6", version))
        assert received(url) - before == len(weights) + (len(config) if version == 0 else 0)
    pulled = asyncio.run(client.pull("m6", 1, tmp_path / "v1"))
    assert (pulled.folder / "config.json").read_text() == config
    assert (pulled.folder / "model.safetensors").read_bytes() == b"b" * 7001
    fresh = WeightClient([url], TOKEN)
    fresh._uploaded[url, "m7"] = (0, {"config.json": hashlib.sha256(config.encode()).hexdigest()})
    before = received(url)
    asyncio.run(fresh.upload_folder(src, "m7", 1))  # m7 has no v0 to take the config from
    assert received(url) - before == 7001 + len(config)
    pulled = asyncio.run(fresh.pull("m7", 1, tmp_path / "m7"))
    assert (pulled.folder / "config.json").read_text() == config


def test_a_store_with_protected_reads_serves_its_files_to_the_token_only(tmp_path):
    """With SPOTRL_PROTECT_READS the file ranges need the token too: a pull with it works, one
    without it fails and leaves nothing behind."""
    proc = start_store(tmp_path, protect_reads="true")
    try:
        src = tmp_path / "src"
        src.mkdir()
        (src / "model.safetensors").write_bytes(bytes(range(256)) * 4000)
        asyncio.run(WeightClient([proc.url], TOKEN).upload_folder(src, "p", 0))
        got = asyncio.run(WeightClient([proc.url], TOKEN).pull("p", 0, tmp_path / "dst"))
        assert (got.folder / "model.safetensors").read_bytes() == (
            src / "model.safetensors"
        ).read_bytes()
        with pytest.raises(WeightTransferError):
            asyncio.run(WeightClient([proc.url]).pull("p", 0, tmp_path / "other", attempts=1))
        assert not (tmp_path / "other").exists()
    finally:
        proc.stop()
