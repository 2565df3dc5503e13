"""Multi-turn episodes in the simulator (issue 40, `ResponseLengthModel.turns` > 1): every
episode ends within its turns with the workload's tokens in each; generated = trained + lost
(observations are not generated); the environment's latency lengthens steps; a restart
(migration off) regenerates whole episodes where migration keeps them; async k = 1 completes."""

import pytest

from bench.simulate import multi_turn, parse_args
from services.core.episodes import EpisodeTable
from services.core.request_table import RequestTable
from services.sim.compare import summarize
from services.sim.simulation import Simulation
from services.sim.systems import HYBRID, HYBRID_ALL_SPOT, HYBRID_ASYNC_K1, HYBRID_NO_MIGRATION
from services.sim.workload import ResponseLengthModel
from tests.unit.test_simulator import CHURN, small_scenario

TURNS = 3
OBSERVATION = 64


class Recording(Simulation):
    """Keeps the table of every step it commits."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.tables: list[RequestTable] = []

    def on_committed(self, step: int) -> None:
        self.tables.append(self.inflight[step].table)
        super().on_committed(step)


def run(system, targets, steps=6, turns=TURNS, env_latency_s=2.0, **cloud) -> Recording:
    sc = small_scenario(**cloud).with_workload(
        turns=turns, env_latency_s=env_latency_s, observation_tokens=OBSERVATION
    )
    sim = Recording(sc, system, targets, seed=3, max_steps=steps)
    sim.run()
    return sim


def generated(r) -> int:
    return len(r.token_ids) - sum(n for _, n in r.observed)


def in_flight(sim: Simulation) -> int:
    """Generated tokens collected for steps not yet committed."""
    return sum(generated(r) for st in sim.inflight.values() for r in st.table.requests.values())


def trains_its_workload(sim: Simulation) -> bool:
    work = sim.sc.workload
    return [r.tokens for r in sim.records] == [
        work.step(3, r.step).total_response_tokens for r in sim.records
    ]


def test_every_episode_ends_within_its_turns_with_the_workloads_tokens():
    sim = run(HYBRID, [(0.0, 4)])
    assert len(sim.tables) == 6
    turns_taken = []
    for table in sim.tables:
        assert isinstance(table, EpisodeTable)
        physics = sim.sc.workload.step(3, table.step).turn_tokens
        for rid, r in table.requests.items():
            episode = table.episodes[rid]
            assert r.done and r.awaiting is None and 1 <= episode.turns <= TURNS
            assert [n for _, n in r.observed] == [OBSERVATION] * (episode.turns - 1)
            assert [len(t) for t in table.turns(rid)] == physics[r.prompt_index][r.sample_index]
            turns_taken.append(episode.turns)
    assert max(turns_taken) == TURNS
    figures = summarize(sim)
    assert figures["turns_per_episode"] == pytest.approx(sum(turns_taken) / len(turns_taken))
    assert figures["turns_discarded"] == 0 and figures["mean_env_s"] > 0
    assert trains_its_workload(sim)


@pytest.mark.parametrize("system", [HYBRID, HYBRID_ALL_SPOT, HYBRID_NO_MIGRATION])
@pytest.mark.parametrize("notice_s", [0.0, 30.0])
def test_tokens_generated_equal_trained_plus_lost(system, notice_s):
    sim = run(system, CHURN, notice_s=notice_s)
    t = sim.totals
    assert t.preemptions > 0 and len(sim.records) == 6
    assert t.generated == t.trained + t.lost  # observation tokens are in neither
    assert trains_its_workload(sim)
    if system.migration:
        assert t.discarded == 0 and t.turns_discarded == 0
    if system.migration and notice_s > 0:
        assert t.lost == 0


def test_empty_observations_go_straight_to_the_next_turn():
    sc = small_scenario().with_workload(turns=TURNS, env_latency_s=1.0, observation_tokens=0)
    sim = Simulation(sc, HYBRID_NO_MIGRATION, CHURN, seed=3, max_steps=4).run()
    t = sim.totals
    assert len(sim.records) == 4 and t.generated == t.trained + t.lost and t.discarded > 0
    assert trains_its_workload(sim)


def test_the_environment_latency_lengthens_steps():
    fast, slow = (run(HYBRID, [(0.0, 4)], env_latency_s=s) for s in (0.0, 5.0))
    assert fast.totals.trained == slow.totals.trained
    mean = [sum(r.rollout_s for r in sim.records) / len(sim.records) for sim in (fast, slow)]
    # an episode waits for every one of its turns' answers: the last group, TURNS of them
    assert mean[1] > mean[0] + TURNS * 5.0 * 0.5
    assert slow.records[-1].end_s > fast.records[-1].end_s


def test_a_restart_regenerates_whole_episodes_migration_keeps_them():
    """Preemptions mid-episode: without migration an episode starts over at its first turn
    (turns already answered are thrown away and generated again); with it nothing flushed is
    lost."""
    on, off = (run(system, CHURN) for system in (HYBRID_ALL_SPOT, HYBRID_NO_MIGRATION))
    assert on.totals.preemptions > 0 and off.totals.preemptions > 0
    assert on.totals.discarded == 0 and on.totals.turns_discarded == 0
    assert off.totals.turns_discarded > 0
    assert off.totals.lost > 2 * on.totals.lost
    assert off.totals.trained == on.totals.trained  # the same work, regenerated or not


@pytest.mark.parametrize("notice_s", [0.0, 30.0])
def test_async_k1_completes_its_steps(notice_s):
    sim = run(HYBRID_ASYNC_K1, CHURN, notice_s=notice_s)
    t = sim.totals
    assert len(sim.records) == 6 and t.preemptions > 0 and sim.requests.max_lag <= 1
    assert t.generated == t.trained + t.lost + in_flight(sim)
    assert trains_its_workload(sim)


def test_one_turn_draws_what_it_always_did():
    base = ResponseLengthModel(prompts_per_step=8, group_size=4)
    other = ResponseLengthModel(
        prompts_per_step=8, group_size=4, env_latency_s=9.0, observation_tokens=7
    )
    assert base.step(1, 2) == other.step(1, 2) and not base.step(1, 2).turn_tokens
    with pytest.raises(ValueError, match="turns"):
        ResponseLengthModel(turns=0)


def test_episodes_grow_with_their_turns_at_a_fixed_turn_median():
    def mean(**changes) -> float:
        work = ResponseLengthModel(prompts_per_step=32, group_size=4, **changes).step(0, 0)
        return work.total_response_tokens / (32 * 4)

    single, split = mean(), mean(turns=4)
    assert split == pytest.approx(single, rel=0.1)  # the same work, in four turns
    # twice the median a response, less what the budget (observations included) cuts off
    assert 1.5 * single < mean(turns=4, turn_median_tokens=2000) < 2 * single


def test_the_cli_takes_the_multi_turn_workload():
    args = parse_args(["--trace", "t.csv", "--turns", "4", "--env-latency-s", "1.5"])
    assert multi_turn(args) == {
        "turns": 4,
        "env_latency_s": 1.5,
        "observation_tokens": 256,
        "turn_median_tokens": None,
    }
    assert multi_turn(parse_args(["--trace", "t.csv"])) == {}
    with pytest.raises(SystemExit):
        parse_args(["--trace", "t.csv", "--turns", "0"])
