"""Checkpoints of draft training: weights, optimizer, scheduler and RNG in one safetensors
file (no pickle) plus a meta.json with its size and sha256, written to a temp folder and
renamed, so an interrupted run resumes bit-identically from the last whole checkpoint.
A checkpoint belongs to the ``config`` (an ``eagle3.train.TrainConfig``) whose hash it records.
"""
from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path
import torch
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

from actwave.config import atomic_write_json, config_hash
from actwave.eagle3.model import Eagle3Draft
from actwave.integrity import (IntegrityError, bytes_record, read_json, require_finite_tensors,
                               verify_file)

log = logging.getLogger(__name__)
CHECKPOINT_TMP = ".tmp-"  # prefix of a checkpoint being written (never read)


def _optimizer_to_tensors(state: dict) -> tuple[dict[str, torch.Tensor], list]:
    """Optimizer state as flat tensors (safetensors) + param groups (JSON): no pickle."""
    tensors = {f"optimizer.{index}.{name}": value for index, entry in state["state"].items()
               for name, value in entry.items()}
    return tensors, state["param_groups"]


def _optimizer_from_tensors(tensors: dict[str, torch.Tensor], param_groups: list) -> dict:
    state: dict[int, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        if key.startswith("optimizer."):
            _, index, name = key.split(".", 2)
            state.setdefault(int(index), {})[name] = value
    return {"state": state, "param_groups": param_groups}


def save_checkpoint(out_dir: Path, step: int, draft: Eagle3Draft, optimizer, scheduler,
                    config, history: list[dict], eval_history: list[dict],
                    store_hash: str | None = None) -> Path:
    """``out_dir/checkpoints/step-XXXXXXX/``: weights, optimizer, RNG (safetensors) + meta.json.

    Written into a uniquely named temp folder and renamed, then older checkpoints are
    removed; the temp folder is removed when writing fails (a full disk, Ctrl-C).
    meta.json records the state file's size and sha256 and the store's hash.
    """
    root = out_dir / "checkpoints"
    final = root / f"step-{step:07d}"
    root.mkdir(parents=True, exist_ok=True)
    optimizer_tensors, param_groups = _optimizer_to_tensors(optimizer.state_dict())
    weights = {f"draft.{k}": v for k, v in draft.trainable_state_dict().items()}
    require_finite_tensors(f"checkpoint at step {step}", weights)
    tensors = {**weights, **optimizer_tensors, "rng.torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        tensors.update({f"rng.cuda.{i}": s for i, s in enumerate(torch.cuda.get_rng_state_all())})
    state = save_tensors({k: v.detach().contiguous().cpu() for k, v in tensors.items()})
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=f"{CHECKPOINT_TMP}step-{step:07d}-"))
    try:
        (tmp / "state.safetensors").write_bytes(state)
        atomic_write_json(tmp / "meta.json", {
            "step": step, "config_hash": config_hash(config), "param_groups": param_groups,
            "scheduler": scheduler.state_dict(), "history": history,
            "eval_history": eval_history, "state": bytes_record(state),
            "store_config_hash": store_hash})
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # a half-written checkpoint is never kept
        raise
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    for older in root.glob("step-*"):
        if older != final:
            shutil.rmtree(older, ignore_errors=True)
    return final


def remove_checkpoint_temps(out_dir: Path) -> list[Path]:
    """Remove ``checkpoints/.tmp-*`` folders of a writer that died mid-checkpoint (SIGKILL,
    power loss: no ``except`` ran); -> the removed paths. Call holding out_dir's lock."""
    leftovers = sorted((out_dir / "checkpoints").glob(f"{CHECKPOINT_TMP}*"))
    for path in leftovers:
        log.warning("removing %s, left by an interrupted checkpoint write", path)
        shutil.rmtree(path, ignore_errors=True)
    return leftovers


def _checkpoint_repair(path: Path) -> str:
    return (f"delete {path}; the next train_draft call with the same arguments trains "
            "again from the start (bit-identical to an uninterrupted run)")


def latest_checkpoint(out_dir: Path, config,
                      store_hash: str | None = None) -> Path | None:
    """The newest finished checkpoint of this config (and store) in out_dir, else None."""
    found = sorted((out_dir / "checkpoints").glob("step-*"))
    if not found:
        return None
    meta = read_json(found[-1] / "meta.json", _checkpoint_repair(found[-1]))
    if meta["config_hash"] != config_hash(config):
        raise ValueError(f"checkpoint {found[-1]} belongs to config {meta['config_hash']}, not "
                         f"{config_hash(config)}; use another out_dir or delete it")
    if store_hash and meta.get("store_config_hash") not in (None, store_hash):
        raise ValueError(f"checkpoint {found[-1]} was trained on capture store "
                         f"{meta['store_config_hash']}, not {store_hash}; use another out_dir "
                         "or delete it")
    return found[-1]


def load_checkpoint(path: Path, draft: Eagle3Draft, optimizer, scheduler) -> dict:
    """Restore weights, optimizer, scheduler and RNG in place; -> the checkpoint's meta.json.

    Refuses (IntegrityError) a state file that fails its recorded checksum or lacks any of
    the draft's tensors: nothing is silently left at its initial value.
    """
    repair = _checkpoint_repair(path)
    meta = read_json(path / "meta.json", repair)
    verify_file(path / "state.safetensors", meta.get("state", {}), repair)
    tensors = load_tensors((path / "state.safetensors").read_bytes())
    weights = {k.removeprefix("draft."): v for k, v in tensors.items() if k.startswith("draft.")}
    missing = sorted(set(draft.trainable_state_dict()) - set(weights))
    if missing:
        raise IntegrityError(path / "state.safetensors", "draft tensors", "all present",
                             f"missing {missing}", repair)
    draft.load_state_dict(weights, strict=False)  # strict would demand the frozen embedding
    optimizer.load_state_dict(_optimizer_from_tensors(tensors, meta["param_groups"]))
    scheduler.load_state_dict(meta["scheduler"])
    torch.set_rng_state(tensors["rng.torch"])
    cuda_keys = sorted((k for k in tensors if k.startswith("rng.cuda.")),
                       key=lambda k: int(k.rsplit(".", 1)[1]))
    cuda_states = [tensors[k] for k in cuda_keys]
    if cuda_states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda_states)
    return meta
