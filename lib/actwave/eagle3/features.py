"""Target features of a text source, computed once: drafts train and score without the
target in the loop.

Online training (``eagle3.online``) runs the target over every batch at every step. On a
2-core CPU that forward is most of a step (SmolLM2-135M, fp32, batch 2 × 320 tokens:
1.5 s of ~1.95 s, ``benchmarks/bench_features.py``), and the study's long runs repeat it
for every set, seed and epoch over the same text. Here the target runs once over an
``OnlineSource``: the states of a union of layers (ℓ = N always: the soft labels come
from it) and the target's argmax are written in checksummed chunks, and every draft whose
layers lie in the union trains through the store route's batches (``train.make_batch``)
and is scored from the same arrays (``acceptance.sequence_acceptance``).

A draft sees the inputs online training would give it, up to ``storage_dtype`` rounding
and the forward's batch composition (padding changes no valid position mathematically;
float sums may differ in the last bits). Layout, under one folder per key (the source's
digest, the target's weights, this config):

    features.json      checksummed record: key, layers, per-chunk {file, first, count,
                       bytes, sha256}, complete
    chunk-00000.safetensors   states (n_layers, n_tokens, D), argmax (n_tokens,),
                              lengths (count,): the chunk's sequences concatenated

Writing resumes chunk by chunk under the folder's ``WriterLock``; reading checks each
chunk's checksum once per process.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save as save_tensors
from tqdm import tqdm

from actwave.capture.forward import forward_with_states, validate_layers
from actwave.capture.models import DTYPES, num_layers, slug
from actwave.config import atomic_write_bytes, cache_dir, config_hash, to_jsonable
from actwave.eagle3.online import OnlineSource
from actwave.eagle3.train import (Segment, TrainConfig, TrainData, TrainResult, _one_writer, _pad,
                                  fit, make_batch)
from actwave.integrity import (Between, IntegrityError, WriterLock, bytes_record, check_fields,
                               describe_model, identity_mismatch, model_identity, read_record,
                               verify_once, write_record)

log = logging.getLogger(__name__)
FORMAT = "actwave-features-v1"
RECORD = "features.json"


@dataclass(frozen=True)
class FeatureConfig:
    """Which layers to keep, in which dtype, and how the target's forward is batched."""

    layers: tuple[int, ...]           # hidden-state ids 0..N (0 = embeddings); N is always added
    storage_dtype: str = "bfloat16"   # training inputs; float32 keeps scoring bit-equal to online
    batch_size: int = 8               # sequences per target forward
    sequences_per_chunk: int = 256    # one chunk file per this many sequences

    def __post_init__(self) -> None:
        check_fields(self, {"layers": Between(0), "batch_size": Between(1),
                            "sequences_per_chunk": Between(1)},
                     {"storage_dtype": ("bfloat16", "float16", "float32")})
        if not self.layers:
            raise ValueError("FeatureConfig.layers must name at least one layer")


def values_digest(source: OnlineSource, target, config: FeatureConfig) -> str:
    """What decides the stored values (source text, target weights and dtype, storage dtype,
    forward batching), not which layers are kept: a draft trained on features of a larger
    union of layers resumes the checkpoints of one trained on a smaller one."""
    identity = model_identity(target)
    return "features-" + config_hash({
        "source": source.digest, "target": identity["weights_sha256"], "dtype": identity["dtype"],
        "storage_dtype": config.storage_dtype, "batch_size": config.batch_size})


def features_root(model: str) -> Path:
    """Where a model's features live: ``cache_dir()/features/<model slug>`` (shared by the
    long runs and the benchmark draft)."""
    return cache_dir() / "features" / slug(model)


def feature_dir(root: Path | str, source: OnlineSource, target, config: FeatureConfig) -> Path:
    """``root/features-<hash of the values digest and the whole config>``."""
    key = {"values": values_digest(source, target, config), "config": to_jsonable(config)}
    return Path(root) / f"features-{config_hash(key)}"


def stored_layers(config: FeatureConfig, target) -> tuple[int, ...]:
    """The sorted layer ids written: ``config.layers`` and N (range-checked)."""
    last = num_layers(target)
    return tuple(sorted(set(validate_layers(config.layers, last)) | {last}))


