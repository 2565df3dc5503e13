"""The reward process: `python -m services.coordinator.reward_worker PARENT_PID`, started by the
coordinator's reward runner. It loads the run's reward (importing a user function's module here,
never in the coordinator), then scores the batches it is sent, one outcome per call
(`reward_protocol.py`).

It may be killed at any moment (a call that hangs) and dies with the coordinator. What user code
prints goes to the coordinator's log (stderr), never into the protocol's stream.
"""

import os
import sys

from services.coordinator.reward_protocol import (
    Loaded,
    LoadReward,
    ScoreBatch,
    read_frame,
    write_frame,
)
from services.infra.lifeline import die_with_parent
from services.tasks.base import Example, TaskError
from services.tasks.reward_choice import RewardChoice, call_reward, describe


def main() -> None:
    die_with_parent(int(sys.argv[1]))
    # the protocol's own descriptors: user code that prints writes to the log (fd 2), and user
    # code that reads stdin reads nothing
    channel = os.fdopen(os.dup(1), "wb")
    inbox = os.fdopen(os.dup(0), "rb")
    os.dup2(2, 1)
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    sys.stdout = sys.stderr
    load = read_frame(inbox, LoadReward)
    if load is None:
        return
    try:
        scorer = RewardChoice(load.name, load.answer_regex, load.tolerance).load()
    except TaskError as exc:
        write_frame(channel, Loaded(error=str(exc)))
        return
    except Exception as exc:  # a pattern that does not compile, say
        write_frame(channel, Loaded(error=describe(exc)))
        return
    write_frame(channel, Loaded())
    while (batch := read_frame(inbox, ScoreBatch)) is not None:
        examples = [Example(prompt, answer, row) for prompt, answer, row in batch.examples]
        for index, response in batch.calls:
            write_frame(channel, call_reward(scorer, examples[index], response))


if __name__ == "__main__":
    main()
