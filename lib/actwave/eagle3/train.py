"""Training EAGLE-3 drafts from a capture store (no target forward passes).

The capture store (``actwave.capture.store``) holds every layer's hidden state per token, so a
draft for any layer set trains from it alone: the draft's k layers are its input and the
target's soft labels are recomputed from the stored ℓ=N state with the target's final
norm + LM head (``actwave.capture.forward.target_logits``). The target object is needed only for
that head and for the frozen input embedding. The unrolled loss is in ``ttt.py``.

Optimisation follows SafeAILab/EAGLE ``traineagle3`` / SpecForge: AdamW β=(0.9, 0.95),
weight decay 0, linear warmup then cosine decay, gradient clipping 0.5. Multi-GPU runs
go through ``accelerate`` (DDP: ``accelerate launch``); on CPU it is one process.

Memory: the training split is kept in memory in the store's dtype,
(k+1)·D·bytes per token (k draft layers + ℓ=N): SmolLM2 (D=576), k=3, bf16 → 4.6 kB per
token, ~310 MB for 67k tokens. Per step, the unroll keeps for backward about three
(B, L, V_draft) float32 tensors per TTT step (logits, log-probs, target probs), e.g.
4×512×16k×4 B = 134 MB each.

Soft labels come from ℓ=N states stored in the store's dtype (bf16 by default), so they
differ from the target's fp32 logits by that rounding; the target argmax used for the
masks and the agreement metric is the one the capture pass stored.
"""
from __future__ import annotations

import csv
import functools
import io
import logging
import math
import time
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Callable

import torch
from tqdm import tqdm

from actwave.capture.forward import target_logits
from actwave.config import atomic_write_bytes, config_hash
from actwave.eagle3.checkpoint import (latest_checkpoint, load_checkpoint,
                                       remove_checkpoint_temps, save_checkpoint)
from actwave.eagle3.model import Eagle3Draft
from actwave.eagle3.ttt import TTTLoss, TTTOutput
from actwave.eagle3.vocab import draft_target_ids, token_frequencies
from actwave.integrity import (Between, IntegrityError, WriterLock, check_fields, int_ids,
                               read_record, require_model, save_config_record)

log = logging.getLogger(__name__)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
TRAIN_COLUMNS = ("input_ids", "argmax", "loss_mask", "seq_index")


@dataclass
class TrainConfig:
    """One draft's training run (saved as ``config.json`` beside it).

    Defaults are the ``cpu`` profile's values (the ``train`` section of ``profiles/cpu.yaml``);
    EAGLE-3 itself trains with 7 TTT steps, lr 1e-4 and a 32k draft vocabulary (gpu profile).
    """

    layer_ids: tuple[int, ...] = ()      # empty: a template (``StudyConfig.train``), no draft
    ttt_steps: int = 3
    gamma: float = 0.8
    lr: float = 1e-3
    warmup_steps: int = 5
    total_steps: int = 48
    batch_size: int = 2                  # sequences per process and step
    max_seq_len: int = 512
    grad_clip: float = 0.5
    betas: tuple[float, float] = (0.9, 0.95)
    weight_decay: float = 0.0
    draft_vocab_size: int = 8192
    seed: int = 0
    checkpoint_every: int = 16
    dtype: str = "float32"               # compute: float32, or bfloat16 autocast
    # "random" (SafeAILab) or "target" rows (speculators); on SmolLM2, 60 CPU steps, random
    # gave equal step-0 but higher step-1/2 held-out agreement (0.105/0.077 vs 0.079/0.056).
    lm_head_init: str = "random"
    eval_sequences: int = 8              # held-out sequences scored at each checkpoint

    def __post_init__(self):
        check_fields(self, TRAIN_RANGES, {"dtype": DTYPES, "lm_head_init": LM_HEAD_INITS})
        self.layer_ids = int_ids("layer_ids", self.layer_ids)
        self.betas = tuple(float(b) for b in self.betas)  # JSON lists; hashed as floats
        if self.warmup_steps >= self.total_steps:
            raise ValueError(f"warmup_steps must lie in 0..total_steps-1 ({self.total_steps - 1}),"
                             f" got {self.warmup_steps}")


