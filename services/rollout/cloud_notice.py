"""Cloud preemption notices, as an instance's metadata service gives them: what to ask each cloud
and what its answer means. Pure: requests are described and answers parsed here; the shell that
sends them is `services.rollout.notice`. It does not decide what a worker does on a notice (the
same as on SIGTERM) and contacts nothing itself.

- AWS (IMDSv2): `PUT /latest/api/token` with `X-aws-ec2-metadata-token-ttl-seconds` gives a
  session token; `GET /latest/meta-data/spot/instance-action` with `X-aws-ec2-metadata-token`
  answers 404 while no interruption is scheduled and 200 `{"action": "terminate" | "stop" |
  "hibernate", "time": "2026-01-01T00:00:00Z"}` once one is (two minutes ahead); 401: the token
  is missing or expired.
- GCP: `GET /computeMetadata/v1/instance/preempted` with `Metadata-Flavor: Google` answers FALSE,
  then TRUE once the VM is preempted (it stops about 30 s later; no time is given).
- Azure: `GET /metadata/scheduledevents?api-version=2020-07-01` with `Metadata: true` answers
  `{"DocumentIncarnation": n, "Events": [...]}`; an event whose EventType is "Preempt", whose
  EventStatus is Scheduled or Started and whose Resources name this VM (`GET
  /metadata/instance/compute/name`) is the notice; its NotBefore (RFC 1123, at least 30 s ahead)
  the deadline. The events of a scale set's other VMs are listed too, and are not ours.
"""

import json
from dataclasses import dataclass, field
from datetime import datetime
from email.utils import parsedate_to_datetime
from typing import Any, Literal

Cloud = Literal["aws", "gcp", "azure"]
# each cloud's documented metadata address (link-local or a name only its VMs resolve)
DEFAULT_BASE_URLS: dict[Cloud, str] = {
    "aws": "http://169.254.169.254",
    "gcp": "http://metadata.google.internal",
    "azure": "http://169.254.169.254",
}
MAX_ANSWER_BYTES = 256 * 1024  # the largest answer read; past it, a MetadataError
AWS_TOKEN_TTL_S = 21600  # the longest session IMDSv2 grants (6 hours)
AZURE_EVENTS_API = "2020-07-01"
AZURE_INSTANCE_API = "2021-02-01"
AZURE_LIVE_STATUSES = ("Scheduled", "Started")
QUOTED_CHARS = 120  # of an answer quoted in an error


class MetadataError(ValueError):
    """The metadata service answered something that is neither a notice nor its absence."""


class TokenRejected(MetadataError):
    """AWS refused the session token (expired or never valid): get a new one."""


@dataclass(frozen=True)
class Probe:
    """One HTTP request to the metadata service: `path` is relative to its base URL."""

    method: Literal["GET", "PUT"]
    path: str
    headers: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Notice:
    """The instance is going away: which cloud said so, what it said, and when it goes."""

    cloud: Cloud
    action: str  # AWS: terminate / stop / hibernate; GCP: preempted; Azure: Preempt <EventId>
    deadline: datetime | None  # when the instance goes, where the cloud says (aware, UTC)
    stated_deadline: str = ""  # the deadline as the cloud wrote it ("" where it gives none)

    def describe(self, now: datetime) -> str:
        """One line: the cloud, the notice and the deadline (`now`: an aware datetime)."""
        if self.deadline is not None:
            left_s = (self.deadline - now).total_seconds()
            when = f"deadline {self.deadline.isoformat()} (in {left_s:.0f}s)"
        elif self.stated_deadline:
            when = f"deadline {self.stated_deadline!r} (unreadable)"
        else:
            when = "no deadline stated"
        return f"{self.cloud}: {self.action}, {when}"


def _quoted(body: bytes) -> str:
    text = body[:QUOTED_CHARS].decode(errors="replace")
    return repr(text) + ("..." if len(body) > QUOTED_CHARS else "")


def _unexpected(what: str, status: int, body: bytes) -> MetadataError:
    return MetadataError(f"{what}: unexpected HTTP {status}: {_quoted(body)}")


def _json(what: str, body: bytes) -> Any:
    try:
        return json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise MetadataError(f"{what}: not JSON ({exc}): {_quoted(body)}") from None


def _time(text: str, rfc1123: bool) -> datetime | None:
    """A stated deadline as an aware datetime; None when it cannot be read."""
    try:
        when = parsedate_to_datetime(text) if rfc1123 else datetime.fromisoformat(text)
    except (TypeError, ValueError):
        return None
    return when if when.tzinfo is not None else None


