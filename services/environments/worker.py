"""An environment process: `python -m services.environments.worker`, started by the environment
runner (`runner.py`) as its child (`services.infra.child_process`). It puts its limits on itself
(memory, no network: see `sandbox.py`), only then loads the environment (importing a user
class's module here, never in the coordinator), and answers the calls it is sent, one reply per
call (`wire.py`).

It may be killed at any moment (a call that hangs) and dies with its parent. What environment
code prints goes to the parent's log (stderr), never into the protocol's stream.
"""

import msgspec

from services.environments.choice import EnvironmentChoice
from services.environments.protocol import (
    BAD_FEEDBACK,
    RAISED,
    BadFeedback,
    Environment,
    check_feedback,
    check_opening,
)
from services.environments.sandbox import isolate_network, limit_memory
from services.environments.wire import Call, Loaded, LoadEnvironment, OpeningCall, Reply
from services.infra.child_process import take_pipes, tie_to_parent
from services.infra.frames import read_frame, write_frame
from services.infra.user_errors import defined_at, trace_text, user_frame
from services.tasks.base import TaskError
from services.tasks.reward_choice import clip, describe


def load(request: LoadEnvironment) -> tuple[Loaded, Environment | None]:
    """The limits put on this process, then the environment loaded: what to answer, and the
    environment (None when it could not be loaded)."""
    if request.isolate_network:
        refused = isolate_network()
        if refused is not None:
            error = (
                f"environment processes cannot be cut off the network: {refused}; "
                "allow them the network (SPOTRL_ENVIRONMENT_NETWORK=true) to run anyway"
            )
            return Loaded(error=error, network_refused=True), None
    if request.memory_limit_bytes:
        limit_memory(request.memory_limit_bytes)
    try:
        env = EnvironmentChoice(request.name).load()
        tools = msgspec.msgpack.decode(msgspec.msgpack.encode(list(env.tools)))
    except TaskError as exc:
        return Loaded(error=str(exc)), None
    except Exception as exc:  # tools that msgpack cannot encode, say
        return Loaded(error=f"environment {request.name}: {describe(exc)}"), None
    return Loaded(tools=tools, max_turns=env.max_turns), env


def answer(env: Environment, call: Call) -> Reply:
    """One call of the environment; what raised or returned a bad value is said, not raised,
    with where in the environment's code (the method that returned it, the frame that
    raised) and what raised's traceback."""
    method = env.opening if isinstance(call, OpeningCall) else env.step
    try:
        if isinstance(call, OpeningCall):
            return Reply(opening=check_opening(env.opening(call.row)))
        return Reply(feedback=check_feedback(env.step(call.row, call.turns, call.feedback)))
    except BadFeedback as exc:
        return Reply(error=BAD_FEEDBACK, detail=clip(str(exc)), at=defined_at(method))
    except Exception as exc:  # the environment's code may raise anything
        return Reply(error=RAISED, detail=describe(exc), at=user_frame(exc), trace=trace_text(exc))


def main() -> None:
    tie_to_parent()
    inbox, channel = take_pipes()  # environment code that prints writes to the log
    request = read_frame(inbox, LoadEnvironment)
    if request is None:
        return
    loaded, env = load(request)
    write_frame(channel, loaded)
    if env is None:
        return
    while (call := read_frame(inbox, Call)) is not None:
        write_frame(channel, answer(env, call))


if __name__ == "__main__":
    main()