LM_HEAD_INITS = ("random", "target")
_POSITIVE = Between(1)
TRAIN_RANGES = {
    "ttt_steps": _POSITIVE, "total_steps": _POSITIVE, "batch_size": _POSITIVE,
    "max_seq_len": _POSITIVE, "draft_vocab_size": _POSITIVE, "checkpoint_every": _POSITIVE,
    "eval_sequences": _POSITIVE, "warmup_steps": Between(0), "seed": Between(0),
    "gamma": Between(0.0, 1.0, low_open=True), "lr": Between(0.0, low_open=True),
    "grad_clip": Between(0.0, low_open=True), "weight_decay": Between(0.0),
    "betas": Between(0.0, 1.0, high_open=True)}


@dataclass
class Segment:
    """A piece of a longer run (``actwave.eagle3.schedule``, ``actwave.study.longrun``).

    lr_schedule: step -> LR factor, instead of ``lr_factor``'s warmup + cosine over
    ``total_steps``; stop_at: train up to this step only (checkpointed there, nothing marked
    complete); init_from: another run's checkpoint folder to start from when out_dir has
    none of its own (its weights, optimizer, RNG and history; the LR set by lr_schedule).
    Checkpoints are keyed by the ``TrainConfig``, not the schedule: give each schedule its
    own out_dir.
    """

    lr_schedule: Callable[[int], float] | None = None
    stop_at: int | None = None
    init_from: Path | None = None


@dataclass
class TrainData:
    """Whole sequences in memory: per sequence (T,·) tensors in the store's dtype."""

    target_states: list[torch.Tensor]   # (T, k·D) the draft's layers, in layer_ids order
    last_states: list[torch.Tensor]     # (T, D) ℓ=N, for the target's soft labels
    input_ids: list[torch.Tensor]       # (T,)
    argmax: list[torch.Tensor]          # (T,) target argmax next token
    loss_mask: list[torch.Tensor]       # (T,) bool, token in an assistant reply

    def __len__(self) -> int:
        return len(self.input_ids)

    @property
    def n_tokens(self) -> int:
        return sum(ids.numel() for ids in self.input_ids)


@dataclass
class TrainResult:
    """The trained draft, its per-step history rows and where it was written."""

    draft: Eagle3Draft
    history: list[dict]
    out_dir: Path
    draft_dir: Path
    seconds: float
    metrics: dict = field(default_factory=dict)


def load_sequences(store, layer_ids, max_seq_len: int | None = None,
                   max_sequences: int | None = None) -> TrainData:
    """Read the draft's layers + ℓ=N of the stored sequences (the first ``max_sequences``,
    each truncated to ``max_seq_len``)."""
    last = store.num_layers
    needed = sorted(set(layer_ids) | {last})
    rows = [needed.index(i) for i in layer_ids]
    data = TrainData([], [], [], [], [])
    for shard in store.iter_shards(layers=needed, columns=TRAIN_COLUMNS):
        if max_sequences is not None and len(data) >= max_sequences:
            break
        lengths = torch.unique_consecutive(shard["seq_index"], return_counts=True)[1].tolist()
        hidden = shard["hidden"]  # (L_sel, n, D)
        for start, length in zip([0, *torch.tensor(lengths).cumsum(0).tolist()[:-1]], lengths):
            stop = start + min(length, max_seq_len or length)
            chosen = hidden[rows, start:stop]  # (k, T, D)
            data.target_states.append(chosen.permute(1, 0, 2).reshape(stop - start, -1))
            data.last_states.append(hidden[needed.index(last), start:stop])
            for name in ("input_ids", "argmax", "loss_mask"):
                getattr(data, name).append(shard[name][start:stop])
            if max_sequences is not None and len(data) >= max_sequences:
                break
    if not len(data):
        raise ValueError(f"capture store {store.path} holds no sequences")
    return data


