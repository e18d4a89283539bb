"""Warmup-stable-decay (WSD) learning rates with decay branches, for drafts scored at many budgets.

Why: a cosine schedule decays over the run's own length, so a draft scored at step b of a
run planned for 4b is scored at a high learning rate, and one planned for exactly b is
scored fully decayed. On SmolLM2 the schedule alone (cosine over 64 steps vs over 256 steps
scored at 64) moved τ̂ by +0.035, more than any layer-set difference: layer sets must be
compared at matched, *decayed* checkpoints. Separate cosine runs for every budget b cost
Σ_b b steps. WSD (Hu et al. 2024, "MiniCPM"; Hägele et al. 2024, "Scaling laws and
compute-optimal training beyond fixed training durations") gets every budget from one run:

- one *trunk* per (set, seed): linear warmup, then a constant learning rate; it never decays;
- per scored budget b a *branch*: it starts from the trunk's checkpoint at step b − d_b and
  decays the learning rate linearly to 0 over d_b = max(⌈fraction·b⌉, minimum) steps,
  reaching 0 at step b. The branch is scored; the trunk goes on.

Cost: trunk up to the last branch point + Σ_b d_b steps, vs Σ_b b for separate runs
(``cost``; e.g. budgets 64/256/1024/2048, 20 %, minimum 16: 2,321 steps vs 3,392).
Every factor is a pure function of the step, so a branch resumed from the trunk's
checkpoint is bit-identical to one run straight through with its schedule (tested).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial


def wsd_factor(step: int, warmup_steps: int, decay_start: int | None = None,
               decay_end: int | None = None) -> float:
    """LR factor at ``step`` (0-based; the factor of the step's optimizer update).

    Linear warmup (step+1)/warmup_steps as ``train.lr_factor``, then 1; with a decay
    window, 1 − (step − decay_start)/(decay_end − decay_start) from ``decay_start`` on,
    so the last step before ``decay_end`` trains at 1/d and the factor is 0 at decay_end.
    """
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if decay_start is None or step < decay_start:
        return 1.0
    return max(0.0, (decay_end - step) / (decay_end - decay_start))


@dataclass(frozen=True)
class WSDSchedule:
    """The trunk's warmup and the scored budgets (steps) with their decay lengths."""

    warmup_steps: int
    budgets: tuple[int, ...]
    decay_fraction: float = 0.2
    min_decay: int = 16

    def __post_init__(self):
        if list(self.budgets) != sorted(set(self.budgets)) or not self.budgets:
            raise ValueError(f"budgets must be increasing and distinct, got {self.budgets}")
        if not 0.0 < self.decay_fraction <= 1.0 or self.min_decay < 1:
            raise ValueError(f"need 0 < decay_fraction <= 1 and min_decay >= 1, got "
                             f"{self.decay_fraction}, {self.min_decay}")
        for budget in self.budgets:  # a branch starts from a trunk checkpoint after warmup
            if self.branch_start(budget) < max(1, self.warmup_steps):
                raise ValueError(f"budget {budget}: its decay ({self.decay_steps(budget)} steps)"
                                 f" would start before step max(1, warmup={self.warmup_steps})")

    def decay_steps(self, budget: int) -> int:
        """d_b = max(⌈fraction·b⌉, minimum), at most b."""
        return min(budget, max(math.ceil(self.decay_fraction * budget), self.min_decay))

    def branch_start(self, budget: int) -> int:
        """The trunk step the branch of ``budget`` starts from: b − d_b."""
        return budget - self.decay_steps(budget)

    @property
    def trunk_steps(self) -> int:
        """How far the trunk runs: to the last branch point."""
        return max(self.branch_start(b) for b in self.budgets)

    def trunk(self):
        """step -> factor of the trunk (warmup, then constant)."""
        return partial(wsd_factor, warmup_steps=self.warmup_steps)

    def branch(self, budget: int):
        """step -> factor of the branch scored at ``budget`` (the trunk's up to b − d_b)."""
        return partial(wsd_factor, warmup_steps=self.warmup_steps,
                       decay_start=self.branch_start(budget), decay_end=budget)


def cost(schedule: WSDSchedule) -> dict[str, int]:
    """Optimizer steps per (set, seed): trunk + Σ d_b (``wsd``) vs Σ b (``separate``,
    one cosine run per budget)."""
    decays = sum(schedule.decay_steps(b) for b in schedule.budgets)
    return {"trunk": schedule.trunk_steps, "branches": decays,
            "wsd": schedule.trunk_steps + decays, "separate": sum(schedule.budgets)}
