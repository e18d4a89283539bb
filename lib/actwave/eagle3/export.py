"""Export EAGLE-3 drafts to the formats vLLM and SGLang serve, and load them back.

Two formats, both ``config.json`` + ``model.safetensors`` (no pickles):

- vLLM ``speculators`` (v0.9 layout): ``speculators_model_type: "eagle3"``, a Llama
  ``transformer_layer_config`` for the single draft layer, weights ``fc.*``,
  ``layers.0.*``, ``norm.*``, ``lm_head.*``, ``d2t``, ``t2d``. vLLM reads
  ``eagle_aux_hidden_state_layer_ids`` as given and captures the hidden state
  *entering* block ℓ (HF ``hidden_states[ℓ]``) — exactly actwave's ℓ.
- SGLang / SpecForge: a ``LlamaForCausalLMEagle3`` config with
  ``eagle_config.eagle_aux_hidden_state_layer_ids`` and SafeAILab weight names
  (``fc``, ``midlayer.*``, ``norm``, ``lm_head``, ``d2t``, ``t2d``). SGLang adds +1 to
  explicitly configured ids (it captures the input of block id+1, i.e. the output of
  block id), and SpecForge's HF backend hooks block outputs with 0-based ids: both
  read ``id = ℓ − 1`` for actwave's ℓ (notes/eagle3-reference.md, sglang PR #25454).

The target embedding is never exported (both servers share the target's). For Gemma
targets the servers' shared embedding lacks Gemma's √H normaliser, which is harmless:
the draft reads the embedding only through input_layernorm, an RMSNorm, and RMSNorm is
scale-invariant (up to eps). Both configs carry an ``actwave`` block recording the
layer-id convention and provenance.
"""
from __future__ import annotations

import json
import warnings
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

from actwave.config import atomic_write_json, package_versions
from actwave.eagle3.model import (WEIGHTS_NAME, Eagle3Config, Eagle3Draft, flat_rope_parameters,
                                  save_tensors, target_text_config)
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


def _actwave_block(draft: Eagle3Draft, convention: str) -> dict:
    return {"layer_id_convention": convention, "layer_ids": list(draft.layer_ids),
            "eagle3_config": draft.config.to_dict(), "versions": package_versions()}


def _write(out_dir, record: dict, tensors: dict[str, torch.Tensor]) -> Path:
    out_dir = Path(out_dir)
    save_tensors(out_dir / WEIGHTS_NAME, tensors)
    atomic_write_json(out_dir / "config.json", record)
    return out_dir


def _dtype_name(draft: Eagle3Draft) -> str:
    return str(draft.fc.weight.dtype).removeprefix("torch.")


def export_speculators(draft: Eagle3Draft, out_dir, target_name_or_path: str,
                       verifier_architectures: list[str] | None = None,
                       speculative_tokens: int = 3) -> Path:
    """Write ``draft`` in vLLM ``speculators`` EAGLE-3 format; returns ``out_dir``.

    target_name_or_path: the verifier as vLLM/speculators should load it (hub id or
    path); verifier_architectures: its ``config.architectures`` (recorded only).
    Warns for ℓ = 0: vLLM's Llama-family capture adds the residual stream, which does
    not exist yet before block 0 (ℓ = N is accepted, as speculators' own launcher
    emits it for the final hidden state).
    """
    if 0 in draft.layer_ids:
        warnings.warn("layer id 0 (the embeddings) is exported, but vLLM's Llama-family "
                      "models cannot capture it (no residual before block 0)", stacklevel=2)
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
        "eagle_aux_hidden_state_layer_ids": list(draft.layer_ids),
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy",
                                  "speculative_tokens": speculative_tokens}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": str(target_name_or_path),
                         "architectures": list(verifier_architectures or [])},
        },
        "torch_dtype": _dtype_name(draft),
        "actwave": _actwave_block(draft, ACTWAVE_CONVENTION + "; eagle_aux_hidden_state_layer_ids "
                                  "are ℓ as-is, the ids vLLM captures"),
    }
    tensors = {_rename(name, OUR_LAYER_PREFIX, SPECULATORS_LAYER_PREFIX): tensor
               for name, tensor in draft.trainable_state_dict().items()}
    return _write(out_dir, record, tensors)