def _pad(tensors: list[torch.Tensor], width: int, fill=0) -> torch.Tensor:
    """Right-pad (T, ...) tensors to (B, width, ...)."""
    out = tensors[0].new_full((len(tensors), width, *tensors[0].shape[1:]), fill)
    for row, values in enumerate(tensors):
        out[row, : values.shape[0]] = values
    return out


@torch.no_grad()
def target_draft_probs(target, last_states: torch.Tensor, vocab_ids: torch.Tensor) -> torch.Tensor:
    """Target next-token probs over the draft vocab, renormalised, fp32.

    last_states: (B, L, D) ℓ=N states; vocab_ids: (V_draft,) target ids -> (B, L, V_draft).
    Only the draft vocabulary's rows of the LM head are computed.
    """
    weight = target.get_output_embeddings().weight
    logits = target_logits(target, last_states.to(device=weight.device, dtype=weight.dtype),
                           vocab_ids.to(weight.device))
    return torch.softmax(logits.float(), dim=-1)


def make_batch(data: TrainData, indices: list[int], target, draft: Eagle3Draft,
               device: torch.device) -> dict[str, torch.Tensor]:
    """Padded TTTLoss inputs for sequences ``indices`` on ``device`` (states in float32)."""
    width = max(data.input_ids[i].numel() for i in indices)
    padded = {name: _pad([getattr(data, name)[i] for i in indices], width).to(device)
              for name in ("target_states", "last_states", "input_ids", "argmax", "loss_mask")}
    vocab_ids = draft_target_ids(draft.d2t).to(device)
    return {"target_states": padded["target_states"].float(),  # (B, L, k·D)
            "input_ids": padded["input_ids"],
            "target_probs": target_draft_probs(target, padded["last_states"], vocab_ids).to(device),
            "target_argmax": padded["argmax"],
            "label_mask": trained_positions(padded["loss_mask"])}


def trained_positions(loss_mask: torch.Tensor) -> torch.Tensor:
    """loss_mask: (B, L) -> label_mask (B, L): position p is trained when the token it
    predicts, x_{p+1}, exists and is in a reply."""
    return torch.cat([loss_mask[:, 1:], torch.zeros_like(loss_mask[:, :1])], dim=1)


def batch_indices(n_sequences: int, batch_size: int, step: int, seed: int,
                  rank: int = 0, world_size: int = 1) -> list[int]:
    """This process's sequences at ``step``: a seeded reshuffle each epoch, a pure function
    of the step (so a resumed run sees the same batches as an uninterrupted one)."""
    global_size = batch_size * world_size
    positions = range(step * global_size + rank * batch_size,
                      step * global_size + (rank + 1) * batch_size)
    perms: dict[int, torch.Tensor] = {}
    out = []
    for position in positions:
        epoch, offset = divmod(position, n_sequences)
        if epoch not in perms:
            generator = torch.Generator().manual_seed(seed * 100_003 + epoch)
            perms[epoch] = torch.randperm(n_sequences, generator=generator)
        out.append(int(perms[epoch][offset]))
    return out


