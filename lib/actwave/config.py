"""Configs, artifact keys and atomic writes shared by every stage.

Each stage has one typed dataclass config. Its artifact lives under
``cache_dir()/<stage>/<name>-<hash>/`` where the hash is the sha256 of the sorted-JSON key
plus ``CODE_VERSION`` (bump it when an artifact format or algorithm changes, so stale
caches are never reused); the key is the config together with the content digests of the
artifact's inputs (``actwave.integrity``, "Provenance"). Beside each artifact:
``config.json`` with the key, the seed, package versions (and, written by
``integrity.save_config_record``, its own checksum).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import platform
import tempfile
from pathlib import Path
from typing import Any

# Bump when the meaning or layout of a cached artifact changes.
CODE_VERSION = "1"


def repo_root() -> Path:
    """The checkout root (two levels above lib/actwave)."""
    return Path(__file__).resolve().parents[2]


def cache_dir() -> Path:
    """Root of all cached artifacts: $ACTWAVE_CACHE, else <repo>/.cache/actwave."""
    root = os.environ.get("ACTWAVE_CACHE")
    path = Path(root) if root else repo_root() / ".cache" / "actwave"
    path.mkdir(parents=True, exist_ok=True)
    return path


def to_jsonable(obj: Any) -> Any:
    """Dataclasses, tuples and paths as plain JSON values."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {k: to_jsonable(v) for k, v in dataclasses.asdict(obj).items()}
    if isinstance(obj, dict):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_jsonable(v) for v in obj]
    if isinstance(obj, Path):
        return str(obj)
    return obj


def config_hash(config: Any, length: int = 12) -> str:
    """sha256 of the sorted-JSON config and CODE_VERSION, truncated."""
    payload = json.dumps({"config": to_jsonable(config), "code": CODE_VERSION},
                         sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(payload.encode()).hexdigest()[:length]


def artifact_dir(stage: str, config: Any, name: str = "run") -> Path:
    """``cache_dir()/stage/name-hash`` for a config (created); ``name`` is a plain stem."""
    if not name or "/" in name or "\\" in name or name.startswith("."):
        raise ValueError(f"artifact name must be a plain folder name (no '/', '\\' or "
                         f"leading '.'), got {name!r}; for a model use actwave.capture.models.slug")
    path = cache_dir() / stage / f"{name}-{config_hash(config)}"
    path.mkdir(parents=True, exist_ok=True)
    return path


def package_versions() -> dict[str, str]:
    """Versions of the packages that decide the numbers, for provenance records."""
    from importlib.metadata import PackageNotFoundError, version

    names = ["actwave", "torch", "transformers", "safetensors", "numpy", "datasets", "gguf"]
    out = {"python": platform.python_version()}
    for name in names:
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = "not installed"
    return out


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else ``platform.processor()``: timings from
    different CPUs (an AVX2 laptop, an AVX-512/AMX server) are not comparable."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_flags() -> list[str]:
    """The CPU's bf16-related feature flags (``/proc/cpuinfo``; empty elsewhere)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines()
                  if line.startswith("flags")), [])
    return sorted(flag for flag in flags if "bf16" in flag or flag in ("avx2", "avx512f", "amx_tile"))


def native_bf16() -> bool:
    """Whether bf16 matmuls run in hardware here (a GPU, or a CPU with ``avx512_bf16`` /
    ``amx_bf16``): on AVX2-only CPUs a bf16 matmul is ~200× slower than fp32."""
    import torch

    return torch.cuda.is_available() or any("bf16" in flag for flag in cpu_flags())


def machine(device: str) -> dict:
    """Where seconds were measured: host, CPU, ``device``, torch threads, and the 1-minute
    load average now (≈ 0 on an idle machine: was anything running beside the job?)."""
    import torch

    return {"host": platform.node(), "processor": platform.processor() or platform.machine(),
            "cpu": cpu_name(), "device": device, "threads": torch.get_num_threads(),
            "cpu_count": os.cpu_count(), "load_average": os.getloadavg()[0]}


def atomic_write_bytes(path: Path | str, data: bytes) -> None:
    """Write to a temp file in the same folder, then rename: never a half-written file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_json(path: Path | str, obj: Any) -> None:
    """Sorted, indented JSON written atomically (byte-stable for equal content)."""
    text = json.dumps(to_jsonable(obj), sort_keys=True, indent=2) + "\n"
    atomic_write_bytes(path, text.encode())


def config_record(config: Any, **extra: Any) -> dict:
    """The record ``config.json`` holds: the config, its hash, versions and extras."""
    return {"config": to_jsonable(config), "config_hash": config_hash(config),
            "code_version": CODE_VERSION, "versions": package_versions(), **extra}


def save_config(directory: Path | str, config: Any, **extra: Any) -> Path:
    """``config.json`` beside an artifact (``config_record``). Artifacts read back as
    records use ``actwave.integrity.save_config_record`` (the same, self-checksummed)."""
    path = Path(directory) / "config.json"
    atomic_write_json(path, config_record(config, **extra))
    return path


def results_dir(profile: str) -> Path:
    """A profile's tables and hand-over indexes: ``$ACTWAVE_RESULTS/<profile>`` (a relative
    path is taken from the repo root), else ``<repo>/results/<profile>``."""
    if not profile or "/" in profile or "\\" in profile or profile.startswith("."):
        raise ValueError(f"profile must be a plain name such as 'cpu', got {profile!r}")
    return repo_root() / os.environ.get("ACTWAVE_RESULTS", "results") / profile