# ---- AWS ----
def aws_token_probe(ttl_s: int = AWS_TOKEN_TTL_S) -> Probe:
    return Probe("PUT", "/latest/api/token", {"X-aws-ec2-metadata-token-ttl-seconds": str(ttl_s)})


def read_aws_token(status: int, body: bytes) -> str:
    """The session token from the answer to `aws_token_probe`."""
    token = body.decode(errors="replace").strip()
    if status != 200 or not token or not token.isprintable():
        raise _unexpected("aws token", status, body)
    return token


def aws_action_probe(token: str) -> Probe:
    return Probe(
        "GET", "/latest/meta-data/spot/instance-action", {"X-aws-ec2-metadata-token": token}
    )


def read_aws_action(status: int, body: bytes) -> Notice | None:
    """None while no interruption is scheduled (404); a Notice once one is."""
    if status == 404:
        return None
    if status == 401:
        raise TokenRejected("aws instance-action: the session token was refused (401)")
    if status != 200:
        raise _unexpected("aws instance-action", status, body)
    answer = _json("aws instance-action", body)
    action = answer.get("action") if isinstance(answer, dict) else None
    stated = answer.get("time") if isinstance(answer, dict) else None
    if not isinstance(action, str) or not action or not isinstance(stated, str):
        raise MetadataError(f"aws instance-action: no action and time in {_quoted(body)}")
    return Notice("aws", action, _time(stated, rfc1123=False), stated)


# ---- GCP ----
def gcp_probe() -> Probe:
    return Probe("GET", "/computeMetadata/v1/instance/preempted", {"Metadata-Flavor": "Google"})


def read_gcp_preempted(status: int, body: bytes) -> Notice | None:
    """None while the answer is FALSE; a Notice once it is TRUE."""
    if status != 200:
        raise _unexpected("gcp preempted", status, body)
    answer = body.decode(errors="replace").strip().upper()
    if answer == "FALSE":
        return None
    if answer == "TRUE":
        return Notice("gcp", "preempted", None)
    raise MetadataError(f"gcp preempted: neither TRUE nor FALSE: {_quoted(body)}")


# ---- Azure ----
def azure_name_probe() -> Probe:
    path = f"/metadata/instance/compute/name?api-version={AZURE_INSTANCE_API}&format=text"
    return Probe("GET", path, {"Metadata": "true"})


def read_azure_name(status: int, body: bytes) -> str:
    """This VM's name, as scheduled events list it in their Resources."""
    name = body.decode(errors="replace").strip()
    if status != 200 or not name or not name.isprintable():
        raise _unexpected("azure compute name", status, body)
    return name


def azure_events_probe() -> Probe:
    path = f"/metadata/scheduledevents?api-version={AZURE_EVENTS_API}"
    return Probe("GET", path, {"Metadata": "true"})


def read_azure_events(status: int, body: bytes, vm_name: str) -> Notice | None:
    """The first live Preempt event naming `vm_name` as a Notice; None when there is none
    (other event types, other VMs' events and finished ones are no notice of ours)."""
    if status != 200:
        raise _unexpected("azure scheduled events", status, body)
    answer = _json("azure scheduled events", body)
    events = answer.get("Events") if isinstance(answer, dict) else None
    if not isinstance(events, list):
        raise MetadataError(f"azure scheduled events: no Events list in {_quoted(body)}")
    ours = vm_name.casefold()  # Azure's names are case-insensitive
    for event in events:
        if not isinstance(event, dict) or not isinstance(event.get("Resources", []), list):
            raise MetadataError(f"azure scheduled events: malformed event {event!r:.200}")
        if event.get("EventType") != "Preempt":
            continue
        if event.get("EventStatus") not in AZURE_LIVE_STATUSES:
            continue
        if ours not in {str(name).casefold() for name in event.get("Resources", [])}:
            continue
        stated = event.get("NotBefore") or ""
        deadline = _time(stated, rfc1123=True) if isinstance(stated, str) else None
        return Notice("azure", f"Preempt {event.get('EventId', '?')}", deadline, str(stated))
    return None


# ---- pacing the error log ----
@dataclass
class ErrorPace:
    """Says which errors of a poll repeated every few seconds to log: the first, then at most
    one each `every_s`; the one logged carries how many were left out since."""

    every_s: float
    last_logged: float | None = None
    left_out: int = 0

    def due(self, now: float) -> int | None:
        """The errors left out before this one when this one is to be logged, else None."""
        if self.last_logged is not None and now - self.last_logged < self.every_s:
            self.left_out += 1
            return None
        left_out, self.left_out, self.last_logged = self.left_out, 0, now
        return left_out

    def recovered(self) -> None:
        """A poll succeeded: the next error is logged at once."""
        self.last_logged, self.left_out = None, 0
