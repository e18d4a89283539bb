"""EAGLE-3 draft vocabulary: the most frequent target tokens, and the id maps.

EAGLE-3 (SafeAILab/EAGLE ``traineagle3``) gives the draft its own, smaller output
vocabulary: the ``V_draft`` target tokens seen most often in the loss-masked training
text. Two maps tie it to the target vocabulary:

- ``d2t: (V_draft,)`` int64 *offsets*: ``target_id = draft_id + d2t[draft_id]``
  (the convention SafeAILab, SpecForge, vLLM and SGLang all read);
- ``t2d: (V_target,)`` bool: True for target ids that the draft can propose.

Draft ids are ordered by target id (ascending), as EAGLE does, so ``d2t`` is
non-decreasing.
"""
from __future__ import annotations

from typing import Iterable

import torch


def token_frequencies(token_ids: Iterable[torch.Tensor],
                      loss_masks: Iterable[torch.Tensor] | None,
                      vocab_size: int) -> torch.Tensor:
    """Count target tokens over a corpus, only where the loss mask is set.

    token_ids: iterable of LongTensors (any shape, e.g. (T,) or (B, T));
    loss_masks: matching iterable of bool/0-1 tensors of the same shapes, or None to
    count every token. Returns counts: (vocab_size,) int64 on the first batch's device.
    """
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
    masks = iter(loss_masks) if loss_masks is not None else None
    counts = None
    for ids in token_ids:
        flat_ids = ids.reshape(-1).long()
        if masks is not None:
            mask = next(masks, None)
            if mask is None or mask.shape != ids.shape:
                raise ValueError("loss_masks must match token_ids one to one, same shapes; "
                                 f"got ids {tuple(ids.shape)}, mask "
                                 f"{None if mask is None else tuple(mask.shape)}")
            flat_ids = flat_ids[mask.reshape(-1).bool()]
        if flat_ids.numel() and (flat_ids.min() < 0 or flat_ids.max() >= vocab_size):
            raise ValueError(f"token ids must lie in 0..{vocab_size - 1}, got "
                             f"{int(flat_ids.min())}..{int(flat_ids.max())}")
        batch_counts = torch.bincount(flat_ids, minlength=vocab_size)
        counts = batch_counts if counts is None else counts + batch_counts.to(counts.device)
    return counts if counts is not None else torch.zeros(vocab_size, dtype=torch.long)


def build_draft_vocab(counts: torch.Tensor, draft_vocab_size: int
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``draft_vocab_size`` most frequent target tokens as ``(d2t, t2d)``.

    counts: (V_target,) token counts. Ties (including never-seen tokens) go to the lower
    target id, so when fewer than ``draft_vocab_size`` tokens occur the vocabulary is
    padded with the lowest unseen ids, as SafeAILab/EAGLE does.
    Returns d2t: (V_draft,) int64 offsets, t2d: (V_target,) bool.
    """
    if counts.dim() != 1:
        raise ValueError(f"counts must be 1-D (V_target,), got shape {tuple(counts.shape)}")
    target_vocab_size = counts.shape[0]
    if not 1 <= draft_vocab_size <= target_vocab_size:
        raise ValueError(f"draft_vocab_size must lie in 1..{target_vocab_size} (the target "
                         f"vocab size), got {draft_vocab_size}")
    # Stable descending sort: equal counts keep ascending id order.
    order = torch.sort(counts, descending=True, stable=True).indices
    draft_to_target_ids = torch.sort(order[:draft_vocab_size]).values  # (V_draft,)
    offsets = torch.arange(draft_vocab_size, device=counts.device)
    d2t = (draft_to_target_ids - offsets).long()
    t2d = torch.zeros(target_vocab_size, dtype=torch.bool, device=counts.device)
    t2d[draft_to_target_ids] = True
    return d2t, t2d


def draft_target_ids(d2t: torch.Tensor) -> torch.Tensor:
    """Target id of every draft id: (V_draft,) int64, ascending."""
    return torch.arange(d2t.shape[0], device=d2t.device) + d2t


def coverage(t2d: torch.Tensor, target_argmax_ids: torch.Tensor) -> float:
    """Fraction of the target's argmax tokens that the draft vocabulary contains.

    A token outside the draft vocab can never be proposed (docs/METHODS.md §11), so
    this bounds per-token acceptance. t2d: (V_target,) bool; target_argmax_ids: any shape.
    """
    flat_ids = target_argmax_ids.reshape(-1).long()
    if flat_ids.numel() == 0:
        raise ValueError("target_argmax_ids is empty: coverage is undefined")
    return t2d.to(flat_ids.device)[flat_ids].float().mean().item()
