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

Provenance and integrity (``actwave.integrity``): the folder's hash is keyed by the config
and ``models.model_digest(config.model)`` (the content digest of the model's files, always
computed), so new weights at the same path get a new store. The manifest is a checksummed
record (``write_record``/``read_record``) holding that digest, each shard's size and sha256
and the identity of the model object that made it (name, config, shapes, weights, dtype).
A store is complete only when its shard records cover all ``n_sequences`` sequences.
``run_capture`` refuses a model that does not match the config or the store, writes under
a lock on the folder (one writer at a time), and on a finished store re-verifies every
shard and recaptures only those that fail (the repair). Readers check sizes on open and
each shard's sha256 on its first read in a process. ``CaptureStore.digest`` (the digest of
the manifest's shard records and model) keys everything built on a store.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import torch
from safetensors import safe_open
from safetensors.torch import save as save_tensors
from tqdm import tqdm

from actwave.capture import data as data_mod
from actwave.capture.forward import entropy_and_argmax, validate_layers, valid_states
from actwave.capture.models import DTYPES, load, model_digest, num_layers, slug
from actwave.capture.regenerate import RegenConfig, regenerate
from actwave.config import (artifact_dir, atomic_write_bytes, config_hash, package_versions,
                            to_jsonable)
from actwave.integrity import (Between, IntegrityError, WriterLock, bytes_record, check_fields,
                               check_size, content_digest, fingerprint_mismatch, int_ids,
                               model_dtype, model_identity, read_record, verify_file, verify_once, write_record)

log = logging.getLogger(__name__)
SOURCES = ("sharegpt", "regenerated")
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
    source: str = "sharegpt"           # replies: 'sharegpt' (original) | 'regenerated' (by the target)
    regen_new_tokens: int = 256        # with 'regenerated': reply budget; prompts get the rest
    seed: int = 0

    def __post_init__(self):
        # Strict types first: n_sequences=2.5 once slipped through as "the whole split".
        check_fields(self, {name: Between(1) for name in (
            "n_sequences", "max_seq_len", "batch_size", "sequences_per_shard",
            "regen_new_tokens")} | {"seed": Between(0)},
            {"source": SOURCES, "dtype": DTYPES, "storage_dtype": DTYPES,
             "split": data_mod.SPLITS})
        if self.source == "regenerated" and not 0 < self.regen_new_tokens < self.max_seq_len:
            raise ValueError(f"regen_new_tokens={self.regen_new_tokens} must lie in "
                             f"1..max_seq_len-1={self.max_seq_len - 1}")


def analysis_captures(model_names, **capture: object) -> dict[str, CaptureConfig]:
    """{model: the analysis-split CaptureConfig} as notebook 01 builds it (same keys)."""
    return {name: CaptureConfig(model=name, split="analysis", **capture) for name in model_names}


def store_key(config: CaptureConfig) -> dict:
    """What names a store: its config and the content digest of the model's files (computed
    on every call, memoised by the files' sizes and times), so a model folder whose weights
    changed never reuses the old store."""
    return {"config": config, "model": model_digest(config.model)}


def store_dir(config: CaptureConfig) -> Path:
    return artifact_dir("capture", store_key(config), name=f"{slug(config.model)}-{config.split}")


def conversations_for(config: CaptureConfig, model=None, tokenizer=None):
    """The split's conversations: ShareGPT as is, or with replies regenerated by the target.

    Regenerated replies follow the EAGLE-3 recipe (the draft learns the target's own
    distribution); they are cached and resumable (``actwave.capture.regenerate``).
    """
    if config.source == "sharegpt":
        return data_mod.sharegpt_split(config.split)
    return regenerate(regen_config(config), model, tokenizer)


def regen_config(config: CaptureConfig) -> RegenConfig:
    """The regeneration behind a capture with ``source="regenerated"``."""
    if config.source != "regenerated":
        raise ValueError(f"capture source is {config.source!r}; only 'regenerated' has one")
    return RegenConfig(model=config.model, split=config.split, n_conversations=config.n_sequences,
                       max_prompt_len=config.max_seq_len - config.regen_new_tokens,
                       max_new_tokens=config.regen_new_tokens, dtype=config.dtype,
                       seed=config.seed)


