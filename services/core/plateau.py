"""Online estimate of a worker's plateau batch size: the smallest batch size whose decode
throughput reaches `share` of the best seen. Pure: fed (batch size, tokens, seconds) samples.
"""

from dataclasses import dataclass, field


@dataclass
class PlateauEstimator:
    max_batch: int
    share: float = 0.9
    min_samples: int = 3
    tokens: dict[int, float] = field(default_factory=dict)  # bucket -> tokens
    seconds: dict[int, float] = field(default_factory=dict)  # bucket -> seconds
    samples: dict[int, int] = field(default_factory=dict)

    @staticmethod
    def bucket(batch: int) -> int:
        """Batch sizes are grouped by powers of two."""
        return 1 << (max(1, batch).bit_length() - 1)

    def record(self, batch: int, tokens: int, seconds: float) -> None:
        if batch <= 0 or seconds <= 0:
            return
        b = self.bucket(batch)
        self.tokens[b] = self.tokens.get(b, 0.0) + tokens
        self.seconds[b] = self.seconds.get(b, 0.0) + seconds
        self.samples[b] = self.samples.get(b, 0) + 1

    def plateau(self) -> int:
        """The estimate; `max_batch` until the largest bucket seen has enough samples."""
        seen = {
            b: self.tokens[b] / self.seconds[b]
            for b, n in self.samples.items()
            if n >= self.min_samples
        }
        if not seen:
            return self.max_batch
        best = max(seen.values())
        largest = max(seen)
        if best == seen[largest] and largest < self.bucket(self.max_batch):
            return self.max_batch  # still growing at the largest size tried: keep room to try

        return min(self.max_batch, min(b for b, v in seen.items() if v >= self.share * best))
