"""What a finished run leaves in Redis: its record, not its scratch.

Kept: the run hash and version, the metrics rows, the events and pool timelines, the trainer's
state, the workers' load records and parked messages. Deleted at once: the jobs stream of every
version, the per-step request tables (requests, tokens, logprobs, versions, published and
quarantined groups, step meta) and the seeding flags. The groups and deltas streams, which audits
read after a run, stay for `audit_ttl_s` after a success or a failure and go at once after a
cancel.

Anything still reading a run when its keys go (a worker, the trainer, the rollout manager) sees
an absent stream, which the stream helpers read as empty; the scheduler runs this again once the
rollout manager has stopped, for what it wrote in between.
"""

import logging
import re
import time
from typing import cast

import redis.asyncio as aioredis

from services.contracts import keys

log = logging.getLogger(__name__)
SCAN_COUNT = 1000
UNLINK_BATCH = 1000
WILD = "\x00"  # stands for any part of a key name; no key contains it


# WILD in a key function's step or version slot: the functions only format the number, so the
# pattern is the key name with any step there.
WILD_NUMBER = cast(int, WILD)


def _matcher(names: list[str]) -> re.Pattern[str]:
    """A regex matching any of the key names, each WILD standing for any text."""
    return re.compile(
        "|".join(".*".join(re.escape(part) for part in name.split(WILD)) for name in names)
    )


def scratch_keys(run_id: str) -> re.Pattern[str]:
    """The keys of a run that nothing needs once it is over."""
    return _matcher(
        [
            keys.jobs_stream(run_id, WILD_NUMBER),
            keys.step_meta(run_id, WILD_NUMBER),
            keys.step_requests(run_id, WILD_NUMBER),
            keys.step_log(run_id, WILD_NUMBER),
            keys.step_log(run_id, WILD_NUMBER, WILD_NUMBER),
            keys.step_published(run_id, WILD_NUMBER),
            keys.step_quarantined(run_id, WILD_NUMBER),
            keys.step_meta(run_id, WILD_NUMBER, WILD_NUMBER),
            keys.step_requests(run_id, WILD_NUMBER, WILD_NUMBER),
            keys.step_published(run_id, WILD_NUMBER, WILD_NUMBER),
            keys.step_quarantined(run_id, WILD_NUMBER, WILD_NUMBER),
            keys.step_shards(run_id, WILD_NUMBER),
            keys.shard_metrics(run_id),
            keys.seed_done(run_id, WILD_NUMBER),
            keys.read_cap(run_id, WILD_NUMBER),
            keys.version_announced(run_id),
            keys.run_staleness(run_id),
            keys.run_manifests(run_id),
            keys.seeding_over(run_id),
            keys.weight_holders(run_id, WILD_NUMBER),
        ]
    )


def audit_keys(run_id: str) -> list[str]:
    """The streams audits read after a run (which groups trained, which worker sent what)."""
    return [keys.groups_stream(run_id), *keys.all_deltas_streams(run_id)]


def _glob_escape(text: str) -> str:
    return re.sub(r"([\\*?\[\]])", r"\\\1", text)


async def release_run(r: aioredis.Redis, run_id: str, state: str, audit_ttl_s: int) -> int:
    """Delete the scratch keys of a run that ended in `state` and put the audit streams on a
    TTL (or delete them, after a cancel); the number of keys deleted."""
    started = time.monotonic()
    scratch = scratch_keys(run_id)
    audit = audit_keys(run_id)
    batch: list[bytes] = []
    deleted = 0
    async for raw in r.scan_iter(match=f"{_glob_escape(keys.run(run_id))}:*", count=SCAN_COUNT):
        if scratch.fullmatch(raw.decode(errors="replace")):
            batch.append(raw)
        if len(batch) >= UNLINK_BATCH:
            deleted += await r.unlink(*batch)
            batch = []
    if batch:
        deleted += await r.unlink(*batch)
    if state == "cancelled" or audit_ttl_s == 0:
        deleted += await r.unlink(*audit)
    else:
        for key in audit:
            await r.expire(key, audit_ttl_s)
    log.info(
        "run %s (%s): %d keys deleted in %.2fs", run_id, state, deleted, time.monotonic() - started
    )
    return deleted