def lr_factor(step: int, warmup_steps: int, total_steps: int) -> float:
    """Linear warmup to 1, then cosine decay to 0 at ``total_steps``."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))


def history_row(step: int, output: TTTOutput, lr: float, tokens: int, seconds: float) -> dict:
    """One CSV row: step, loss, per-TTT-step loss and top-1 agreement."""
    row = {"step": step, "loss": float(output.loss.detach()), "lr": lr, "tokens": tokens,
           "seconds": seconds}
    for i, (loss, acc) in enumerate(zip(output.step_losses.tolist(), output.accuracy())):
        row[f"loss_{i}"] = loss
        row[f"acc_{i}"] = acc
    return row


def write_history(path: Path, history: list[dict]) -> None:
    """history.csv, written atomically."""
    if not history:
        return
    text = io.StringIO()
    writer = csv.DictWriter(text, fieldnames=list(history[0]), lineterminator="\n")
    writer.writeheader()
    writer.writerows(history)
    atomic_write_bytes(path, text.getvalue().encode())


# ----------------------------------------------------------------------------- training
def new_draft(target, data: TrainData, config: TrainConfig) -> Eagle3Draft:
    """A seeded, untrained fp32 draft whose vocab is the most frequent reply tokens of ``data``."""
    vocab_size = target.get_input_embeddings().weight.shape[0]
    counts = token_frequencies(data.input_ids, data.loss_mask, vocab_size)
    torch.manual_seed(config.seed)
    draft = Eagle3Draft.from_target(target, config.layer_ids, config.draft_vocab_size,
                                    token_counts=counts, lm_head_init=config.lm_head_init)
    return draft.float()


def train_step(module, optimizer, scheduler, accelerator, batch: dict,
                config: TrainConfig) -> TTTOutput:
    """Forward (optionally bf16 autocast), backward, clip, AdamW step, LR step.

    A non-finite loss or gradient norm raises FloatingPointError before the optimizer
    step, so the weights (and the last checkpoint) stay as they were.
    """
    with torch.autocast(accelerator.device.type, dtype=torch.bfloat16,
                        enabled=config.dtype == "bfloat16"):
        output = module(**batch)
    accelerator.backward(output.loss)
    norm = accelerator.clip_grad_norm_(module.parameters(), config.grad_clip)
    loss = float(output.loss.detach())
    if not (math.isfinite(loss) and math.isfinite(float(norm))):
        raise FloatingPointError(f"non-finite loss {loss} or gradient norm {float(norm)}; "
                                 "no optimizer step was taken")
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return output


def _finished(out_dir: Path, config: TrainConfig, store) -> bool:
    """Whether out_dir holds this config's finished draft; refuses one from another store
    (by content digest). An unreadable or unchecksummed record counts as unfinished: the run
    is rebuilt from its last checkpoint."""
    record_path = out_dir / "config.json"
    if not record_path.exists():
        return False
    try:
        record = read_record(record_path, "rebuilt from the last checkpoint by train_draft")
    except IntegrityError as err:
        log.warning("%s", err)
        return False
    if not (record.get("complete") and record.get("config_hash") == config_hash(config)):
        return False
    if record.get("store_digest") != store.digest:
        raise ValueError(f"{out_dir} holds a draft trained on capture store "
                         f"{record.get('store_digest')} ({record.get('store')}), not "
                         f"{store.digest} ({store.path}); use another out_dir, or delete "
                         f"{out_dir} to retrain")
    return True


def check_store_target(store, target, role: str = "training") -> None:
    """Refuse a ``target`` other than the model that made the capture ``store`` (its
    manifest's model identity), naming both: the draft's soft labels and embedding come
    from ``target``, its inputs from the store."""
    require_model(store.manifest.get("model"), target,
                  f"{role} store {store.path} was captured with target", ", but the target "
                  "passed is", f"capture store {store.path} records no model; recapture it "
                  "(actwave.capture.store.run_capture)",
                  "pass the target that made the store, or capture one with this target")


def _one_writer(train):
    """Run ``train`` holding out_dir's WriterLock on the main process (other DDP ranks
    never write to out_dir)."""
    @functools.wraps(train)
    def locked(store, target, config, out_dir, *args, **kwargs):
        from accelerate import Accelerator

        # Accelerator, not PartialState: only it reads ACCELERATE_USE_CPU, without which
        # CPU processes (gloo) launched together would each train alone.
        if not Accelerator().is_main_process:
            return train(store, target, config, out_dir, *args, **kwargs)
        with WriterLock(Path(out_dir)):
            return train(store, target, config, out_dir, *args, **kwargs)
    return locked


def _checked_step(step: int, out_dir: Path, *args) -> TTTOutput:
    """``train_step``, its non-finite error extended with the step and what was kept."""
    try:
        return train_step(*args)
    except FloatingPointError as err:
        kept = sorted((out_dir / "checkpoints").glob("step-*"))
        raise FloatingPointError(
            f"training stopped at step {step + 1}: {err}; the last good checkpoint "
            f"({kept[-1] if kept else 'none yet'}) is kept and nothing is marked complete; "
            "lower lr or check the capture store for NaN/inf") from err


def require_finite_metrics(what: str, row: dict) -> None:
    """Refuse (FloatingPointError) a metrics row holding NaN/inf, naming the first such key:
    a draft is never marked complete with a metric that is not a number."""
    bad = [key for key, value in row.items()
           if isinstance(value, float) and not math.isfinite(value)]
    if bad:
        raise FloatingPointError(
            f"{what}: {bad[0]} = {row[bad[0]]} ({len(bad)} non-finite metric(s): {bad}); the "
            "held-out store may hold NaN/inf states, or none of its positions is scored (no "
            "reply token whose target argmax is in the draft vocabulary); nothing is marked "
            "complete")


def _read_csv(path: Path) -> list[dict]:
    if not path.exists():
        return []
    with path.open() as f:
        return [{k: float(v) if v not in ("", "nan") else math.nan for k, v in row.items()}
                for row in csv.DictReader(f)]


def _optimizer(draft: Eagle3Draft, config: TrainConfig, schedule=None):
    """AdamW over the trainable weights + LambdaLR of ``schedule`` (step -> factor; default
    linear-warmup/cosine). The lambda wraps it: LambdaLR checkpoints the attributes of a
    callable object, which would carry one run's schedule into a run started from it."""
    optimizer = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=config.lr,
                                  betas=config.betas, weight_decay=config.weight_decay)
    factor = schedule or (lambda step: lr_factor(step, config.warmup_steps, config.total_steps))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: factor(step))
    return optimizer, scheduler


