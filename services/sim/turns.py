"""Multi-turn episodes in the simulation (issue 40). With more than one turn in the workload
the step's table is the coordinator's own `EpisodeTable`: a flush that ends a turn
(`CollectOutcome.turn_ended`) is answered by the environment after its latency (an event), and
`EpisodeTable.observe` appends the observation (not generated) and gives the next turn's job,
queued as a continuation is (any instance may take it), or ends the episode; a group completes
when all its episodes are over.

What the environment says does not matter here, only when it answers and how many tokens it
appends (the workload's physics). It never ends an episode early: every episode takes the
workload's `turns` unless the token budget runs out first.
"""

from typing import TYPE_CHECKING

from services.contracts.sampling import SamplingParams
from services.core.episodes import EpisodeTable, Observation
from services.core.request_table import RequestTable, request_id
from services.sim.scenario import Scenario
from services.sim.state import StepState, Totals
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
        return RequestTable("sim", step, prompts, n, sampling, seed, [])
    return SimEpisodeTable(
        "sim", step, prompts, n, sampling, seed, [], max_turns=workload.turns, totals=totals
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


class TurnFlow:
    """Mixed into `Simulation`. The state and the methods of the other halves it uses are
    declared here with their types; `Simulation` sets and defines them."""

    sc: Scenario
    now: float
    totals: Totals
    inflight: dict[int, StepState]  # steps queued and not committed, oldest first

    if TYPE_CHECKING:

        def at(self, t: float, kind: str, payload: object = None) -> None: ...
        def group_done(self, st: StepState, prompt: int) -> None: ...

    def turns_ended(self, st: StepState, rids: list[str]) -> None:
        """Turns a flush ended: the environment answers each after its latency."""
        for rid in rids:
            table = st.table
            assert isinstance(table, EpisodeTable)
            seconds = st.env_latency_s[rid][table.episodes[rid].turns - 1]
            self.totals.env_s += seconds
            self.at(self.now + seconds, "env_answer", (st.step, rid, table.requests[rid].lease))

    def on_env_answer(self, payload: tuple[int, str, int]) -> None:
        """The environment answers a turn: the next turn is queued, or the episode is over
        (after the workload's last turn, or when the budget has no room left)."""
        step, rid, lease = payload
        st = self.inflight[step]  # a step with a turn awaiting an answer is not committed
        table = st.table
        assert isinstance(table, EpisodeTable)
        r = table.requests[rid]
        done = table.episodes[rid].turns >= table.max_turns
        tokens = [] if done else [0] * self.sc.workload.observation_tokens
        job = table.observe(rid, lease, Observation(tokens, 0.0, done))
        self.totals.env_answers += 1
        if job is not None:
            st.queue.append(job)
            return
        if r.done:
            self.totals.episodes += 1
            groups = table.completed_groups([rid])
            table.mark_published(groups)
            for prompt in groups:
                self.group_done(st, prompt)