def sglang_layer_ids(layer_ids, num_layers: int) -> list[int]:
    """actwave ℓ -> the id SGLang/SpecForge configs need (ℓ − 1), validated.

    SGLang captures the input of block ``id + 1`` for an explicit id, so ℓ = 0 (the
    embeddings, input of block 0) is written as −1 and ℓ = N (no block N exists to
    capture the input of) cannot be expressed.
    """
    ids = list(layer_ids)
    if num_layers in ids:
        raise ValueError(f"layer id {num_layers} (= N, the last block's output) cannot be "
                         "served by SGLang: it captures only inputs of blocks 0..N-1, "
                         f"i.e. actwave ids 0..{num_layers - 1}")
    return [layer_id - 1 for layer_id in ids]


def export_specforge(draft: Eagle3Draft, out_dir, target_name_or_path: str = "") -> Path:
    """Write ``draft`` as an SGLang/SpecForge ``LlamaForCausalLMEagle3`` checkpoint."""
    config = draft.config
    record = {
        **_layer_config(config),
        "architectures": ["LlamaForCausalLMEagle3"],
        "draft_vocab_size": config.draft_vocab_size,
        "target_hidden_size": config.target_hidden_size,
        # SGLang adds +1 to explicit ids ("output of layer id"), so ℓ − 1 here makes it
        # capture hidden_states[ℓ], the same physical layers the draft was trained on.
        "eagle_config": {"eagle_aux_hidden_state_layer_ids":
                         sglang_layer_ids(draft.layer_ids, config.target_num_layers),
                         "use_aux_hidden_state": True},
        "torch_dtype": _dtype_name(draft),
        "actwave": {**_actwave_block(draft, ACTWAVE_CONVENTION + "; eagle_config ids are ℓ − 1 "
                                     "because SGLang adds 1 to explicitly configured ids"),
                    "target_name_or_path": str(target_name_or_path or config.target_model)},
    }
    return _write(out_dir, record, draft.trainable_state_dict())


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


def _read_config(directory) -> tuple[Path, dict]:
    directory = Path(directory)
    return directory, json.loads((directory / "config.json").read_text())


def load_speculators(directory, target: nn.Module) -> Eagle3Draft:
    """Load a vLLM ``speculators`` EAGLE-3 checkpoint as an Eagle3Draft for ``target``."""
    directory, record = _read_config(directory)
    if record.get("speculators_model_type") != "eagle3":
        raise ValueError(f"{directory} is not a speculators EAGLE-3 checkpoint "
                         f"(speculators_model_type={record.get('speculators_model_type')!r})")
    enabled = [flag for flag in UNSUPPORTED_SPECULATORS_FLAGS if record.get(flag)]
    if enabled:
        raise ValueError(f"speculators options {enabled} are not implemented by actwave's "
                         "draft layer (all must be false)")
    layer_config = record["transformer_layer_config"]
    layer_ids = record.get("eagle_aux_hidden_state_layer_ids") or _default_layer_ids(target)
    verifier = record.get("speculators_config", {}).get("verifier", {})
    target_model = record.get("actwave", {}).get("eagle3_config", {}).get(
        "target_model", verifier.get("name_or_path") or "")
    config = _config_from(layer_config, layer_ids, record["draft_vocab_size"],
                          record.get("target_hidden_size") or layer_config["hidden_size"],
                          target, target_model)
    return Eagle3Draft.from_state(config, _read_tensors(directory, config), target)


def load_specforge(directory, target: nn.Module) -> Eagle3Draft:
    """Load an SGLang/SpecForge EAGLE-3 checkpoint (ids ℓ − 1, see module doc) for ``target``."""
    directory, record = _read_config(directory)
    explicit_ids = record.get("eagle_config", {}).get("eagle_aux_hidden_state_layer_ids")
    layer_ids = ([layer_id + 1 for layer_id in explicit_ids] if explicit_ids
                 else _default_layer_ids(target))
    target_model = record.get("actwave", {}).get("eagle3_config", {}).get("target_model", "")
    config = _config_from(record, layer_ids,
                          record.get("draft_vocab_size") or record["vocab_size"],
                          record.get("target_hidden_size") or record["hidden_size"],
                          target, target_model)
    return Eagle3Draft.from_state(config, _read_tensors(directory, config), target)
