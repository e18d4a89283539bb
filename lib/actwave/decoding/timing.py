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


# A process stopped mid-measurement (SIGSTOP to pause a worker, a suspended laptop, a
# preempted VM) keeps the wall clock running but spends no CPU time: its seconds measure the
# stop, not the method. A method on a CPU target computes all along, so CPU time under
# STALL_SHARE of the wall time marks a stop (one thread beside two busy processes on two
# cores still gets ~2/3); the caller times it again (``evaluate._timed``: tokens are
# deterministic, only the time changes).
STALL_SHARE = 0.25
STALL_MIN_SECONDS = 1.0
STALL_RETRIES = 2


def stalled(wall_seconds: float, cpu_seconds: float, device: torch.device) -> bool:
    """Whether a CPU measurement spent most of its wall time stopped (see STALL_SHARE)."""
    return (device.type == "cpu" and wall_seconds > STALL_MIN_SECONDS
            and cpu_seconds < STALL_SHARE * wall_seconds)


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
