"""Offline acceptance: the τ a draft would reach on a text, without running generation.

Chain speculative decoding (``actwave.decoding.speculative.generate(mode="chain", depth=K)``) starts
each round at a *root*: the last emitted token x_c, which the target has not seen yet. The
draft's catch-up row at index c−1 (true fused target state g_{c−1}, token x_c, position
c−1) proposes x̂_{c+1}; each later draft step feeds back its own output hidden at the same
index, with the proposed token and position c−1+i. That is exactly step i of the
training-time-test unroll (``actwave.eagle3.ttt.unroll``) at index t = c−1, with the
ground-truth token as input — and along an accepted path the proposed token *is* the
ground-truth one. So one batched unroll over a text scores every possible round at once.

Per root c and step i (0-based), on a text x that the target decodes greedily:
    hit_i(c) = [draft's step-i proposal = x_{c+1+i}] ∧ [x_{c+1+i} = target argmax after x_{c+i}]
    accepted(c) = number of leading hits (≤ K)
The second factor makes the rule exact on greedy text and conservative elsewhere (the
chain stops where the text leaves the target's greedy path). The top-k variant counts a
hit when x_{c+1+i} is among the draft's top-k proposals: the acceptance of a full k-ary
tree of depth K (not EAGLE-2's pruned tree).

Two estimators of τ (see docs/METHODS.md, "Offline acceptance"):
- ``tau_hat`` = 1 + mean over all roots of accepted(c): every position is a root, so it
  has far less variance than a decoding run; this is what the layer-set study compares.
- ``decode_walk``: the roots a decoding run actually visits (c, then c + accepted(c) + 1,
  …) and τ = (tokens − 1) / rounds as ``speculative.generate`` reports it. On the target's
  own greedy output it equals chain decoding's τ exactly (tested).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from actwave.eagle3.ttt import shift_left, unroll


@dataclass
class SequenceAcceptance:
    """Acceptance of one sequence's rounds.

    accepted: (R,) int, leading hits per root; reached: (K,) int, roots whose chain
    reached step i (Π_{j≤i} hit_j summed over roots); roots: (R,) positions c of the roots;
    step_hits: (K,) int, roots whose step-i proposal is a hit whatever the earlier steps
    did (the per-TTT-step agreement on greedy text).
    """

    accepted: torch.Tensor
    reached: torch.Tensor
    roots: torch.Tensor
    step_hits: torch.Tensor | None = None

    @property
    def n_roots(self) -> int:
        return int(self.roots.numel())


def leading_hits(hits: torch.Tensor) -> torch.Tensor:
    """hits: (..., K) bool -> (...,) int, the number of leading True values."""
    return hits.long().cumprod(dim=-1).sum(dim=-1)


@torch.no_grad()
def step_proposals(draft, target_states: torch.Tensor, input_ids: torch.Tensor, depth: int,
                   top_k: int = 1) -> torch.Tensor:
    """The draft's top-k target-id proposals per index and step.

    target_states: (B, L, k·D) the draft's layers; input_ids: (B, L) -> (B, L−1, K, top_k);
    [b, t, i] are step i's proposals at index t, i.e. candidates for x_{t+2+i}.
    """
    step_logits = unroll(draft, target_states.to(draft.fc.weight.dtype), input_ids, depth)
    proposals = [draft.draft_to_target(logits.topk(top_k, dim=-1).indices)  # (B, W, top_k)
                 for logits in step_logits]
    return torch.stack(proposals, dim=2)  # (B, W, K, top_k)


def chain_hits(proposals: torch.Tensor, input_ids: torch.Tensor, target_argmax: torch.Tensor,
               in_reply: torch.Tensor) -> torch.Tensor:
    """hit_i(c) for every root c = t+1 (see module docstring).

    proposals: (B, W, K, top_k) from ``step_proposals`` (W = L−1); input_ids, target_argmax,
    in_reply: (B, L) -> (B, W, K) bool; steps reaching past the text or the reply are misses.
    """
    batch, width, depth, _ = proposals.shape
    hits = []
    for step in range(depth):
        truth = shift_left(input_ids, 2 + step, fill=-1)[:, :width]  # x_{t+2+i}
        greedy = shift_left(target_argmax, 1 + step, fill=-2)[:, :width] == truth
        valid = shift_left(in_reply, 2 + step, fill=False)[:, :width].bool()
        proposed = (proposals[:, :, step] == truth[..., None]).any(-1)
        hits.append(proposed & greedy & valid)
    return torch.stack(hits, dim=-1)  # (B, W, K)


def root_mask(in_reply: torch.Tensor) -> torch.Tensor:
    """(B, L) bool -> (B, W) bool: index t is a round when x_{t+1} and x_{t+2} are reply tokens
    (the root was emitted and there is a next reply token to propose)."""
    reply = in_reply.bool()
    return reply[:, 1:] & shift_left(reply, 2, fill=False)[:, : reply.shape[1] - 1]


@torch.no_grad()
def sequence_acceptance(draft, target_states: torch.Tensor, input_ids: torch.Tensor,
                        target_argmax: torch.Tensor, in_reply: torch.Tensor, depth: int,
                        top_k: int | tuple[int, ...] = 1):
    """Offline acceptance of one sequence (all (L,) tensors but states (L, k·D)).

    ``top_k`` an int -> one SequenceAcceptance; a tuple -> one per value, from a single
    unroll (the top-1 proposal is the first of the top-k).
    """
    top_ks = (top_k,) if isinstance(top_k, int) else tuple(top_k)
    if input_ids.dim() != 1 or input_ids.numel() < 3:
        raise ValueError(f"need one sequence of >= 3 tokens, got shape {tuple(input_ids.shape)}")
    if depth < 1 or min(top_ks) < 1:
        raise ValueError(f"depth and top_k must be >= 1, got depth={depth}, top_k={top_k}")
    device = draft.fc.weight.device
    ids, argmax, reply = (x[None].to(device) for x in (input_ids, target_argmax, in_reply))
    proposals = step_proposals(draft, target_states[None].to(device), ids, depth, max(top_ks))
    rounds = root_mask(reply)[0]  # (W,)
    results = []
    for k in top_ks:
        hits = chain_hits(proposals[..., :k], ids, argmax, reply)[0]  # (W, K)
        reached = hits.long().cumprod(dim=-1)[rounds].sum(dim=0)  # (K,)
        results.append(SequenceAcceptance(accepted=leading_hits(hits[rounds]).cpu(),
                                          reached=reached.cpu(),
                                          roots=(rounds.nonzero().squeeze(1) + 1).cpu(),
                                          step_hits=hits[rounds].long().sum(dim=0).cpu()))
    return results[0] if isinstance(top_k, int) else tuple(results)


def tau_hat(results: list[SequenceAcceptance]) -> float:
    """1 + mean accepted tokens over every root of every sequence (NaN without roots)."""
    roots = sum(r.n_roots for r in results)
    if roots == 0:
        return float("nan")
    return 1.0 + sum(int(r.accepted.sum()) for r in results) / roots


def decode_walk(accepted_at: dict[int, int], first: int, n_new: int) -> tuple[float, int]:
    """τ and rounds of a decoding run over a generated text, from per-root acceptance.

    accepted_at: root position c -> accepted(c) for every c in [first, first + n_new − 2];
    first: position of the first generated token (emitted by the prefill, not a round);
    n_new: generated tokens. Rounds start at ``first`` and jump by accepted + 1 until
    n_new tokens are out; τ = (n_new − 1) / rounds, as ``speculative.generate`` reports.
    """
    if n_new < 2:
        return float("nan"), 0
    emitted, root, rounds = 1, first, 0
    while emitted < n_new:
        step = accepted_at[root] + 1
        emitted, root, rounds = emitted + step, root + step, rounds + 1
    return (n_new - 1) / rounds, rounds


@torch.no_grad()
def text_acceptance(target, draft, ids: torch.Tensor, reply_start: int, depth: int,
                    top_k: int | tuple[int, ...] = 1):
    """``sequence_acceptance`` of one text ``ids`` (L,) (prompt + reply, the reply from
    ``reply_start``), after one target forward over it for the draft's layers and argmax."""
    from actwave.capture.forward import forward_with_states

    logits, states, _ = forward_with_states(target, draft.layer_ids, ids[None])
    in_reply = torch.arange(ids.numel(), device=ids.device) >= reply_start
    return sequence_acceptance(draft, states[0], ids, logits[0].argmax(-1), in_reply, depth,
                               top_k=top_k)


