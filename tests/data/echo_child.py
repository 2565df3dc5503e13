"""A child of the child-process tests (`python -m tests.data.echo_child [MODE]`): it ties itself
to its parent, takes its pipes and sends back every frame it reads, with what it saw of its
environment. MODE `stubborn`: it ignores SIGTERM; `grandchild`: it first starts a sleeping child
of its own and sends its pid."""

import os
import signal
import subprocess
import sys

import msgspec

from services.infra.child_process import PARENT_ENV, take_pipes, tie_to_parent
from services.infra.frames import read_frame, write_frame


class Echo(msgspec.Struct, frozen=True):
    text: str
    parent_env: bool = False  # whether the parent's pid was still in the environment
    printed_to_log: bool = False


def main() -> None:
    mode = sys.argv[1] if len(sys.argv) > 1 else ""
    tie_to_parent()
    inbox, channel = take_pipes()
    print("printed by the child: goes to the log, not into the frames")
    if mode == "stubborn":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if mode == "grandchild":
        sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        write_frame(channel, Echo(str(sleeper.pid)))
    while (message := read_frame(inbox, Echo)) is not None:
        write_frame(channel, Echo(message.text, PARENT_ENV in os.environ, True))


if __name__ == "__main__":
    main()