def _start_from(segment: Segment, draft: Eagle3Draft, optimizer, scheduler,
                store_hash: str | None) -> dict:
    """Load ``segment.init_from`` (another run's checkpoint, on the same training data)
    -> its meta; the learning rate of the next step is this run's schedule's."""
    meta = load_checkpoint(Path(segment.init_from), draft, optimizer, scheduler)
    if meta.get("store_config_hash") not in (None, store_hash):
        raise ValueError(f"checkpoint {segment.init_from} was trained on "
                         f"{meta['store_config_hash']}, not {store_hash}")
    if segment.lr_schedule is not None:
        for group, base in zip(optimizer.param_groups, scheduler.base_lrs):
            group["lr"] = base * segment.lr_schedule(meta["step"])
    log.info("starting at step %d from %s", meta["step"], segment.init_from)
    return meta


def _stop_step(segment: Segment, config: TrainConfig, start: int) -> int:
    """The step this call trains up to: ``segment.stop_at`` or ``total_steps``."""
    stop = config.total_steps if segment.stop_at is None else segment.stop_at
    if not start <= stop <= config.total_steps:
        raise ValueError(f"stop_at={stop} must lie between the start step {start} (of the "
                         f"checkpoint resumed) and total_steps={config.total_steps}")
    return stop


def _resume(out_dir: Path, config: TrainConfig, digest: str, segment: Segment, draft,
            optimizer, scheduler) -> tuple[int, list[dict], list[dict]]:
    """-> (start step, history, eval history): from the latest checkpoint of this config and
    data in ``out_dir``, else from the segment's starting point, else from scratch."""
    checkpoint = latest_checkpoint(out_dir, config, digest)
    if checkpoint is not None:
        meta = load_checkpoint(checkpoint, draft, optimizer, scheduler)
        log.info("resuming %s at step %d", out_dir, meta["step"])
    elif segment.init_from is not None:
        meta = _start_from(segment, draft, optimizer, scheduler, digest)
    else:
        return 0, [], []
    return meta["step"], meta["history"], meta["eval_history"]


