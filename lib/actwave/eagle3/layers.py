"""Building blocks of the EAGLE-3 draft layer (see ``actwave.eagle3.model``).

Llama-style pieces, written from the public descriptions (docs/METHODS.md §11): RMSNorm, rotate-half RoPE whose
frequencies follow the target's ``rope_parameters``, grouped-query self-attention whose
q/k/v read the 2H-wide [embedding; hidden] input, a SwiGLU MLP, and the single decoder
layer (``midlayer``) that ties them together.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from actwave.eagle3.config import Eagle3Config


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
