"""Export EAGLE-3 drafts to the formats vLLM and SGLang serve, and load them back.

Three formats, each a config JSON + ``model.safetensors`` (no pickles):

- vLLM ``speculators`` (v0.9 layout): ``speculators_model_type: "eagle3"``, a Llama
  ``transformer_layer_config`` for the single draft layer, weights ``fc.*``,
  ``layers.0.*``, ``norm.*``, ``lm_head.*``, ``d2t``, ``t2d``.
- SGLang / SpecForge: a ``LlamaForCausalLMEagle3`` config with
  ``eagle_config.eagle_aux_hidden_state_layer_ids`` and SafeAILab weight names
  (``fc``, ``midlayer.*``, ``norm``, ``lm_head``, ``d2t``, ``t2d``).
- SpecForge HF backend (``specforge-hf``): the SGLang/SpecForge record, but in
  ``specforge_draft_config.json`` (SpecForge's ``--draft-model-config``), never in
  ``config.json``: its ids are ℓ − 1 (0-based block outputs), which SGLang and vLLM would
  read as other layers, so no server ever picks the file up as its config.

Which physical layers an engine feeds the draft depends on how *that engine version*
reads ``eagle_aux_hidden_state_layer_ids`` (``ENGINES``; each rule, its source and the
sets it cannot express: docs/METHODS.md §15). Every export names its engine, writes the
ids that engine reads as the trained ℓ, refuses a set the engine cannot express (saying
why), and records the rule in the config's ``actwave`` block.

The target embedding is never exported (both servers share the target's). For Gemma
targets the servers' shared embedding lacks Gemma's √H normaliser, which is harmless:
the draft reads the embedding only through input_layernorm, an RMSNorm, and RMSNorm is
scale-invariant (up to eps).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

from actwave.config import atomic_write_json, package_versions
from actwave.eagle3.config import Eagle3Config, flat_rope_parameters, target_text_config
from actwave.eagle3.model import WEIGHTS_NAME, Eagle3Draft, save_tensors
from actwave.eagle3.vocab import build_draft_vocab

SPECULATORS_FORMAT_VERSION = "0.9.0"
OUR_LAYER_PREFIX = "midlayer."
SPECULATORS_LAYER_PREFIX = "layers.0."
ACTWAVE_CONVENTION = ("actwave layer id ℓ = number of target decoder blocks applied = HF "
                      "hidden_states[ℓ] (0 = embeddings, N = last block output before the "
                      "final norm)")
# Speculators variants our draft layer does not implement (all False in SafeAILab's EAGLE-3).
UNSUPPORTED_SPECULATORS_FLAGS = ("norm_before_residual", "norm_before_fc", "fc_norm",
                                 "norm_output")


def _layer_config(config: Eagle3Config) -> dict:
    """The draft decoder layer as a one-layer Llama config (keys both servers read)."""
    rope = config.rope_parameters
    return {
        "model_type": "llama",
        "vocab_size": config.target_vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": 1,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "rms_norm_eps": config.rms_norm_eps,
        "max_position_embeddings": config.max_position_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "rope_parameters": dict(rope),
        # transformers 4.x readers (SGLang, older vLLM) use the legacy pair.
        "rope_theta": config.rope_theta,
        "rope_scaling": None if rope.get("rope_type", "default") == "default" else dict(rope),
    }


SPECFORGE_HF_CONFIG = "specforge_draft_config.json"
# The config file of each format: vLLM and SGLang load a draft folder's config.json only.
CONFIG_FILES = {"speculators": "config.json", "sglang": "config.json",
                "specforge-hf": SPECFORGE_HF_CONFIG}


def _write(out_dir, record: dict, tensors: dict[str, torch.Tensor], fmt: str) -> Path:
    """``model.safetensors`` + the format's config file; refuses a folder holding another
    format's config file (a server would load the folder with that file's ids)."""
    out_dir = Path(out_dir)
    name = CONFIG_FILES[fmt]
    others = sorted(n for n in set(CONFIG_FILES.values()) - {name} if (out_dir / n).exists())
    if others:
        raise ValueError(f"{out_dir} already holds {others[0]} of another export format; "
                         f"write the {fmt} export to another folder (or delete that file)")
    save_tensors(out_dir / WEIGHTS_NAME, tensors)
    atomic_write_json(out_dir / name, record)
    return out_dir


def _dtype_name(draft: Eagle3Draft) -> str:
    return str(draft.fc.weight.dtype).removeprefix("torch.")


def export_speculators(draft: Eagle3Draft, out_dir, target_name_or_path: str,
                       verifier_architectures: list[str] | None = None,
                       speculative_tokens: int = 3, engine: str = "vllm>=pr36063") -> Path:
    """Write ``draft`` in vLLM ``speculators`` EAGLE-3 format for ``engine``; returns ``out_dir``.

    target_name_or_path: the verifier as vLLM/speculators should load it (hub id or
    path); verifier_architectures: its ``config.architectures`` (recorded only);
    engine: a ``speculators``-format key of ``ENGINES`` (ValueError if it cannot
    capture the draft's layers).
    """
    ids = _checked_ids(draft, engine, "speculators")
    config = draft.config
    record = {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_version": SPECULATORS_FORMAT_VERSION,
        "transformer_layer_config": _layer_config(config),
        "draft_vocab_size": config.draft_vocab_size,
        "target_hidden_size": config.target_hidden_size,
        # Must be explicit: vLLM assumes True when the key is absent.
        "norm_before_residual": False,
        "eagle_aux_hidden_state_layer_ids": ids,
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy",
                                  "speculative_tokens": speculative_tokens}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": str(target_name_or_path),
                         "architectures": list(verifier_architectures or [])},
        },
        "torch_dtype": _dtype_name(draft),
        "actwave": _engine_block(draft, engine, ids, "speculators"),
    }
    tensors = {_rename(name, OUR_LAYER_PREFIX, SPECULATORS_LAYER_PREFIX): tensor
               for name, tensor in draft.trainable_state_dict().items()}
    return _write(out_dir, record, tensors, "speculators")


@dataclass(frozen=True)
class Engine:
    """One engine version's reading of ``eagle_aux_hidden_state_layer_ids``.

    ``offset``: the engine captures ℓ = id + offset; ``lowest``/``highest``: the ℓ range
    it can capture for an N-layer target (``highest`` counts back from N: 0 means ℓ = N,
    1 means ℓ = N − 1); ``shift_if_first_is_one``: the offset becomes +1 when the first id
    is 1 (SGLang's rule since PR #25454); ``fmt``: the checkpoint format that carries the
    ids; ``where``: the config entry the ids go to.
    """

    name: str
    fmt: str
    rule: str
    source: str
    offset: int
    lowest: int
    highest: int
    max_k: int | None = None
    shift_if_first_is_one: bool = False
    where: str = "eagle_config.eagle_aux_hidden_state_layer_ids (draft config.json)"


VLLM_WHERE = "eagle_aux_hidden_state_layer_ids (speculators config.json)"
SGLANG_RULE_SOURCE = "sgl-project/sglang PR #25454 (merged 2026-05-16)"
ENGINES: dict[str, Engine] = {engine.name: engine for engine in (
    Engine("vllm>=pr36063", "speculators",
           "ids as given; 0 = embeddings, id = output of block id-1 (EagleModelMixin)",
           "vllm-project/vllm PR #36063", offset=0, lowest=0, highest=0, where=VLLM_WHERE),
    Engine("vllm<pr36063", "speculators",
           "ids as given; captures the input of block id (blocks 0..N-1; the residual "
           "is added, so id 0 fails)", "vllm-project/vllm PR #36063", offset=0, lowest=1,
           highest=1, where=VLLM_WHERE),
    Engine("sglang>=pr25454", "sglang",
           "+1 to every id when the first id is 1, else ids as given; captures the input "
           "of block id (blocks 0..N-1)", SGLANG_RULE_SOURCE, offset=0, lowest=0, highest=1,
           shift_if_first_is_one=True),
    Engine("sglang<pr25454", "sglang",
           "+1 to every id; captures the input of block id+1 (blocks 0..N-1; ids ≥ 0)",
           SGLANG_RULE_SOURCE, offset=1, lowest=1, highest=1),
    Engine("specforge-hf", "specforge-hf",
           "SpecForge HF target backend: hooks the output of 0-based block id, exactly 3 ids",
           "sgl-project/SpecForge specforge/modeling/target/eagle3_target_model.py",
           offset=1, lowest=1, highest=0, max_k=3,
           where="Eagle3TargetModel.set_aux_hidden_states_layers([...]) (training)"),
)}


def engine_reads(engine: str, ids, num_layers: int) -> tuple[int, ...]:
    """The layers ℓ that ``engine`` captures for configured ``ids`` (depth order).

    ValueError when the engine cannot capture them for an N = ``num_layers`` target.
    """
    rule = _engine(engine)
    ids = [int(i) for i in ids]
    shift = 1 if rule.shift_if_first_is_one and ids[:1] == [1] else rule.offset
    layers = tuple(sorted(i + shift for i in ids))
    _check_reach(rule, layers, num_layers)
    return layers


def engine_layer_ids(layer_ids, num_layers: int, engine: str) -> list[int]:
    """actwave ℓ -> the ids ``engine`` reads as exactly these layers; ValueError if none.

    Engines capture in depth order whatever the config order, so ``layer_ids`` must be
    strictly increasing (the fc of the draft concatenates them in that order).
    """
    rule = _engine(engine)
    ids = _increasing(layer_ids)
    _check_reach(rule, ids, num_layers)
    if rule.shift_if_first_is_one:
        return _first_one_shift_ids(ids, rule.name)
    return [v - rule.offset for v in ids]


def _check_reach(rule: Engine, layers: tuple[int, ...], num_layers: int) -> None:
    """Refuse layers outside the engine's reach, or the wrong number of them."""
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
        raise ValueError(f"the target's number of layers N must be an int ≥ 1, "
                         f"got {num_layers!r}")
    top = num_layers - rule.highest
    outside = [v for v in layers if not rule.lowest <= v <= top]
    if outside:
        raise ValueError(f"{rule.name} cannot capture layer(s) {outside} of an N={num_layers} "
                         f"target: it reaches ℓ = {rule.lowest}..{top} ({rule.rule})")
    if rule.max_k is not None and len(layers) != rule.max_k:
        raise ValueError(f"{rule.name} takes exactly {rule.max_k} layer ids, got {len(layers)}")


def _first_one_shift_ids(ids: tuple[int, ...], engine: str) -> list[int]:
    """Current SGLang: ℓ as given unless the first is 1; smallest ℓ = 2 is written ℓ − 1.

    ℓ − 1 with first id 1 is read +1 by every SGLang version, so such exports also serve
    older servers. A set starting at ℓ = 1 has no form: written as is, its first id 1
    triggers the +1; written as ℓ − 1, its first id 0 is taken as is.
    """
    if ids[0] == 1:
        raise ValueError(f"{engine} cannot express {list(ids)}: a first id of 1 makes it "
                         "add +1 to every id, and the shifted form starts at 0, which it takes "
                         "as is; drop layer 1 or serve with vllm>=pr36063 or sglang<pr25454")
    return [v - 1 for v in ids] if ids[0] == 2 else list(ids)


def readers_of(ids, layer_ids, num_layers: int, fmt: str) -> list[str]:
    """Engines of checkpoint format ``fmt`` that read ``ids`` as exactly ``layer_ids``."""
    wanted = tuple(int(v) for v in layer_ids)
    readers = []
    for name, rule in ENGINES.items():
        try:
            if rule.fmt == fmt and engine_reads(name, ids, num_layers) == wanted:
                readers.append(name)
        except ValueError:
            continue  # this engine cannot capture them at all
    return readers


def _engine(engine: str) -> Engine:
    if engine not in ENGINES:
        raise ValueError(f"unknown engine {engine!r}; known: {sorted(ENGINES)}")
    return ENGINES[engine]


def _increasing(layer_ids) -> tuple[int, ...]:
    ids = tuple(layer_ids)
    if (not ids or any(isinstance(v, bool) or not isinstance(v, int) for v in ids)
            or any(a >= b for a, b in zip(ids, ids[1:]))):
        raise ValueError(f"layer ids must be strictly increasing ints (engines capture in depth "
                         f"order), got {list(ids)}")
    return ids


def _engine_block(draft: Eagle3Draft, engine: str, ids: list[int], fmt: str) -> dict:
    """The ``actwave`` record of an export: convention, engine rule, source, readers."""
    rule = ENGINES[engine]
    num_layers = draft.config.target_num_layers
    return {"layer_id_convention": ACTWAVE_CONVENTION, "layer_ids": list(draft.layer_ids),
            "eagle3_config": draft.config.to_dict(), "versions": package_versions(),
            "engine": engine, "engine_rule": rule.rule, "engine_rule_source": rule.source,
            "written_layer_ids": ids,
            "read_as_trained_by": readers_of(ids, draft.layer_ids, num_layers, fmt)}


def _checked_ids(draft: Eagle3Draft, engine: str, fmt: str) -> list[int]:
    if _engine(engine).fmt != fmt:
        raise ValueError(f"engine {engine!r} does not read the {fmt} format; use one of "
                         f"{[name for name, rule in ENGINES.items() if rule.fmt == fmt]}")
    return engine_layer_ids(draft.layer_ids, draft.config.target_num_layers, engine)


def export_specforge(draft: Eagle3Draft, out_dir, target_name_or_path: str = "",
                     engine: str = "sglang>=pr25454") -> Path:
    """Write ``draft`` as an SGLang/SpecForge ``LlamaForCausalLMEagle3`` checkpoint.

    engine: an ``sglang``-format key of ``ENGINES`` (written as ``config.json``), or
    ``specforge-hf`` (written as ``specforge_draft_config.json``, which no server loads:
    its ℓ − 1 ids would be read as other layers there). The ids are those the engine reads
    as the draft's layers (ValueError naming the reason if it cannot express them).
    """
    fmt = _engine(engine).fmt
    if fmt not in ("sglang", "specforge-hf"):
        raise ValueError(f"engine {engine!r} does not read the SGLang/SpecForge format; use "
                         f"one of {[n for n, r in ENGINES.items() if r.fmt != 'speculators']}")
    ids = _checked_ids(draft, engine, fmt)
    config = draft.config
    record = {
        **_layer_config(config),
        "architectures": ["LlamaForCausalLMEagle3"],
        "draft_vocab_size": config.draft_vocab_size,
        "target_hidden_size": config.target_hidden_size,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": ids, "use_aux_hidden_state": True},
        "torch_dtype": _dtype_name(draft),
        "actwave": {**_engine_block(draft, engine, ids, fmt),
                    "target_name_or_path": str(target_name_or_path or config.target_model)},
    }
    return _write(out_dir, record, draft.trainable_state_dict(), fmt)


def _rename(name: str, old_prefix: str, new_prefix: str) -> str:
    return new_prefix + name[len(old_prefix):] if name.startswith(old_prefix) else name


def _config_from(layer_config: dict, layer_ids, draft_vocab_size: int, target_hidden_size: int,
                 target: nn.Module, target_model: str) -> Eagle3Config:
    if layer_config.get("num_hidden_layers", 1) != 1:
        raise ValueError("only single-layer EAGLE-3 drafts are supported, got "
                         f"num_hidden_layers={layer_config['num_hidden_layers']}")
    num_heads = layer_config["num_attention_heads"]
    return Eagle3Config(
        layer_ids=tuple(layer_ids), target_hidden_size=target_hidden_size,
        hidden_size=layer_config["hidden_size"],
        intermediate_size=layer_config["intermediate_size"],
        num_attention_heads=num_heads,
        num_key_value_heads=layer_config.get("num_key_value_heads") or num_heads,
        head_dim=layer_config.get("head_dim") or layer_config["hidden_size"] // num_heads,
        rms_norm_eps=layer_config.get("rms_norm_eps", 1e-6),
        rope_parameters=flat_rope_parameters(
            layer_config.get("rope_parameters") or layer_config.get("rope_scaling"),
            layer_config.get("rope_theta") or 10000.0),
        max_position_embeddings=layer_config.get("max_position_embeddings", 2048),
        target_vocab_size=layer_config["vocab_size"], draft_vocab_size=draft_vocab_size,
        target_model=target_model,
        target_num_layers=int(target_text_config(target).num_hidden_layers))


def _default_layer_ids(target: nn.Module) -> tuple[int, ...]:
    """EAGLE-3's rule (2, N//2, N-3), what vLLM and SGLang use when no ids are configured."""
    num_layers = int(target_text_config(target).num_hidden_layers)
    return (2, num_layers // 2, num_layers - 3)


def _read_tensors(directory: Path, config: Eagle3Config) -> dict[str, torch.Tensor]:
    """Weights in actwave names; identity vocab maps when a full-vocab draft has none."""
    tensors = {_rename(name, SPECULATORS_LAYER_PREFIX, OUR_LAYER_PREFIX): tensor
               for name, tensor in load_file(directory / WEIGHTS_NAME).items()
               if not name.startswith(("embed_tokens.", "verifier_"))}
    if "d2t" not in tensors and config.draft_vocab_size == config.target_vocab_size:
        tensors["d2t"], tensors["t2d"] = build_draft_vocab(
            torch.zeros(config.target_vocab_size), config.draft_vocab_size)
    return tensors


def _read_ids(record: dict, ids, target: nn.Module, engine: str | None,
              fallback: str) -> tuple[int, ...]:
    """The layers ℓ that ``ids`` stand for under the given, recorded or fallback engine."""
    engine = engine or record.get("actwave", {}).get("engine") or fallback
    num_layers = int(target_text_config(target).num_hidden_layers)
    return engine_reads(engine, ids, num_layers)


def _read_config(directory, name: str = "config.json") -> tuple[Path, dict]:
    directory = Path(directory)
    return directory, json.loads((directory / name).read_text())


def load_speculators(directory, target: nn.Module, engine: str | None = None) -> Eagle3Draft:
    """Load a vLLM ``speculators`` EAGLE-3 checkpoint as an Eagle3Draft for ``target``.

    The ids are read by ``engine``'s rule: default the engine the export recorded, else
    the current vLLM's.
    """
    directory, record = _read_config(directory)
    if record.get("speculators_model_type") != "eagle3":
        raise ValueError(f"{directory} is not a speculators EAGLE-3 checkpoint "
                         f"(speculators_model_type={record.get('speculators_model_type')!r})")
    enabled = [flag for flag in UNSUPPORTED_SPECULATORS_FLAGS if record.get(flag)]
    if enabled:
        raise ValueError(f"speculators options {enabled} are not implemented by actwave's "
                         "draft layer (all must be false)")
    layer_config = record["transformer_layer_config"]
    explicit_ids = record.get("eagle_aux_hidden_state_layer_ids")
    layer_ids = (_read_ids(record, explicit_ids, target, engine, "vllm>=pr36063")
                 if explicit_ids else _default_layer_ids(target))
    verifier = record.get("speculators_config", {}).get("verifier", {})
    target_model = record.get("actwave", {}).get("eagle3_config", {}).get(
        "target_model", verifier.get("name_or_path") or "")
    config = _config_from(layer_config, layer_ids, record["draft_vocab_size"],
                          record.get("target_hidden_size") or layer_config["hidden_size"],
                          target, target_model)
    return Eagle3Draft.from_state(config, _read_tensors(directory, config), target)


def load_specforge(directory, target: nn.Module, engine: str | None = None) -> Eagle3Draft:
    """Load an SGLang/SpecForge EAGLE-3 checkpoint for ``target``.

    The ids are read by ``engine``'s rule: default the engine the export recorded (an
    older actwave export without one wrote ℓ − 1 for ``sglang<pr25454``), else the
    current SGLang's — the layers a server of today would feed the draft. A folder with
    ``specforge_draft_config.json`` and no ``config.json`` is a ``specforge-hf`` export.
    """
    hf_only = (Path(directory) / SPECFORGE_HF_CONFIG).exists() and \
        not (Path(directory) / "config.json").exists()
    directory, record = _read_config(directory, SPECFORGE_HF_CONFIG if hf_only else "config.json")
    explicit_ids = record.get("eagle_config", {}).get("eagle_aux_hidden_state_layer_ids")
    legacy = ("specforge-hf" if hf_only else
              "sglang<pr25454" if "actwave" in record else "sglang>=pr25454")
    layer_ids = (_read_ids(record, explicit_ids, target, engine, legacy) if explicit_ids
                 else _default_layer_ids(target))
    target_model = record.get("actwave", {}).get("eagle3_config", {}).get("target_model", "")
    config = _config_from(record, layer_ids,
                          record.get("draft_vocab_size") or record["vocab_size"],
                          record.get("target_hidden_size") or record["hidden_size"],
                          target, target_model)
    return Eagle3Draft.from_state(config, _read_tensors(directory, config), target)
