"""The streaming capture pass and its sharded store of hidden states.

One pass of the target over a dataset stores, per token, all N+1 hidden states, the
target's predictive entropy and argmax, and the token's bookkeeping. Every later step
(metrics, selection, draft training for any layer set) reads this store and never re-runs
the target.

Store folder ``cache_dir()/capture/<model>-<split>-<hash>/``:
``manifest.json`` (config, dataset hash, versions, shard list, ``complete``) and shards
``shard-XXXXX.safetensors`` holding whole sequences:

    hidden     (N+1, n, D) storage dtype, layer-major (cheap to read a layer subset)
    input_ids  (n,) int64   the token at this position
    entropy    (n,) float32 predictive entropy (nats) of the target's next-token distribution
    argmax     (n,) int64   the target's argmax next token
    loss_mask  (n,) bool    token belongs to an assistant reply
    special    (n,) bool    special token (BOS, chat-template markers)
    seq_index  (n,) int64   sequence number in the dataset
    position   (n,) int64   position in its sequence

Shards are written to a temp file and renamed, and the manifest is rewritten after each
shard, so an interrupted pass resumes at the first missing shard.
"""
from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Sequence

import torch
from safetensors import safe_open
from safetensors.torch import save as save_tensors
from tqdm import tqdm

from actwave import data as data_mod
from actwave.capture import entropy_and_argmax, hidden_states
from actwave.config import (artifact_dir, atomic_write_bytes, atomic_write_json, config_hash,
                            package_versions, to_jsonable)
from actwave.models import load, num_layers

log = logging.getLogger(__name__)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
COLUMNS = ("input_ids", "entropy", "argmax", "loss_mask", "special", "seq_index", "position")


