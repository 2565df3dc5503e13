"""Which groups one RL step takes (services/trainer/intake.py): the step's own complete groups
once each; a group of another step, a second group of a prompt or one with the wrong number of
responses is parked with the reason; a quarantined group counts toward B untrained."""

from services.common.messages import Group, Response
from services.common.redis_streams import Read
from services.trainer.intake import StepIntake

N = 2


def group(prompt: int, step: int = 5, responses: int = N, quarantined: bool = False) -> Group:
    return Group(
        run_id="r",
        step=step,
        version=step,
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
