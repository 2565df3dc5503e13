"""Per-client read budgets: a token bucket per client (`rate_per_s` tokens a second, at most
`burst` saved up), decided from the clock it is given. Pure: the HTTP shell
(`services.infra.read_limit`) asks it and answers 429 when a client is over.

At most `max_clients` buckets are kept; past it the client seen least recently is forgotten (it
comes back with a full bucket), so that many clients cannot grow the memory.
"""

import math
from collections import OrderedDict
from dataclasses import dataclass


@dataclass
class Bucket:
    tokens: float
    at: float  # clock of the last refill, seconds


class ClientBuckets:
    def __init__(self, rate_per_s: float, burst: int, max_clients: int = 10_000) -> None:
        if rate_per_s <= 0 or burst < 1 or max_clients < 1:
            raise ValueError("rate_per_s > 0, burst >= 1 and max_clients >= 1")
        self.rate_per_s, self.burst, self.max_clients = rate_per_s, burst, max_clients
        self.buckets: OrderedDict[str, Bucket] = OrderedDict()

    def take(self, client: str, now: float) -> float:
        """Spend one token of `client`'s bucket: 0.0 when it had one, else the seconds until it
        will (nothing is spent then)."""
        bucket = self.buckets.get(client)
        if bucket is None:
            bucket = self.buckets[client] = Bucket(float(self.burst), now)
            if len(self.buckets) > self.max_clients:
                self.buckets.popitem(last=False)
        else:
            self.buckets.move_to_end(client)
            if now > bucket.at:  # a clock that went back refills nothing
                refill = (now - bucket.at) * self.rate_per_s
                bucket.tokens = min(float(self.burst), bucket.tokens + refill)
                bucket.at = now
        if bucket.tokens >= 1.0:
            bucket.tokens -= 1.0
            return 0.0
        return (1.0 - bucket.tokens) / self.rate_per_s


def retry_after_s(wait_s: float) -> int:
    """A wait as the whole seconds of a Retry-After header (at least 1)."""
    return max(1, math.ceil(wait_s))
