"""Layer statistics whose memory does not grow as L²·d²: block-pair passes (pure math).

``layerstats.StreamingLayerStats`` keeps all L(L+1)/2 cross-covariance blocks Σ_ab (d × d,
float64) at once: 75 GB for an 8B Llama (33 states × 4096). Entropies, both CKA matrices and
the α = 2 aggregate need only scalars of those blocks (docs/METHODS.md §4, §7, §8): per layer
the spectrum of Σ_aa, per pair ‖Σ_ab‖²_F and μ_aᵀΣ_abμ_b. ``BlockPairStats`` therefore
accumulates the blocks of a few layer pairs at a time, reduces each to its scalars and
frees it, in as many passes over the same tokens as ``memory_budget`` requires. The first
pass also gathers the cheap per-token moments (Σx, Σ‖x‖², Σ‖x_a‖²‖x_b‖², Σ‖x_a‖²x_b) and
fixes the shift reference (the first chunk's mean) that every later pass reuses, so each
block is exactly the all-pairs route's block and the results agree to round-off.

The result is a ``LayerStats`` without covariance blocks (``cov == {}``): entropy, renyi2,
cka, cka_biased, n_tokens, n_seen as the all-pairs route gives them; aggregate Shannon
entropies (``layerstats.aggregate_entropy``) need the blocks and so the all-pairs route.
"""
from __future__ import annotations

from typing import Callable, Iterable, Sequence

import torch
from torch import Tensor

from actwave.stats.layerstats import (LayerStats, add_moments, centred_row_norm_products,
                                      kept_tokens, moment_sums)
from actwave.stats.metrics import (MIN_TOKENS_DEBIASED, _check_layers_finite, cka_from_moments,
                                   entropy_from_cov)

# d × d float64 work blocks beside the accumulated ones: the float32 route's product and its
# float64 copy, or eigvalsh's copy of a diagonal block.
WORK_BLOCKS = 2


def fixed_bytes(num_layers: int, dim: int, chunk_tokens: int = 1024) -> int:
    """Bytes a block-pair pass holds besides its blocks: moments, reference, one chunk.

    Σ‖x_a‖²x_b ``(L, L, d)`` twice (accumulator + the batched product), Σx and the reference
    ``(L, d)``, L×L scalars (four), one chunk in float64 and float32, the work blocks.
    """
    L, d = num_layers, dim
    return (8 * (2 * L * L * d + 2 * L * d + 4 * L * L + L)
            + 12 * chunk_tokens * L * d + 8 * WORK_BLOCKS * d * d)


def pair_schedule(num_layers: int, dim: int, memory_budget: int,
                  chunk_tokens: int = 1024) -> list[list[tuple[int, int]]]:
    """The layer pairs (a ≤ b, rows) each pass accumulates, so a pass fits ``memory_budget``.

    Pairs in row order, as many per pass as fit beside ``fixed_bytes``: ⌈L(L+1)/2 / P⌉
    passes for P = ⌊(budget − fixed) / 8d²⌋. Refuses a budget below one block's worth.
    """
    if num_layers < 1 or dim < 1 or chunk_tokens < 1:
        raise ValueError(f"need num_layers, dim, chunk_tokens ≥ 1, got "
                         f"{num_layers}, {dim}, {chunk_tokens}")
    fixed, block = fixed_bytes(num_layers, dim, chunk_tokens), 8 * dim * dim
    if not isinstance(memory_budget, int) or memory_budget < fixed + block:
        raise ValueError(f"memory_budget={memory_budget!r} bytes is below the minimum "
                         f"{fixed + block} for {num_layers} layers × d={dim} "
                         f"(moments and one chunk of {chunk_tokens} tokens: {fixed} bytes, plus "
                         f"one {dim}×{dim} float64 block: {block} bytes)")
    per_pass = (memory_budget - fixed) // block
    pairs = [(a, b) for a in range(num_layers) for b in range(a, num_layers)]
    return [pairs[start:start + per_pass] for start in range(0, len(pairs), per_pass)]