@torch.no_grad()
def _chunk_columns(source: OnlineSource, first: int, count: int, target, layers, dtype,
                   batch_size: int) -> dict[str, torch.Tensor]:
    """Run the target over sequences first..first+count-1 -> the chunk's tensors."""
    device = next(target.parameters()).device
    states, argmax = [], []
    for start in range(first, first + count, batch_size):
        indices = list(range(start, min(start + batch_size, first + count)))
        width = max(source.input_ids[i].numel() for i in indices)
        input_ids = _pad([source.input_ids[i] for i in indices], width).to(device)  # (B, L)
        valid = _pad([torch.ones_like(source.input_ids[i]) for i in indices], width).to(device)
        logits, hidden, _ = forward_with_states(target, layers, input_ids,
                                                attention_mask=valid)  # (B, L, V), (B, L, n·D)
        hidden = hidden.unflatten(-1, (len(layers), -1))  # (B, L, n, D)
        for row, index in enumerate(indices):
            n = source.input_ids[index].numel()
            states.append(hidden[row, :n].transpose(0, 1).to(dtype).cpu())  # (n_layers, n, D)
            argmax.append(logits[row, :n].argmax(-1).cpu())
    lengths = torch.tensor([source.input_ids[i].numel() for i in range(first, first + count)])
    return {"states": torch.cat(states, dim=1).contiguous(), "argmax": torch.cat(argmax),
            "lengths": lengths}


def _new_record(source: OnlineSource, target, config: FeatureConfig, layers) -> dict:
    return {"format": FORMAT, "config": to_jsonable(config), "layers": list(layers),
            "digest": values_digest(source, target, config), "source": source.digest, "source_path": source.path, "n_sequences": len(source),
            "n_tokens": source.n_tokens, "target": model_identity(target), "chunks": [],
            "complete": False}


def compute_features(source: OnlineSource, target, config: FeatureConfig, root: Path | str,
                     progress: bool = True) -> Path:
    """Write (or finish, or just find) the features of ``source`` under ``root``; -> folder.

    Resumable: chunks already recorded are kept (a chunk whose size differs from its record
    is recomputed), the record is rewritten after each new chunk.
    """
    folder = feature_dir(root, source, target, config)
    layers = stored_layers(config, target)
    dtype = DTYPES[config.storage_dtype]
    with WriterLock(folder):
        path = folder / RECORD
        record = (read_record(path, f"delete {folder} and rerun") if path.exists()
                  else _new_record(source, target, config, layers))
        if record["complete"]:
            return folder
        done = {c["first"] for c in record["chunks"] if (folder / c["file"]).is_file()
                and (folder / c["file"]).stat().st_size == c["bytes"]}
        record["chunks"] = [c for c in record["chunks"] if c["first"] in done]
        firsts = range(0, len(source), config.sequences_per_chunk)
        for first in tqdm(firsts, desc=f"features {source.path}", disable=not progress):
            if first in done:
                continue
            count = min(config.sequences_per_chunk, len(source) - first)
            data = save_tensors(_chunk_columns(source, first, count, target, layers, dtype,
                                               config.batch_size))
            name = f"chunk-{first // config.sequences_per_chunk:05d}.safetensors"
            atomic_write_bytes(folder / name, data)
            record["chunks"] = sorted(record["chunks"] + [
                {"file": name, "first": first, "count": count, **bytes_record(data)}],
                key=lambda c: c["first"])
            write_record(path, record)
        record["complete"] = True
        write_record(path, record)
    return folder


