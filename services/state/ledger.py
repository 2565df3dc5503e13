"""The trained ledger of a run: one compact record per step of what reached the trainer, kept
for audits after the groups themselves are deleted (the groups stream is trimmed as soon as the
step that trained on them is committed, so Redis memory is bounded by the step, not the run).

A record is a few hundred bytes whatever the step's size: which prompts were trained and which
dropped (bitmaps), how many responses and tokens, how many groups came twice (and were not
trained twice), how many were incomplete, the oldest weight version that generated a trained
token, and a sha256 over the trained token ids. The trainer
writes it once the step's last group is in, before the step's version is committed; a step
trained again after a restart writes the same record again.
"""

import hashlib
import json
from array import array
from dataclasses import dataclass, field

import redis.asyncio as aioredis

from services.contracts import keys
from services.contracts.messages import Group
from services.contracts.spans import generated_count


def _bitmap(indices: set[int]) -> str:
    """Hex of a little-endian bitmap: bit i set when i is in `indices`."""
    value = 0
    for i in indices:
        value |= 1 << i
    return format(value, "x")


def bitmap_members(hex_bits: str) -> set[int]:
    value = int(hex_bits or "0", 16)
    return {i for i in range(value.bit_length()) if value >> i & 1}


@dataclass
class StepLedger:
    """What the trainer consumed for one step, built as groups arrive."""

    trained: set[int] = field(default_factory=set)  # prompt indices trained on
    quarantined: set[int] = field(default_factory=set)  # dropped from the step, counted in B
    responses: int = 0
    tokens: int = 0
    duplicates: int = 0  # groups of a prompt already taken this step: never trained twice
    incomplete: int = 0  # groups with another number of responses than n: parked
    oldest_version: int | None = None  # the oldest weights that generated a trained token
    _hash: "hashlib._Hash" = field(default_factory=hashlib.sha256)

    def seen(self, prompt_index: int) -> bool:
        return prompt_index in self.trained or prompt_index in self.quarantined

    def add(self, group: Group) -> None:
        self.trained.add(group.prompt_index)
        self.responses += len(group.responses)
        self._hash.update(group.prompt_index.to_bytes(4, "little"))
        for resp in group.responses:
            # the tokens the model generated: a multi-turn response's observations are not trained
            self.tokens += generated_count(resp.observed, len(resp.token_ids))
            for _, version in resp.version_runs:
                if self.oldest_version is None or version < self.oldest_version:
                    self.oldest_version = version
            self._hash.update(len(resp.token_ids).to_bytes(4, "little"))
            self._hash.update(array("i", resp.token_ids).tobytes())

    def record(self) -> dict:
        return {
            "trained": _bitmap(self.trained),
            "quarantined": _bitmap(self.quarantined),
            "responses": self.responses,
            "tokens": self.tokens,
            "duplicates": self.duplicates,
            "incomplete": self.incomplete,
            "oldest_version": self.oldest_version,
            "sha256": self._hash.hexdigest(),
        }


async def write_step(r: aioredis.Redis, run_id: str, step: int, ledger: StepLedger) -> None:
    await r.hset(keys.run_trained(run_id), str(step), json.dumps(ledger.record()))


def read_records(raw: dict[bytes, bytes]) -> dict[int, dict]:
    """Decode the ledger hash (HGETALL of keys.run_trained) into {step: record}."""
    return {int(k): json.loads(v) for k, v in raw.items()}
