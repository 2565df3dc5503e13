"""Poison requests of a step: the asyncio shell that reports what `collect.note_crash` decided.

A request released with reason "crash" counts the worker it crashed; once it is poison, its group
is quarantined (dropped from the step, handed to the trainer as an empty `Group` with
`quarantined` set, which counts toward the step's B and is never trained on) or, with
on_poison=fail_run, the run fails with a reason that names the request.
"""

import logging

import redis.asyncio as aioredis
from prometheus_client import Counter

from services.contracts.runspec import RunSpec
from services.coordinator.run.runs import RunFailed
from services.coordinator.scheduling import crash_reports
from services.core.request_table import RequestTable
from services.state import timeline

log = logging.getLogger(__name__)
QUARANTINED = Counter(
    "spotrl_coordinator_groups_quarantined_total", "Groups dropped for a poison request"
)
ERROR_CHARS = 300  # of the last worker's error quoted in a reason


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
        if spec.faults.on_poison == "fail_run":
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
