"""The draft references a step's jobs carry (services/core/request_table.py, drafts): the prompt's
earlier responses in the run, then its group's finished siblings, newest last, within the job's
bounds; the first jobs ordered by expected length; and with both off, jobs as before."""

from services.contracts.messages import MAX_DRAFT_REFERENCES, DeltaItem, Job
from services.contracts.sampling import SamplingParams
from services.core.request_table import JOB_DRAFT_TOKENS, RequestTable, latest_within
from tests import factories
from tests.conftest import apply

PROMPTS = [[1, 2], [3, 4], [5, 6]]
HISTORY = {0: [[7, 8, 9]], 1: [[10] * 5, [11] * 9], 2: [[12] * 2]}


def drafting(history=None, drafts=True, length_aware=False, n=3, max_new=40) -> RequestTable:
    return RequestTable(
        "run", 4, PROMPTS, n, SamplingParams(max_new_tokens=max_new), 0, [0],
        drafts=drafts, history=HISTORY if history is None else history,
        length_aware=length_aware,
    )  # fmt: skip


def finish(table: RequestTable, rid: str, tokens: list[int]) -> None:
    item = DeltaItem(
        request_id=rid, lease=table.requests[rid].lease, grant="", offset=0,
        token_ids=tokens, logprobs=[-0.1] * len(tokens), finished=True, finish_reason="stop",
    )  # fmt: skip
    apply(table, item)


def plain(job: Job) -> bytes:
    """A job's bytes without its grant (a random secret, new in every table)."""
    return job.replace(grant="").encode()


def test_first_jobs_carry_their_prompts_history_only():
    jobs = {j.request_id: j for j in drafting().initial_jobs()}
    assert jobs["4:0:0"].drafts == [[7, 8, 9]]
    assert jobs["4:1:2"].drafts == [[10] * 5, [11] * 9]  # oldest first
    assert drafting(history={}).initial_jobs()[0].drafts == []


def test_a_continuation_carries_the_finished_siblings_after_the_history():
    t = drafting()
    finish(t, "4:1:2", [21, 22, 0])
    finish(t, "4:1:0", [20, 0])
    apply(t, DeltaItem(request_id="4:1:1", lease=0, grant="", offset=0, token_ids=[30],
                       logprobs=[-0.1]))  # fmt: skip
    moved = t.migrate("4:1:1", "preemption")
    assert moved is not None and moved.prefix_ids == [30]
    # history, then the siblings by sample index; never its own tokens, nor another group's
    assert moved.drafts == [[10] * 5, [11] * 9, [20, 0], [21, 22, 0]]
    finish(t, "4:0:1", [40, 0])
    assert t.job("4:0:0").drafts == [[7, 8, 9], [40, 0]]


def test_a_jobs_drafts_keep_the_latest_within_the_bounds():
    many = {0: [[p] * 1000 for p in range(20)]}
    job = drafting(history=many).initial_jobs()[0]
    total = sum(len(d) for d in job.drafts)
    assert len(job.drafts) <= MAX_DRAFT_REFERENCES and total == JOB_DRAFT_TOKENS
    assert job.drafts[-1] == [19] * 1000  # the newest kept whole, the oldest dropped
    assert job.drafts[0] == [11] * 192  # the one across the bound cut to its head
    Job.decode(job.encode())  # within what a worker takes
    assert latest_within([[1], [], [2, 3]], max_references=1) == [[2, 3]]


def test_with_drafts_off_jobs_are_those_of_a_table_without_them():
    off, before = drafting(drafts=False), factories.table(PROMPTS, 3, 40, step=4, stops=(0,))
    finish(off, "4:0:1", [40, 0])
    finish(before, "4:0:1", [40, 0])
    assert [plain(j) for j in off.initial_jobs()] == [plain(j) for j in before.initial_jobs()]
    assert plain(off.job("4:0:0")) == plain(before.job("4:0:0"))
    assert off.job("4:0:0").drafts == []


def test_length_aware_first_jobs_go_longest_expected_first_groups_together():
    history = {1: [[10] * 5, [11] * 9], 2: [[12] * 20]}  # prompt 0 has none
    order = [j.request_id for j in drafting(history, length_aware=True).initial_jobs()]
    groups = [rid.split(":")[1] for rid in order]
    # no history first (it may be the longest), then 20 before 7 tokens expected
    assert groups == ["0"] * 3 + ["2"] * 3 + ["1"] * 3
    assert order[:3] == ["4:0:0", "4:0:1", "4:0:2"]
    plain_order = [j.request_id for j in drafting(history).initial_jobs()]
    assert [rid.split(":")[1] for rid in plain_order] == ["0"] * 3 + ["1"] * 3 + ["2"] * 3