def _held_out_row(step: int, history: list[dict], draft, target, config: TrainConfig,
                  eval_data, eval_fn) -> dict:
    """One eval-history row at a checkpoint: step, tokens seen, the held-out sequences'
    per-TTT-step loss / agreement (``evaluate_data``) and ``eval_fn(draft)``'s metrics."""
    row = {"step": step, "tokens": sum(h["tokens"] for h in history)}
    if eval_data is not None:
        row.update(evaluate_data(draft, eval_data, target, config.ttt_steps,
                                 config.batch_size, config.dtype))
    row.update(eval_fn(draft) if eval_fn else {})
    require_finite_metrics(f"held-out evaluation at step {step}", row)
    return row


def _save_finished(out_dir: Path, draft, config: TrainConfig, eval_history: list[dict],
                   seconds: float, metrics: dict, source, eval_store, data: TrainData) -> None:
    """The finished draft, its eval.csv, and config.json marked complete (written last: a
    run interrupted before it is resumed, not read as finished)."""
    draft.save_pretrained(out_dir / "draft")
    write_history(out_dir / "eval.csv", eval_history)
    save_config_record(out_dir, config, complete=True, seconds=seconds, metrics=metrics,
                       store=str(source.path), store_digest=source.digest,
                       eval_store_digest=eval_store.digest if eval_store is not None else None,
                       target=draft.target_identity, n_train_sequences=len(data),
                       n_train_tokens=data.n_tokens)


def _load_finished(out_dir: Path, target) -> TrainResult:
    record = read_record(out_dir / "config.json", "rebuilt from the last checkpoint by train_draft")
    return TrainResult(Eagle3Draft.load(out_dir / "draft", target),
                       _read_csv(out_dir / "history.csv"), out_dir, out_dir / "draft",
                       record["seconds"], record.get("metrics", {}))


@_one_writer
def train_draft(store, target, config: TrainConfig, out_dir, progress: bool = True,
                eval_store=None, eval_fn=None, segment: Segment | None = None) -> TrainResult:
    """Train (or resume, or just load) one draft for ``target`` from a capture ``store``.

    out_dir gets ``checkpoints/`` (every ``checkpoint_every`` steps; the newest is resumed),
    ``history.csv`` (step, loss, lr, per-TTT-step loss_i / acc_i; process 0's batches),
    ``eval.csv`` (held-out loss_i / acc_i per checkpoint when ``eval_store`` is given),
    ``draft/`` (the final ``save_pretrained``) and ``config.json`` (this config, store
    hash, seconds, final held-out metrics). ``eval_fn(draft) -> dict`` adds its numbers
    (e.g. offline acceptance, ``actwave.decoding.acceptance``) to each checkpoint's eval row.
    One writer per out_dir (``WriterLock``); a ``target`` other than the model that made
    ``store`` (or ``eval_store``) is refused (``check_store_target``); a finished out_dir
    trained on another store (content digest) is refused; a finished draft that fails its
    checksum is rebuilt from the last checkpoint; a non-finite loss or gradient, or a
    non-finite held-out metric, stops the run (FloatingPointError) with the last good
    checkpoint kept and nothing marked complete; a checkpoint write that fails leaves no
    temp folder. ``segment``: another schedule, a stop step, a start checkpoint (``Segment``).
    """
    if not config.layer_ids:
        raise ValueError("TrainConfig.layer_ids is empty (a template): a draft needs its layers")
    check_store_target(store, target)
    if eval_store is not None:
        check_store_target(eval_store, target, "evaluation")
    return fit(store, lambda: load_sequences(store, config.layer_ids, config.max_seq_len),
               make_batch, target, config, out_dir, progress, eval_store, eval_fn, segment)


