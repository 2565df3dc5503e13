"""Peer-to-peer weight fan-out, its parts alone: which source a block comes from, what a peer
serves of a version it is still pulling, and the zero-copy block server answering ranges."""

import http.client
import random

import pytest

from services.rollout.peers import PeerShelf
from services.weights.block_server import BlockServer
from services.weights.block_sources import ALL, SourcePicker, plan_blocks
from services.weights.contract import FileEntry

SHA = "0" * 64


def entry(name, size, block=None):
    hashes = [SHA] * -(-size // block) if block else []
    return FileEntry(name=name, size=size, sha256=SHA, block_size=block, block_sha256=hashes)


def test_blocks_are_numbered_over_the_files_and_unhashed_files_are_left_out():
    blocks = plan_blocks([entry("a", 10, 4), entry("b", 3), entry("c", 4, 4)])
    assert [(b.index, b.name, b.start, b.end) for b in blocks] == [
        (0, "a", 0, 3),
        (1, "a", 4, 7),
        (2, "a", 8, 9),
        (3, "c", 0, 3),
    ]
    assert blocks[2].size == 2


def test_a_block_goes_to_the_least_loaded_peer_holding_it_else_the_store():
    picker = SourcePicker("store", per_peer=2, rng=random.Random(0))
    picker.update({"p": frozenset({1}), "q": ALL, "store": ALL})
    assert picker.pick(0, 0.0) == "q"  # only q holds block 0
    picker.started("q")
    assert picker.pick(1, 0.0) == "p"  # both hold it: p has nothing under way
    picker.started("q")
    assert picker.pick(0, 0.0) == "store"  # q is at its share, p lacks block 0
    picker.finished("q")
    picker.busy("q", 0.0)
    assert picker.pick(0, 0.1) == "store"  # q said busy: left alone a while
    assert picker.pick(0, picker.busy_s + 0.1) == "q"
    picker.drop("q", "corrupt block")
    picker.drop("store", "never")
    assert picker.pick(0, 9.0) == "store" and "store" not in picker.dropped


def test_a_peer_serves_only_verified_blocks_until_its_pull_is_whole(tmp_path):
    shelf = PeerShelf()
    blocks = plan_blocks([entry("w", 10, 4)])
    shelf.begin("run", 3, tmp_path / "v3.partial", blocks)
    assert shelf.resolve("run", 3, "w", 4, 7) is None  # not verified yet
    shelf.verified("run", 3, [blocks[1]])
    assert shelf.resolve("run", 3, "w", 4, 7) == tmp_path / "v3.partial" / "w"
    assert shelf.resolve("run", 3, "w", 4, 9) is None  # past the block: not all verified
    assert shelf.resolve("run", 3, "w", 4, None) is None
    assert shelf.resolve("run", 3, "w", 0, 3) is None
    assert shelf.resolve("run", 2, "w", 4, 7) is None  # another version
    shelf.complete("run", 3, tmp_path / "v3", ["w"])
    assert shelf.resolve("run", 3, "w", 0, None) == tmp_path / "v3" / "w"
    assert shelf.resolve("run", 3, "other", 0, None) is None
    shelf.drop("run", 3)
    assert shelf.resolve("run", 3, "w", 0, None) is None


@pytest.fixture
def served(tmp_path):
    data = bytes(range(256)) * 64
    (tmp_path / "w").write_bytes(data)

    def resolve(model, version, name, start, last):
        return tmp_path / name if (model, version, name) == ("m", 1, "w") else None

    server = BlockServer(resolve, "127.0.0.1", token="secret", max_serving=2)
    server.start()
    yield server, data
    server.stop()


def get(server, path, headers):
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    conn.request("GET", path, headers=headers)
    resp = conn.getresponse()
    body = resp.read()
    conn.close()
    return resp.status, body


def test_the_block_server_answers_ranges_and_refuses_the_rest(served):
    server, data = served
    auth = {"Authorization": "Bearer secret"}
    path = "/v1/models/m/versions/1/files/w"
    assert get(server, path, {**auth, "Range": "bytes=100-4195"}) == (206, data[100:4196])
    assert get(server, path, auth) == (200, data)
    assert get(server, path, {"Range": "bytes=0-9"})[0] == 401
    assert get(server, "/v1/models/m/versions/2/files/w", auth)[0] == 404
    assert get(server, "/v1/models/m/versions/x/files/w", auth)[0] == 400
    assert get(server, path, {**auth, "Range": "bytes=-5"})[0] == 416
    server.serving = server.max_serving  # as many responses under way as it may send
    assert get(server, path, {**auth, "Range": "bytes=0-9"})[0] == 503
