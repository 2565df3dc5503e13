"""The base models the Docker tests run on, built once on the host and shared: the Compose test
and the Swarm test both run on the embedded model (what `spotrl init-model` builds, 1000 steps
of pre-training: minutes on a busy machine), so building it once saves a CI run those minutes.
Each is kept under `~/.cache/spotrl/models` (or $SPOTRL_MODEL_CACHE) by what it is made of: its
spec, its builder, the tasks and the versions of the packages it uses. The Compose test still
runs `spotrl init-model` in its container (a short one), so that path stays checked.
"""

import fcntl
import hashlib
import os
import shutil
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from importlib import metadata
from pathlib import Path

from services.contracts.runspec import EMBEDDED_PRETRAIN_STEPS
from services.trainer.init_model import InitModelSpec, init_model

ROOT = Path(__file__).resolve().parents[2]
CACHE = Path(os.environ.get("SPOTRL_MODEL_CACHE", Path.home() / ".cache" / "spotrl" / "models"))
# "embedded" is what `spotrl init-model` builds; "tiny" the unit tests' (seconds, learns less),
# "tiny-b" another base of that size (head_dim 32, as vLLM on CPU needs)
SPECS = {
    "embedded": {"pretrain_steps": EMBEDDED_PRETRAIN_STEPS},
    "tiny": {"hidden_size": 64, "layers": 2, "heads": 2, "pretrain_steps": 40, "batch_size": 64},
    # another base for the same task (other shapes): runs on two bases share one fleet
    "tiny-b": {"hidden_size": 96, "layers": 2, "heads": 3, "pretrain_steps": 40, "batch_size": 64},
}


def say(msg: str) -> None:
    print(f"[models {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def model_key(spec: InitModelSpec) -> str:
    """What a base model is made of: its spec, its builder, the tasks, the packages it uses."""
    files = [ROOT / "services/trainer/init_model.py"]
    files += sorted((ROOT / "services/tasks").rglob("*.py"))
    made_of = spec.model_dump_json() + " ".join(
        f"{p}=={metadata.version(p)}" for p in ("torch", "transformers", "tokenizers")
    )
    digest = hashlib.sha256(made_of.encode() + b"".join(f.read_bytes() for f in files))
    return digest.hexdigest()[:16]


def cached_model(size: str) -> Path:
    """The base model of this size in the cache: built here the first time (one build at a
    time, whichever test asks first), found there after."""
    spec = InitModelSpec(**SPECS[size])
    CACHE.mkdir(parents=True, exist_ok=True)
    cached = CACHE / f"model-{size}-{model_key(spec)}"
    with open(CACHE / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (cached / "config.json").is_file():
            for old in CACHE.glob(f"model-{size}-*"):
                shutil.rmtree(old)
            say(f"init-model ({size}): {spec.pretrain_steps} steps of pre-training")
            started = time.monotonic()
            partial = CACHE / f"partial-model-{size}"
            shutil.rmtree(partial, ignore_errors=True)
            init_model(partial, spec)
            partial.rename(cached)
            say(f"init-model ({size}): built in {time.monotonic() - started:.0f} s")
    return cached


def build_beside(size: str) -> Future[Path]:
    """The cached model of this size, built in a thread while the caller does something else
    (the image's build: mostly downloads and disk); `copy_model` waits for it."""
    pool = ThreadPoolExecutor(1, thread_name_prefix=f"model-{size}")
    future = pool.submit(cached_model, size)
    pool.shutdown(wait=False)
    return future


def copy_model(size: str, out: Path) -> Path:
    """The cached base model of this size copied to `out`, readable by the services (they run
    as uid 10001; the weights are written 0600)."""
    shutil.copytree(cached_model(size), out)
    out.chmod(0o755)
    for f in out.iterdir():
        f.chmod(0o644)
    return out