def fit(source, load_data, batch_fn, target, config: TrainConfig, out_dir, progress: bool = True,
        eval_store=None, eval_fn=None, segment: Segment | None = None) -> TrainResult:
    """The training loop of ``train_draft`` (store) and ``eagle3.online`` (target in the loop).

    source: ``digest`` (content digest of the store, or of the online text) and ``path``
    identify the training data in checkpoints and config.json; ``load_data()`` -> the sequences (``input_ids``/``loss_mask`` lists, len);
    ``batch_fn(data, indices, target, draft, device)`` -> the ``TTTLoss`` inputs of those
    sequences (``make_batch``). Under DDP each process takes its ``batch_indices``.
    """
    from accelerate import Accelerator

    out_dir = Path(out_dir)
    segment = segment or Segment()
    if _finished(out_dir, config, source):
        try:
            return _load_finished(out_dir, target)
        except IntegrityError as err:
            log.warning("rebuilding the draft from its last checkpoint: %s", err)
    accelerator = Accelerator()
    if accelerator.is_main_process:  # the lock holder: no other writer's temp folders exist
        remove_checkpoint_temps(out_dir)
    data = load_data()
    eval_data = (load_sequences(eval_store, config.layer_ids, config.max_seq_len,
                                config.eval_sequences) if eval_store is not None else None)
    draft = new_draft(target, data, config).to(accelerator.device)
    optimizer, scheduler = _optimizer(draft, config, segment.lr_schedule)
    start, history, eval_history = _resume(out_dir, config, source.digest, segment, draft,
                                           optimizer, scheduler)
    stop = _stop_step(segment, config, start)
    module, optimizer = accelerator.prepare(TTTLoss(draft, config.ttt_steps, config.gamma),
                                            optimizer)
    tic = time.perf_counter() - (history[-1]["seconds"] if history else 0.0)
    for step in tqdm(range(start, stop), desc=f"draft {config.layer_ids}",
                     disable=not (progress and accelerator.is_main_process), mininterval=10):
        indices = batch_indices(len(data), config.batch_size, step, config.seed,
                                accelerator.process_index, accelerator.num_processes)
        batch = batch_fn(data, indices, target, draft, accelerator.device)
        lr = optimizer.param_groups[0]["lr"]
        output = _checked_step(step, out_dir, module, optimizer, scheduler, accelerator, batch,
                               config)
        tokens = sum(data.input_ids[i].numel() for i in indices)
        history.append(history_row(step + 1, output, lr, tokens, time.perf_counter() - tic))
        if (step + 1) % config.checkpoint_every == 0 or step + 1 == stop:
            if eval_data is not None or eval_fn is not None:
                eval_history.append(_held_out_row(step + 1, history, draft, target, config,
                                                  eval_data, eval_fn))
            if accelerator.is_main_process:
                save_checkpoint(out_dir, step + 1, draft, optimizer, scheduler, config, history,
                                eval_history, source.digest)
                write_history(out_dir / "history.csv", history)
            accelerator.wait_for_everyone()
    seconds = time.perf_counter() - tic
    metrics = eval_history[-1] if eval_history else {}
    if stop < config.total_steps:  # a segment: checkpointed at stop, not finished
        return TrainResult(draft, history, out_dir, out_dir / "draft", seconds, metrics)
    if accelerator.is_main_process:
        _save_finished(out_dir, draft, config, eval_history, seconds, metrics, source,
                       eval_store, data)
    accelerator.wait_for_everyone()
    return TrainResult(draft, history, out_dir, out_dir / "draft", seconds, metrics)


