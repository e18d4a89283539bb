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
continuation being the likelier to hold. ``score_walk`` predicts, for the cost model's
choice of m, how fast decoding runs on greedy text with lookup rounds of <= m tokens.
"""
from __future__ import annotations

import math
from dataclasses import replace
from typing import Sequence

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


def walk_rounds(ids: list[int], reply_start: int, draft_accepted: Sequence[int],
                lookup: int) -> list[tuple[int, int]]:
    """The rounds that greedy decoding with lookup rounds of <= ``lookup`` tokens runs over
    ``ids`` (prompt + the target's greedy reply, the reply from index ``reply_start``), as
    ``speculative.generate`` would: per round (the copied chain's length, 0 for a draft round;
    the tokens verification accepts).

    draft_accepted[i]: tokens a draft round accepts at root ``reply_start + i`` (one entry
    per root: reply_start .. len(ids) − 2; offline acceptance, exact on greedy text). A
    round at root c proposes from the n-grams of ids[: c + 1] (prompt included), accepts its
    leading matches with the text, and the next round's root is c + accepted + 1 — the
    decoding walk of ``acceptance.decode_walk`` with lookup rounds mixed in.
    """
    if len(draft_accepted) != len(ids) - reply_start - 1:
        raise ValueError(f"draft_accepted has {len(draft_accepted)} roots; the reply from "
                         f"{reply_start} of {len(ids)} tokens has {len(ids) - reply_start - 1}")
    index = NgramIndex(ids[:reply_start + 1])
    root, rounds = reply_start, []
    while root < len(ids) - 1:
        chain = index.propose(lookup) if lookup else []
        accepted = (leading_matches(chain, ids[root + 1:]) if chain
                    else int(draft_accepted[root - reply_start]))
        rounds.append((len(chain), accepted))
        index.extend(ids[root + 1:root + 2 + accepted])
        root += accepted + 1
    return rounds


def score_walk(shape: TreeShape, texts: list[tuple[list[int], int, Sequence[int]]], lookup: int,
               verify_seconds: Sequence[float], greedy_seconds: float) -> TreeShape:
    """``shape`` (a draft tree the cost model scored) with lookup rounds of <= ``lookup``
    tokens (0: none), predicted by walking greedy ``texts`` [(ids, reply_start,
    draft_accepted), as ``walk_rounds``] round by round: a lookup round of m tokens costs
    one verification over 1 + m tokens (verify_seconds[n − 1]: over n), a draft round the
    shape's ``round_seconds``. -> the shape with ``lookup`` and the walk's tokens per round,
    seconds per round and speedup (greedy emits the same tokens one ``greedy_seconds`` each).

    A walk rather than an average over every root: a round that accepts many tokens skips
    the roots inside them, so an average over roots weighs long lookup rounds as often as
    the text offers them, not as often as decoding runs them.
    """
    if math.isnan(shape.expected_tokens) or math.isnan(shape.round_seconds):
        raise ValueError(f"score_walk needs a shape the cost model scored, got {shape}")
    if not 0 <= lookup < len(verify_seconds):
        raise ValueError(f"lookup={lookup}: a lookup round verifies 1 + lookup tokens and the "
                         f"verify curve has {len(verify_seconds)} sizes")
    tokens = rounds = 0
    seconds = 0.0
    for ids, reply_start, draft_accepted in texts:
        walked = walk_rounds(ids, reply_start, draft_accepted, lookup)
        tokens += len(ids) - reply_start - 1  # the prefill emits the first reply token
        rounds += len(walked)
        seconds += sum(verify_seconds[m] if m else shape.round_seconds for m, _ in walked)
    if rounds == 0:
        raise ValueError("score_walk needs greedy texts with replies of >= 2 tokens")
    return replace(shape, lookup=lookup, expected_tokens=tokens / rounds,
                   round_seconds=seconds / rounds,
                   predicted_speedup=tokens * greedy_seconds / seconds)