def text_walk(target, draft, prompt_ids: list[int], reply_ids: list[int],
              depth: int) -> tuple[float, int]:
    """The offline decoding walk (τ, rounds) of ``draft`` over ``reply_ids`` generated after
    ``prompt_ids``: ``text_acceptance`` from the reply's first token on, ``decode_walk``. On
    the target's greedy reply it is the τ chain decoding of depth ``depth`` reports."""
    sequence = torch.tensor(list(prompt_ids) + list(reply_ids), device=draft.fc.weight.device)
    result = text_acceptance(target, draft, sequence, len(prompt_ids), depth)
    return decode_walk(dict(zip(result.roots.tolist(), result.accepted.tolist())),
                       len(prompt_ids), len(reply_ids))


def walk_check(target, drafts: dict, records, depth: int):
    """Per chain-decoding record of each draft in ``drafts`` ({label: Eagle3Draft}): the
    decoded τ and rounds beside the offline walk over the same greedy text (``text_walk``;
    the prompt from our greedy record of the same prompt and turn) and whether they are
    equal. records: ``evaluate``'s records table -> DataFrame, one row per record."""
    import pandas as pd

    key = ["benchmark", "prompt_id", "turn"]
    greedy = records[records["method"] == "greedy"].set_index(key)
    rows = []
    for record in records[records["method"].isin(list(drafts))].itertuples(index=False):
        reference = greedy.loc[tuple(getattr(record, k) for k in key)]
        if reference["prompt_ids"] is None:
            raise ValueError(f"the greedy record of {record.benchmark} {record.prompt_id} "
                             "holds no prompt_ids (a run made before they were stored); rerun it")
        tau, rounds = text_walk(target, drafts[record.method], reference["prompt_ids"],
                                record.tokens, depth)
        decoded_rounds = sum(record.accept_counts)
        rows.append({"label": record.method, "benchmark": record.benchmark,
                     "prompt_id": record.prompt_id, "turn": record.turn,
                     "n_tokens": record.n_tokens, "decoding_tau": record.tau,
                     "decoding_rounds": decoded_rounds, "walk_tau": tau, "walk_rounds": rounds,
                     "equal": rounds == decoded_rounds and (tau == record.tau or (
                         math.isnan(tau) and math.isnan(record.tau)))})
    return pd.DataFrame(rows)