class TargetFeatures:
    """A finished features folder beside the ``OnlineSource`` it was computed from.

    Stands where ``fit`` expects a store (``digest``, ``path``) and hands out the
    ``TrainData`` of any layer subset.
    """

    def __init__(self, folder: Path | str, source: OnlineSource):
        self.folder = Path(folder)
        self.source = source
        repair = f"delete {self.folder} and rerun compute_features"
        self.record = read_record(self.folder / RECORD, repair)
        if not self.record.get("complete"):
            raise ValueError(f"features {self.folder} are unfinished; rerun compute_features")
        if self.record["source"] != source.digest:
            raise ValueError(f"features {self.folder} were computed from {self.record['source']}"
                             f", not from {source.digest} ({source.path})")
        self.repair = repair

    def __len__(self) -> int:
        return len(self.source)

    @property
    def layers(self) -> tuple[int, ...]:
        return tuple(self.record["layers"])

    @property
    def digest(self) -> str:
        """The training data's identity (``values_digest``), in checkpoints and records."""
        return self.record["digest"]

    @property
    def path(self) -> str:
        return str(self.folder)

    def check_target(self, target) -> None:
        """Refuse a target other than the one that computed these features."""
        problems = identity_mismatch(self.record["target"], model_identity(target))
        if problems:
            raise ValueError(f"features {self.folder} were computed by "
                             f"{describe_model(self.record['target'])}, not "
                             f"{describe_model(model_identity(target))} ({'; '.join(problems)})")

    def _read(self, chunk: dict, layers: tuple[int, ...]) -> dict[str, torch.Tensor]:
        """One chunk's argmax, lengths and the states of ``layers`` (n, n_tokens, D), read
        layer by layer (each is contiguous on disk): a draft reads its k + 1 of the union."""
        path = self.folder / chunk["file"]
        verify_once(path, chunk, self.repair)
        with safe_open(path, "pt") as f:
            rows = [self.layers.index(i) for i in layers]
            states = torch.cat([f.get_slice("states")[r:r + 1] for r in rows])  # (n, T, D)
            columns = {"states": states, "argmax": f.get_tensor("argmax"),
                       "lengths": f.get_tensor("lengths")}
        if int(columns["lengths"].sum()) != columns["argmax"].numel():
            raise IntegrityError(path, "tokens", int(columns["lengths"].sum()),
                                 columns["argmax"].numel(), self.repair)
        return columns

    def train_data(self, layer_ids, max_seq_len: int | None = None) -> TrainData:
        """The store route's ``TrainData`` of the draft layers ``layer_ids`` (in that order;
        each must be stored) and ℓ = N, each sequence cut to ``max_seq_len``."""
        missing = [i for i in layer_ids if i not in self.layers]
        if missing:
            raise ValueError(f"layers {missing} are not in features {self.folder} (it holds "
                             f"{list(self.layers)}); compute features with them")
        k = len(layer_ids)
        data = TrainData([], [], [], [], [])
        for chunk in self.record["chunks"]:
            columns = self._read(chunk, (*layer_ids, self.layers[-1]))
            offsets = [0, *columns["lengths"].cumsum(0).tolist()]
            for j in range(chunk["count"]):
                index, start = chunk["first"] + j, offsets[j]
                stop = start + min(offsets[j + 1] - start, max_seq_len or offsets[j + 1])
                chosen = columns["states"][:k, start:stop]  # (k, T, D)
                data.target_states.append(chosen.permute(1, 0, 2).reshape(stop - start, -1))
                # copies: a view would keep the whole chunk alive
                data.last_states.append(columns["states"][k, start:stop].clone())
                data.argmax.append(columns["argmax"][start:stop].clone())
                data.input_ids.append(self.source.input_ids[index][: stop - start])
                data.loss_mask.append(self.source.loss_mask[index][: stop - start])
        return data


def find_features(root: Path | str, source: OnlineSource, target,
                  config: FeatureConfig) -> Path | None:
    """A finished folder under ``root`` with the same values (``values_digest``) holding at
    least ``config.layers``: the long runs' union of layers serves a single draft too."""
    digest, wanted = values_digest(source, target, config), set(stored_layers(config, target))
    for path in sorted(Path(root).glob(f"features-*/{RECORD}")):
        try:
            record = read_record(path, f"delete {path.parent} and rerun")
        except IntegrityError as err:
            log.warning("skipping %s", err)
            continue
        if record.get("complete") and record.get("digest") == digest and \
                wanted <= set(record["layers"]):
            return path.parent
    return None


def open_features(source: OnlineSource, target, config: FeatureConfig, root: Path | str,
                  progress: bool = True) -> TargetFeatures:
    """A finished folder of these values and (at least) these layers (``find_features``),
    else ``compute_features`` (resuming); opened."""
    folder = find_features(root, source, target, config)
    if folder is None:
        folder = compute_features(source, target, config, root, progress)
    return TargetFeatures(folder, source)


@_one_writer
def train_from_features(features: TargetFeatures, target, config: TrainConfig, out_dir,
                        progress: bool = True, segment: Segment | None = None,
                        eval_fn=None) -> TrainResult:
    """``train_draft`` on cached features: the same loop, checkpoints, resume, segments and
    per-checkpoint ``eval_fn(draft) -> dict`` (``train.fit``), the target used only for its
    LM head (soft labels) and embedding."""
    features.check_target(target)
    target.eval()
    return fit(features, lambda: features.train_data(config.layer_ids, config.max_seq_len),
               make_batch, target, config, out_dir, progress, eval_fn=eval_fn, segment=segment)
