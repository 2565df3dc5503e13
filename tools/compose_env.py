"""The `environment:` blocks of docker-compose.yml, rendered from the settings classes.

This table is their source: each value is given by the field name of the settings class the
service reads it with (`settings_env` checks the name, so a misspelt one is an error) and the
rendered value must validate against that class. Edit the table, then

    .venv/bin/python tools/compose_env.py --write    # rewrite the blocks in docker-compose.yml
    .venv/bin/python tools/compose_env.py --check    # exit 1 if the file and the table differ

(tests/unit/test_compose.py runs the check). A value may be a Compose variable with a default,
`${VAR:-default}`: the default is what is validated. A setting's comment goes after its value.
"""

import argparse
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic_settings import BaseSettings

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))

from services.coordinator.settings import CoordinatorSettings  # noqa: E402
from services.infra.settings import CommonSettings, env_name, env_value  # noqa: E402
from services.rollout.settings import RolloutSettings  # noqa: E402
from services.trainer.settings import TrainerSettings  # noqa: E402
from services.weightstore.settings import WeightStoreSettings  # noqa: E402

COMPOSE_FILE = ROOT / "docker-compose.yml"
SHARED = "x-env"  # the anchored block every spotrl service merges (`<<: *env`)
# Each service's credentials come from its env file (`spotrl secrets`): Compose lets an
# `environment:` value override an env file's, so no block may set these.
FROM_SECRETS = ("redis_url", "api_token", "token", "accept_tokens", "worker_redis_users")


@dataclass(frozen=True)
class Note:
    """A value with its comment, written after it or on the line above."""

    value: Any
    comment: str
    above: bool = False


@dataclass(frozen=True)
class Block:
    settings: type[BaseSettings]
    values: dict[str, Any]


BLOCKS: dict[str, Block] = {
    SHARED: Block(
        CommonSettings,
        {
            "coordinator_url": "http://coordinator:8100",
            "weightstore_url": "http://weightstore:8200",
            "protect_reads": Note(
                "${SPOTRL_PROTECT_READS:-false}",
                "Tokens and the Redis URL come from each service's env file (spotrl secrets).",
                above=True,
            ),
            "log_level": "INFO",
        },
    ),
    "weightstore": Block(
        WeightStoreSettings,
        {
            "port": 8200,
            "block_port": Note(8201, "zero-copy block server: pullers learn it from /v1/blocks"),
            "root": "/data/weights",
            "keep_versions": 4,
        },
    ),
    "coordinator": Block(CoordinatorSettings, {"port": 8100}),
    "trainer": Block(
        TrainerSettings,
        {
            "port": 8300,
            "work_dir": Note("/data/trainer", "checkpoints: a recreated trainer resumes from them"),
            "checkpoint_every": 1,
            "torch_threads": "${SPOTRL_TRAINER_THREADS:-4}",
        },
    ),
    "rollout": Block(
        RolloutSettings,
        {
            "port": 8400,
            "pool": "preemptible",
            "engine": Note(
                "${SPOTRL_ENGINE:-hf}", "vllm: build the image with VLLM=cpu or VLLM=cuda"
            ),
            "slots": Note("${SPOTRL_SLOTS:-64}", "most requests a worker generates at once"),
            "max_loras": Note(
                "${SPOTRL_MAX_LORAS:-4}", "LoRA runs: adapters held at once (0: merged)"
            ),
            "runs_at_once": Note(
                "${SPOTRL_RUNS_AT_ONCE:-1}", "LoRA runs on one base served in one batch"
            ),
            "cache_dir": "/tmp/spotrl-rollout",
            "torch_threads": "${SPOTRL_ROLLOUT_THREADS:-2}",
            "p2p": Note("${SPOTRL_P2P:-true}", "false: every weight block from the store"),
            "peer_port": Note(8401, "serves the weight blocks it holds to the other replicas"),
        },
    ),
}


def compose_default(value: str) -> str:
    """`${VAR:-default}` as Compose reads it with VAR unset."""
    m = re.fullmatch(r"\$\{\w+:-(.*)\}", value)
    return m.group(1) if m else value


def rendered(name: str) -> dict[str, str]:
    """One block as the environment it sets, each value validated against its settings class."""
    block = BLOCKS[name]
    env: dict[str, str] = {}
    for field, raw in block.values.items():
        if field in FROM_SECRETS:
            raise ValueError(f"{name}: {field} comes from the env file (spotrl secrets)")
        value = raw.value if isinstance(raw, Note) else raw
        env[env_name(block.settings, field)] = env_value(value)
    checked = {
        f: compose_default(env_value(v.value if isinstance(v, Note) else v))
        for f, v in block.values.items()
    }
    block.settings.model_validate(checked)
    return env


def yaml_scalar(value: str) -> str:
    """A string as YAML that reads back as that string: plain where it can be, else quoted."""
    plain = re.fullmatch(r"[\w/.${}@-][\w/.:${}@-]*", value) and not value.isdigit()
    return value if plain and yaml.safe_load(value) == value else json.dumps(value)


def yaml_lines(name: str, indent: int) -> list[str]:
    block, pad = BLOCKS[name], " " * indent
    lines = []
    for (var, value), raw in zip(rendered(name).items(), block.values.values(), strict=True):
        note = raw if isinstance(raw, Note) else None
        if note and note.above:
            lines.append(f"{pad}# {note.comment}")
        after = f"  # {note.comment}" if note and not note.above else ""
        lines.append(f"{pad}{var}: {yaml_scalar(value)}{after}")
    return lines


def rewrite(text: str) -> str:
    """`text` (docker-compose.yml) with every block replaced by its rendering."""
    lines = text.splitlines()
    out: list[str] = []
    i, service = 0, None
    while i < len(lines):
        line = lines[i]
        out.append(line)
        i += 1
        if line.startswith(f"{SHARED}:"):
            i = _after_block(lines, i, indent=2)
            out += yaml_lines(SHARED, 2)
            continue
        m = re.fullmatch(r"  (\w+):", line)
        if m:
            service = m.group(1)
        if line == "    environment:" and service in BLOCKS:
            if i < len(lines) and lines[i].strip() == "<<: *env":
                out.append(lines[i])
                i += 1
            i = _after_block(lines, i, indent=6)
            out += yaml_lines(service, 6)
    return "\n".join(out) + "\n"


def _after_block(lines: list[str], i: int, indent: int) -> int:
    """The index after the lines from i indented at least `indent` (comments included)."""
    while i < len(lines) and lines[i].startswith(" " * indent):
        i += 1
    return i


def differences(text: str) -> list[str]:
    """What docker-compose.yml sets that the table does not (and back), per block."""
    doc = yaml.safe_load(text)
    shared = rendered(SHARED)
    found = {SHARED: doc.get(SHARED, {})} | {
        n: doc["services"].get(n, {}).get("environment", {}) for n in BLOCKS if n != SHARED
    }
    problems = []
    for name, env in found.items():
        want = rendered(name) if name == SHARED else shared | rendered(name)
        got = {k: str(v) for k, v in env.items()}
        if got != want:
            problems.append(f"{name}: file has {got}, table renders {want}")
    if rewrite(text) != text:
        problems.append("the file's layout of the blocks differs from the rendering (--write)")
    return problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--check", action="store_true", help="exit 1 if the file differs")
    mode.add_argument("--write", action="store_true", help="rewrite the blocks in the file")
    args = parser.parse_args()
    text = COMPOSE_FILE.read_text()
    if args.write:
        COMPOSE_FILE.write_text(rewrite(text))
        return 0
    problems = differences(text)
    for p in problems:
        print(p, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
