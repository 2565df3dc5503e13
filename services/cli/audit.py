"""What reached the trainer, checked against what a run should have produced: every (step, prompt)
group once, each with exactly n finished responses, and how many versions behind its step the
oldest trained token was generated (`max_staleness`: 0 in a synchronous run). A group dropped by
quarantine (one of its requests crashed too many workers) is counted on its own, not as lost.

It reads the trained ledger (services.state.ledger): one compact record per step written by the
trainer, which outlives the groups themselves (deleted once their step is committed)."""

from pathlib import Path
from typing import cast

from services.cli.redis_client import open_redis
from services.contracts import keys
from services.contracts.runspec import RunSpec
from services.state.ledger import bitmap_members, read_records


def audit_run(
    redis_url: str,
    run_id: str,
    spec: RunSpec,
    steps: int | None = None,
    ca_file: Path | None = None,
) -> dict:
    r = open_redis(redis_url, ca_file)
    try:
        records = read_records(cast(dict[bytes, bytes], r.hgetall(keys.run_trained(run_id))))
    finally:
        r.close()
    steps = spec.training.steps if steps is None else steps
    n = spec.training.group_size
    complete = duplicated = quarantined = tokens = 0
    staleness: int | None = None  # the most versions a trained token lagged its step by
    for step in range(steps):
        rec = records.get(step)
        if rec is None:
            continue  # nothing of this step reached the trainer: all lost
        trained = bitmap_members(rec["trained"])
        dropped = bitmap_members(rec["quarantined"])
        quarantined += len(dropped)
        # every response of a trained group counts once; more than n would be duplicates
        complete += min(rec["responses"], len(trained) * n)
        duplicated += max(0, rec["responses"] - len(trained) * n) + rec["duplicates"] * n
        tokens += rec["tokens"]
        if rec.get("oldest_version") is not None:
            staleness = max(staleness or 0, step - rec["oldest_version"])
    expected = (steps * spec.training.prompts_per_step - quarantined) * n
    return {
        "expected_responses": expected,
        "responses": complete,
        "lost": expected - complete,
        "duplicated": duplicated,
        "groups_quarantined": quarantined,
        "tokens": tokens,
        "max_staleness": staleness,
    }
