"""Offline scoring of a long-run draft on held-out text, and the per-position record it stores.

``score`` walks every held-out sequence with the target's stored states and argmax
(``decoding.acceptance.sequence_acceptance``): τ̂, per-step acceptance and agreement, and the
accepted-chain length at every root, stored compactly (``encode_positions``) so that
``decode_walk`` can replay chain decoding on the same greedy text and be checked exactly
against a real decode (``sequence_walk``).
"""
from __future__ import annotations

import base64
import zlib

import numpy as np
import torch

from actwave.decoding.acceptance import decode_walk, sequence_acceptance, tau_hat
from actwave.eagle3.train import TrainData


def root_runs(roots: list[int]) -> list[list[int]]:
    """Sorted root positions -> [[first, length], ...] runs of consecutive positions."""
    runs: list[list[int]] = []
    for root in roots:
        if runs and runs[-1][0] + runs[-1][1] == root:
            runs[-1][1] += 1
        else:
            runs.append([root, 1])
    return runs


def encode_positions(results) -> dict:
    """Per-root accepted lengths of every sequence, compactly: root runs per sequence and
    all accepted values (≤ K < 256) as one zlib-compressed, base64 uint8 array."""
    accepted = np.concatenate([r.accepted.numpy() for r in results]).astype(np.uint8)
    return {"encoding": "roots: [first, length] runs per sequence; accepted: base64(zlib("
                        "uint8)), sequences concatenated in order",
            "roots": [root_runs(r.roots.tolist()) for r in results],
            "accepted": base64.b64encode(zlib.compress(accepted.tobytes(), 9)).decode()}


def decode_positions(positions: dict) -> list[tuple[np.ndarray, np.ndarray]]:
    """``encode_positions`` inverted -> per sequence (roots (R,), accepted (R,)) int64."""
    flat = np.frombuffer(zlib.decompress(base64.b64decode(positions["accepted"])), np.uint8)
    out, offset = [], 0
    for runs in positions["roots"]:
        roots = np.concatenate([np.arange(a, a + n) for a, n in runs] or [np.zeros(0)])
        out.append((roots.astype(np.int64), flat[offset: offset + roots.size].astype(np.int64)))
        offset += roots.size
    return out


def sequence_walk(roots, accepted, n_reply: int) -> tuple[float, int]:
    """The chain-decoding τ and rounds of one reply (``decode_walk`` from its first token);
    NaN, 0 when the roots are not the reply's one contiguous run (multi-turn text)."""
    roots = [int(r) for r in roots]
    if not roots or roots != list(range(roots[0], roots[0] + n_reply - 1)):
        return float("nan"), 0
    return decode_walk(dict(zip(roots, (int(a) for a in accepted))), roots[0], n_reply)


@torch.no_grad()
def score(draft, data: TrainData, depth: int) -> dict:
    """Offline acceptance of ``draft`` on every held-out sequence of ``data`` (the target's
    stored states and argmax): τ̂, per-step acceptance (Π hits) and agreement (hit at step
    i), one row per sequence (roots, accepted, n_reply, walk τ) and the per-position arrays."""
    was_training = draft.training
    draft.eval()
    results = [sequence_acceptance(draft, data.target_states[i].float(), data.input_ids[i],
                                   data.argmax[i], data.loss_mask[i], depth=depth)
               for i in range(len(data))]
    draft.train(was_training)
    roots = max(sum(r.n_roots for r in results), 1)
    rows = []
    for index, result in enumerate(results):
        n_reply = int(data.loss_mask[index].sum())
        walk, rounds = sequence_walk(result.roots.tolist(), result.accepted.tolist(), n_reply)
        rows.append({"roots": result.n_roots,
                     "accepted": int(result.accepted.sum()), "n_reply": n_reply,
                     "walk_tau": walk, "walk_rounds": rounds})
    return {"tau_hat": tau_hat(results), "depth": depth, "n_sequences": len(results),
            "n_roots": sum(r.n_roots for r in results),
            "step_acceptance": (sum(r.reached for r in results) / roots).tolist(),
            "step_agreement": (sum(r.step_hits for r in results) / roots).tolist(),
            "per_sequence": rows, "positions": encode_positions(results)}
