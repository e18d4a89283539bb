"""EAGLE-3 draft model (Li et al. 2025, arXiv 2503.01840), in plain torch.

Architecture (as in SafeAILab/EAGLE ``traineagle3``, SpecForge ``llama3_eagle`` and
vLLM ``speculators`` eagle3; written from the notes, not copied):

- ``fuse``: g = fc(concat of k target hidden states), fc: k·H_target → H, no bias. Only
  target features go through fc; the draft's own output hidden (width H) skips it.
- one Llama-style decoder layer (``midlayer``): residual = hidden;
  q/k/v read concat[input_layernorm(embed(ids)), hidden_norm(hidden)] (width 2H);
  RoPE at ``position_ids``; o_proj → H; + residual; post_attention_layernorm;
  SwiGLU MLP; + residual → the output hidden (pre-norm), fed back at the next step.
- logits = lm_head(norm(out)) over the draft vocabulary; ``d2t``/``t2d`` map draft ids
  to target ids (see ``actwave.eagle3.vocab``).
- ``embed_tokens`` is a frozen copy of the target's input embedding module, so it
  reproduces the target's own input embedding (Gemma's √H scaling included). It is
  not saved with the draft; ``load`` re-attaches it from the target.

Alignment (EAGLE): query position t receives ``hidden`` = the fused target state at t
(or, at later drafting steps, the draft's own output hidden at t) and ``input_ids`` =
the token at t+1; its logits predict the token at t+2 (the target's distribution at
t+1). SafeAILab/SpecForge use RoPE position t for step 0 and t+i at unrolled step i;
callers pass ``position_ids`` explicitly and must use the same rule in training and
inference.

Non-Llama targets (Qwen2/3, Gemma3) still get the Llama-style draft layer, as public
EAGLE-3 drafts do: plain RMSNorm (x·w, w initialised to 1; not Gemma's x·(1+w)), no
q/k norms, no attention biases, SiLU gate, scale 1/√head_dim. The rotary frequencies
follow the target's (full-attention) ``rope_parameters``.

Layer ids follow DESIGN.md: ℓ = number of target blocks applied (HF
``hidden_states[ℓ]``; ℓ = N is the last block's output before the final norm).
"""
from __future__ import annotations

import copy
import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save
from torch import nn

from actwave.capture import validate_layers
from actwave.config import atomic_write_bytes, save_config
from actwave.eagle3.vocab import build_draft_vocab, draft_target_ids

CHECKPOINT_FORMAT = "actwave-eagle3-v1"
WEIGHTS_NAME = "model.safetensors"


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
        self.layer_ids = tuple(int(i) for i in self.layer_ids)
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


@dataclass
class Eagle3Output:
    """logits: (B, T, V_draft); hidden: (B, T, H) pre-norm output; the (updated) cache."""

    logits: torch.Tensor
    hidden: torch.Tensor
    past_key_values: object | None


class RMSNorm(nn.Module):
    """Llama RMSNorm: x / rms(x) · w, computed in float32 and cast back."""

    def __init__(self, width: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for rotate-half RoPE from the target's ``rope_parameters``."""

    def __init__(self, config: Eagle3Config):
        super().__init__()
        # A plain float32 attribute, not a buffer: ``draft.to(torch.bfloat16)`` would
        # otherwise round the frequencies and shift every rotation angle.
        self.inv_freq, self.attention_scaling = _rope_inv_freq(config)

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """position_ids: (B, T) -> cos, sin: (B, 1, T, head_dim)."""
        if self.inv_freq.device != position_ids.device:
            self.inv_freq = self.inv_freq.to(position_ids.device)
        freqs = position_ids[..., None].float() * self.inv_freq  # (B, T, head_dim/2)
        angles = torch.cat([freqs, freqs], dim=-1)  # (B, T, head_dim)
        cos = (angles.cos() * self.attention_scaling).to(dtype)
        sin = (angles.sin() * self.attention_scaling).to(dtype)
        return cos[:, None], sin[:, None]


def _rope_inv_freq(config: Eagle3Config) -> tuple[torch.Tensor, float]:
    """Inverse frequencies (head_dim/2,) and attention scaling for the draft's RoPE."""
    params = config.rope_parameters
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        exponents = torch.arange(0, config.head_dim, 2, dtype=torch.float32) / config.head_dim
        return 1.0 / (config.rope_theta ** exponents), 1.0
    # Scaled variants (llama3, yarn, ...): reuse transformers' formulas on a Llama config.
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"rope_type {rope_type!r} is not supported; allowed: "
                         f"'default', {sorted(ROPE_INIT_FUNCTIONS)}")
    rope_config = LlamaConfig(hidden_size=config.hidden_size, head_dim=config.head_dim,
                              num_attention_heads=config.num_attention_heads,
                              max_position_embeddings=config.max_position_embeddings,
                              rope_parameters=dict(params))
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](rope_config, None)
    return inv_freq.float(), float(scaling)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat([-second, first], dim=-1)


