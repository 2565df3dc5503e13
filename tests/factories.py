"""Shared test factories: the messages and step state that many test modules build, each with
the values most of them use, every one overridable. A test that needs other values passes them;
what it passes is what it checks.

- `table`: a step's `RequestTable` (an `EpisodeTable` with `max_turns`);
- `job`: a token-level `Job` (engine and stream tests);
- `beat`: a worker's `Heartbeat`.

The deployment-config builder and the integration fixtures live in tests/integration/conftest.py
(`deploy_config`), beside the deployment they configure.
"""

from collections.abc import Sequence

from services.contracts.messages import Heartbeat, Job
from services.contracts.sampling import SamplingParams
from services.core.episodes import EpisodeTable
from services.core.request_table import RequestTable


def table(
    prompts: int | list[list[int]] = 2,
    group_size: int = 2,
    max_new_tokens: int = 4,
    *,
    run_id: str = "run",
    step: int = 0,
    seed: int = 0,
    stops: Sequence[int] = (0,),
    sampling: SamplingParams | None = None,
    shard: int = 0,
    shards: int = 1,
    max_turns: int | None = None,
) -> RequestTable:
    """A step's requests: `prompts` prompts of [1, 2] (or the prompts given) of `group_size`
    responses of at most `max_new_tokens` tokens (or under `sampling`); with `max_turns`, an
    `EpisodeTable` of multi-turn episodes."""
    prompt_ids = [[1, 2]] * prompts if isinstance(prompts, int) else prompts
    sampling = sampling or SamplingParams(max_new_tokens=max_new_tokens)
    args = (run_id, step, prompt_ids, group_size, sampling, seed, list(stops))
    if max_turns is not None:
        return EpisodeTable(*args, shard=shard, shards=shards, max_turns=max_turns)
    return RequestTable(*args, shard=shard, shards=shards)


def job(
    rid: str = "0:0:0",
    prompt: Sequence[int] = (1,),
    n: int = 2,
    prefix: Sequence[int] = (),
    temperature: float = 0.0,
    seed: int = 1,
    lease: int = 0,
    stop: Sequence[int] = (),
    grant: str = "g",
    *,
    run_id: str = "r",
    step: int = 0,
    sampling: SamplingParams | None = None,
    drafts: Sequence[Sequence[int]] = (),
) -> Job:
    """A token-level job: continue `prompt + prefix` for `n` tokens (sampled at `temperature`,
    or under `sampling`), with `drafts` as references to draft from."""
    return Job(
        run_id=run_id,
        request_id=rid,
        lease=lease,
        grant=grant,
        step=step,
        prompt_ids=list(prompt),
        prefix_ids=list(prefix),
        remaining_tokens=n,
        sampling=sampling or SamplingParams(temperature=temperature),
        seed=seed,
        stop_token_ids=list(stop),
        drafts=[list(d) for d in drafts],
    )


def beat(
    worker_id: str = "w",
    pool: str = "preemptible",
    version: int | None = 0,
    *,
    run_id: str | None = "run",
    active: int = 0,
    slots: int = 8,
    tokens_generated: int = 0,
    at: float = 0.0,
    **over,
) -> Heartbeat:
    """A worker's heartbeat: serving `run_id` with weight `version` loaded, idle, at time 0."""
    fields = {
        "worker_id": worker_id,
        "pool": pool,
        "run_id": run_id,
        "version": version,
        "active": active,
        "slots": slots,
        "tokens_generated": tokens_generated,
        "at": at,
    }
    return Heartbeat(**(fields | over))