# ----------------------------------------------------------------------------- evaluation
@torch.no_grad()
def evaluate_data(draft: Eagle3Draft, data: TrainData, target, ttt_steps: int = 7,
                  batch_size: int = 4, dtype: str = "float32", batch_fn=make_batch) -> dict:
    """Per-TTT-step loss and top-1 agreement (draft argmax vs target argmax) over ``data``.

    ``loss_i`` is the per-batch loss weighted by the batch's counted positions. ``batch_fn``
    builds TTTLoss inputs (``make_batch`` from a store; ``online.online_batch`` runs the
    target instead, for an ``OnlineSource``).
    """
    steps = ttt_steps
    module = TTTLoss(draft, steps)
    device = draft.fc.weight.device
    correct = torch.zeros(steps)
    counts = torch.zeros(steps)
    weighted_loss = torch.zeros(steps)
    was_training = draft.training
    draft.eval()
    for start in range(0, len(data), batch_size):
        batch = batch_fn(data, list(range(start, min(start + batch_size, len(data)))),
                         target, draft, device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=dtype == "bfloat16"):
            output = module(**batch)
        correct += output.step_correct.cpu().float()
        counts += output.step_counts.cpu().float()
        weighted_loss += output.step_losses.cpu().float() * output.step_counts.cpu().float()
    draft.train(was_training)
    result = {"n_sequences": len(data), "n_tokens": data.n_tokens}
    for i in range(steps):
        result[f"loss_{i}"] = float(weighted_loss[i] / counts[i]) if counts[i] else math.nan
        result[f"acc_{i}"] = float(correct[i] / counts[i]) if counts[i] else math.nan
    return result


def evaluate_draft(draft: Eagle3Draft, store_eval, target, ttt_steps: int = 7,
                   batch_size: int = 4, max_seq_len: int | None = None,
                   max_sequences: int | None = None, dtype: str = "float32") -> dict:
    """Held-out per-TTT-step top-1 agreement (``acc_i``) and loss (``loss_i``) on a store."""
    data = load_sequences(store_eval, draft.layer_ids, max_seq_len, max_sequences)
    return evaluate_data(draft, data, target, ttt_steps, batch_size, dtype)


def add_config_arguments(parser) -> None:
    """``--layers`` and one ``--<field>`` per scalar ``TrainConfig`` field (default if absent)."""
    parser.add_argument("--layers", required=True, help="comma-separated layer ids, e.g. 2,15,27")
    for f in fields(TrainConfig):
        if f.name not in ("layer_ids", "betas"):
            parser.add_argument(f"--{f.name}", type=type(f.default), default=None)


def config_from_args(args) -> TrainConfig:
    """The ``TrainConfig`` of arguments parsed with ``add_config_arguments``."""
    overrides = {f.name: getattr(args, f.name) for f in fields(TrainConfig)
                 if getattr(args, f.name, None) is not None}
    return TrainConfig(layer_ids=tuple(int(i) for i in args.layers.split(",")), **overrides)


def main(argv: list[str] | None = None) -> None:
    """Command line, for one process or DDP via ``accelerate launch``:

        accelerate launch -m actwave.eagle3.train --model smollm2-135m \\
            --store <capture dir> --eval-store <capture dir> --layers 2,15,27 --out <dir> \\
            --total_steps 2000 --ttt_steps 7 --dtype bfloat16
    """
    import argparse

    from accelerate import Accelerator

    from actwave.capture.models import load
    from actwave.capture.store import CaptureStore

    parser = argparse.ArgumentParser(description="Train one EAGLE-3 draft from a capture store.")
    parser.add_argument("--model", required=True, help="bundled name, HF id or local path")
    parser.add_argument("--store", required=True)
    parser.add_argument("--eval-store", default=None)
    parser.add_argument("--out", required=True)
    add_config_arguments(parser)
    args = parser.parse_args(argv)
    target, _ = load(args.model, device=str(Accelerator().device))
    train_draft(CaptureStore(args.store), target, config_from_args(args), args.out,
                eval_store=CaptureStore(args.eval_store) if args.eval_store else None)


if __name__ == "__main__":
    main()
