"""Online draft training: the target runs inside the training loop, no train store.

As in SpecForge's online mode, every step each process runs the target over its own
batch of token sequences (``capture.forward_with_states``) and hands the draft the k
chosen layers' states and the target's logits. Everything else is the store route's loop
(``train.fit``): the TTT unroll and loss, the optimiser, checkpoints, resume and DDP.
``online_batch`` returns exactly ``train.make_batch``'s tensors (padding zeroed the same
way), so both routes give the same loss on the same batches; the store route differs only
by its storage rounding (bf16 states by default). See docs/METHODS.md §12.

Cost: one target forward per batch and step (every epoch again), instead of one capture
pass; memory holds the (B, L, V_target) logits of a batch besides the draft's unroll.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from actwave.capture.forward import forward_with_states
from actwave.capture.models import DTYPES, load, model_digest
from actwave.capture.store import SOURCES, CaptureConfig, CaptureStore, check_model, tokenize_split
from actwave.config import config_hash, to_jsonable
from actwave.eagle3.train import (Segment, TrainConfig, TrainResult, _one_writer, _pad,
                                  add_config_arguments, check_store_target, config_from_args,
                                  evaluate_data, fit, trained_positions)
from actwave.integrity import describe_model, identity_mismatch, model_identity
from actwave.eagle3.vocab import draft_target_ids


@dataclass
class OnlineSource:
    """Tokenised training sequences and the identity recorded for them.

    input_ids / loss_mask: per sequence (T,) int64 / bool (token in an assistant reply).
    ``config_hash`` (the digest of the capture config, the text and the target) takes the
    store digest's place in checkpoints and config.json, so a draft trained online is never
    resumed or reused as one trained from a store or on other text; ``path`` says where the
    sequences came from; ``target`` is the ``model_identity`` of the target that made them
    (``train_online`` refuses another target; None: not checked).
    """

    input_ids: list[torch.Tensor]
    loss_mask: list[torch.Tensor]
    config_hash: str
    path: str
    target: dict | None = None

    def __post_init__(self) -> None:
        if not self.input_ids or len(self.input_ids) != len(self.loss_mask):
            raise ValueError(f"need one loss mask per sequence and at least one sequence, got "
                             f"{len(self.input_ids)} sequences and {len(self.loss_mask)} masks")
        short = [i for i, ids in enumerate(self.input_ids) if ids.numel() < 2]
        if short:
            raise ValueError(f"sequence {short[0]} has fewer than 2 tokens; TTT needs >= 2")

    @classmethod
    def from_sequences(cls, sequences: list[dict], config_hash: str, path: str,
                       target: dict | None = None) -> OnlineSource:
        """From ``{"input_ids": [...], "loss_mask": [...]}`` rows (``store.tokenize_split``)."""
        return cls([torch.tensor(s["input_ids"], dtype=torch.long) for s in sequences],
                   [torch.tensor(s["loss_mask"], dtype=torch.bool) for s in sequences],
                   config_hash, path, target)

    @property
    def digest(self) -> str:
        """What identifies the training data (as ``CaptureStore.digest`` does a store's)."""
        return self.config_hash

    def __len__(self) -> int:
        return len(self.input_ids)

    @property
    def n_tokens(self) -> int:
        return sum(ids.numel() for ids in self.input_ids)

    def truncated(self, max_seq_len: int) -> OnlineSource:
        """Each sequence cut to its first ``max_seq_len`` tokens (as ``load_sequences``)."""
        return OnlineSource([ids[:max_seq_len] for ids in self.input_ids],
                            [mask[:max_seq_len] for mask in self.loss_mask],
                            self.config_hash, self.path, self.target)


def online_source(capture, target, tokenizer) -> OnlineSource:
    """The sequences a capture of ``capture`` (a ``store.CaptureConfig``) would store.

    Same tokenisation, skipped conversations and (with ``source='regenerated'``) replies;
    refuses a target that is not ``capture.model`` in ``capture.dtype``. Its hash covers
    the config, the data (the text, regenerated replies included), the content digest of
    the model's files and the target's weights, prefixed ``online-``.
    """
    found = check_model(capture, target, None, "online training")
    sequences, data_hash = tokenize_split(capture, tokenizer, target)
    if not sequences:
        raise ValueError(f"split {capture.split!r} gave no sequences of >= 2 tokens")
    identity = config_hash({"capture": to_jsonable(capture), "data": data_hash,
                            "model": model_digest(capture.model),
                            "target": found["weights_sha256"]})
    return OnlineSource.from_sequences(sequences, f"online-{identity}",
                                       f"online:{capture.model}/{capture.split}", found)


def check_source_target(source: OnlineSource, target) -> None:
    """Refuse a ``target`` other than the one that made ``source`` (when it records one)."""
    if source.target is None:
        return
    found = model_identity(target)
    problems = identity_mismatch(source.target, found)
    if problems:
        raise ValueError(f"online source {source.path} was made with target "
                         f"{describe_model(source.target)}, but the target passed is "
                         f"{describe_model(found)} ({'; '.join(problems)})")


@torch.no_grad()
def online_batch(data: OnlineSource, indices: list[int], target, draft,
                 device: torch.device) -> dict[str, torch.Tensor]:
    """``make_batch``'s TTTLoss inputs for sequences ``indices``, from one target forward.

    target_states (B, L, k·D) float32 and target_argmax (B, L) are zero at padding, as a
    store batch's; target_probs (B, L, V_draft) is the target's softmax over the draft
    vocabulary (renormalised), fp32. The target must sit on ``device``.
    """
    width = max(data.input_ids[i].numel() for i in indices)
    input_ids = _pad([data.input_ids[i] for i in indices], width).to(device)  # (B, L)
    valid = _pad([torch.ones_like(data.loss_mask[i]) for i in indices], width).to(device)
    loss_mask = _pad([data.loss_mask[i] for i in indices], width).to(device)
    logits, states, _ = forward_with_states(target, draft.layer_ids, input_ids,
                                            attention_mask=valid.long())  # (B, L, V), (B, L, k·D)
    vocab_ids = draft_target_ids(draft.d2t).to(device)
    return {"target_states": states.float() * valid[..., None],
            "input_ids": input_ids,
            "target_probs": torch.softmax(logits[..., vocab_ids].float(), dim=-1),
            "target_argmax": logits.argmax(-1).masked_fill(~valid, 0),
            "label_mask": trained_positions(loss_mask)}


def evaluate_online(draft, source: OnlineSource, target, ttt_steps: int = 7,
                    batch_size: int = 4, dtype: str = "float32") -> dict:
    """``train.evaluate_data`` on an ``OnlineSource`` (the target runs per batch; no store):
    per-TTT-step top-1 agreement ``acc_i`` and loss ``loss_i``."""
    return evaluate_data(draft, source, target, ttt_steps, batch_size, dtype,
                         batch_fn=online_batch)


@_one_writer
def train_online(source: OnlineSource, target, config: TrainConfig, out_dir,
                 progress: bool = True, eval_store=None, eval_fn=None,
                 segment: Segment | None = None) -> TrainResult:
    """``train_draft`` with the target in the loop: same out_dir layout, checkpoints,
    resume, held-out evaluation (``eval_store``, a capture store), ``segment`` and DDP
    semantics. A target other than the one that made ``source`` or ``eval_store`` is
    refused."""
    check_source_target(source, target)
    if eval_store is not None:
        check_store_target(eval_store, target, "evaluation")
    target.eval()
    return fit(source, lambda: source.truncated(config.max_seq_len), online_batch, target,
               config, out_dir, progress, eval_store, eval_fn, segment)


def main(argv: list[str] | None = None) -> None:
    """Command line, for one process or DDP via ``accelerate launch``:

        accelerate launch -m actwave.eagle3.online --model smollm2-135m --sequences 1024 \\
            --layers 2,15,27 --out <dir> --total_steps 2000 --dtype bfloat16
    """
    import argparse

    from accelerate import Accelerator

    parser = argparse.ArgumentParser(description="Train one EAGLE-3 draft, target in the loop.")
    parser.add_argument("--model", required=True, help="bundled name, HF id or local path")
    parser.add_argument("--split", default="train", help="ShareGPT split (default train)")
    parser.add_argument("--sequences", type=int, required=True, help="conversations to use")
    parser.add_argument("--source", default="sharegpt", choices=SOURCES)
    parser.add_argument("--target-dtype", default="float32", choices=sorted(DTYPES))
    parser.add_argument("--eval-store", default=None)
    parser.add_argument("--out", required=True)
    add_config_arguments(parser)
    args = parser.parse_args(argv)
    config = config_from_args(args)
    accelerator = Accelerator()
    target, tokenizer = load(args.model, dtype=DTYPES[args.target_dtype], device=accelerator.device)
    capture = CaptureConfig(model=args.model, split=args.split, n_sequences=args.sequences,
                            max_seq_len=config.max_seq_len, dtype=args.target_dtype,
                            source=args.source)
    with accelerator.main_process_first():  # regenerated replies: written once, then read
        source = online_source(capture, target, tokenizer)
    train_online(source, target, config, args.out,
                 eval_store=CaptureStore(args.eval_store) if args.eval_store else None)


if __name__ == "__main__":
    main()
