"""The stack's images on every node, with no registry: built once by tools/offline-image.sh in
the Compose test's engine (its data root keeps them), saved to a tarball named by the images'
ids, and `docker load`ed into each node that does not hold those ids yet.
"""

import hashlib
import subprocess
import sys
import time
from pathlib import Path

from tests.compose.engine import DockerEngine
from tests.swarm.cluster import CACHE, Cluster

IMAGES = ("spotrl:latest", "spotrl-base:bookworm")


def say(msg: str) -> None:
    print(f"[swarm {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def image_ids(docker) -> dict[str, str]:
    """Each image's id on an engine (`docker` runs its CLI), absent ones left out."""
    out = {}
    for image in IMAGES:
        got = docker("image", "inspect", "-f", "{{.Id}}", image, check=False)
        if got.returncode == 0:
            out[image] = got.stdout.strip()
    return out


def build_and_save(timeout_s: float = 2400.0) -> tuple[Path, dict[str, str], float]:
    """(tarball, image ids, seconds the build took): built or found up to date, then saved."""
    engine = DockerEngine()
    engine.start()
    try:
        build_s = engine.build_images(timeout_s)
        ids = image_ids(engine.docker)
        key = hashlib.sha256(" ".join(sorted(ids.values())).encode()).hexdigest()[:16]
        tarball = CACHE / f"images-{key}.tar"
        if not tarball.is_file():
            CACHE.mkdir(parents=True, exist_ok=True)
            for old in CACHE.glob("images-*.tar*"):
                old.unlink()
            partial = tarball.with_suffix(".tar.partial")
            engine.docker("save", "-o", str(partial), *IMAGES, timeout_s=900)
            partial.rename(tarball)
            say(f"saved {tarball.name} ({tarball.stat().st_size // 2**20} MiB)")
        return tarball, ids, build_s
    finally:
        engine.stop()


def load_everywhere(cluster: Cluster, tarball: Path, ids: dict[str, str]) -> list[str]:
    """Load the tarball into every node that lacks those images, all at once; the nodes loaded."""
    stale = [n for n in cluster.nodes.values() if image_ids(n.docker) != ids]
    loads = [
        (
            n,
            subprocess.Popen(
                ["docker", "load", "-q", "-i", str(tarball)],
                env=n.env(),
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
            ),
        )
        for n in stale
    ]
    for node, proc in loads:
        _, err = proc.communicate(timeout=900)
        if proc.returncode != 0:
            raise RuntimeError(f"{node.name}: docker load: {err.strip()}")
    for node in stale:
        if image_ids(node.docker) != ids:
            raise RuntimeError(f"{node.name}: images after load {image_ids(node.docker)} != {ids}")
    return [n.name for n in stale]
