"""Speculative decoding with an EAGLE-3 draft: chain or EAGLE-2 dynamic tree, batch 1.

One round (EAGLE, Li et al. 2024/2025; loop structure after gpt-fast's
``speculative_decode``):

1. *catch-up*: the draft runs over the positions the target just verified, with the true
   fused target states, extending its cache (its cache only ever holds rows built from
   target features); its last row proposes the root's children.
2. *draft*: ``tree.build_tree`` grows a chain (top-1, ``depth`` tokens) or an EAGLE-2
   tree; expansion rows are dropped from the draft cache afterwards.
3. *verify*: one target forward over [root; tree nodes] with the tree attention mask
   and per-node positions L + depth, returning logits and the draft's k layer states
   (hooks; not all N+1). Grouped-query attention runs on the key/value heads with the
   queries packed per group (``packed_gqa_attention``), so the cache is never repeated.
4. *accept*: greedy — the longest path whose every token equals the target argmax at its
   parent, then the bonus token = argmax after the last accepted node; sampling —
   recursive rejection sampling without replacement down the tree (exact in law).
   The target cache keeps the rows of the accepted path, in order.

With ``shape.lookup`` > 0 (greedy), a round whose context repeats an earlier n-gram is a
*lookup round* (``actwave.decoding.lookup``): steps 1–2 are replaced by the copied chain of
tokens that followed the earlier occurrence, and the draft catches up over those rounds'
tokens at its next round.

τ = tokens emitted by verification rounds / verification rounds (bonus included, the
prefill token excluded), as in EAGLE's evaluation.

The tree is one ``TreeShape`` argument; ``actwave.decoding.costmodel.auto_shape`` picks one
from the target's measured verification cost curve and the draft's per-depth acceptance
(the caller resolves it: this module does not import the cost model).
"""
from __future__ import annotations

import weakref
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Sequence

import torch
from transformers import AttentionInterface, DynamicCache
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from actwave.capture.forward import forward_with_states
from actwave.decoding.timing import SectionClock
from actwave.decoding.lookup import NgramIndex
from actwave.decoding.tree import DraftTree, TreeShape, build_tree, target_tree_mask, token_chain

SECTIONS = ("prefill", "catch_up", "tree", "verify", "accept")
PACKED_ATTENTION = "actwave_packed_gqa"


@dataclass
class SpecResult:
    """tokens: new ids (stopping at and including EOS); accept_counts[a] = rounds that
    accepted a draft tokens; timings in seconds per section (``SECTIONS``: prefill, draft
    catch-up, tree drafting, verification forward, acceptance + cache bookkeeping) and
    total; shape: the tree used (with the cost model's prediction when it picked it);
    lookup_rounds: rounds that verified a copied chain instead of a draft tree."""

    tokens: list[int]
    tau: float
    accept_counts: list[int]
    target_forwards: int
    draft_forwards: int
    timings: dict[str, float] = field(default_factory=dict)
    shape: TreeShape = field(default_factory=TreeShape)
    lookup_rounds: int = 0


@dataclass
class GreedyResult:
    """Plain greedy decoding: new ids and timings (prefill, decode, total seconds)."""

    tokens: list[int]
    target_forwards: int
    timings: dict[str, float] = field(default_factory=dict)


def _check_inputs(input_ids, max_new_tokens: int) -> None:
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        raise ValueError(f"input_ids must be a (1, T) tensor of token ids, got "
                         f"{type(input_ids).__name__} {tuple(getattr(input_ids, 'shape', ()))}")
    if input_ids.shape[0] != 1:
        raise ValueError(f"only batch size 1 is supported, got input_ids of shape {tuple(input_ids.shape)}")
    if input_ids.shape[1] == 0:
        raise ValueError("empty prompt: input_ids must hold at least one token")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")


def _check_temperature(temperature: float) -> None:
    if not temperature >= 0.0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature!r}")


def _check_spec_inputs(target, draft, input_ids, max_new_tokens: int, shape,
                       temperature: float) -> None:
    """``generate``'s arguments: token ids of the target's vocabulary, a ``TreeShape``,
    lookup rounds only at temperature 0, a draft made for this target."""
    _check_inputs(input_ids, max_new_tokens)
    vocab_size = target.get_input_embeddings().weight.shape[0]
    if input_ids.is_floating_point() or input_ids.min() < 0 or input_ids.max() >= vocab_size:
        raise ValueError(f"input_ids must be integer token ids in 0..{vocab_size - 1} (the "
                         f"target's vocabulary), got {input_ids.dtype} values "
                         f"{int(input_ids.min())}..{int(input_ids.max())}")
    if not isinstance(shape, TreeShape):
        raise ValueError(f"shape must be a TreeShape, got {type(shape).__name__}")
    _check_temperature(temperature)
    if shape.lookup and temperature != 0.0:
        raise ValueError(f"shape.lookup={shape.lookup} needs temperature 0 (greedy): a copied "
                         f"chain has no draft distribution to rejection-sample against, got "
                         f"temperature={temperature!r}")
    draft.check_target(target)


