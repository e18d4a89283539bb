"""EAGLE-3 draft training throughput vs its FLOP cost, fp32 and bf16 autocast, one run.

    python benchmarks/bench_train.py --steps 3 --batch-size 2 --seq-len 512 --ttt-steps 3

prints (1) the machine's matmul rate (GFLOP/s) in fp32 and bf16, measured on the draft's
dominant GEMM (tokens × H @ H × V_draft, the LM head); (2) per compute dtype the training
throughput (tokens/s through ``actwave.eagle3.train.train_step``: soft labels, TTT unroll,
backward, AdamW) and the draft's estimated training FLOP rate as a fraction of (1).

Draft FLOPs per token = fc (2·k·H²) + Σ_i [2·(2H·(n_h+2n_kv)·d_h + n_h·d_h·H + 3·H·I +
H·V_draft) + 4·n_h·d_h·(keys seen at step i)], ×3 for forward + backward. The target's
soft-label head (2·H·V_target per token, forward only) is reported separately.

Uses the real SmolLM2 and a capture store when one exists (``--store``, else the newest
``smollm2-135m-train-*`` store in the cache); otherwise a random-weight target with
SmolLM2-135M's shape and random states (same cost, meaningless loss).
"""
from __future__ import annotations

import argparse
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from actwave.capture.store import CaptureStore
from actwave.config import cache_dir
from actwave.decoding.timing import synchronize
from actwave.eagle3.train import (TrainConfig, TrainData, TTTLoss, load_sequences, make_batch,
                                  new_draft, train_step)
from timing import matmul_gflops  # benchmarks/timing.py

SMOLLM2_SHAPE = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                     num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                     max_position_embeddings=8192, rope_theta=100000.0, tie_word_embeddings=True)


def draft_train_flops_per_token(draft, ttt_steps: int, seq_len: int) -> float:
    """Estimated forward+backward FLOPs per token of one TTT unroll (see module docstring)."""
    c = draft.config
    heads, kv_heads, head_dim, width = (c.num_attention_heads, c.num_key_value_heads,
                                        c.head_dim, c.hidden_size)
    per_step = 2 * (2 * width * (heads + 2 * kv_heads) * head_dim + heads * head_dim * width
                    + 3 * width * c.intermediate_size + width * c.draft_vocab_size)
    attention = sum(4 * heads * head_dim * ((seq_len + 1) / 2 + step) for step in range(ttt_steps))
    forward = 2 * len(c.layer_ids) * c.target_hidden_size * width + ttt_steps * per_step + attention
    return 3.0 * forward


def find_store(path: str | None) -> CaptureStore | None:
    if path:
        return CaptureStore(path)
    found = sorted((cache_dir() / "capture").glob("smollm2-135m-train-*/manifest.json"),
                   key=lambda p: p.stat().st_mtime)
    for manifest in reversed(found):
        store = CaptureStore(manifest.parent, require_complete=False)
        if store.complete:
            return store
    return None


def random_data(layer_ids, n_sequences: int, seq_len: int, hidden: int, vocab: int) -> TrainData:
    """Random states and tokens (ids in the lower half of the vocab: the draft vocab holds them)."""
    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(0, vocab // 2, (seq_len,), generator=g) for _ in range(n_sequences)]
    return TrainData(
        target_states=[torch.randn(seq_len, len(layer_ids) * hidden, generator=g).bfloat16()
                       for _ in ids],
        last_states=[(4 * torch.randn(seq_len, hidden, generator=g)).bfloat16() for _ in ids],
        input_ids=ids, argmax=[torch.roll(i, -1) for i in ids],
        loss_mask=[torch.ones(seq_len, dtype=torch.bool) for _ in ids])


def time_training(target, data: TrainData, config: TrainConfig, steps: int) -> tuple[float, object]:
    """tokens/s over ``steps`` timed steps after one warm-up step; -> (tokens/s, draft)."""
    from accelerate import Accelerator

    device = next(target.parameters()).device
    accelerator = Accelerator(cpu=device.type == "cpu")
    draft = new_draft(target, data, config)
    optimizer = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=config.lr,
                                  betas=config.betas)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    module = TTTLoss(draft, config.ttt_steps, config.gamma)
    tokens, elapsed = 0, 0.0
    for step in range(steps + 1):
        indices = [(step * config.batch_size + i) % len(data) for i in range(config.batch_size)]
        tic = time.perf_counter()
        batch = make_batch(data, indices, target, draft, accelerator.device)
        train_step(module, optimizer, scheduler, accelerator, batch, config)
        synchronize(device)
        if step:  # step 0 is warm-up
            elapsed += time.perf_counter() - tic
            tokens += sum(data.input_ids[i].numel() for i in indices)
    return tokens / elapsed, draft


