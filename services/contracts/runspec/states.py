"""The states of a run, as its record and the REST API name them."""

from typing import Literal

RunState = Literal["queued", "running", "stalled", "succeeded", "failed", "cancelled"]
FINAL_STATES = ("succeeded", "failed", "cancelled")
# A stalled run is still live: it goes back to running as soon as it can progress again.
LIVE_STATES = ("running", "stalled")
