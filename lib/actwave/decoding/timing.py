"""Wall-clock timing of device work: what speculative decoding, its cost model, the
evaluation and the benchmarks time with.

CUDA kernels run asynchronously, so a timer read right after a call measures the launch,
not the work; every reading here first waits for the device's queue (a no-op on CPU).
"""
from __future__ import annotations

import time
from collections import Counter

import torch


def synchronize(device) -> None:
    """Wait for queued CUDA work on ``device`` so wall-clock timings cover it (CPU: no-op)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


class SectionClock:
    """Seconds per named section of a loop, plus the total since construction.

    ``since = clock.lap("verify", since)`` adds the time from ``since`` to now to the
    section and returns now; ``finish()`` -> {section: seconds, ..., "total": seconds}.
    """

    def __init__(self, device: torch.device, sections: tuple[str, ...]):
        self.device, self.totals = device, Counter({section: 0.0 for section in sections})
        self.start = self._now()

    def _now(self) -> float:
        synchronize(self.device)
        return time.perf_counter()

    def lap(self, section: str, since: float) -> float:
        if section not in self.totals:
            raise ValueError(f"unknown timing section {section!r}; allowed: {sorted(self.totals)}")
        now = self._now()
        self.totals[section] += now - since
        return now

    def finish(self) -> dict[str, float]:
        return {**self.totals, "total": self._now() - self.start}