def peak_bytes(num_layers: int, dim: int, memory_budget: int, chunk_tokens: int = 1024) -> int:
    """Bytes the largest pass of ``pair_schedule`` holds (≤ ``memory_budget``)."""
    schedule = pair_schedule(num_layers, dim, memory_budget, chunk_tokens)
    return fixed_bytes(num_layers, dim, chunk_tokens) + 8 * dim * dim * len(schedule[0])


class BlockPairStats:
    """``LayerStats`` (without covariance blocks) of L layers under a memory budget.

    Use: for each pass in ``schedule``, call ``update`` on the same tokens in the same order,
    then ``end_pass``; after the last, ``finalize``. ``block_pair_layer_stats`` does this
    given a function that yields the tokens once per call. Accumulation, shift and
    ``matmul_dtype`` are those of ``layerstats.StreamingLayerStats``.
    """

    def __init__(self, num_layers: int, dim: int, memory_budget: int,
                 device: torch.device | str | None = None, *, layers: Sequence[int] | None = None,
                 chunk_tokens: int = 1024, matmul_dtype: torch.dtype = torch.float64) -> None:
        if matmul_dtype not in (torch.float64, torch.float32):
            raise ValueError(f"matmul_dtype must be torch.float64 or torch.float32, "
                             f"got {matmul_dtype}")
        self.schedule = pair_schedule(num_layers, dim, memory_budget, chunk_tokens)
        self.layers = tuple(range(num_layers)) if layers is None else tuple(int(x) for x in layers)
        if len(self.layers) != num_layers:
            raise ValueError(f"{len(self.layers)} layer labels for num_layers={num_layers}")
        self.num_layers, self.dim, self.chunk_tokens = num_layers, dim, chunk_tokens
        self.memory_budget, self.matmul_dtype = memory_budget, matmul_dtype
        self.device = None if device is None else torch.device(device)
        self.pass_index = self.n_tokens = self.n_seen = 0
        self._pass_tokens = 0
        self._reference: Tensor | None = None  # (L, d) shift, fixed by the first chunk
        self._blocks: dict[tuple[int, int], Tensor] = {}

    @property
    def done(self) -> bool:
        return self.pass_index == len(self.schedule)

    def _allocate(self, device: torch.device) -> None:
        L, d, f64 = self.num_layers, self.dim, torch.float64
        self.device = device
        self._sums, self._sq_sums, self._sq_products, self._sq_weighted = moment_sums(L, d, device)
        self._frob_sq = torch.zeros(L, L, dtype=f64, device=device)  # ‖Σ_ab‖²_F
        self._bilinear = torch.zeros(L, L, dtype=f64, device=device)  # μ_aᵀ Σ_ab μ_b
        self._traces = torch.zeros(L, dtype=f64, device=device)
        self._entropy = torch.zeros(L, dtype=f64, device=device)
        self._renyi2 = torch.zeros(L, dtype=f64, device=device)

    def _open_pass(self) -> None:
        self._blocks = {(a, b): torch.zeros(self.dim, self.dim, dtype=torch.float64,
                                            device=self.device)
                        for a, b in self.schedule[self.pass_index]}
        self._rows = sorted({row for pair in self._blocks for row in pair})

    def update(self, hidden: Tensor, keep: Tensor | None = None) -> None:
        """Add tokens ``hidden: (L, n, d)`` to the current pass, optionally only ``keep: (n,)``."""
        if self.done:
            raise RuntimeError(f"all {len(self.schedule)} passes are done; call finalize()")
        kept = kept_tokens(hidden, keep, self.num_layers, self.dim)
        if self.pass_index == 0:
            self.n_seen += hidden.shape[1]
        if not hasattr(self, "_sums"):
            self._allocate(self.device or kept.device)
        if not self._blocks:
            self._open_pass()
        for start in range(0, kept.shape[1], self.chunk_tokens):
            self._accumulate(kept[:, start:start + self.chunk_tokens])

    def _accumulate(self, chunk: Tensor) -> None:
        first_pass = self.pass_index == 0
        rows = list(range(self.num_layers)) if first_pass else self._rows
        x = chunk[rows].to(device=self.device, dtype=torch.float64)  # (L_pass, m, d)
        if first_pass:
            raw_sums = x.sum(dim=1)  # (L, d)
            _check_layers_finite(raw_sums, self.layers)
            if self._reference is None:
                self._reference = raw_sums / x.shape[1]
        x -= self._reference[rows][:, None, :]
        position = {row: i for i, row in enumerate(rows)}
        low = x if self.matmul_dtype == torch.float64 else x.to(self.matmul_dtype)
        for (a, b), block in self._blocks.items():
            if low is x:
                block.addmm_(x[position[a]].T, x[position[b]])
            else:
                block += (low[position[a]].T @ low[position[b]]).to(torch.float64)
        if first_pass:  # the per-token sums of all layers, once
            add_moments((self._sums, self._sq_sums, self._sq_products, self._sq_weighted), x)
            self.n_tokens += x.shape[1]
        self._pass_tokens += x.shape[1]

    def end_pass(self) -> None:
        """Centre this pass's blocks, keep their scalars, free them."""
        if self.done:
            raise RuntimeError(f"all {len(self.schedule)} passes are done")
        if self._pass_tokens != self.n_tokens or self.n_tokens < MIN_TOKENS_DEBIASED:
            raise ValueError(f"pass {self.pass_index} saw {self._pass_tokens} tokens, the first "
                             f"{self.n_tokens}; every pass must see the same ≥ "
                             f"{MIN_TOKENS_DEBIASED} tokens in the same order")
        n, mean = self.n_tokens, self._sums / self.n_tokens
        for (a, b), block in self._blocks.items():
            block.addr_(self._sums[a], self._sums[b], alpha=-1.0 / n)  # Σ_ab, in place
            self._frob_sq[a, b] = self._frob_sq[b, a] = torch.linalg.vector_norm(block).square()
            self._bilinear[a, b] = self._bilinear[b, a] = mean[a] @ block @ mean[b]
            if a == b:
                self._traces[a] = block.trace()
                self._entropy[a] = entropy_from_cov(block, 1.0)
                self._renyi2[a] = entropy_from_cov(block, 2.0)
        self._blocks, self._pass_tokens = {}, 0
        self.pass_index += 1

    def finalize(self) -> LayerStats:
        """Both CKA matrices from the pair scalars; refused before the last pass ended."""
        if not self.done:
            raise RuntimeError(f"finalize() after pass {self.pass_index} of {len(self.schedule)}")
        n = self.n_tokens
        row_products = centred_row_norm_products(self._sq_products, self._sq_weighted,
                                                 self._sq_sums, self._sums / n, self._bilinear, n)
        return LayerStats(
            layers=self.layers, n_tokens=n, dim=self.dim, n_seen=self.n_seen,
            entropy=self._entropy.clone(), renyi2=self._renyi2.clone(),
            cka=cka_from_moments(self._frob_sq, row_products, self._traces, n, debiased=True),
            cka_biased=cka_from_moments(self._frob_sq, row_products, self._traces, n,
                                        debiased=False))


def block_pair_layer_stats(read_pass: Callable[[], Iterable[tuple[Tensor, Tensor | None]]],
                           num_layers: int, dim: int, memory_budget: int,
                           device: torch.device | str | None = None,
                           **options) -> tuple[LayerStats, int]:
    """``LayerStats`` and the number of passes, from ``read_pass()`` called once per pass.

    Each call must yield the same ``(hidden: (L, n, d), keep: (n,) bool or None)`` chunks in
    the same order (e.g. one per shard of a capture store). ``options``: ``layers``,
    ``chunk_tokens``, ``matmul_dtype`` of ``BlockPairStats``.
    """
    stream = BlockPairStats(num_layers, dim, memory_budget, device, **options)
    while not stream.done:
        for hidden, keep in read_pass():
            stream.update(hidden, keep)
        stream.end_pass()
    return stream.finalize(), len(stream.schedule)