def _finish_tokens(tokens: list[int], max_new_tokens: int, eos: set[int]) -> list[int]:
    """Cut at max_new_tokens and after the first stop token."""
    tokens = tokens[:max_new_tokens]
    stop = next((i for i, token in enumerate(tokens) if token in eos), None)
    return tokens if stop is None else tokens[: stop + 1]


def _pick(logits: torch.Tensor, temperature: float, generator) -> int:
    """Argmax (T=0) or a draw from softmax(logits / T): logits (V,)."""
    if temperature == 0.0:
        return int(logits.argmax())
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


def keep_cache_rows(cache: DynamicCache, start: int, rows: torch.Tensor) -> None:
    """Keep cache positions [0, start) followed by start + rows (in that order), every layer.

    Moves only the kept tree rows into place and slices: no copy of the committed prefix,
    and no move at all when the kept rows are already in place (a chain prefix 0, 1, .., a).
    """
    end = start + len(rows)
    in_place = rows.tolist() == list(range(len(rows)))  # a chain prefix: nothing to move
    for layer in cache.layers:
        for name in ("keys", "values"):
            tensor = getattr(layer, name)  # (B, heads, L + n, head_dim)
            if not in_place:
                tensor[..., start:end, :] = tensor[..., start + rows.to(tensor.device), :]
            setattr(layer, name, tensor[..., :end, :])


