"""Timing helpers shared by the benchmark scripts: CUDA-aware sync and the matmul rate."""
import time

import torch


def sync(device) -> None:
    """Wait for queued CUDA work, so wall-clock timings cover it."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def matmul_gflops(m: int, k: int, n: int, dtype: torch.dtype, device="cpu",
                  repeats: int = 3) -> float:
    """GFLOP/s of an (m, k) @ (k, n) product in ``dtype`` on ``device``, after a warm-up."""
    a = torch.randn(m, k, dtype=dtype, device=device)
    b = torch.randn(k, n, dtype=dtype, device=device)
    a @ b
    sync(device)
    tic = time.perf_counter()
    for _ in range(repeats):
        a @ b
    sync(device)
    return 2 * m * k * n * repeats / (time.perf_counter() - tic) / 1e9
