"""Multi-turn episodes in the simulation (issue 40). With more than one turn in the workload
the step's table is the coordinator's own `EpisodeTable`: a flush that ends a turn
(`CollectOutcome.turn_ended`) is answered by the environment after its latency (an event), and
`EpisodeTable.observe` appends the observation (not generated) and gives the next turn's job,
queued as a continuation is (any instance may take it), or ends the episode; a group completes
when all its episodes are over.

What the environment says does not matter here, only when it answers and how many tokens it
appends (the workload's physics). It never ends an episode early: every episode takes the
workload's `turns` unless the token budget runs out first. The turns' events are the
requests' component's (requests.py: `turns_ended`, `on_env_answer`).
"""

from services.contracts.sampling import SamplingParams
from services.core.episodes import EpisodeTable
from services.core.request_table import RequestTable, request_id
from services.sim.state import RUN_ID, Totals
from services.sim.workload import ResponseLengthModel, StepWorkload


class SimEpisodeTable(EpisodeTable):
    """The coordinator's `EpisodeTable`, counting in the run's totals the whole turns that a
    restart (migration off) throws away: the episode starts over at its first turn."""

    def __init__(self, *args, totals: Totals, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.totals = totals

    def _restarted(self, rid: str) -> None:
        self.totals.turns_discarded += self.episodes[rid].turns - 1  # those answered
        super()._restarted(rid)


def step_table(
    workload: ResponseLengthModel, step: int, prompt_tokens: list[int], seed: int, totals: Totals
) -> RequestTable:
    """The step's request table: the coordinator's `RequestTable`, or with more than one turn
    its `EpisodeTable`."""
    prompts = [[0] * n for n in prompt_tokens]
    sampling = SamplingParams(max_new_tokens=workload.max_response_tokens)
    n = workload.group_size
    if workload.turns == 1:
        return RequestTable(RUN_ID, step, prompts, n, sampling, seed, [])
    return SimEpisodeTable(
        RUN_ID, step, prompts, n, sampling, seed, [], max_turns=workload.turns, totals=totals
    )


def turn_physics(
    step: int, work: StepWorkload
) -> tuple[dict[str, list[int]], dict[str, list[float]]]:
    """Request -> the tokens each turn generates, and each answer's seconds (empty: one turn)."""
    tokens, seconds = {}, {}
    for p, group in enumerate(work.turn_tokens):
        for s, turns in enumerate(group):
            rid = request_id(step, p, s)
            tokens[rid], seconds[rid] = turns, work.env_latency_s[p][s]
    return tokens, seconds