def packed_gqa_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                         is_causal=None, **kwargs):
    """SDPA for several queries under a mask without repeating the key/value cache.

    HF's SDPA path repeats every cached key/value head for each query head it serves
    (``repeat_kv``) when a mask is given and more than one query comes in — a copy of the
    whole cache per layer per verification. Here the q queries of the r heads of a group
    are packed into r·q rows that attend to the group's single key/value head.
    query (B, H, q, d), key/value (B, H_kv, S, d), mask (1|B, 1, q, S) -> (B, q, H, d).
    """
    groups = getattr(module, "num_key_value_groups", 1)
    if groups == 1 or query.shape[2] == 1 or attention_mask is None or dropout:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, is_causal=is_causal, **kwargs)
    batch, heads, q, dim = query.shape
    packed = query.reshape(batch, heads // groups, groups * q, dim)  # head h = group h // r
    mask = _packed_mask(attention_mask, groups, key.shape[2])  # (1|B, 1, r·q, S)
    out = torch.nn.functional.scaled_dot_product_attention(packed, key, value, attn_mask=mask,
                                                           scale=scaling)
    return out.reshape(batch, heads, q, dim).transpose(1, 2).contiguous(), None


AttentionInterface.register(PACKED_ATTENTION, packed_gqa_attention)

_packed_masks: dict = {}  # (id(mask), groups, length) -> (weakref to the mask, packed mask)


def _packed_mask(attention_mask: torch.Tensor, groups: int, length: int) -> torch.Tensor:
    """The mask (1|B, 1, q, S) sliced to ``length`` keys and repeated per packed head.

    Every layer of one forward receives the same mask object (one per attention type:
    Gemma-3 alternates a sliding-window and a full one), so each repeat is made once and
    reused (measured: the per-layer repeat cost ~1.5 ms of a ~40 ms SmolLM2 verification on
    2 CPU cores). The weak reference makes a hit require that very tensor still be alive: a
    new mask never inherits a dead one's entry, even at a reused id.
    """
    key = (id(attention_mask), groups, length)
    hit = _packed_masks.get(key)
    if hit is not None and hit[0]() is attention_mask:
        return hit[1]
    if len(_packed_masks) >= 4:  # the masks of past forwards
        _packed_masks.clear()
    packed = attention_mask[:, :, :, :length].repeat(1, 1, groups, 1)
    _packed_masks[key] = (weakref.ref(attention_mask), packed)
    return packed


@contextmanager
def attention_implementation(target, implementation: str):
    """Run the target's attention layers with a registered attention function."""
    configs = {id(c): c for c in (target.config, target.config.get_text_config())}.values()
    before = [c._attn_implementation for c in configs]
    try:
        for config in configs:
            config._attn_implementation_internal = implementation
        yield
    finally:
        for config, value in zip(configs, before):
            config._attn_implementation_internal = value


def verify_forward(target, layer_ids, tree: DraftTree, cache, committed: int):
    """One target forward over ``tree`` on a cache of ``committed`` tokens.

    -> (logits (n, V), states (1, n, k·D)); the cache grows by n rows (``keep_cache_rows``
    keeps the accepted ones).
    """
    mask = target_tree_mask(tree, committed, target.config.get_text_config(),
                            target.get_output_embeddings().weight.dtype)
    positions = (committed + tree.depths)[None]
    implementation = target.config._attn_implementation
    packed = PACKED_ATTENTION if implementation == "sdpa" else implementation
    with attention_implementation(target, packed):
        logits, states, _ = forward_with_states(target, layer_ids, tree.tokens[None], cache=cache,
                                                position_ids=positions, attention_mask=mask)
    return logits[0], states


def accept_round(tree: DraftTree, logits: torch.Tensor, states: torch.Tensor, cache, committed: int,
                 temperature: float = 0.0, draft=None, generator=None):
    """Acceptance and bookkeeping after ``verify_forward``.

    -> (new tokens [accepted..., bonus], states of the accepted path (1, a+1, k·D)); the
    cache keeps the accepted rows after its ``committed`` tokens.
    """
    if temperature == 0.0:
        path, next_token = accept_greedy(tree, logits)
    else:
        path, next_token = accept_sampling(tree, logits, draft, temperature, generator)
    path_rows = torch.tensor(path, device=tree.tokens.device)
    keep_cache_rows(cache, committed, path_rows)
    return tree.tokens[path_rows[1:]].tolist() + [next_token], states[:, path_rows]


def accept_greedy(tree: DraftTree, target_logits: torch.Tensor) -> tuple[list[int], int]:
    """Longest path matching the target argmax at each parent -> (node path from root, bonus)."""
    target_next = target_logits.argmax(-1).tolist()  # (n,) target's choice after each node
    tokens = tree.tokens.tolist()
    path = [0]
    while True:
        match = [c for c in tree.children[path[-1]] if tokens[c] == target_next[path[-1]]]
        if not match:
            return path, target_next[path[-1]]
        path.append(match[0])


def accept_sampling(tree: DraftTree, target_logits: torch.Tensor, draft, temperature: float,
                    generator) -> tuple[list[int], int]:
    """Recursive rejection sampling without replacement (Jeon et al. 2024) down the tree.

    At an accepted node with target probs p and children x_1.. drawn without replacement
    from the draft's q: accept x_i with prob min(1, p(x_i)/q(x_i)); on rejection
    p ← norm(max(p − q, 0)) and q ← q with x_i removed, renormalised. If no child is
    accepted, the next token is drawn from the residual p. Output ~ target distribution.
    """
    tokens = tree.tokens.tolist()
    target_probs = torch.softmax(target_logits.float() / temperature, dim=-1)  # (n, V)
    path = [0]
    while True:
        node = path[-1]
        p = target_probs[node]
        chosen = None
        if tree.children[node]:
            q = torch.zeros_like(p)
            row_q = tree.child_logq[node].exp()  # (V_draft,)
            q[draft.draft_to_target(torch.arange(len(row_q), device=row_q.device))] = row_q
            for child in tree.children[node]:
                token = tokens[child]
                u = torch.rand((), generator=generator, device=p.device)
                if u * q[token] < p[token]:
                    chosen = child
                    break
                p, q = _residual(p, q), q.clone()
                q[token] = 0.0
                q = q / q.sum().clamp_min(1e-30)
        if chosen is None:
            return path, int(torch.multinomial(p, 1, generator=generator))
        path.append(chosen)


def _residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(p − q, 0)); p itself when p ≤ q everywhere (rejection then had prob 0)."""
    residual = (p - q).clamp_min(0.0)
    total = residual.sum()
    return residual / total if total > 0 else p


@torch.no_grad()
def generate(target, draft, input_ids: torch.Tensor, max_new_tokens: int, *,
             shape: TreeShape = TreeShape(), temperature: float = 0.0,
             eos_token_ids: Sequence[int] = (), seed: int = 0) -> SpecResult:
    """Speculative decoding of ``input_ids`` (1, T) with an EAGLE-3 ``draft`` of ``target``.

    shape: the draft tree (``TreeShape``: chain or EAGLE-2 dynamic tree; the default is the
    fixed tree; ``actwave.decoding.costmodel.auto_shape`` picks one for this draft and
    machine). temperature 0: output equals greedy decoding of the target; > 0: output is
    distributed as the target's sampling. The shape used is ``result.shape``.
    """
    _check_spec_inputs(target, draft, input_ids, max_new_tokens, shape, temperature)
    device, eos = input_ids.device, set(int(t) for t in eos_token_ids)
    generator = torch.Generator(device).manual_seed(seed) if temperature > 0 else None
    clock = SectionClock(device, SECTIONS)
    target_cache, draft_cache = DynamicCache(), DynamicCache()
    logits, states, _ = forward_with_states(target, draft.layer_ids, input_ids,
                                            logits_to_keep=1, cache=target_cache)
    tokens = [_pick(logits[0, -1], temperature, generator)]
    committed = input_ids.shape[1]  # tokens in the target cache; the root sits here
    pending_ids, pending_start = input_ids[0, 1:].tolist() + tokens, 0
    accepted: Counter = Counter()
    draft_forwards = 0
    history = NgramIndex(input_ids[0].tolist() + tokens) if shape.lookup else None
    lookup_rounds = 0
    tick = clock.lap("prefill", clock.start)
    # a stop token ends the run wherever a round accepted it, not only as its last token
    while len(tokens) < max_new_tokens and eos.isdisjoint(tokens):
        copied = history.propose(shape.lookup) if history else []
        if copied:  # a lookup round: the draft's catch-up waits for its next round
            drafted = token_chain(torch.tensor(tokens[-1:] + copied, device=device))
            lookup_rounds += 1
        else:
            positions = torch.arange(pending_start, committed, device=device)[None]
            hidden = draft.fuse(states.to(draft.fc.weight.dtype))  # (1, m, H)
            out = draft(torch.tensor([pending_ids], device=device), hidden, positions, None,
                        draft_cache, logits_to_keep=1)
            tick = clock.lap("catch_up", tick)
            drafted, expansions = build_tree(draft, draft_cache, tokens[-1], out.logits[0, -1],
                                             out.hidden[0, -1], depth=shape.depth,
                                             top_k=shape.top_k, total_tokens=shape.total_tokens,
                                             temperature=temperature, generator=generator)
            draft_forwards += 1 + expansions
            pending_ids, pending_start, states = [], committed, states[:, :0]
        tick = clock.lap("tree", tick)
        logits, round_states = verify_forward(target, draft.layer_ids, drafted, target_cache,
                                              committed)
        tick = clock.lap("verify", tick)
        new_tokens, round_states = accept_round(drafted, logits, round_states, target_cache,
                                                committed, temperature, draft, generator)
        accepted[len(new_tokens) - 1] += 1
        pending_ids = pending_ids + new_tokens  # what the draft has yet to catch up on
        states = torch.cat([states, round_states], dim=1)  # (1, committed' - pending_start, k·D)
        committed += len(new_tokens)
        tokens += new_tokens
        if history:
            history.extend(new_tokens)
        tick = clock.lap("accept", tick)
    tokens = _finish_tokens(tokens, max_new_tokens, eos)
    rounds = sum(accepted.values())
    histogram = [accepted[a] for a in range(max(accepted, default=-1) + 1)]
    return SpecResult(tokens=tokens, tau=(len(tokens) - 1) / rounds if rounds else float("nan"),
                      accept_counts=histogram, target_forwards=1 + rounds,
                      draft_forwards=draft_forwards, timings=clock.finish(), shape=shape,
                      lookup_rounds=lookup_rounds)


@torch.no_grad()
def greedy_generate(target, input_ids: torch.Tensor, max_new_tokens: int,
                    eos_token_ids: Sequence[int] = ()) -> GreedyResult:
    """Plain greedy decoding with a KV cache, one target forward per token (the baseline)."""
    _check_inputs(input_ids, max_new_tokens)
    eos = set(int(t) for t in eos_token_ids)
    clock = SectionClock(input_ids.device, ("prefill", "decode"))
    cache = DynamicCache(config=target.config)  # HF's own cache (sliding layers where used)
    logits = target(input_ids=input_ids, cache=cache, use_cache=True,
                    logits_to_keep=1).logits
    tokens = [int(logits[0, -1].argmax())]
    tick = clock.lap("prefill", clock.start)
    while len(tokens) < max_new_tokens and tokens[-1] not in eos:
        step = torch.tensor([[tokens[-1]]], device=input_ids.device)
        logits = target(input_ids=step, cache=cache, use_cache=True).logits
        tokens.append(int(logits[0, -1].argmax()))
    clock.lap("decode", tick)
    return GreedyResult(tokens=tokens, target_forwards=len(tokens), timings=clock.finish())
