"""The EAGLE-3 draft's config: its hyper-parameters, how they follow from a target, and the
check that a saved draft fits the target it is loaded onto.

Kept apart from ``actwave.eagle3.model`` so the building blocks (``actwave.eagle3.layers``)
and the draft itself both import it, without importing each other. Layer ids follow
docs/METHODS.md §2: ℓ = number of target blocks applied, 0..N.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from torch import nn

from actwave.capture.forward import validate_layers
from actwave.integrity import Between, check_fields, int_ids


@dataclass
class Eagle3Config:
    """Hyper-parameters of one EAGLE-3 draft (saved as JSON beside its weights)."""

    layer_ids: tuple[int, ...]        # target layers ℓ fed to fc, in concatenation order
    target_hidden_size: int
    hidden_size: int                  # = target_hidden_size (embedding ‖ hidden concat)
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    # transformers-5 style flat RoPE dict ("rope_type", "rope_theta", scaling keys).
    rope_parameters: dict = field(default_factory=lambda: {"rope_type": "default",
                                                           "rope_theta": 10000.0})
    max_position_embeddings: int = 2048
    target_vocab_size: int = 0
    draft_vocab_size: int = 0
    target_model: str = ""            # target's name, for check_target ("" = unknown)
    target_num_layers: int = 0        # N of the target (0 = unknown)

    def __post_init__(self):
        check_fields(self, {name: Between(1) for name in (
            "target_hidden_size", "hidden_size", "intermediate_size", "num_attention_heads",
            "num_key_value_heads", "head_dim", "max_position_embeddings")} | {
            "layer_ids": Between(0), "target_vocab_size": Between(0),
            "draft_vocab_size": Between(0), "target_num_layers": Between(0),
            "rms_norm_eps": Between(0.0, low_open=True)})
        self.layer_ids = int_ids("layer_ids", self.layer_ids)
        if not self.layer_ids:
            raise ValueError("layer_ids must name at least one target layer, got ()")
        if self.hidden_size != self.target_hidden_size:
            raise ValueError("EAGLE-3 concatenates the target embedding with the draft hidden: "
                             f"hidden_size ({self.hidden_size}) must equal target_hidden_size "
                             f"({self.target_hidden_size})")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads ({self.num_attention_heads}) must be a "
                             f"multiple of num_key_value_heads ({self.num_key_value_heads})")
        if not 1 <= self.draft_vocab_size <= self.target_vocab_size:
            raise ValueError(f"draft_vocab_size must lie in 1..target_vocab_size "
                             f"({self.target_vocab_size}), got {self.draft_vocab_size}")

    @property
    def rope_theta(self) -> float:
        return float(self.rope_parameters["rope_theta"])

    def to_dict(self) -> dict:
        record = dataclasses.asdict(self)
        record["layer_ids"] = list(self.layer_ids)
        return record

    @classmethod
    def from_dict(cls, record: dict) -> "Eagle3Config":
        allowed = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(record) - allowed)
        if unknown:
            raise ValueError(f"unknown Eagle3Config fields {unknown}; allowed: {sorted(allowed)}")
        return cls(**record)


def check_target_config(config: Eagle3Config, target: nn.Module, check_name: bool = True) -> None:
    """Raise ValueError naming every mismatch between a draft config and ``target``
    (hidden size, vocab size, layer ids beyond N, number of layers, target name)."""
    text_config = target_text_config(target)
    num_layers = int(text_config.num_hidden_layers)
    problems = []
    if text_config.hidden_size != config.target_hidden_size:
        problems.append(f"hidden size {text_config.hidden_size} != draft's "
                        f"target_hidden_size {config.target_hidden_size}")
    vocab_size = target.get_input_embeddings().weight.shape[0]
    if vocab_size != config.target_vocab_size:
        problems.append(f"vocab size {vocab_size} != draft's target_vocab_size "
                        f"{config.target_vocab_size}")
    bad_ids = [i for i in config.layer_ids if not 0 <= i <= num_layers]
    if bad_ids:
        problems.append(f"layer ids {bad_ids} outside 0..{num_layers} (target has "
                        f"N={num_layers} blocks)")
    if config.target_num_layers and config.target_num_layers != num_layers:
        problems.append(f"target has {num_layers} layers, draft was built for "
                        f"{config.target_num_layers}")
    name = _target_name(target)
    if check_name and name and config.target_model and name != config.target_model:
        problems.append(f"target {name!r} != draft's target_model {config.target_model!r}")
    if problems:
        raise ValueError("draft does not fit this target: " + "; ".join(problems))


def target_text_config(target: nn.Module):
    """The decoder config of a causal LM (the text part of a multimodal one)."""
    config = target.config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _target_name(target: nn.Module) -> str:
    """The target's name: ``model.name_or_path`` (actwave.capture.models.load sets the registry
    name there), else the config's ``_name_or_path``; "" for a model built from a config."""
    name = getattr(target, "name_or_path", "") or getattr(target.config, "_name_or_path", "")
    return str(name or "")


