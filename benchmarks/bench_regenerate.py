"""Tokens/s of batched greedy regeneration, SmolLM2-135M bf16: batch 16 vs batch 1, one run.

    .venv/bin/python benchmarks/bench_regenerate.py [--dtype bfloat16] [--device cpu]
        [--n-batched 16] [--n-single 4] [--max-new-tokens 64] [--max-prompt-len 256]

Batch 1 runs before and after the batched run so drift in machine speed shows.
"""
import argparse
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from actwave import data, models, regenerate as regen

parser = argparse.ArgumentParser()
parser.add_argument("--dtype", default="bfloat16")
parser.add_argument("--device", default="cpu")
parser.add_argument("--n-batched", type=int, default=16)
parser.add_argument("--n-single", type=int, default=4)
parser.add_argument("--max-new-tokens", type=int, default=64)
parser.add_argument("--max-prompt-len", type=int, default=256)
args = parser.parse_args()

model, tokenizer = models.load("smollm2-135m", dtype=getattr(torch, args.dtype), device=args.device)
config = regen.RegenConfig(model="smollm2-135m", n_conversations=args.n_batched,
                           max_prompt_len=args.max_prompt_len, max_new_tokens=args.max_new_tokens)
rows, _, _ = regen.select_conversations(config, tokenizer)
prompts = [data.prompt_ids(tokenizer, r["turns"][0]) for r in rows]
stop_ids = models.stop_token_ids(tokenizer, "smollm2-135m")
pad_id = tokenizer.pad_token_id


def tokens_per_second(batch_size, subset):
    tic = time.perf_counter()
    replies = regen.generate_sorted(model, subset, batch_size, args.max_new_tokens, stop_ids, pad_id)
    seconds = time.perf_counter() - tic
    n_new = sum(len(r) for r in replies)
    return n_new / seconds, n_new, seconds


regen.generate_sorted(model, prompts[:2], 2, 4, stop_ids, pad_id)  # warm-up
rates = {}
for label, batch_size, subset in [("batch 1", 1, prompts[: args.n_single]),
                                  (f"batch {args.n_batched}", args.n_batched, prompts),
                                  ("batch 1 (again)", 1, prompts[: args.n_single])]:
    rate, n_new, seconds = tokens_per_second(batch_size, subset)
    rates[label] = rate
    print(f"{label:16s} prompts={len(subset):3d} new_tokens={n_new:5d} seconds={seconds:7.1f} "
          f"tok/s={rate:7.1f}", flush=True)
print(f"prompt lengths: {sorted(len(p) for p in prompts)}")
single = (rates["batch 1"] + rates["batch 1 (again)"]) / 2
print(f"ratio batch {args.n_batched} / batch 1 tokens/s: {rates[f'batch {args.n_batched}'] / single:.2f}")