def tokenize_split(config: CaptureConfig, tokenizer, model=None) -> tuple[list[dict], str]:
    """Token ids + loss masks of the split's first n usable conversations, and the data hash.

    Conversations whose first ``max_seq_len`` tokens hold no assistant token are skipped
    (a long first prompt): they carry no reply to analyse or train on.
    """
    conversations = conversations_for(config, model, tokenizer)
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
    hidden, last = valid_states(model, input_ids.to(device), mask.to(device),
                                storage_dtype)  # (N+1, n, D), (n, D)
    entropy, argmax = entropy_and_argmax(model, last)
    ids = input_ids[mask.bool()]
    lengths = mask.sum(1)
    return {
        "hidden": hidden.cpu(),
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


def _write_shard(path: Path, columns: dict[str, torch.Tensor]) -> dict:
    """Write one shard atomically; -> its integrity record {"bytes", "sha256"}."""
    data = save_tensors({k: v.contiguous() for k, v in columns.items()})
    atomic_write_bytes(path, data)
    return bytes_record(data)


def _new_manifest(config: CaptureConfig, model, dataset_hash: str, n_sequences: int,
                  tokenizer, fingerprint: dict) -> dict:
    return {"format": MANIFEST_FORMAT, "config": to_jsonable(config),
            "config_hash": config_hash(config), "model_digest": model_digest(config.model),
            "dataset_hash": dataset_hash, "n_sequences": n_sequences,
            "num_layers": num_layers(model), "hidden_size": int(model.config.get_text_config().hidden_size),
            "vocab_size": int(model.get_output_embeddings().weight.shape[0]),
            "chat_template": tokenizer.chat_template, "versions": package_versions(),
            "storage_dtype": config.storage_dtype, "model": fingerprint,
            "shards": [], "n_tokens": 0, "complete": False, "seconds": 0.0}


def _check_manifest(manifest: dict, config: CaptureConfig, dataset_hash: str, path: Path) -> None:
    if manifest.get("config_hash") != config_hash(config) or manifest.get("dataset_hash") != dataset_hash:
        raise ValueError(
            f"stale capture cache at {path}: its manifest records config {manifest.get('config_hash')}"
            f" / data {manifest.get('dataset_hash')}, expected {config_hash(config)} / {dataset_hash};"
            " delete that folder to recapture")
    _check_model_digest(manifest, config, path)


def _check_model_digest(manifest: dict, config: CaptureConfig, path: Path) -> None:
    """Refuse a manifest made from other model files than ``config.model``'s now."""
    expected = model_digest(config.model)
    if manifest.get("model_digest") != expected:
        raise ValueError(f"stale capture cache at {path}: made from the files of model "
                         f"{config.model!r} with digest {manifest.get('model_digest')}, which "
                         f"now have digest {expected}; delete that folder to recapture")


MANIFEST_FORMAT = "actwave-capture-v2"
MANIFEST_NAME = "manifest.json"


def write_manifest(path: Path, manifest: dict) -> None:
    """Write a store's manifest (checksummed record) into folder ``path``."""
    write_record(Path(path) / MANIFEST_NAME, manifest)


def completeness_problem(manifest: dict) -> str | None:
    """Why a manifest marked complete is not (None when it is): every shard record must have
    a sha256, and the records must cover sequences 0..n_sequences-1 once, in order, with
    ``n_tokens`` their sum."""
    shards = manifest.get("shards", [])
    unhashed = [s.get("file") for s in shards if "sha256" not in s]
    if unhashed:
        return f"shard records without a sha256: {unhashed}"
    expected = manifest.get("n_sequences")
    if not isinstance(expected, int) or expected < 1:
        return f"n_sequences is {expected!r}, not a count"
    covered = 0
    for shard in shards:
        if shard.get("first_sequence") != covered or not isinstance(shard.get("n_sequences"), int):
            return (f"shard {shard.get('file')} starts at sequence {shard.get('first_sequence')}, "
                    f"expected {covered}: {covered} of {expected} sequences precede it")
        covered += shard["n_sequences"]
    if covered != expected:
        return f"its shard records hold {covered} of {expected} sequences"
    tokens = sum(s.get("n_tokens", 0) for s in shards)
    if tokens != manifest.get("n_tokens"):
        return f"its shard records hold {tokens} tokens, the manifest says {manifest.get('n_tokens')}"
    return None


def repair_hint(manifest: dict, path: Path) -> str:
    """The call that repairs a store: run_capture re-verifies it and recaptures bad shards."""
    config = (repr(CaptureConfig(**manifest["config"])) if "config" in manifest
              else f"<the CaptureConfig that made {path}>")
    return (f"actwave.capture.store.run_capture({config}) re-verifies the store and "
            "recaptures only the bad shards (notebook 01: ./reproduce.sh --only 01)")


def _same_model(name: str, other: str) -> bool:
    return name == other or (Path(name).is_dir() and Path(other).is_dir()
                             and Path(name).resolve() == Path(other).resolve())


def check_model(config: CaptureConfig, model, manifest: dict | None, path: Path) -> dict:
    """Refuse a model that is not ``config.model`` (by its name, when it has one), not in
    ``config.dtype``, or not the model an existing store was made with; -> its fingerprint."""
    name = str(getattr(model, "name_or_path", "") or "")
    if name and not _same_model(name, config.model):
        raise ValueError(f"model {name!r} was passed with a capture config for "
                         f"{config.model!r}: pass {config.model!r} or use "
                         f"CaptureConfig(model={name!r})")
    if model_dtype(model) != DTYPES[config.dtype]:
        raise ValueError(f"model is in {model_dtype(model)} but config.dtype={config.dtype!r}: "
                         f"load it with dtype=DTYPES[{config.dtype!r}] or set the config's dtype")
    found = model_identity(model)
    if manifest is None:
        return found
    recorded = manifest.get("model") or {  # stores from before fingerprints: the shapes only
        key: manifest[key] for key in ("num_layers", "hidden_size", "vocab_size")
        if key in manifest}
    shapes = {"num_layers": num_layers(model),
              "hidden_size": int(model.config.get_text_config().hidden_size),
              "vocab_size": int(model.get_output_embeddings().weight.shape[0])}
    problems = fingerprint_mismatch(recorded, {**found, **shapes})
    if problems:
        raise ValueError(f"capture store {path} was made with another model ("
                         + "; ".join(problems) + f"): pass the model it was made with, or "
                         f"delete {path} to recapture with this one")
    return found


def _read_manifest(path: Path) -> dict | None:
    """The folder's manifest; None if there is none or it is unreadable (then every shard is
    recaptured: without the manifest's checksums no shard can be trusted)."""
    try:
        return read_record(path / MANIFEST_NAME, "recapture")
    except IntegrityError as err:
        if (path / "manifest.json").exists():
            log.warning("capture manifest unreadable, recapturing %s: %s", path, err)
        return None


def _drop_failed_shards(manifest: dict, path: Path) -> None:
    """Verify every recorded shard (size + sha256); drop those that fail so they are
    recaptured (a record without a sha256 vouches for nothing: it is recaptured too)."""
    kept = []
    for shard in manifest["shards"]:
        try:
            if "sha256" not in shard:
                raise IntegrityError(path / shard["file"], "manifest record", "a sha256",
                                     "none", "recapture")
            verify_file(path / shard["file"], shard, repair_hint(manifest, path))
        except IntegrityError as err:
            log.warning("recapturing %s", err)
            manifest["complete"] = False
            continue
        kept.append(shard)
    manifest["shards"] = kept
    if manifest.get("complete") and completeness_problem(manifest):
        log.warning("capture at %s is incomplete (%s): capturing the rest", path,
                    completeness_problem(manifest))
        manifest["complete"] = False


def shard_name(shard_no: int) -> str:
    return f"shard-{shard_no:05d}.safetensors"


def pending_shards(manifest: dict, config: CaptureConfig, n_sequences: int) -> list[int]:
    """Numbers of the shards of ``n_sequences`` sequences that the manifest lacks."""
    done = {s["file"] for s in manifest["shards"]}
    n_shards = len(range(0, n_sequences, config.sequences_per_shard))
    return [no for no in range(n_shards) if shard_name(no) not in done]


def capture_shard(config: CaptureConfig, model, tokenizer, sequences: list[dict],
                  shard_no: int, out: Path) -> dict:
    """Capture shard ``shard_no`` of ``sequences`` into ``out``; -> its manifest record."""
    special_ids = set(tokenizer.all_special_ids)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    start = shard_no * config.sequences_per_shard
    chunk = sequences[start: start + config.sequences_per_shard]
    parts = [capture_batch(model, chunk[b: b + config.batch_size], start + b, special_ids,
                           DTYPES[config.storage_dtype], pad_id)
             for b in range(0, len(chunk), config.batch_size)]
    columns = _concat(parts)
    record = _write_shard(out / shard_name(shard_no), columns)
    return {"file": shard_name(shard_no), "n_tokens": int(columns["input_ids"].numel()),
            "first_sequence": start, "n_sequences": len(chunk), **record}


def record_shards(manifest: dict, records: list[dict], seconds: float, out: Path) -> None:
    """Add finished shards' records to the manifest and rewrite it."""
    manifest["shards"].extend(records)
    # Shard order is token order: a recaptured shard goes back to its place.
    manifest["shards"].sort(key=lambda s: s["file"])
    manifest["n_tokens"] = sum(s["n_tokens"] for s in manifest["shards"])
    manifest["seconds"] += seconds
    write_manifest(out, manifest)


def _capture_shards(config: CaptureConfig, model, tokenizer, sequences: list[dict],
                    manifest: dict, out: Path, progress: bool) -> None:
    """Capture every shard the manifest lacks, rewriting the manifest after each one."""
    for shard_no in tqdm(pending_shards(manifest, config, len(sequences)),
                         desc=f"capture {config.model}/{config.split}", disable=not progress,
                         mininterval=10):
        tic = time.perf_counter()
        record = capture_shard(config, model, tokenizer, sequences, shard_no, out)
        record_shards(manifest, [record], time.perf_counter() - tic, out)


def verified_manifest(config: CaptureConfig, model, out: Path) -> dict | None:
    """The folder's manifest with every shard that fails its checksum dropped, after checking
    a passed ``model`` against it; None if there is none (call under the folder's lock)."""
    manifest = _read_manifest(out)
    if manifest is not None:
        _check_model_digest(manifest, config, out)
        _drop_failed_shards(manifest, out)
        if model is not None:
            check_model(config, model, manifest, out)
    return manifest


def mark_complete(manifest: dict, out: Path) -> None:
    problem = completeness_problem(manifest)
    if problem:
        raise IntegrityError(out / MANIFEST_NAME, "shards", "all sequences captured", problem,
                             "run run_capture again: it captures the missing shards")
    manifest["complete"] = True
    write_manifest(out, manifest)


def prepare_capture(config: CaptureConfig, model, tokenizer, manifest: dict | None, out: Path,
                    device: str | torch.device = "cpu") -> tuple:
    """Load the model if none is passed, check it and the split's data against ``manifest``
    (a new one if None); -> (model, tokenizer, tokenized sequences, manifest)."""
    if model is None:
        model, tokenizer = load(config.model, dtype=DTYPES[config.dtype], device=device)
    fingerprint = check_model(config, model, manifest, out)
    sequences, dataset_hash = tokenize_split(config, tokenizer, model)
    if not sequences:
        raise ValueError(f"split {config.split!r} gave no sequences of >= 2 tokens")
    if manifest is None:
        manifest = _new_manifest(config, model, dataset_hash, len(sequences), tokenizer,
                                 fingerprint)
    _check_manifest(manifest, config, dataset_hash, out)
    return model, tokenizer, sequences, manifest


def run_capture(config: CaptureConfig, model=None, tokenizer=None, progress: bool = True,
                device: str = "cpu") -> "CaptureStore":
    """Capture (or resume, or repair) a split; returns the finished, verified store.

    Pass a loaded ``model``/``tokenizer`` to reuse them, else ``config.model`` is loaded
    on ``device`` in ``config.dtype``. One writer at a time per store (``WriterLock``);
    a finished store is re-verified and only shards that fail are recaptured. Many
    processes: ``actwave.capture.distributed``.
    """
    out = store_dir(config)
    with WriterLock(out):
        manifest = verified_manifest(config, model, out)
        if manifest is not None and manifest["complete"]:
            return CaptureStore(out)
        model, tokenizer, sequences, manifest = prepare_capture(config, model, tokenizer,
                                                                manifest, out, device)
        _capture_shards(config, model, tokenizer, sequences, manifest, out, progress)
        mark_complete(manifest, out)
    return CaptureStore(out)


class CaptureStore:
    """Read access to a finished capture: manifest, columns and layer-sliced shards."""

    def __init__(self, path: Path | str, require_complete: bool = True):
        self.path = Path(path)
        manifest_path = self.path / MANIFEST_NAME
        if not manifest_path.exists():
            raise FileNotFoundError(f"no capture at {self.path} (manifest.json missing); "
                                    "run notebook 01 / actwave.capture.store.run_capture first")
        self.manifest = read_record(manifest_path, "actwave.capture.store.run_capture with the "
                                    f"config that made {self.path} recaptures it (notebook 01)")
        if require_complete and not self.complete:
            raise ValueError(f"capture at {self.path} is incomplete; run run_capture again to resume")
        problem = completeness_problem(self.manifest) if require_complete else None
        if problem:
            raise ValueError(f"capture at {self.path} is incomplete: {problem}; run run_capture "
                             "again to capture the rest")
        self.repair = repair_hint(self.manifest, self.path)
        for shard in self.manifest["shards"]:  # sizes now (a stat each), sha256 on first read
            check_size(self.path / shard["file"], shard, self.repair)

    @property
    def complete(self) -> bool:
        return bool(self.manifest.get("complete"))

    @property
    def num_layers(self) -> int:
        return int(self.manifest["num_layers"])

    @property
    def hidden_size(self) -> int:
        return int(self.manifest["hidden_size"])

    @property
    def n_tokens(self) -> int:
        return int(self.manifest["n_tokens"])

    @property
    def config_hash(self) -> str:
        return self.manifest["config_hash"]

    @property
    def digest(self) -> str:
        """Content digest (16 hex) of the store: its shard records (file, size, sha256,
        sequences, tokens), the model it was made with (file digest and identity), its data
        hash and config hash. Keys every artifact built on it (layer statistics, drafts,
        study records): a recaptured store with other contents gets new keys."""
        return content_digest({key: self.manifest.get(key) for key in (
            "shards", "model", "model_digest", "dataset_hash", "config_hash", "n_sequences",
            "n_tokens", "storage_dtype")})

    def _open(self, shard: dict):
        path = self.path / shard["file"]
        verify_once(path, shard, self.repair)
        try:
            return safe_open(str(path), framework="pt")
        except Exception as err:  # safetensors raises its own error types on bad headers
            raise IntegrityError(path, "safetensors shard", "readable", err, self.repair) from err

    def iter_shards(self, layers: Sequence[int] | None = None,
                    columns: Sequence[str] = ("entropy", "special", "loss_mask"),
                    shard_ids: Sequence[int] | None = None) -> Iterator[dict]:
        """Per shard (all, or the manifest positions ``shard_ids``): {"hidden": (L_sel, n, D)
        in storage dtype, plus the named columns}."""
        layer_ids = validate_layers(range(self.num_layers + 1) if layers is None
                                    else int_ids("layers", layers), self.num_layers)
        shards = self.manifest["shards"]
        if shard_ids is not None:
            bad = [i for i in shard_ids if not 0 <= i < len(shards)]
            if bad:
                raise ValueError(f"shard id {bad[0]} out of range: {self.path} has "
                                 f"{len(shards)} shards (ids 0..{len(shards) - 1})")
            shards = [shards[i] for i in shard_ids]
        for shard in shards:
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
