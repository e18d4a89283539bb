"""Streaming layer statistics vs a naive n×n-Gram implementation, and vs the matmul peak.

    python benchmarks/bench_metrics.py --layers 31 --tokens 200000 --dim 576

prints, from one run: (1) the machine's float64 matmul rate (GFLOP/s, one large GEMM);
(2) at a size where both fit (``--compare-layers``, ``--compare-tokens``), the time of the
naive route (per-layer n×n Grams: entropy by an n×n eigendecomposition, biased CKA as
⟨HKH, HLH⟩, debiased with U-centred Grams) vs ``StreamingLayerStats`` (d×d covariances), their ratio and the largest
disagreement; (3) the full-size streaming pass: time, throughput of its cross-product
matmuls (n·d²·L(L+1) flops) as a fraction of the matmul rate, accumulator memory, and the
finalize time. Data are random, generated chunk by chunk outside the timed region.
"""
from __future__ import annotations

import argparse
import time

import torch

from actwave.decoding.timing import synchronize
from actwave.stats.layerstats import StreamingLayerStats
from timing import matmul_gflops  # benchmarks/timing.py


def random_chunk(layers: int, tokens: int, dim: int, seed: int) -> torch.Tensor:
    """(L, n, d) bf16 chunk: a shared signal plus per-layer noise and a large mean."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(1, tokens, dim, generator=g)
    noise = torch.randn(layers, tokens, dim, generator=g)
    return (base + noise * torch.linspace(0.1, 2.0, layers)[:, None, None] + 20).to(torch.bfloat16)


def u_centred(gram: torch.Tensor) -> torch.Tensor:
    """Székely–Rizzo U-centring of an n×n Gram (debiased HSIC as a plain inner product)."""
    n = gram.shape[0]
    gram = gram.clone().fill_diagonal_(0)
    col_means = gram.sum(0) / (n - 2)
    col_means -= col_means.sum() / (2 * (n - 1))
    return (gram - col_means[:, None] - col_means[None, :]).fill_diagonal_(0)


def naive_stats(hidden: torch.Tensor) -> dict[str, torch.Tensor]:
    """Entropy and both CKA matrices from per-layer n×n Grams of ``hidden: (L, n, d)``."""
    grams, ucentred, entropy = [], [], []
    for layer in hidden.to(torch.float64):
        centred = layer - layer.mean(0)
        gram = centred @ centred.T  # (n, n), already double-centred
        eig = torch.linalg.eigvalsh(gram).clamp(min=0)
        probs = eig / eig.sum()
        entropy.append(-torch.special.xlogy(probs, probs).sum())
        grams.append(gram.flatten())
        ucentred.append(u_centred(gram).flatten())

    def cka(flat: list[torch.Tensor]) -> torch.Tensor:
        stacked = torch.stack(flat)  # (L, n²)
        inner = stacked @ stacked.T
        return inner / torch.sqrt(inner.diagonal()[:, None] * inner.diagonal()[None, :])
    return {"entropy": torch.stack(entropy), "cka_biased": cka(grams), "cka": cka(ucentred)}


def stream(layers: int, tokens: int, dim: int, chunk: int,
           matmul_dtype: torch.dtype = torch.float64,
           device: str = "cpu") -> tuple[float, float, object]:
    """Seconds in update(), seconds in finalize(), and the stats."""
    acc = StreamingLayerStats(layers, dim, device=device, matmul_dtype=matmul_dtype)
    update_s = 0.0
    for index, start in enumerate(range(0, tokens, chunk)):
        data = random_chunk(layers, min(chunk, tokens - start), dim, seed=index)
        tic = time.perf_counter()
        acc.update(data)
        synchronize(device)
        update_s += time.perf_counter() - tic
    tic = time.perf_counter()
    stats = acc.finalize()
    synchronize(device)
    return update_s, time.perf_counter() - tic, stats


def compare(layers: int, tokens: int, dim: int) -> tuple[float, float]:
    """Print and return (naive seconds / streaming seconds, largest disagreement)."""
    data = random_chunk(layers, tokens, dim, seed=0)
    tic = time.perf_counter()
    naive = naive_stats(data)
    naive_s = time.perf_counter() - tic
    update_s, final_s, stats = stream(layers, tokens, dim, chunk=tokens)
    stream_s = update_s + final_s
    diff = max(float((naive[k] - getattr(stats, k)).abs().max()) for k in naive)
    print(f"[compare] L={layers} n={tokens} d={dim}: naive n×n Gram {naive_s:.2f} s, "
          f"streaming {stream_s:.2f} s -> naive/streaming = {naive_s / stream_s:.1f}x; "
          f"max |difference| = {diff:.1e}")
    return naive_s / stream_s, diff


def main(argv: list[str] | None = None) -> list[dict]:
    """Run the benchmark, print its lines; return its summary rows for run_all.py."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=31)
    parser.add_argument("--tokens", type=int, default=200_000)
    parser.add_argument("--dim", type=int, default=576)
    parser.add_argument("--chunk", type=int, default=4096, help="tokens per update() call")
    parser.add_argument("--compare-layers", type=int, default=8)
    parser.add_argument("--compare-tokens", type=int, default=3000)
    parser.add_argument("--matmul-dtype", choices=("float64", "float32"), default="float64")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="device of the full-size streaming pass (the comparison runs on CPU)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    rate = matmul_gflops(2048, 2048, 2048, torch.float64, args.device)
    L, n, d = args.layers, args.tokens, args.dim
    flops = n * d * d * L * (L + 1)
    print(f"[machine] float64 matmul {rate:.1f} GFLOP/s on {args.device} "
          f"({torch.get_num_threads()} CPU threads)")
    print(f"[plan] accumulators {L * (L + 1) / 2 * d * d * 8 / 2**30:.2f} GiB float64; "
          f"{flops / 1e12:.2f} TFLOP -> about {flops / rate / 1e9 / 60:.1f} min at that rate")
    speedup, diff = compare(min(args.compare_layers, L), args.compare_tokens, d)
    update_s, final_s, stats = stream(L, n, d, args.chunk, getattr(torch, args.matmul_dtype),
                                      args.device)
    print(f"[stream {args.matmul_dtype} matmuls] L={L} n={n} d={d}: update {update_s:.1f} s "
          f"({n / update_s:.0f} tok/s, {flops / update_s / 1e9:.1f} GFLOP/s = "
          f"{flops / update_s / 1e9 / rate:.0%} of the matmul rate), finalize {final_s:.1f} s; "
          f"entropy range {float(stats.entropy.min()):.3f}..{float(stats.entropy.max()):.3f} nats")
    return [{"benchmark": "metrics", "measure": "naive n×n Gram time / streaming time",
             "ratio": speedup, "target": "> 1",
             "detail": f"L={min(args.compare_layers, L)} n={args.compare_tokens}; "
                       f"max |diff| {diff:.1e}"},
            {"benchmark": "metrics",
             "measure": f"streaming ({args.matmul_dtype}) GFLOP/s / float64 matmul rate",
             "ratio": flops / update_s / 1e9 / rate, "target": "-",
             "detail": f"L={L} n={n} d={d}: {n / update_s:.0f} tok/s"}]


if __name__ == "__main__":
    main()
