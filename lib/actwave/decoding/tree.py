"""EAGLE-2 dynamic draft trees (Li et al. 2024, arXiv 2406.16858) and their attention masks.

The draft grows a tree below the root (the last committed token, not yet seen by the
target): level 1 comes from the draft's catch-up pass over target features, each later
level from one draft forward over the ``top_k`` best frontier nodes, each proposing
``top_k`` children. All proposed nodes compete for the ``total_tokens − 1`` tree slots.

Node ranking. Greedy (temperature 0): EAGLE-2's cumulative draft log-probability of the
node. Sampling: children are drawn *without replacement* from the draft distribution
(Gumbel-top-k gives them in sequential-draw order) and nodes are ranked by their
*parent's* cumulative log-prob, then draw order. Every keep/expand decision about a
sibling group is then fixed before its values are drawn and always keeps a prefix of the
draws — what recursive rejection sampling without replacement (Jeon et al. 2024,
arXiv 2402.14160) needs to preserve the target distribution.

Positions follow EAGLE: the root sits at the committed length ``L``, a node at depth d at
``L + d``; the draft row that expands a depth-d node uses position ``L − 1 + d`` (its
input token is the node, its hidden is the draft output that proposed the node).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from typing import Mapping, Sequence

import torch


@dataclass
class DraftTree:
    """A verified-ready draft tree; node 0 is the root, parents precede children.

    tokens: (n,) target ids; depths: (n,); parents[i] (−1 for the root); children[i] in
    rank / draw order; child_logq[i]: (V_draft,) draft log-probs from which node i's
    children were chosen (only for expanded nodes).
    """

    tokens: torch.Tensor
    depths: torch.Tensor
    parents: list[int]
    children: list[list[int]]
    child_logq: dict[int, torch.Tensor] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.parents)


def token_chain(tokens: torch.Tensor) -> DraftTree:
    """The chain tree tokens[0] (root) -> tokens[1] -> ...: tokens (n,) on the device wanted."""
    n = len(tokens)
    return DraftTree(tokens=tokens, depths=torch.arange(n, device=tokens.device),
                     parents=[-1] + list(range(n - 1)),
                     children=[[i + 1] for i in range(n - 1)] + [[]])


def ancestor_mask(parents: list[int], device=None) -> torch.Tensor:
    """(n, n) bool: [i, j] True iff node j is node i or one of its ancestors."""
    return _ancestor_mask(tuple(parents), torch.device(device or "cpu"))


@lru_cache(maxsize=256)
def _ancestor_mask(parents: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """Built once per tree shape (a chain's shape never changes): callers must not mutate it."""
    n = len(parents)
    allowed = torch.eye(n, dtype=torch.bool)
    for node in range(1, n):  # parents precede children: row of the parent is complete
        allowed[node] |= allowed[parents[node]]
    return allowed.to(device)


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """bool (T, S), True = attend -> additive float mask (1, 1, T, S)."""
    blocked = torch.full((), torch.finfo(dtype).min, dtype=dtype, device=allowed.device)
    return torch.where(allowed, torch.zeros((), dtype=dtype, device=allowed.device),
                       blocked)[None, None]


def target_tree_mask(tree: DraftTree, cache_len: int, config, dtype: torch.dtype):
    """Additive mask for verifying ``tree`` on top of ``cache_len`` cached tokens.

    -> (1, 1, n, cache_len + n), or for models with sliding-window layers (Gemma3, some
    Qwen) a dict {"full_attention": ..., "sliding_attention": ...} which HF models accept
    as a precomputed mapping; the window rule is HF's: query − key position < window.
    """
    device = tree.tokens.device
    n = len(tree)
    allowed = torch.cat([torch.ones(n, cache_len, dtype=torch.bool, device=device),
                         ancestor_mask(tree.parents, device)], dim=1)  # (n, L + n)
    full = additive_mask(allowed, dtype)
    layer_types = set(getattr(config, "layer_types", None) or ())
    if "sliding_attention" not in layer_types:
        return full
    query_pos = cache_len + tree.depths  # (n,)
    key_pos = torch.cat([torch.arange(cache_len, device=device), query_pos])  # (L + n,)
    in_window = (query_pos[:, None] - key_pos[None, :]) < config.sliding_window
    return {"full_attention": full, "sliding_attention": additive_mask(allowed & in_window, dtype)}


def choose_children(logits: torch.Tensor, top_k: int, temperature: float,
                    generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Children of each of f nodes from draft logits (f, V_draft) (or one node: (V_draft,)).

    -> (draft ids (f, k), their log-probs (f, k), log-probs of the whole rows (f, V_draft)).
    Greedy: the top-k of log_softmax(logits). Sampling: k draws without replacement from
    softmax(logits / T) by Gumbel-top-k, in draw order; a zero-probability token comes only
    after every positive one and has log-prob −inf (callers drop it).
    """
    scale = 1.0 if temperature == 0.0 else temperature
    row_logq = torch.log_softmax(logits.float() / scale, dim=-1)
    k = min(top_k, row_logq.shape[-1])
    if temperature == 0.0:
        logq, ids = row_logq.topk(k)
        return ids, logq, row_logq
    uniform = torch.rand(row_logq.shape, generator=generator, device=row_logq.device)
    gumbel = -torch.log(-torch.log(uniform.clamp_min(1e-20)))
    ids = (row_logq + gumbel).topk(k).indices
    return ids, row_logq.gather(-1, ids), row_logq


class _Candidates:
    """Growing list of proposed nodes (index 0 = root) with their ranking keys."""

    def __init__(self, root_token: int, sampling: bool):
        self.tokens, self.parents, self.depths = [root_token], [-1], [0]
        self.scores, self.keys = [0.0], [(float("inf"),)]
        self.children: list[list[int]] = [[]]
        self.sampling = sampling

    def add(self, parent: int, tokens: list[int], logq: list[float]) -> list[int]:
        new = []
        for rank, (token, node_logq) in enumerate(zip(tokens, logq)):
            index = len(self.tokens)
            score = self.scores[parent] + node_logq
            depth = self.depths[parent] + 1
            primary = self.scores[parent] if self.sampling else score
            self.keys.append((primary, -rank, -depth, -index))
            self.tokens.append(token)
            self.parents.append(parent)
            self.depths.append(depth)
            self.scores.append(score)
            self.children.append([])
            new.append(index)
        return new

    def best(self, nodes: list[int], count: int) -> list[int]:
        return sorted(nodes, key=lambda node: self.keys[node], reverse=True)[:count]

    def select(self, count: int) -> list[int]:
        """The ``count`` best non-root nodes whose ancestors are all kept, in index order."""
        kept = {0}
        for node in self.best(list(range(1, len(self.tokens))), len(self.tokens)):
            if len(kept) > count:
                break
            if self.parents[node] in kept:
                kept.add(node)
        return sorted(kept)


def _draft_rows_mask(candidates: _Candidates, frontier: list[int], row_of: dict[int, int],
                     cache_len: int, rows_before: int, device, dtype) -> torch.Tensor:
    """Mask for expanding ``frontier``: target-feature rows + own ancestors' expansion rows."""
    total = cache_len + rows_before + len(frontier)
    allowed = torch.zeros(len(frontier), total, dtype=torch.bool)
    allowed[:, :cache_len] = True
    for i, node in enumerate(frontier):
        allowed[i, cache_len + rows_before + i] = True
        ancestor = candidates.parents[node]
        while ancestor > 0:
            allowed[i, row_of[ancestor]] = True
            ancestor = candidates.parents[ancestor]
    return additive_mask(allowed.to(device), dtype)


def _propose(candidates: _Candidates, draft, parents: list[int], logits: torch.Tensor,
             top_k: int, temperature: float, generator, child_logq: dict) -> list[int]:
    """Children of every node in ``parents`` from their logits rows (f, V_draft).

    One host transfer per level, not per node; zero-probability draws are dropped.
    """
    ids, logq, row_logq = choose_children(logits, top_k, temperature, generator)
    tokens, logq = draft.draft_to_target(ids).tolist(), logq.tolist()  # (f, k) each
    new = []
    for row, parent in enumerate(parents):
        child_logq[parent] = row_logq[row]
        keep = [i for i, value in enumerate(logq[row]) if value != float("-inf")]
        new += candidates.add(parent, [tokens[row][i] for i in keep], [logq[row][i] for i in keep])
    return new


@torch.no_grad()
def build_tree(draft, draft_cache, root_token: int, root_logits: torch.Tensor,
               root_hidden: torch.Tensor, *, depth: int, top_k: int, total_tokens: int,
               temperature: float = 0.0, generator: torch.Generator | None = None
               ) -> tuple[DraftTree, int]:
    """Grow an EAGLE-2 tree below ``root_token``; -> (tree, number of draft forwards).

    root_logits: (V_draft,) and root_hidden: (H,) from the draft's catch-up row at the
    last committed position; ``draft_cache`` holds exactly the target-feature rows
    (length L = the root's position) and is returned to that length.
    """
    cache_len = draft_cache.get_seq_length()
    device, dtype = root_hidden.device, root_hidden.dtype
    candidates = _Candidates(root_token, sampling=temperature > 0.0)
    child_logq: dict[int, torch.Tensor] = {}
    frontier = _propose(candidates, draft, [0], root_logits[None], top_k, temperature, generator,
                        child_logq)
    frontier_hidden = root_hidden.expand(len(frontier), -1)  # (f, H)
    row_of: dict[int, int] = {}
    forwards = 0
    for _ in range(depth - 1):
        rows_before = draft_cache.get_seq_length() - cache_len
        mask = _draft_rows_mask(candidates, frontier, row_of, cache_len, rows_before, device, dtype)
        positions = torch.tensor([cache_len - 1 + candidates.depths[n] for n in frontier], device=device)
        input_ids = torch.tensor([candidates.tokens[n] for n in frontier], device=device)
        out = draft(input_ids[None], frontier_hidden[None], positions[None], mask, draft_cache)
        forwards += 1
        row = {node: i for i, node in enumerate(frontier)}
        for node, i in row.items():
            row_of[node] = cache_len + rows_before + i
        children = _propose(candidates, draft, frontier, out.logits[0], top_k, temperature,
                            generator, child_logq)
        frontier = candidates.best(children, top_k)
        # each new frontier node continues from the hidden of the row that proposed it
        frontier_hidden = out.hidden[0, [row[candidates.parents[n]] for n in frontier]]  # (f, H)
    draft_cache.crop(cache_len - draft_cache.get_seq_length())
    return _finalise(candidates, candidates.select(total_tokens - 1), child_logq, device), forwards


def _finalise(candidates: _Candidates, kept: list[int], child_logq: dict, device) -> DraftTree:
    """Re-index the kept candidates 0..n−1 (index order keeps parents first)."""
    new_index = {old: new for new, old in enumerate(kept)}
    parents = [new_index.get(candidates.parents[old], -1) for old in kept]
    children: list[list[int]] = [[] for _ in kept]
    for old in kept[1:]:  # candidate index order = rank / draw order within a sibling group
        children[new_index[candidates.parents[old]]].append(new_index[old])
    return DraftTree(
        tokens=torch.tensor([candidates.tokens[old] for old in kept], device=device),
        depths=torch.tensor([candidates.depths[old] for old in kept], device=device),
        parents=parents, children=children,
        child_logq={new_index[old]: logq for old, logq in child_logq.items() if old in new_index})


# ----------------------------------------------------------------------------- tree sizing
MODES = ("tree", "chain")


@dataclass(frozen=True)
class TreeShape:
    """The draft tree of one speculative-decoding run, and what the cost model expects of it
    per verification round (NaN when not predicted): tokens emitted (1 + expected
    accepted), seconds, and tokens/s ÷ greedy tokens/s.

    mode "chain": ``depth`` draft tokens per round (``top_k`` and ``total_tokens`` follow:
    1 and depth + 1); "tree": EAGLE-2 dynamic tree, ``top_k`` children per expanded node,
    ``depth`` levels, ``total_tokens`` tree tokens including the root. The default is the
    fixed tree; ``actwave.decoding.costmodel.auto_shape`` picks one for a draft and machine.
    lookup > 0 (greedy only): a round whose context repeats an earlier n-gram verifies the
    <= lookup tokens that followed it instead of a draft tree (``actwave.decoding.lookup``).
    """

    mode: str = "tree"
    depth: int = 6
    top_k: int = 8
    total_tokens: int = 32
    expected_tokens: float = float("nan")
    round_seconds: float = float("nan")
    predicted_speedup: float = float("nan")
    lookup: int = 0

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        for name, low in (("depth", 1), ("top_k", 1), ("total_tokens", 2), ("lookup", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
        if self.mode == "chain":
            object.__setattr__(self, "top_k", 1)
            object.__setattr__(self, "total_tokens", self.depth + 1)

    def settings(self) -> dict:
        """The shape settings alone (mode, depth, top_k, total_tokens, lookup), e.g. for an
        ``EvalConfig``."""
        return dict(mode=self.mode, depth=self.depth, top_k=self.top_k,
                    total_tokens=self.total_tokens, lookup=self.lookup)

    def label(self) -> str:
        """'tree 4/4/16' (mode depth/top-k/total tokens), '+ lookup m' when lookup rounds run."""
        label = f"{self.mode} {self.depth}/{self.top_k}/{self.total_tokens}"
        return f"{label} + lookup {self.lookup}" if self.lookup else label


def rank_acceptance(reach: Sequence[float] | Mapping[int, Sequence[float]]) -> torch.Tensor:
    """Per-depth reach probabilities -> p (D, R): P(target token = draft's rank-r proposal
    at depth d | the path to d−1 was accepted), float64.

    ``reach`` is a list (top-1 chain) or {top_k: list}: entry d−1 = P(the first d draft
    tokens are all accepted) with top_k candidates per level (as offline acceptance
    measures it on held-out text). Ranks between two given top_k share the gain evenly;
    ranks above the largest given top_k, and depths past the list, get 0.
    """
    by_k = {1: reach} if not isinstance(reach, Mapping) else dict(reach)
    if not by_k or any(not isinstance(k, int) or k < 1 for k in by_k):
        raise ValueError(f"acceptance must be a list of floats or {{top_k >= 1: list}}, "
                         f"got keys {sorted(by_k) if by_k else '(none)'}")
    depth = max(len(v) for v in by_k.values())
    p = torch.zeros(depth, max(by_k), dtype=torch.float64)
    previous_k, previous = 0, torch.zeros(depth, dtype=torch.float64)
    for k in sorted(by_k):
        values = torch.tensor([float(x) for x in by_k[k]], dtype=torch.float64)
        if values.numel() == 0 or not bool(((values >= 0) & (values <= 1)).all()):
            raise ValueError(f"acceptance[{k}] must be a non-empty list of probabilities "
                             f"in [0, 1], got {list(by_k[k])}")
        before = torch.cat([torch.ones(1, dtype=torch.float64), values[:-1]])
        conditional = torch.zeros(depth, dtype=torch.float64)
        conditional[: values.numel()] = torch.where(before > 0, values / before.clamp_min(1e-300),
                                                    torch.zeros_like(values)).clamp(max=1.0)
        conditional = torch.maximum(conditional, previous)  # more candidates never accept less
        p[:, previous_k:k] = ((conditional - previous) / (k - previous_k))[:, None]
        previous_k, previous = k, conditional
    return p


def node_values(p: torch.Tensor, depth: int, top_k: int) -> list[float]:
    """P(accepted) of every node of the EAGLE-2 tree (``top_k`` children per expanded node,
    the ``top_k`` best nodes of a level expanded, ``depth`` levels) ranked by that
    probability, best first: the best n−1 of them form the best n-token tree, and the
    expected number of accepted tokens is their sum (independent-acceptance model)."""
    ranks = p[:, :top_k].tolist() if p.shape[1] >= top_k else [
        row + [0.0] * (top_k - p.shape[1]) for row in p.tolist()]
    values, frontier = [], [1.0]
    for level in range(min(depth, len(ranks))):
        children = sorted((v * r for v in frontier for r in ranks[level]), reverse=True)
        values += children
        frontier = children[:top_k]
    return sorted(values, reverse=True)


def score_shape(p: torch.Tensor, depth: int, top_k: int, total_tokens: int,
                verify_seconds: Sequence[float], level_seconds: Sequence[float],
                catch_up_seconds: float, greedy_seconds: float) -> TreeShape:
    """What the cost model expects of one shape: tokens per round (1 + the best
    ``total_tokens`` − 1 node values), seconds per round (catch-up + (depth−1) levels of
    ``top_k`` rows + one verification over ``total_tokens``) and their rate ÷ greedy's.
    Arguments as ``choose_shape``; a shape past the measured curves is refused."""
    if total_tokens > len(verify_seconds) or top_k > len(level_seconds):
        raise ValueError(f"shape {depth}/{top_k}/{total_tokens} lies past the measured cost "
                         f"curves ({len(verify_seconds)} verify sizes, {len(level_seconds)} widths)")
    gains = node_values(p, depth, top_k)
    expected = 1.0 + sum(gains[: total_tokens - 1])
    seconds = catch_up_seconds + (depth - 1) * level_seconds[top_k - 1] + verify_seconds[total_tokens - 1]
    mode = "chain" if top_k == 1 else "tree"
    return TreeShape(mode=mode, depth=depth if mode == "tree" else total_tokens - 1, top_k=top_k,
                     total_tokens=total_tokens, expected_tokens=expected, round_seconds=seconds,
                     predicted_speedup=expected / seconds * greedy_seconds)


def choose_shape(p: torch.Tensor, verify_seconds: Sequence[float], level_seconds: Sequence[float],
                 catch_up_seconds: float, greedy_seconds: float, max_depth: int = 8,
                 max_top_k: int = 8) -> TreeShape:
    """The (depth, top_k, total_tokens) with the most expected tokens per second.

    p: (D, R) from ``rank_acceptance``; verify_seconds[n−1]: one verification round over n
    tree tokens (forward, acceptance, cache bookkeeping); level_seconds[w−1]: one draft
    expansion over w rows; catch_up_seconds: the draft's catch-up pass; greedy_seconds:
    one plain greedy step. A round costs catch-up + (depth−1) levels + verify(n).
    """
    if not verify_seconds or not level_seconds:
        raise ValueError("verify_seconds and level_seconds must be non-empty cost curves")
    costs = (verify_seconds, level_seconds, catch_up_seconds, greedy_seconds)
    best = None
    for depth in range(1, max_depth + 1):
        for top_k in range(1, min(max_top_k, len(level_seconds)) + 1):
            n_nodes = len(node_values(p, depth, top_k))
            for n in range(2, min(n_nodes + 1, len(verify_seconds)) + 1):
                shape = score_shape(p, depth, top_k, n, *costs)
                if best is None or shape.predicted_speedup > best.predicted_speedup:
                    best = shape
    if best is None:  # depth or verify curve too short for any tree of two tokens
        raise ValueError(f"no tree fits: verify_seconds has {len(verify_seconds)} sizes (need >= 2)")
    return best
