"""Capture throughput vs a bare forward pass on the same batches (target ratio >= 0.85).

    .venv/bin/python benchmarks/bench_capture.py [--model smollm2-135m] [--batches 4]
        [--batch-size 4] [--seq-len 256] [--dtype float32]

Both routes see the same padded ShareGPT batches in one run, interleaved so that machine
noise hits them alike. "bare" is ``model(input_ids, attention_mask)`` (full logits, no
hidden states); "capture" is the store's per-batch work: all N+1 states, entropy and
argmax, conversion to the storage dtype, and serialising the shard bytes.
"""
from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from safetensors.torch import save as save_tensors

from actwave.capture import models
from actwave.capture.store import DTYPES, CaptureConfig, _pad_batch, capture_batch, tokenize_split
from actwave.decoding.timing import synchronize


def _time(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> list[dict]:
    """Run the benchmark, print its lines; return its summary rows for run_all.py."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--batches", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    parser.add_argument("--storage-dtype", default="bfloat16", choices=sorted(DTYPES))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)

    model, tokenizer = models.load(args.model, dtype=DTYPES[args.dtype], device=args.device)
    config = CaptureConfig(model=args.model, n_sequences=args.batches * args.batch_size,
                           max_seq_len=args.seq_len)
    sequences, _ = tokenize_split(config, tokenizer)
    batches = [sequences[i: i + args.batch_size] for i in range(0, len(sequences), args.batch_size)]
    special = set(tokenizer.all_special_ids)
    n_tokens = sum(len(s["input_ids"]) for s in sequences)

    def bare(batch):
        ids, mask = _pad_batch(batch, 0)
        with torch.no_grad():
            model(input_ids=ids.to(args.device), attention_mask=mask.to(args.device))
        synchronize(args.device)

    def captured(batch):
        columns = capture_batch(model, batch, 0, special, DTYPES[args.storage_dtype])
        captured.bytes += len(save_tensors({k: v.contiguous() for k, v in columns.items()}))
        synchronize(args.device)
    captured.bytes = 0

    bare(batches[0]), captured(batches[0])  # warm-up
    captured.bytes = 0
    t_bare = t_capture = 0.0
    for batch in batches:
        t_bare += _time(lambda: bare(batch))
        t_capture += _time(lambda: captured(batch))
    print(f"model {args.model} on {args.device}  dtype {args.dtype}  storage {args.storage_dtype}  "
          f"threads {torch.get_num_threads()}  tokens {n_tokens}")
    print(f"bare forward : {n_tokens / t_bare:8.1f} tok/s")
    print(f"capture      : {n_tokens / t_capture:8.1f} tok/s")
    print(f"ratio capture/bare throughput: {t_bare / t_capture:.3f}  (target >= 0.85)")
    print(f"disk bytes per token: {captured.bytes / n_tokens:,.0f}")
    return [{"benchmark": "capture",
             "measure": f"capture / bare forward tok/s ({args.dtype}, {args.device})",
             "ratio": t_bare / t_capture, "target": ">= 0.85",
             "detail": f"{n_tokens / t_capture:.0f} vs {n_tokens / t_bare:.0f} tok/s; "
                       f"{captured.bytes / n_tokens:,.0f} B/token"}]


if __name__ == "__main__":
    main()
