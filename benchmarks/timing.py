"""The machine's matmul rate, shared by the benchmark scripts (the denominator of their ratios)."""
import time

import torch

from actwave.decoding.timing import synchronize


def matmul_gflops(m: int, k: int, n: int, dtype: torch.dtype, device="cpu",
                  repeats: int = 3) -> float:
    """GFLOP/s of an (m, k) @ (k, n) product in ``dtype`` on ``device``, after a warm-up."""
    a = torch.randn(m, k, dtype=dtype, device=device)
    b = torch.randn(k, n, dtype=dtype, device=device)
    a @ b
    synchronize(device)
    tic = time.perf_counter()
    for _ in range(repeats):
        a @ b
    synchronize(device)
    return 2 * m * k * n * repeats / (time.perf_counter() - tic) / 1e9
