"""What the environment runner and its processes say to each other over the process's stdin and
stdout, each message a frame (`services.infra.frames`).

runner -> process: `LoadEnvironment` once, then one call at a time (`OpeningCall`, `StepCall`).
process -> runner: `Loaded` once, then one `Reply` per call.
"""

from typing import Any

import msgspec

from services.environments.protocol import Feedback, Turn


class LoadEnvironment(msgspec.Struct, frozen=True):
    name: str  # a built-in's name, or module.path:Class
    memory_limit_bytes: int  # RLIMIT_AS of the process; 0: none
    isolate_network: bool  # enter a network namespace of its own before loading


class Loaded(msgspec.Struct, frozen=True):
    error: str = ""  # why the environment could not be loaded; empty when it was
    network_refused: bool = False  # the error is that no network namespace could be entered
    tools: list[dict[str, Any]] = []  # the environment's tools
    max_turns: int = 0


class OpeningCall(msgspec.Struct, frozen=True, tag="opening"):
    row: dict[str, Any]  # the dataset row


class StepCall(msgspec.Struct, frozen=True, tag="step"):
    row: dict[str, Any]
    turns: list[Turn]  # the model's turns so far, the last one to answer
    feedback: list[Feedback]  # the answers to the turns before the last


Call = OpeningCall | StepCall


class Reply(msgspec.Struct, frozen=True):
    error: str = ""  # protocol.ERROR_KINDS' raised or bad_feedback; empty when it worked
    detail: str = ""  # the exception's type and message, or what is wrong, cut short
    at: str = ""  # where in the environment's code: `file.py:LINE in function` ("" unknown)
    trace: str = ""  # the traceback of what raised (user_errors.trace_text); "" otherwise
    opening: str = ""  # an OpeningCall's answer
    feedback: Feedback | None = None  # a StepCall's answer
