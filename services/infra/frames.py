"""The frames a parent and its child process exchange over the child's stdin and stdout: a
4-byte big-endian length, then a msgpack body (never pickle). What the messages are belongs to
each pair (the reward runner and its processes, the environment runner and its processes); this
module only frames them.
"""

import struct
from typing import IO, Any

import msgspec

HEADER = struct.Struct(">I")
MAX_REPLY_BYTES = 1024 * 1024  # a child's reply: a score, an observation of <= 16 Ki characters

_ENCODER = msgspec.msgpack.Encoder()


def frame(message: Any) -> bytes:
    """`message` as one frame: its length, then its msgpack body."""
    body = _ENCODER.encode(message)
    return HEADER.pack(len(body)) + body


def decode(body: bytes, kind: Any) -> Any:
    """A frame's body as a `kind` (a msgspec.Struct, or a union of tagged ones)."""
    return msgspec.msgpack.decode(body, type=kind)


def read_frame(stream: IO[bytes], kind: Any) -> Any:
    """The next message from a blocking stream (the child's side); None at its end."""
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
