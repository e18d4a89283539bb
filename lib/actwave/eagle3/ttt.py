"""EAGLE-3 training-time test (TTT): the unrolled multi-step draft loss.

EAGLE-3 (Li et al. 2025, arXiv 2503.01840, §3.2 "training-time test") trains the draft
on its own multi-step rollouts. Written from the public descriptions (SafeAILab/EAGLE
``traineagle3``, SpecForge ``core/eagle3.py``; see docs/METHODS.md §12):

- Index t of a sequence x_0..x_{L-1}. Step 0 feeds the fused target state g_t and the
  token x_{t+1}; step i ≥ 1 feeds the draft's own output hidden of step i-1 at the same
  index t and the ground-truth token x_{t+1+i}. Step i at index t predicts x_{t+2+i},
  i.e. it is trained toward the target's distribution at position p = t+1+i.
- RoPE position t+i at step i (SpecForge PR #424 fixed the reuse of t).
- Attention at step i: query t sees the step-0 keys s ≤ t (causal) and, for every
  step 1 ≤ j ≤ i, only the key at the same index t (a diagonal block). The keys of all
  steps sit in one DynamicCache; one additive 4D mask over them per step.
- Loss: Σ_i γ^i · soft cross-entropy(target probs over the draft vocab, renormalised;
  draft log-probs), over positions whose predicted token is in an assistant reply and
  whose target argmax lies in the draft vocab (tokens outside it can never be proposed).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import DynamicCache


def ttt_attention_mask(width: int, step: int, dtype: torch.dtype,
                       device: torch.device | str | None = None) -> torch.Tensor:
    """Additive mask (1, 1, W, (step+1)·W) of TTT step ``step`` over the keys of steps 0..step.

    Block 0 (the step-0 keys) is causal; blocks 1..step are diagonal (query t sees only
    the key at index t of that step). 0 = attend, the dtype's lowest value = blocked.
    """
    if width < 1 or step < 0:
        raise ValueError(f"need width >= 1 and step >= 0, got width={width}, step={step}")
    causal = torch.ones(width, width, dtype=torch.bool, device=device).tril()
    diagonal = torch.eye(width, dtype=torch.bool, device=device)
    allowed = torch.cat([causal] + [diagonal] * step, dim=1)  # (W, (step+1)·W)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=device)
    return mask.masked_fill(~allowed, torch.finfo(dtype).min)[None, None]


def shift_left(values: torch.Tensor, shift: int, fill: int | float = 0) -> torch.Tensor:
    """values: (B, L, ...) -> (B, L, ...), out[:, t] = values[:, t+shift]; ``fill`` past the end."""
    if shift == 0:
        return values
    pad = values.new_full((values.shape[0], shift, *values.shape[2:]), fill)
    return torch.cat([values[:, shift:], pad], dim=1)


def unroll(draft: nn.Module, target_states: torch.Tensor, input_ids: torch.Tensor,
           ttt_steps: int) -> list[torch.Tensor]:
    """Run the TTT unroll; -> per step i the draft logits (B, W, V_draft), W = L-1.

    target_states: (B, L, k·H) target states of the draft's layers at each position t;
    input_ids: (B, L) tokens x_t. Logits of step i at index t predict x_{t+2+i}; the last
    i indices of step i read padding tokens and must be ignored by the caller.
    """
    if ttt_steps < 1:
        raise ValueError(f"ttt_steps must be >= 1, got {ttt_steps}")
    batch, length = input_ids.shape
    width = length - 1
    if width < 1:
        raise ValueError(f"sequences need >= 2 tokens for TTT, got length {length}")
    hidden = draft.fuse(target_states[:, :width])  # (B, W, H)
    positions = torch.arange(width, device=input_ids.device).expand(batch, width)
    cache = DynamicCache()
    step_logits = []
    for step in range(ttt_steps):
        step_ids = shift_left(input_ids, 1 + step)[:, :width]  # x_{t+1+i}, 0 past the end
        mask = ttt_attention_mask(width, step, hidden.dtype, hidden.device)
        out = draft(step_ids, hidden, positions + step, attention_mask=mask,
                    past_key_values=cache)
        step_logits.append(out.logits)
        hidden = out.hidden
    return step_logits


@dataclass
class TTTOutput:
    """loss: scalar Σ γ^i loss_i; per TTT step (S,): loss, top-1 matches, counted positions."""

    loss: torch.Tensor
    step_losses: torch.Tensor
    step_correct: torch.Tensor
    step_counts: torch.Tensor

    def accuracy(self) -> list[float]:
        """Top-1 agreement with the target per step (NaN where no position counted)."""
        counts = self.step_counts.float()
        return (self.step_correct.float() / counts).masked_fill(counts == 0, float("nan")).tolist()


def soft_cross_entropy(draft_logits: torch.Tensor, target_probs: torch.Tensor) -> torch.Tensor:
    """-Σ_v p_target(v) log p_draft(v) per row, in float32: (..., V), (..., V) -> (...)."""
    return -(target_probs.float() * F.log_softmax(draft_logits.float(), dim=-1)).sum(-1)


class TTTLoss(nn.Module):
    """Wraps a draft so that one ``forward`` is one whole TTT unroll + loss (DDP-friendly)."""

    def __init__(self, draft: nn.Module, ttt_steps: int = 7, gamma: float = 0.8):
        super().__init__()
        if not 0.0 < gamma <= 1.0:
            raise ValueError(f"gamma must lie in (0, 1], got {gamma}")
        self.draft = draft
        self.ttt_steps = ttt_steps
        self.gamma = gamma

    def forward(self, target_states: torch.Tensor, input_ids: torch.Tensor,
                target_probs: torch.Tensor, target_argmax: torch.Tensor,
                label_mask: torch.Tensor) -> TTTOutput:
        """One unroll over a batch.

        target_states: (B, L, k·H); input_ids: (B, L); target_probs: (B, L, V_draft) the
        target's next-token distribution at each position over the draft vocab
        (renormalised); target_argmax: (B, L) target ids; label_mask: (B, L) bool, True
        where position p's prediction is trained (x_{p+1} exists and is in a reply).
        """
        step_logits = unroll(self.draft, target_states, input_ids, self.ttt_steps)
        in_vocab = label_mask & self.draft.t2d[target_argmax]  # (B, L)
        losses, correct, counts = [], [], []
        total = target_probs.new_zeros((), dtype=torch.float32)
        for step, logits in enumerate(step_logits):
            first = 1 + step  # index t of step i is scored against position t+1+i
            trained = in_vocab[:, first:]  # (B, L-1-i)
            scored = logits[:, : logits.shape[1] - step]  # (B, L-1-i, V_draft)
            # Weighting by the mask (not gathering rows) avoids a scatter in the backward pass.
            per_position = soft_cross_entropy(scored, target_probs[:, first:])  # (B, L-1-i)
            step_loss = (per_position * trained).sum() / trained.sum().clamp(min=1)
            total = total + self.gamma ** step * step_loss
            with torch.no_grad():
                counted = label_mask[:, first:]
                guess = self.draft.draft_to_target(scored.argmax(-1))
                hits = (guess == target_argmax[:, first:]) & counted
                correct.append(hits.sum())
                counts.append(counted.sum())
            losses.append(step_loss.detach())
        return TTTOutput(loss=total, step_losses=torch.stack(losses),
                         step_correct=torch.stack(correct), step_counts=torch.stack(counts))
