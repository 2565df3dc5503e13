"""Poison requests of a step: the asyncio shell that acts on `stall.is_poison`.

A request released with reason "crash" counts the worker it crashed (`RequestTable.note_crash`);
once it is poison, its group is quarantined (dropped from the step, handed to the trainer as an
empty `Group` with `quarantined` set, which counts toward the step's B and is never trained on)
or, with on_poison=fail_run, the run fails with a reason that names the request.
"""

import logging

import redis.asyncio as aioredis
from prometheus_client import Counter

from services.common import timeline
from services.common.messages import Group
from services.common.runspec import RunSpec
from services.coordinator.runs import RunFailed
from services.coordinator.scheduling import crash_reports
from services.core.request_table import RequestTable
from services.core.stall import is_poison

log = logging.getLogger(__name__)
QUARANTINED = Counter(
    "spotrl_coordinator_groups_quarantined_total", "Groups dropped for a poison request"
)
ERROR_CHARS = 300  # of the last worker's error quoted in a reason


def note_crash(
    table: RequestTable, spec: RunSpec, rid: str, lease: int, worker_id: str, alone: bool
) -> bool | None:
    """`worker_id` crashed running `rid` (`alone`: nothing else ran beside it). None when the
    crash does not count (an old lease, say); else whether the request is now poison. Its
    group is quarantined at once with on_poison=drop_group."""
    if not table.note_crash(rid, lease, worker_id):
        return None
    req = table.requests[rid]
    if not is_poison(len(req.crashed_on), alone, spec.max_request_crashes):
        return False
    if spec.on_poison == "drop_group":
        table.quarantine(req.prompt_index)
    return True


def dropped_group(table: RequestTable, prompt_index: int) -> Group:
    """What the trainer gets for a quarantined group: no responses."""
    return Group(
        run_id=table.run_id,
        step=table.step,
        version=table.version,
        prompt_index=prompt_index,
        prompt_ids=table.prompts[prompt_index],
        responses=[],
        quarantined=True,
    )


async def report_poison(
    r: aioredis.Redis, spec: RunSpec, table: RequestTable, poisoned: list[tuple[str, str]]
) -> None:
    """Say which requests (each with the worker it crashed last) were quarantined and why; with
    on_poison=fail_run raise RunFailed instead."""
    reports = await crash_reports(r, sorted({w for _, w in poisoned}))
    for rid, worker_id in poisoned:
        req = table.requests[rid]
        error = str(reports.get(worker_id, {}).get("error", "unknown"))
        reason = (
            f"request {rid} (step {table.step}, prompt {req.prompt_index}) crashed "
            f"{len(req.crashed_on)} workers ({', '.join(req.crashed_on)}); last error: "
            f"{worker_id}: {error[:ERROR_CHARS]}"
        )
        if spec.on_poison == "fail_run":
            raise RunFailed(reason)
        QUARANTINED.inc()
        log.warning("step %d: group %d dropped: %s", table.step, req.prompt_index, reason)
        await timeline.emit(
            r,
            table.run_id,
            "quarantined",
            step=table.step,
            prompt_index=req.prompt_index,
            request=rid,
            workers=req.crashed_on,
            reason=reason,
        )
