"""Prompt-lookup rounds beside the draft: copy the text's own continuation when it repeats.

Prompt lookup decoding (Saxena 2023; HF's ``prompt_lookup_num_tokens``; SGLang's n-gram
speculation) proposes, after a context whose last n tokens already occurred earlier in the
prompt or the reply, the tokens that followed that earlier occurrence. Greedy replies of
small models copy a lot — function signatures and docstrings in HumanEval, repeated phrases
in chat — so on those rounds a copied chain is both cheaper (no draft forward) and longer
than what the draft would propose.

``speculative.generate`` with ``TreeShape.lookup = m > 0`` (greedy only) runs a *lookup
round* whenever the last ``MIN_NGRAM``..``MAX_NGRAM`` tokens match an earlier occurrence:
it verifies the chain of the ≤ m tokens that followed the most recent one, and defers the
draft's catch-up to the next draft round (the draft then catches up over every token since
its last round). Other rounds are ordinary draft rounds. Verification is the same greedy
acceptance, so the output is still the target's greedy decoding.

A 1-gram match is too weak a signal to skip the draft: on greedy replies to MT-bench and
HumanEval prompts (SmolLM2-135M, the benchmark draft), lookup rounds triggered by ≥ 2-gram
matches gave more tokens per second than 1-gram ones in a development-time simulation on the
measured cost curve; the longest match (up to ``MAX_NGRAM`` = 3) is preferred, its
continuation being the likelier to hold. ``lookup_stats`` gives the cost model what it needs
to choose m.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Sequence

import torch

from actwave.decoding.tree import TreeShape

MIN_NGRAM, MAX_NGRAM = 2, 3


class NgramIndex:
    """The token history with, per n-gram (n = MIN_NGRAM..MAX_NGRAM), the end position of its
    most recent occurrence *before* the last token (so the current suffix never matches
    itself)."""

    def __init__(self, tokens: list[int]):
        self.tokens: list[int] = []
        self.last_end: dict[tuple[int, ...], int] = {}
        self.extend(tokens)

    def extend(self, tokens: list[int]) -> None:
        """Append tokens; index the n-grams ending at every position but the new last one."""
        for token in tokens:
            self._index_end(len(self.tokens) - 1)  # the old last position is no longer the suffix
            self.tokens.append(int(token))

    def _index_end(self, end: int) -> None:
        for n in range(MIN_NGRAM, MAX_NGRAM + 1):
            if end - n + 1 >= 0:
                self.last_end[tuple(self.tokens[end - n + 1:end + 1])] = end

    def propose(self, max_tokens: int) -> list[int]:
        """≤ ``max_tokens`` tokens that followed the most recent earlier occurrence of the
        longest matching suffix n-gram; [] without a match."""
        length = len(self.tokens)
        for n in range(MAX_NGRAM, MIN_NGRAM - 1, -1):
            if length < n:
                continue
            end = self.last_end.get(tuple(self.tokens[length - n:]))
            if end is not None:
                return self.tokens[end + 1:end + 1 + max_tokens]
        return []


def leading_matches(proposal: list[int], text: list[int]) -> int:
    """How many leading tokens of ``proposal`` equal ``text``'s."""
    count = 0
    for proposed, actual in zip(proposal, text):
        if proposed != actual:
            break
        count += 1
    return count


@dataclass
class LookupStats:
    """Per round root of greedy texts (R roots in all): whether a lookup round would run,
    its chain length and how many of its tokens greedy verification accepts (all (R,) int).
    """

    proposed: torch.Tensor
    accepted: torch.Tensor

    @property
    def triggered(self) -> torch.Tensor:
        return self.proposed > 0


def lookup_stats(texts: list[tuple[list[int], int]], max_tokens: int) -> LookupStats:
    """Lookup rounds at every root of greedy ``texts`` [(prompt + greedy reply ids, index of
    the reply's first token)]: root c = position of the last emitted token, from the reply's
    first token to the one before the last (as ``acceptance.sequence_acceptance``); on the
    target's greedy text, accepted = leading matches with the text (exact)."""
    proposed, accepted = [], []
    for ids, reply_start in texts:
        index = NgramIndex(ids[:reply_start + 1])
        for root in range(reply_start, len(ids) - 1):
            chain = index.propose(max_tokens)
            proposed.append(len(chain))
            accepted.append(leading_matches(chain, ids[root + 1:]))
            index.extend([ids[root + 1]])
    return LookupStats(torch.tensor(proposed, dtype=torch.long),
                       torch.tensor(accepted, dtype=torch.long))



def score_lookup(shape: TreeShape, stats: LookupStats, lookup: int,
                 verify_seconds: Sequence[float], greedy_seconds: float) -> TreeShape:
    """``shape`` (a draft tree the cost model scored) with lookup rounds of <= ``lookup``
    tokens: at each root (R roots), a triggered lookup round emits 1 + accepted tokens for a
    verification over 1 + proposed tokens; any other root is a draft round as ``shape``
    predicts. ``stats``: ``lookup_stats(texts, lookup)``; verify_seconds[n - 1]: one
    verification over n tokens; -> the shape with ``lookup`` and the mixed prediction."""
    if math.isnan(shape.expected_tokens) or math.isnan(shape.round_seconds):
        raise ValueError(f"score_lookup needs a shape the cost model scored, got {shape}")
    if stats.proposed.numel() == 0:
        raise ValueError("score_lookup needs lookup stats of at least one round root")
    longest = int(stats.proposed.max())
    if longest > lookup or longest >= len(verify_seconds):
        raise ValueError(f"lookup chains of {longest} tokens: more than lookup={lookup} or past "
                         f"the verify curve ({len(verify_seconds)} sizes)")
    verify = torch.tensor(list(verify_seconds), dtype=torch.float64)
    triggered = stats.triggered
    tokens = torch.where(triggered, 1.0 + stats.accepted.double(), shape.expected_tokens)  # (R,)
    seconds = torch.where(triggered, verify[stats.proposed], shape.round_seconds)  # (R,)
    expected, round_seconds = float(tokens.mean()), float(seconds.mean())
    return replace(shape, lookup=lookup, expected_tokens=expected,
                               round_seconds=round_seconds,
                               predicted_speedup=expected / round_seconds * greedy_seconds)