def flat_rope_parameters(params: dict | None, default_theta: float = 10000.0) -> dict:
    """Flat RoPE settings for the draft's full attention.

    Per-layer-type settings (Gemma3: {"full_attention": ..., "sliding_attention": ...})
    give their full-attention entry; legacy ``type`` becomes ``rope_type``; None values
    are dropped; ``rope_theta`` falls back to ``default_theta``.
    """
    params = dict(params or {})
    if "full_attention" in params:
        params = dict(params["full_attention"])
    params = {key: value for key, value in params.items() if value is not None}
    params.setdefault("rope_type", params.pop("type", "default"))
    params.setdefault("rope_theta", float(default_theta))
    return params


def validate_layer_ids(layer_ids, num_layers: int) -> tuple[int, ...]:
    """Distinct int layer ids in 0..N (``actwave.capture.forward.validate_layers``) as a tuple;
    bools, floats and strings refused (``int_ids``), not truncated."""
    ids = validate_layers(int_ids("layer_ids", layer_ids), num_layers)
    if len(set(ids)) != len(ids):
        raise ValueError(f"layer_ids must be distinct, got {ids}")
    return ids


def config_from_target(target: nn.Module, layer_ids, draft_vocab_size: int,
                       target_vocab_size: int, overrides: dict) -> Eagle3Config:
    """The draft config for ``target``: its widths, heads and RoPE, ``layer_ids`` checked
    against its N; ``overrides`` replace named fields (TypeError naming unknown ones)."""
    text_config = target_text_config(target)
    num_layers = int(text_config.num_hidden_layers)
    hidden_size = int(text_config.hidden_size)
    num_heads = int(text_config.num_attention_heads)
    values = dict(
        layer_ids=validate_layer_ids(layer_ids, num_layers),
        target_hidden_size=hidden_size,
        hidden_size=hidden_size,
        intermediate_size=int(text_config.intermediate_size),
        num_attention_heads=num_heads,
        num_key_value_heads=int(getattr(text_config, "num_key_value_heads", None) or num_heads),
        head_dim=int(getattr(text_config, "head_dim", None) or hidden_size // num_heads),
        rms_norm_eps=float(getattr(text_config, "rms_norm_eps", 1e-6)),
        rope_parameters=flat_rope_parameters(
            getattr(text_config, "rope_parameters", None) or getattr(text_config, "rope_scaling", None),
            getattr(text_config, "rope_theta", None) or 10000.0),
        max_position_embeddings=int(getattr(text_config, "max_position_embeddings", 2048)),
        target_vocab_size=target_vocab_size,
        draft_vocab_size=draft_vocab_size,
        target_model=_target_name(target),
        target_num_layers=num_layers,
    )
    unknown = sorted(set(overrides) - set(values))
    if unknown:
        raise TypeError(f"unknown Eagle3Config overrides {unknown}; allowed: {sorted(values)}")
    values.update(overrides)
    return Eagle3Config(**values)
