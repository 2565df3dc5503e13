"""Which worker wrote a delta batch: with `worker_redis_users` on, every batch a worker adds to
a deltas stream carries field `s`, the HMAC of its message under the key the coordinator gave
that worker at registration (`keys.WORKER_KEYS`, a hash only the coordinator reads). A batch is
applied only when `s` checks out under the key of the `worker_id` it names: a worker cannot
write deltas or releases in another worker's name, nor can anything that can XADD to the
stream without a key.

The coordinator writes batches too: the releases of a dead worker's requests that another
coordinator shard holds (`core.reclaim`). It signs those with a key of its own, kept in the same
hash under `COORDINATOR`, a name no worker id can take; a batch signed with it passes whatever
worker it names.

`refusals` decides (pure); `WorkerKeys` is its shell: it caches the keys and reads them again
for a worker it has none of, or whose batch does not match the key it has (the worker
registered again since: a restart gets a new key), at most once per read.
"""

import logging
from collections.abc import Iterable, Mapping

import redis.asyncio as aioredis
from prometheus_client import Counter

from services.contracts import keys
from services.contracts.messages import FIELD, DeltaBatch, StreamFields
from services.infra.redis_streams import Entry, Read, with_reconnect
from services.infra.signing import SIGNATURE_FIELD, key_bytes, new_key, sign, verify

log = logging.getLogger(__name__)
COORDINATOR = "@coordinator"  # the coordinator's own key in keys.WORKER_KEYS ('@': no worker id)
REFUSED = Counter(
    "spotrl_coordinator_delta_batches_unsigned_total",
    "Delta batches parked: unsigned, or not signed with the key of the worker they name",
)


def refusal(
    batch: DeltaBatch,
    fields: Mapping[bytes, bytes],
    key: bytes | None,
    coordinator_key: bytes | None = None,
) -> str | None:
    """Why a batch's entry is refused under `key` (its worker's key; None: none known), or
    None when its signature checks out (under `key`, or the coordinator's own)."""
    signature = fields.get(SIGNATURE_FIELD)
    if not signature:
        return f"unsigned delta batch (worker {batch.worker_id})"
    message = fields.get(FIELD, b"")
    if coordinator_key is not None and verify(coordinator_key, message, signature):
        return None
    if key is None:
        return f"delta batch of worker {batch.worker_id}, which has no signing key"
    if not verify(key, message, signature):
        return f"delta batch not signed with the key of worker {batch.worker_id}"
    return None


def refusals(
    messages: Iterable[tuple[bytes, DeltaBatch]],
    entries: Iterable[Entry],
    worker_keys: Mapping[str, bytes],
) -> dict[bytes, str]:
    """Entry id -> why, of the messages whose signature does not check out."""
    fields_of = {entry_id: fields for entry_id, fields in entries if fields}
    mine = worker_keys.get(COORDINATOR)
    out = {}
    for entry_id, batch in messages:
        key = worker_keys.get(batch.worker_id)
        why = refusal(batch, fields_of.get(entry_id, {}), key, mine)
        if why is not None:
            out[entry_id] = why
    return out


class WorkerKeys:
    """The workers' signing keys, as last read from `keys.WORKER_KEYS`."""

    def __init__(self, r: aioredis.Redis) -> None:
        self.r = r
        self.keys: dict[str, bytes] = {}

    async def screen(self, read: Read[DeltaBatch]) -> None:
        """Set aside (to park, with the reason) the read's batches whose signature does not
        check out, so that they are acknowledged and never applied."""
        refused = refusals(read.messages, read.entries, self.keys)
        if refused:
            names = {batch.worker_id for e, batch in read.messages if e in refused}
            await self._reload(names | {COORDINATOR})
            refused = refusals(read.messages, read.entries, self.keys)
        if not refused:
            return
        read.messages[:] = [(e, batch) for e, batch in read.messages if e not in refused]
        read.parked.extend(refused.items())
        REFUSED.inc(len(refused))
        log.warning(
            "parked %d delta batches whose signature does not check out (first: %s)",
            len(refused),
            next(iter(refused.values())),
        )

    async def entry(self, batch: DeltaBatch) -> StreamFields:
        """The stream entry of a batch the coordinator writes, signed with its own key (made
        by the first coordinator process that needs it)."""
        key = self.keys.get(COORDINATOR)
        if key is None:
            await with_reconnect(
                lambda: self.r.hsetnx(keys.WORKER_KEYS, COORDINATOR, new_key()), "coordinator key"
            )
            await self._reload({COORDINATOR})
            key = self.keys[COORDINATOR]
        message = batch.encode()
        return {FIELD: message, SIGNATURE_FIELD: sign(key, message)}

    async def _reload(self, workers: set[str]) -> None:
        """Read the keys of `workers` again (a worker forgotten loses its key here too)."""
        names = sorted(workers)
        stored = await with_reconnect(
            lambda: self.r.hmget(keys.WORKER_KEYS, names), "read worker keys"
        )
        for name, key in zip(names, stored, strict=True):
            try:
                self.keys[name] = key_bytes(key) if key else b""
            except ValueError:
                log.error("worker %s: its stored signing key is not hex", name)
                self.keys[name] = b""
            if not self.keys[name]:
                del self.keys[name]