class Eagle3Attention(nn.Module):
    """Self-attention whose q/k/v read the 2H-wide [embedding; hidden] input."""

    def __init__(self, config: Eagle3Config):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        width_in = 2 * config.hidden_size
        self.q_proj = nn.Linear(width_in, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(width_in, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(width_in, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                attention_mask: torch.Tensor | None, cache) -> torch.Tensor:
        """x: (B, T, 2H) -> (B, T, H). cache: DynamicCache or None (layer 0 is used)."""
        batch, steps, _ = x.shape
        queries = self.q_proj(x).view(batch, steps, self.num_heads, self.head_dim).transpose(1, 2)
        keys = self.k_proj(x).view(batch, steps, self.num_kv_heads, self.head_dim).transpose(1, 2)
        values = self.v_proj(x).view(batch, steps, self.num_kv_heads, self.head_dim).transpose(1, 2)
        queries = queries * cos + _rotate_half(queries) * sin  # (B, nh, T, hd)
        keys = keys * cos + _rotate_half(keys) * sin  # (B, nkv, T, hd)
        past_len = 0
        if cache is not None:
            past_len = cache.get_seq_length(0)
            keys, values = cache.update(keys, values, 0)  # (B, nkv, S, hd), S = past + T
        mask = _attention_bias(attention_mask, batch, steps, past_len, keys.shape[2], queries)
        groups = self.num_heads // self.num_kv_heads
        keys = keys.repeat_interleave(groups, dim=1)  # (B, nh, S, hd)
        values = values.repeat_interleave(groups, dim=1)
        attended = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask)
        return self.o_proj(attended.transpose(1, 2).reshape(batch, steps, -1))


def _attention_bias(attention_mask: torch.Tensor | None, batch: int, steps: int,
                    past_len: int, total_len: int, queries: torch.Tensor) -> torch.Tensor:
    """Additive mask (B|1, 1, T, S) in the query dtype; None means causal over [cache; new]."""
    if attention_mask is None:
        query_pos = torch.arange(steps, device=queries.device)[:, None] + past_len
        key_pos = torch.arange(total_len, device=queries.device)[None, :]
        return (key_pos <= query_pos)[None, None]  # (1, 1, T, S) bool, True = attend
    expected = (1, steps, total_len)
    if attention_mask.dim() != 4 or tuple(attention_mask.shape[1:]) != expected \
            or attention_mask.shape[0] not in (1, batch):
        raise ValueError(f"attention_mask must have shape ({batch}|1, 1, {steps}, {total_len}) "
                         f"(batch, 1, new tokens, cached + new tokens), got "
                         f"{tuple(attention_mask.shape)}")
    if not attention_mask.is_floating_point():
        raise TypeError(f"attention_mask must be an additive float mask, got {attention_mask.dtype}")
    return attention_mask.to(device=queries.device, dtype=queries.dtype)


class Eagle3MLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) · up(x))."""

    def __init__(self, config: Eagle3Config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Eagle3DecoderLayer(nn.Module):
    """The single EAGLE-3 decoder layer (names as SafeAILab's ``midlayer``)."""

    def __init__(self, config: Eagle3Config):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Eagle3Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = Eagle3MLP(config)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor, attention_mask: torch.Tensor | None, cache) -> torch.Tensor:
        """embeds, hidden: (B, T, H) -> out: (B, T, H), pre-norm."""
        residual = hidden
        attn_input = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)
        hidden = residual + self.self_attn(attn_input, cos, sin, attention_mask, cache)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class Eagle3Draft(nn.Module):
    """EAGLE-3 draft: fc fusion of k target layers + one decoder layer + draft lm_head.

    The frozen ``embed_tokens`` is a parameter without grad: optimise
    ``[p for p in draft.parameters() if p.requires_grad]``.
    """

    def __init__(self, config: Eagle3Config, embed_tokens: nn.Embedding):
        super().__init__()
        if embed_tokens.weight.shape != (config.target_vocab_size, config.hidden_size):
            raise ValueError(f"embed_tokens has shape {tuple(embed_tokens.weight.shape)}, the "
                             f"config needs ({config.target_vocab_size}, {config.hidden_size})")
        self.config = config
        self.embed_tokens = embed_tokens.requires_grad_(False)
        self.fc = nn.Linear(len(config.layer_ids) * config.target_hidden_size,
                            config.hidden_size, bias=False)
        self.midlayer = Eagle3DecoderLayer(config)
        self.rotary_emb = RotaryEmbedding(config)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(config.target_vocab_size, dtype=torch.bool))
        self.set_vocab(*build_draft_vocab(torch.zeros(config.target_vocab_size),
                                          config.draft_vocab_size))
        self.to(embed_tokens.weight.device)

    @property
    def layer_ids(self) -> tuple[int, ...]:
        return self.config.layer_ids

    @classmethod
    def from_target(cls, target: nn.Module, layer_ids, draft_vocab_size: int | None = None,
                    token_counts: torch.Tensor | None = None, lm_head_init: str = "target",
                    **overrides) -> "Eagle3Draft":
        """An untrained draft for ``target`` reading target layers ``layer_ids``.

        Hyper-parameters come from the target's (text) config; ``overrides`` replace any
        Eagle3Config field (e.g. ``intermediate_size``). The draft vocab is the
        ``draft_vocab_size`` most frequent target tokens per ``token_counts`` (V_target,)
        (else the first ids); None keeps the full target vocab. ``lm_head_init``:
        "target" starts lm_head from the target's output-embedding rows of the draft
        vocab (as vLLM speculators does), "random" keeps nn.Linear's init (SafeAILab).
        The draft takes the target embedding's device and dtype.
        """
        embedding = target.get_input_embeddings()
        target_vocab_size = embedding.weight.shape[0]
        config = _config_from_target(target, layer_ids, draft_vocab_size or target_vocab_size,
                                     target_vocab_size, overrides)
        embed_copy = copy.deepcopy(embedding)
        draft = cls(config, embed_copy).to(embedding.weight.dtype)
        counts = token_counts if token_counts is not None else torch.zeros(target_vocab_size)
        if counts.shape != (target_vocab_size,):
            raise ValueError(f"token_counts must have shape ({target_vocab_size},), "
                             f"got {tuple(counts.shape)}")
        draft.set_vocab(*build_draft_vocab(counts, config.draft_vocab_size))
        if lm_head_init == "target":
            draft._init_lm_head_from(target)
        elif lm_head_init != "random":
            raise ValueError(f"lm_head_init must be 'target' or 'random', got {lm_head_init!r}")
        return draft

    def set_vocab(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        """Install the draft→target maps; checks they describe the same id set."""
        if d2t.shape != self.d2t.shape or t2d.shape != self.t2d.shape:
            raise ValueError(f"d2t/t2d must have shapes {tuple(self.d2t.shape)}/"
                             f"{tuple(self.t2d.shape)}, got {tuple(d2t.shape)}/{tuple(t2d.shape)}")
        target_ids = draft_target_ids(d2t.long()).to(t2d.device)
        in_range = bool(((target_ids >= 0) & (target_ids < t2d.numel())).all())
        if not in_range or not bool(t2d.bool()[target_ids].all()) or int(t2d.sum()) != d2t.numel():
            raise ValueError("d2t and t2d disagree: t2d must be True exactly at the target ids "
                             "draft_id + d2t[draft_id]")
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)

    def _init_lm_head_from(self, target: nn.Module) -> None:
        output_embedding = target.get_output_embeddings()
        if output_embedding is None:
            raise ValueError("lm_head_init='target' needs target.get_output_embeddings(); "
                             "use lm_head_init='random'")
        rows = output_embedding.weight.detach()[draft_target_ids(self.d2t).to(
            output_embedding.weight.device)]  # (V_draft, H)
        with torch.no_grad():
            self.lm_head.weight.copy_(rows.to(self.lm_head.weight))

    def fuse(self, target_states: torch.Tensor) -> torch.Tensor:
        """target_states: (B, T, k·H_t), layers concatenated in ``layer_ids`` order -> (B, T, H)."""
        expected = len(self.layer_ids) * self.config.target_hidden_size
        if target_states.shape[-1] != expected:
            raise ValueError(f"target_states last dim must be k*H_target = {expected} "
                             f"(k={len(self.layer_ids)}), got {target_states.shape[-1]}")
        return self.fc(target_states)

    def forward(self, input_ids: torch.Tensor, hidden: torch.Tensor, position_ids: torch.Tensor,
                attention_mask: torch.Tensor | None = None, past_key_values=None) -> Eagle3Output:
        """One draft pass over T new positions (see the module docstring for alignment).

        input_ids: (B, T) target ids of the token at t+1; hidden: (B, T, H) fused target
        state (``fuse``) or the draft's own previous output hidden; position_ids: (B, T);
        attention_mask: (B|1, 1, T, S) additive float mask over S = cached + T keys, None
        for causal; past_key_values: a DynamicCache whose layer 0 receives the new keys
        and values (callers crop it, e.g. ``cache.crop(-n)``).
        """
        if input_ids.shape != hidden.shape[:2] or position_ids.shape != input_ids.shape:
            raise ValueError(f"input_ids {tuple(input_ids.shape)}, hidden {tuple(hidden.shape)} "
                             f"and position_ids {tuple(position_ids.shape)} must agree on (B, T)")
        embeds = self.embed_tokens(input_ids).to(hidden.dtype)  # (B, T, H)
        cos, sin = self.rotary_emb(position_ids, hidden.dtype)
        out = self.midlayer(embeds, hidden, cos, sin, attention_mask, past_key_values)
        logits = self.lm_head(self.norm(out))  # (B, T, V_draft)
        return Eagle3Output(logits=logits, hidden=out, past_key_values=past_key_values)

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Map draft-vocab ids (any shape) to target ids: id + d2t[id]."""
        return draft_ids + self.d2t[draft_ids]

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """Everything saved with the draft: all weights and buffers but the target embedding."""
        return {name: tensor for name, tensor in self.state_dict().items()
                if not name.startswith("embed_tokens.")}

    def save_pretrained(self, directory) -> Path:
        """``config.json`` (Eagle3Config + provenance) and ``model.safetensors``."""
        directory = Path(directory)
        save_tensors(directory / WEIGHTS_NAME, self.trainable_state_dict())
        save_config(directory, self.config.to_dict(), format=CHECKPOINT_FORMAT)
        return directory

    @classmethod
    def load(cls, directory, target: nn.Module) -> "Eagle3Draft":
        """Load a ``save_pretrained`` draft, re-attaching (a copy of) the target embedding."""
        directory = Path(directory)
        record = json.loads((directory / "config.json").read_text())
        if record.get("format") != CHECKPOINT_FORMAT:
            raise ValueError(f"{directory} is not an actwave EAGLE-3 draft "
                             f"(format {record.get('format')!r}, expected {CHECKPOINT_FORMAT!r})")
        config = Eagle3Config.from_dict(record["config"])
        return cls.from_state(config, load_file(directory / WEIGHTS_NAME), target)

    @classmethod
    def from_state(cls, config: Eagle3Config, tensors: dict[str, torch.Tensor],
                   target: nn.Module) -> "Eagle3Draft":
        """A draft from its config and saved tensors (our names), checked against ``target``."""
        check_target_config(config, target)
        draft = cls(config, copy.deepcopy(target.get_input_embeddings()))
        expected = set(draft.trainable_state_dict())
        if set(tensors) != expected:
            raise ValueError(f"draft weights do not match the architecture: missing "
                             f"{sorted(expected - set(tensors))}, unexpected "
                             f"{sorted(set(tensors) - expected)}")
        draft.load_state_dict(tensors, strict=False)
        draft.set_vocab(draft.d2t.clone(), draft.t2d.clone())
        return draft.to(tensors["fc.weight"].dtype)

    def check_target(self, target: nn.Module, check_name: bool = True) -> None:
        """Raise ValueError naming every way ``target`` differs from the one the draft is for."""
        check_target_config(self.config, target, check_name)

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
    """The target's name: ``model.name_or_path`` (actwave.models.load sets the registry
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


def save_tensors(path, tensors: dict[str, torch.Tensor]) -> None:
    """Atomically write tensors (moved to CPU, made contiguous) as one safetensors file."""
    payload = {name: tensor.detach().contiguous().cpu() for name, tensor in tensors.items()}
    atomic_write_bytes(Path(path), save(payload))


def validate_layer_ids(layer_ids, num_layers: int) -> tuple[int, ...]:
    """Distinct layer ids in 0..N (``actwave.capture.validate_layers``) as a tuple."""
    ids = validate_layers(layer_ids, num_layers)
    if len(set(ids)) != len(ids):
        raise ValueError(f"layer_ids must be distinct, got {ids}")
    return ids


def _config_from_target(target: nn.Module, layer_ids, draft_vocab_size: int,
                        target_vocab_size: int, overrides: dict) -> Eagle3Config:
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

