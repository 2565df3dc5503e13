"""How a rollout worker makes itself known: it registers with the coordinator once (retrying
while the coordinator is unreachable) and then heartbeats into Redis, a key with a TTL that
says what it serves, how busy it is and whether it stepped aside or crashed.

It does not decide anything from what others say: it only reports.
"""

import asyncio
import logging
import time
from functools import partial

import httpx

from services.contracts import keys
from services.contracts.messages import Heartbeat
from services.infra.redis_streams import with_reconnect
from services.infra.retry import retry
from services.infra.service import auth_headers
from services.rollout.context import WorkerContext
from services.rollout.settings import RolloutSettings

log = logging.getLogger(__name__)
REGISTER_TIMEOUT_S = 10.0
NOT_NOW = (429, 503)  # the coordinator says "later": over a rate, or its Redis away


class CoordinatorNotNow(Exception):
    """The coordinator answered "not now" (`NOT_NOW`): registering is tried again."""


async def register(s: RolloutSettings) -> None:
    """Register with the coordinator, again while it is unreachable or says "not now"; a
    refusal is a RuntimeError (not retried)."""
    body = {
        "id": s.worker_id,
        "pool": s.pool,
        "engine": s.engine,
        "slots": s.slots,
        "url": s.advertise_url,
    }

    async def post() -> None:
        async with httpx.AsyncClient(timeout=REGISTER_TIMEOUT_S) as http:
            resp = await http.post(
                f"{s.coordinator_url}/v1/workers", json=body, headers=auth_headers(s.api_token)
            )
        if resp.status_code in NOT_NOW:
            raise CoordinatorNotNow(f"{resp.status_code} {resp.text}")
        if resp.status_code != 201:
            raise RuntimeError(f"registration refused: {resp.status_code} {resp.text}")

    await retry(
        post,
        "register (coordinator not reachable)",
        on=(httpx.HTTPError, CoordinatorNotNow),
        first_delay_s=0.2,
    )
    log.info("registered %s (%s pool)", s.worker_id, s.pool)


def heartbeat(ctx: WorkerContext) -> Heartbeat:
    """What the worker says about itself now."""
    return Heartbeat(
        worker_id=ctx.s.worker_id,
        pool=ctx.s.pool,
        run_id=ctx.run_id,
        version=ctx.version,
        active=ctx.busy,
        slots=ctx.s.slots,
        tokens_generated=ctx.tokens_generated,
        plateau=ctx.plateau.plateau(),
        paused=ctx.paused,
        error=ctx.crashed,
        at=time.time(),
    )


async def heartbeat_forever(ctx: WorkerContext) -> None:
    key = keys.worker_heartbeat(ctx.s.worker_id)
    ttl_ms = int(ctx.s.heartbeat_ttl_s * 1000)
    while True:
        beat = heartbeat(ctx).encode()
        await with_reconnect(partial(ctx.r.set, key, beat, px=ttl_ms), "heartbeat")
        await asyncio.sleep(ctx.s.heartbeat_s)