def main(argv: list[str] | None = None) -> list[dict]:
    """Run the benchmark, print its lines; return its summary rows for run_all.py."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--ttt-steps", type=int, default=3)
    parser.add_argument("--draft-vocab", type=int, default=8192)
    parser.add_argument("--layers", default="2,15,27")
    parser.add_argument("--store", default=None, help="capture store folder (default: search)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtypes", default="float32,bfloat16",
                        help="compute dtypes to time (bf16 is very slow on CPUs without it)")
    args = parser.parse_args(argv)
    layer_ids = tuple(int(x) for x in args.layers.split(","))
    store = find_store(args.store)
    if store is not None:
        from actwave.capture.models import load
        target, _ = load(store.manifest["config"]["model"], device=args.device)
        data = load_sequences(store, layer_ids, args.seq_len)
        source = f"real {store.manifest['config']['model']}, store {store.path.name}"
    else:
        torch.manual_seed(0)
        target = LlamaForCausalLM(LlamaConfig(**SMOLLM2_SHAPE)).eval().to(args.device)
        data = random_data(layer_ids, 2 * args.batch_size, args.seq_len, 576, 49152)
        source = "random target with SmolLM2-135M's shape, random states"
    mean_len = data.n_tokens / len(data)
    print(f"{source}; layers {layer_ids}; batch {args.batch_size} x ~{mean_len:.0f} tokens; "
          f"TTT {args.ttt_steps}; V_draft {args.draft_vocab}; threads {torch.get_num_threads()}")
    hidden = target.config.hidden_size
    vocab = target.get_input_embeddings().weight.shape[0]
    n_rows = int(args.batch_size * mean_len)
    rows = []
    for dtype_name in args.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        config = TrainConfig(layer_ids=layer_ids, ttt_steps=args.ttt_steps, total_steps=10,
                             warmup_steps=0, batch_size=args.batch_size, max_seq_len=args.seq_len,
                             draft_vocab_size=args.draft_vocab, dtype=dtype_name)
        peak = matmul_gflops(n_rows, hidden, args.draft_vocab, dtype, args.device, repeats=5)
        tokens_per_s, draft = time_training(target, data, config, args.steps)
        flops = draft_train_flops_per_token(draft, args.ttt_steps, int(mean_len))
        head_flops = 2 * hidden * vocab
        achieved = tokens_per_s * flops / 1e9
        print(f"{dtype_name:>8}: matmul {peak:7.1f} GFLOP/s | train {tokens_per_s:7.1f} tok/s, "
              f"draft {flops / 1e6:6.1f} MFLOP/tok -> {achieved:6.1f} GFLOP/s = "
              f"{achieved / peak:.2f} of matmul | +target head {head_flops / 1e6:.0f} MFLOP/tok -> "
              f"{tokens_per_s * (flops + head_flops) / 1e9 / peak:.2f}")
        rows.append({"benchmark": "train", "measure": f"draft training GFLOP/s / {dtype_name} "
                     "LM-head matmul rate", "ratio": achieved / peak, "target": "-",
                     "detail": f"{tokens_per_s:.0f} tok/s; {source.split(',')[0]}"})
    return rows


if __name__ == "__main__":
    main()
