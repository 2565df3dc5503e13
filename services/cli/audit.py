"""What reached the trainer, checked against what a run should have produced: every (step,
prompt) group once, each with exactly n finished responses. A group dropped by quarantine (one
of its requests crashed too many workers) is counted on its own, not as lost."""

from collections import Counter

import redis

from services.common import keys
from services.common.messages import Group, MalformedMessage
from services.common.runspec import RunSpec


def audit_run(redis_url: str, run_id: str, spec: RunSpec, steps: int | None = None) -> dict:
    r = redis.Redis.from_url(redis_url)
    try:
        entries = r.xrange(keys.groups_stream(run_id))
    finally:
        r.close()
    steps = spec.steps if steps is None else steps
    seen: Counter = Counter()
    complete = 0
    duplicated = 0
    quarantined = 0
    for _, fields in entries:
        try:
            g = Group.from_fields(fields)
        except MalformedMessage:
            continue
        seen[(g.step, g.prompt_index)] += 1
        if seen[(g.step, g.prompt_index)] > 1:
            duplicated += len(g.responses)
            continue
        if g.quarantined:
            quarantined += 1
            continue
        duplicated += max(0, len(g.responses) - spec.group_size)
        complete += min(spec.group_size, sum(1 for resp in g.responses if resp.token_ids))
    expected = (steps * spec.prompts_per_step - quarantined) * spec.group_size
    return {
        "expected_responses": expected,
        "responses": complete,
        "lost": expected - complete,
        "duplicated": duplicated,
        "groups_quarantined": quarantined,
    }
