"""What one client may hold of an HTTP server, and how long it may take to send a request: the
rules `services.infra.connection_guard` applies to every connection of every spotrl server,
decided from the clock it is given. Pure.

- A client address holds at most `per_client` open connections of one server; past it a new one
  is refused. Addresses in `uncapped` are never refused: loopback by default, where every
  process of a machine (workers, the trainer, the CLI) shares one address, so that the address
  does not tell one client from another.
- A request's headers must be in `header_timeout_s` after its first byte (a new connection's
  first request: after the connection opened).
- A request's body may take `body_timeout_s` plus its bytes over `body_min_bytes_per_s`: a
  small body gets the fixed time, a long upload as long as it keeps coming at the rate or
  faster, and a trickle is cut off once its grace is spent whatever its declared length.

Time in which the server itself does not read (it paused reading: an app that is not taking the
body yet, a pipelined request waiting its turn) is not the client's and does not count.
"""

import enum
import ipaddress
from dataclasses import dataclass, field

Network = ipaddress.IPv4Network | ipaddress.IPv6Network
LOOPBACK = "127.0.0.0/8,::1"
HELD_POLL_S = 1.0  # while the server holds a client back, how often the guard looks again


def parse_networks(text: str) -> tuple[Network, ...]:
    """A comma list of networks (`10.0.0.0/8`) or addresses (`::1`); a ValueError names the
    entry that is neither."""
    networks = []
    for entry in (part.strip() for part in text.split(",")):
        if not entry:
            continue
        try:
            networks.append(ipaddress.ip_network(entry, strict=False))
        except ValueError:
            raise ValueError(f"{entry[:60]!r} is not an address or a network") from None
    return tuple(networks)


class Phase(enum.Enum):
    """What a connection waits on its client for; the value names the close past its time."""

    HEADERS = "header_timeout"
    BODY = "body_timeout"


OVER_CAP = "over_client_cap"  # the reason a connection is refused at once


@dataclass(frozen=True)
class ConnectionLimits:
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    body_min_bytes_per_s: float = 64 * 1024
    per_client: int = 128
    uncapped: tuple[Network, ...] = field(default_factory=lambda: parse_networks(LOOPBACK))

    def capped(self, host: str) -> bool:
        """Whether the per-client cap applies to this address (not a network address, a Unix
        socket's empty one say: no)."""
        try:
            address = ipaddress.ip_address(host.split("%", 1)[0])
        except ValueError:
            return False
        if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
            address = address.ipv4_mapped  # a dual-stack socket's view of an IPv4 client
        return not any(address in network for network in self.uncapped)

    def allowed_s(self, phase: Phase, received_bytes: int) -> float:
        """How long a phase may have waited on the client once it sent `received_bytes`."""
        if phase is Phase.HEADERS:
            return self.header_timeout_s
        return self.body_timeout_s + received_bytes / self.body_min_bytes_per_s


class ClientCounts:
    """Open connections of one server by client address."""

    def __init__(self, limits: ConnectionLimits) -> None:
        self.limits = limits
        self.open: dict[str, int] = {}

    def admit(self, host: str) -> bool:
        """Count a new connection of `host` in; False (nothing counted) when it is over the cap."""
        held = self.open.get(host, 0)
        if held >= self.limits.per_client and self.limits.capped(host):
            return False
        self.open[host] = held + 1
        return True

    def release(self, host: str) -> None:
        held = self.open.pop(host, 0) - 1
        if held > 0:
            self.open[host] = held


@dataclass
class RequestClock:
    """One connection's wait on its client: the phase (None: it owes nothing now, a request is
    being answered or the connection sits between requests), when the phase began, the bytes
    sent since, and the time in it that the server held the client back."""

    limits: ConnectionLimits
    phase: Phase | None = None
    since: float = 0.0
    received: int = 0
    held_s: float = 0.0
    checked_at: float = 0.0

    def enter(self, phase: Phase | None, now: float) -> None:
        self.phase, self.since, self.checked_at = phase, now, now
        self.received, self.held_s = 0, 0.0

    def deadline(self) -> float:
        """When the phase runs out if the client sends nothing more (inf: no phase)."""
        if self.phase is None:
            return float("inf")
        return self.since + self.held_s + self.limits.allowed_s(self.phase, self.received)

    def due(self, now: float, reading: bool) -> float | None:
        """Look at the connection at `now` (`reading`: whether the server reads from it): None
        when the client is out of time, else when to look again (inf: no need)."""
        if self.phase is None:
            return float("inf")
        if not reading:  # held back since the last look, as far as is known: not its time
            self.held_s += now - self.checked_at
            self.checked_at = now
            return now + HELD_POLL_S
        self.checked_at = now
        deadline = self.deadline()
        return deadline if now < deadline else None
