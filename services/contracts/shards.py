"""How a run's requests are split over its coordinator shards (`RunSpec.coordinator_shards`).

A shard owns whole groups, so that it completes and publishes them alone: the requests of
prompt p of every step go to shard p mod K. Each shard queues the jobs of its requests, keeps
their durable table and reads its own deltas stream (`keys.deltas_stream(run, shard)`), to which
a worker sends the deltas of the requests of that shard. Shard 0 is the coordinator's own
process, which also schedules, reclaims dead workers' jobs and records each step; shards 1..K-1
are processes it starts (`coordinator/run/shard.py`). With K = 1 everything is shard 0, under the
names of before.
"""

MAX_COORDINATOR_SHARDS = 16


def shard_of_prompt(prompt_index: int, shards: int) -> int:
    return prompt_index % shards


def shard_of(request_id: str, shards: int) -> int:
    """The shard of a request id ("{step}:{prompt}:{sample}"); 0 for one that names no prompt
    (it is dropped by shard 0 as unknown, as before)."""
    if shards == 1:
        return 0
    _, _, rest = request_id.partition(":")
    prompt = rest.partition(":")[0]
    return shard_of_prompt(int(prompt), shards) if prompt.isdigit() else 0