@dataclass
class CaptureConfig:
    """What to capture: the model, which ShareGPT split and how much, at which precision."""

    model: str = "smollm2-135m"
    split: str = "analysis"            # ShareGPT split: analysis | train | eval
    n_sequences: int = 64
    max_seq_len: int = 512
    batch_size: int = 4
    dtype: str = "float32"             # compute dtype of the target
    storage_dtype: str = "bfloat16"    # dtype of stored hidden states (bf16 keeps range)
    sequences_per_shard: int = 16
    seed: int = 0

    def __post_init__(self):
        for name in ("dtype", "storage_dtype"):
            if getattr(self, name) not in DTYPES:
                raise ValueError(f"{name}={getattr(self, name)!r}; allowed: {sorted(DTYPES)}")
        for name in ("n_sequences", "max_seq_len", "batch_size", "sequences_per_shard"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


def store_dir(config: CaptureConfig) -> Path:
    safe_model = config.model.replace("/", "--")
    return artifact_dir("capture", config, name=f"{safe_model}-{config.split}")


def tokenize_split(config: CaptureConfig, tokenizer) -> tuple[list[dict], str]:
    """Token ids + loss masks of the split's first n usable conversations, and the data hash.

    Conversations whose first ``max_seq_len`` tokens hold no assistant token are skipped
    (a long first prompt): they carry no reply to analyse or train on.
    """
    conversations = data_mod.sharegpt_split(config.split)
    sequences, used = [], []
    for index, row in enumerate(conversations):
        seq = data_mod.tokenize_chat(tokenizer, row["messages"], config.max_seq_len)
        if any(seq["loss_mask"]) and len(seq["input_ids"]) >= 2:
            sequences.append(seq)
            used.append(index)
        if len(sequences) == config.n_sequences:
            break
    return sequences, data_mod.content_hash(conversations.select(used))


def _pad_batch(sequences: list[dict], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad a batch -> input_ids (B, T), attention_mask (B, T)."""
    width = max(len(s["input_ids"]) for s in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for row, seq in enumerate(sequences):
        ids[row, : len(seq["input_ids"])] = torch.tensor(seq["input_ids"])
        mask[row, : len(seq["input_ids"])] = 1
    return ids, mask


@torch.no_grad()
def capture_batch(model, sequences: list[dict], first_index: int, special_ids: set[int],
                  storage_dtype: torch.dtype, pad_id: int = 0) -> dict[str, torch.Tensor]:
    """Run one padded batch; -> shard columns for its valid tokens (see module docstring)."""
    device = next(model.parameters()).device
    input_ids, mask = _pad_batch(sequences, pad_id)
    states = hidden_states(model, input_ids.to(device), mask.to(device))  # (N+1, B, T, D)
    valid = mask.bool().to(device)
    hidden = states[:, valid]  # (N+1, n, D), tokens in row-major (sequence, position) order
    entropy, argmax = entropy_and_argmax(model, hidden[-1])
    ids = input_ids[mask.bool()]
    lengths = mask.sum(1)
    return {
        "hidden": hidden.to(storage_dtype).cpu(),
        "input_ids": ids,
        "entropy": entropy.float().cpu(),
        "argmax": argmax.cpu(),
        "loss_mask": torch.tensor([m for s in sequences for m in s["loss_mask"]]),
        "special": torch.tensor([int(t) in special_ids for t in ids.tolist()]),
        "seq_index": torch.repeat_interleave(torch.arange(len(sequences)) + first_index, lengths),
        "position": torch.cat([torch.arange(int(n)) for n in lengths]),
    }


def _concat(parts: list[dict]) -> dict[str, torch.Tensor]:
    out = {k: torch.cat([p[k] for p in parts]) for k in COLUMNS}
    out["hidden"] = torch.cat([p["hidden"] for p in parts], dim=1)
    return out


def _write_shard(path: Path, columns: dict[str, torch.Tensor]) -> None:
    tensors = {k: v.contiguous() for k, v in columns.items()}
    atomic_write_bytes(path, save_tensors(tensors))


def _new_manifest(config: CaptureConfig, model, dataset_hash: str, n_sequences: int,
                  tokenizer) -> dict:
    return {"config": to_jsonable(config), "config_hash": config_hash(config),
            "dataset_hash": dataset_hash, "n_sequences": n_sequences,
            "num_layers": num_layers(model), "hidden_size": int(model.config.get_text_config().hidden_size),
            "vocab_size": int(model.get_output_embeddings().weight.shape[0]),
            "chat_template": tokenizer.chat_template, "versions": package_versions(),
            "storage_dtype": config.storage_dtype, "shards": [], "n_tokens": 0, "complete": False,
            "seconds": 0.0}


def _check_manifest(manifest: dict, config: CaptureConfig, dataset_hash: str, path: Path) -> None:
    if manifest.get("config_hash") != config_hash(config) or manifest.get("dataset_hash") != dataset_hash:
        raise ValueError(
            f"stale capture cache at {path}: its manifest records config {manifest.get('config_hash')}"
            f" / data {manifest.get('dataset_hash')}, expected {config_hash(config)} / {dataset_hash};"
            " delete that folder to recapture")


def run_capture(config: CaptureConfig, model=None, tokenizer=None, progress: bool = True,
                device: str = "cpu") -> "CaptureStore":
    """Capture (or resume capturing) a split; returns the finished store.

    Pass a loaded ``model``/``tokenizer`` to reuse them, else ``config.model`` is loaded
    on ``device`` in ``config.dtype``.
    """
    out = store_dir(config)
    if (out / "manifest.json").exists() and CaptureStore(out, require_complete=False).complete:
        return CaptureStore(out)
    if model is None:
        model, tokenizer = load(config.model, dtype=DTYPES[config.dtype], device=device)
    sequences, dataset_hash = tokenize_split(config, tokenizer)
    if not sequences:
        raise ValueError(f"split {config.split!r} gave no sequences of >= 2 tokens")
    manifest_path = out / "manifest.json"
    manifest = (json.loads(manifest_path.read_text()) if manifest_path.exists()
                else _new_manifest(config, model, dataset_hash, len(sequences), tokenizer))
    _check_manifest(manifest, config, dataset_hash, out)
    done = {s["file"] for s in manifest["shards"] if (out / s["file"]).exists()}
    manifest["shards"] = [s for s in manifest["shards"] if s["file"] in done]
    special_ids = set(tokenizer.all_special_ids)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    starts = range(0, len(sequences), config.sequences_per_shard)
    for shard_no, start in enumerate(tqdm(starts, desc=f"capture {config.model}/{config.split}",
                                          disable=not progress, mininterval=10)):
        name = f"shard-{shard_no:05d}.safetensors"
        if name in done:
            continue
        tic = time.perf_counter()
        chunk = sequences[start: start + config.sequences_per_shard]
        parts = [capture_batch(model, chunk[b: b + config.batch_size], start + b, special_ids,
                               DTYPES[config.storage_dtype], pad_id)
                 for b in range(0, len(chunk), config.batch_size)]
        columns = _concat(parts)
        _write_shard(out / name, columns)
        manifest["shards"].append({"file": name, "n_tokens": int(columns["input_ids"].numel()),
                                   "first_sequence": start, "n_sequences": len(chunk)})
        manifest["n_tokens"] = sum(s["n_tokens"] for s in manifest["shards"])
        manifest["seconds"] += time.perf_counter() - tic
        atomic_write_json(manifest_path, manifest)
    manifest["complete"] = True
    atomic_write_json(manifest_path, manifest)
    return CaptureStore(out)


class CaptureStore:
    """Read access to a finished capture: manifest, columns and layer-sliced shards."""

    def __init__(self, path: Path | str, require_complete: bool = True):
        self.path = Path(path)
        manifest_path = self.path / "manifest.json"
        if not manifest_path.exists():
            raise FileNotFoundError(f"no capture at {self.path} (manifest.json missing); "
                                    "run notebook 01 / actwave.store.run_capture first")
        try:
            self.manifest = json.loads(manifest_path.read_text())
        except json.JSONDecodeError as err:
            raise ValueError(f"corrupted capture manifest {manifest_path}: {err}") from err
        if require_complete and not self.complete:
            raise ValueError(f"capture at {self.path} is incomplete; run run_capture again to resume")

    complete = property(lambda self: bool(self.manifest.get("complete")))
    num_layers = property(lambda self: int(self.manifest["num_layers"]))
    hidden_size = property(lambda self: int(self.manifest["hidden_size"]))
    n_tokens = property(lambda self: int(self.manifest["n_tokens"]))
    config_hash = property(lambda self: self.manifest["config_hash"])

    def _open(self, shard: dict):
        path = self.path / shard["file"]
        try:
            return safe_open(str(path), framework="pt")
        except Exception as err:  # safetensors raises its own error types on bad headers
            raise ValueError(f"corrupted capture shard {path}: {err}; delete it to recapture") from err

    def iter_shards(self, layers: Sequence[int] | None = None,
                    columns: Sequence[str] = ("entropy", "special", "loss_mask")) -> Iterator[dict]:
        """Per shard: {"hidden": (L_sel, n, D) in storage dtype, plus the named columns}."""
        from actwave.capture import validate_layers
        layer_ids = validate_layers(range(self.num_layers + 1) if layers is None else layers,
                                    self.num_layers)
        for shard in self.manifest["shards"]:
            with self._open(shard) as f:
                sliced = f.get_slice("hidden")
                hidden = torch.cat([sliced[i: i + 1] for i in layer_ids])  # (L_sel, n, D)
                yield {"hidden": hidden, **{c: f.get_tensor(c) for c in columns}}

    def column(self, name: str) -> torch.Tensor:
        """One per-token column over all shards -> (n_tokens,)."""
        if name not in COLUMNS:
            raise ValueError(f"unknown column {name!r}; known: {list(COLUMNS)}")
        parts = []
        for shard in self.manifest["shards"]:
            with self._open(shard) as f:
                parts.append(f.get_tensor(name))
        return torch.cat(parts)


def open_store(config: CaptureConfig) -> CaptureStore:
    """The finished store for a config (as notebook 01 wrote it), without recomputing."""
    return CaptureStore(store_dir(config))
