"""The CUDA paths (skipped without a GPU; benchmarks/gpu_check.sh runs them on one).

Statistics on the GPU equal the CPU's, the block-pair route's measured peak of allocated GPU
memory stays under its budget, and in float32 speculative decoding on CUDA reproduces plain
greedy decoding token for token. (The bf16 greedy match rate is a measurement, not a test:
``benchmarks/bench_speculative.py --dtype bfloat16`` reports it.)
"""
from __future__ import annotations

import pytest
import torch
from conftest import tiny_model
from test_speculative import SETTINGS, prompt, random_draft

from actwave.decoding.speculative import generate, greedy_generate
from actwave.stats import blockstats as B
from actwave.stats import layerstats as LS

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def wide_states(L: int = 6, n: int = 2000, d: int = 256) -> torch.Tensor:
    """(L, n, d) float64 layers sharing a signal, with a large common mean."""
    g = torch.Generator().manual_seed(0)
    base = torch.randn(n, d, generator=g, dtype=torch.float64)
    return torch.stack([base * (a + 1) + torch.randn(n, d, generator=g, dtype=torch.float64) * a
                        + 30.0 for a in range(L)])


def test_block_pairs_on_cuda_equal_all_pairs_on_cpu_and_peak_under_budget():
    hidden = wide_states()
    L, n, d = hidden.shape
    expected = LS.layer_stats(hidden)
    budget = B.fixed_bytes(L, d) + 3 * 8 * d * d
    on_gpu = hidden.cuda()
    # The first call on a device makes cuBLAS/cuSOLVER allocate their workspaces (tens of MB
    # on Hopper, kept for the process); the budget bounds the route's own tensors, so the
    # peak is read on a second call.
    B.block_pair_layer_stats(lambda: [(on_gpu, None)], L, d, budget, "cuda")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    stats, passes = B.block_pair_layer_stats(lambda: [(on_gpu, None)], L, d, budget, "cuda")
    peak = torch.cuda.max_memory_allocated() - before
    assert passes == 7  # 21 pairs, 3 a pass
    assert peak <= budget < LS.StreamingLayerStats.accumulator_bytes(L, d), (peak, budget)
    assert stats.cka.is_cuda
    for name in ("entropy", "renyi2", "cka", "cka_biased"):
        torch.testing.assert_close(getattr(stats, name).cpu(), getattr(expected, name),
                                   rtol=0, atol=1e-10)


@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_float32_speculative_equals_greedy_on_cuda(mode):
    target = tiny_model().cuda()
    ids = prompt().cuda()
    expected = greedy_generate(target, ids, 32).tokens
    result = generate(target, random_draft(target).cuda(), ids, 32, shape=SETTINGS[mode])
    assert result.tokens == expected
    assert sum(result.accept_counts) == result.target_forwards - 1


def test_bfloat16_speculative_runs_on_cuda():
    """bf16 verification may flip near-ties, so only the run and its bookkeeping are tested."""
    target = tiny_model().cuda().to(torch.bfloat16)
    ids = prompt().cuda()
    result = generate(target, random_draft(target).cuda().to(torch.bfloat16), ids, 16,
                      shape=SETTINGS["tree"])
    assert len(result.tokens) == 16
    assert sum(result.accept_counts) == result.target_forwards - 1
