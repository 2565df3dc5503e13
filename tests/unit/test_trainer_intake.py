"""Which groups one RL step takes (services/trainer/intake.py): the step's own complete groups
once each; a group of another step, a second group of a prompt or one with the wrong number of
responses is parked with the reason; a quarantined group counts toward B untrained."""

from services.contracts.messages import Group, Response
from services.infra.redis_streams import Read
from services.trainer.intake import StepIntake

N = 2


def group(prompt: int, step: int = 5, responses: int = N, quarantined: bool = False) -> Group:
    return Group(
        run_id="r",
        step=step,
        prompt_index=prompt,
        prompt_ids=[1, 2],
        responses=[
            Response(token_ids=[3, 4], logprobs=[-0.1, -0.2], reward=1.0, finish_reason="stop")
            for _ in range(0 if quarantined else responses)
        ],
        quarantined=quarantined,
    )


def read_of(*groups: Group, malformed: int = 0) -> Read[Group]:
    messages = [(f"{i}-0".encode(), g) for i, g in enumerate(groups)]
    entries = [(entry_id, g.fields()) for entry_id, g in messages]
    bad = [(f"{100 + i}-0".encode(), {b"m": b"junk"}) for i in range(malformed)]
    return Read(entries + bad, messages, [(entry_id, "malformed") for entry_id, _ in bad])


def test_a_step_takes_its_complete_groups_once_and_parks_the_rest():
    intake = StepIntake("r", 5, prompts=4, group_size=N)
    read = read_of(
        group(0),
        group(1, step=4),  # of another step
        group(0),  # came twice
        group(2, responses=1),  # incomplete
        group(3, quarantined=True),
        group(1),
        malformed=1,
    )
    good = intake.take(read)
    assert [g.prompt_index for g in good] == [0, 1]
    assert dict(read.parked) == {
        b"1-0": "group of step 4 during step 5",
        b"2-0": "group 0 came twice",
        b"3-0": "1 responses, want n=2",
        b"100-0": "malformed",
    }
    assert intake.trained == 2 and intake.dropped == 1 and intake.missing == 1
    assert intake.ledger.trained == {0, 1} and intake.ledger.quarantined == {3}
    assert intake.ledger.duplicates == 1 and intake.ledger.incomplete == 1
    assert sorted(g.prompt_index for g in intake.kept) == [0, 1, 3]
    assert intake.entry_ids == read.ids and intake.last_entry == "100-0"


def test_a_quarantined_group_is_never_taken_twice_either():
    intake = StepIntake("r", 5, prompts=2, group_size=N)
    intake.take(read_of(group(0, quarantined=True)))
    read = read_of(group(0))
    assert intake.take(read) == [] and read.parked == [(b"0-0", "group 0 came twice")]
    assert intake.missing == 1 and intake.last_entry == "0-0"


def test_groups_of_later_steps_in_flight_are_held_for_their_step_unacknowledged():
    """max_staleness 2 (asynchronous RL): while step 5 trains, groups of steps 6 and 7 arrive;
    they are held (not parked, not among the entries acknowledged with step 5), one of step 8
    is past the steps in flight and parked, and the next step takes what was held for it."""
    intake = StepIntake("r", 5, prompts=2, group_size=N, staleness=2)
    read = read_of(group(0), group(0, step=6), group(1, step=7), group(1, step=8), group(1))
    good = intake.take(read)
    assert [g.prompt_index for g in good] == [0, 1]
    assert [(e, g.step) for e, g in intake.ahead] == [(b"1-0", 6), (b"2-0", 7)]
    assert intake.entry_ids == [b"0-0", b"3-0", b"4-0"]  # retired with step 5
    assert dict(read.parked) == {b"3-0": "group of step 8 during step 5"}
    # step 6 takes its held group and holds step 7's on
    nxt = StepIntake("r", 6, prompts=2, group_size=N, staleness=2)
    held = Read([(e, g.fields()) for e, g in intake.ahead], list(intake.ahead), [])
    assert [g.step for g in nxt.take(held)] == [6]
    assert [g.step for _, g in nxt.ahead] == [7] and nxt.entry_ids == [b"1-0"]
