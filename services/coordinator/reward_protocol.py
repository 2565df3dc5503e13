"""What the coordinator and its reward process say to each other over the process's stdin and
stdout: frames of a 4-byte big-endian length and a msgpack body (never pickle).

coordinator -> process: `LoadReward` once, then `ScoreBatch`es.
process -> coordinator: `Loaded` once, then one `reward_choice.Outcome` per call of a batch, in
order, each as soon as it is known: a call that takes too long is the one after the last outcome
received.
"""

import struct
from typing import IO, Any, TypeVar

import msgspec

HEADER = struct.Struct(">I")
MAX_REPLY_BYTES = 1024 * 1024  # a reply is a score and a short detail
T = TypeVar("T")


class LoadReward(msgspec.Struct, frozen=True):
    name: str  # a built-in's name, or module.path:function
    answer_regex: str | None
    tolerance: float


class Loaded(msgspec.Struct, frozen=True):
    error: str = ""  # why the reward could not be loaded; empty when it was


class ScoreBatch(msgspec.Struct, frozen=True):
    examples: list[tuple[str, str, dict[str, Any]]]  # prompt, answer, row
    calls: list[tuple[int, str]]  # index into examples, decoded response


_ENCODER = msgspec.msgpack.Encoder()


def frame(message: Any) -> bytes:
    body = _ENCODER.encode(message)
    return HEADER.pack(len(body)) + body


def decode(body: bytes, kind: type[T]) -> T:
    return msgspec.msgpack.decode(body, type=kind)


def read_frame(stream: IO[bytes], kind: type[T]) -> T | None:
    """The next message from a blocking stream (the process's side); None at its end."""
    header = stream.read(HEADER.size)
    if len(header) < HEADER.size:
        return None
    (size,) = HEADER.unpack(header)
    body = stream.read(size)
    if len(body) < size:
        return None
    return decode(body, kind)


def write_frame(stream: IO[bytes], message: Any) -> None:
    stream.write(frame(message))
    stream.flush()
