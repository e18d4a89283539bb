"""EAGLE-3 draft model (Li et al. 2025, arXiv 2503.01840), in plain torch.

Architecture (as in SafeAILab/EAGLE ``traineagle3``, SpecForge ``llama3_eagle`` and
vLLM ``speculators`` eagle3; written from their public descriptions, docs/METHODS.md §11):

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

The layer's building blocks (RMSNorm, RoPE, attention, MLP, decoder layer) live in
``actwave.eagle3.layers``, its config in ``actwave.eagle3.config``; this module holds the
draft and its I/O.

Layer ids follow docs/METHODS.md §2: ℓ = number of target blocks applied (HF
``hidden_states[ℓ]``; ℓ = N is the last block's output before the final norm).
"""
from __future__ import annotations

import copy
import hashlib
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save
from torch import nn

from actwave.config import atomic_write_bytes
from actwave.eagle3.config import Eagle3Config, check_target_config, config_from_target
from actwave.eagle3.layers import Eagle3DecoderLayer, RMSNorm, RotaryEmbedding
from actwave.eagle3.vocab import build_draft_vocab, draft_target_ids
from actwave.integrity import (IntegrityError, bytes_record, model_identity, read_record,
                               require_finite_tensors, require_model, save_config_record,
                               verify_file)

CHECKPOINT_FORMAT = "actwave-eagle3-v1"
WEIGHTS_NAME = "model.safetensors"


@dataclass
class Eagle3Output:
    """logits: (B, T, V_draft); hidden: (B, T, H) pre-norm output; the (updated) cache."""

    logits: torch.Tensor
    hidden: torch.Tensor
    past_key_values: object | None


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
        # model_identity of the target the draft is for (set by from_target / from_state /
        # load; saved with the draft and checked against the target on load)
        self.target_identity: dict | None = None
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
        config = config_from_target(target, layer_ids, draft_vocab_size or target_vocab_size,
                                     target_vocab_size, overrides)
        embed_copy = copy.deepcopy(embedding)
        draft = cls(config, embed_copy).to(embedding.weight.dtype)
        draft.target_identity = model_identity(target)
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
                attention_mask: torch.Tensor | None = None, past_key_values=None,
                logits_to_keep: int = 0) -> Eagle3Output:
        """One draft pass over T new positions (see the module docstring for alignment).

        input_ids: (B, T) target ids of the token at t+1; hidden: (B, T, H) fused target
        state (``fuse``) or the draft's own previous output hidden; position_ids: (B, T);
        attention_mask: (B|1, 1, T, S) additive float mask over S = cached + T keys, None
        for causal; past_key_values: a DynamicCache whose layer 0 receives the new keys
        and values (callers crop it, e.g. ``cache.crop(-n)``). ``logits_to_keep`` > 0
        computes logits for the last that many positions only (as in HF): a catch-up pass
        over a prompt needs just the last row, and the LM head dominates a draft pass.
        """
        if input_ids.shape != hidden.shape[:2] or position_ids.shape != input_ids.shape:
            raise ValueError(f"input_ids {tuple(input_ids.shape)}, hidden {tuple(hidden.shape)} "
                             f"and position_ids {tuple(position_ids.shape)} must agree on (B, T)")
        embeds = self.embed_tokens(input_ids).to(hidden.dtype)  # (B, T, H)
        cos, sin = self.rotary_emb(position_ids, hidden.dtype)
        out = self.midlayer(embeds, hidden, cos, sin, attention_mask, past_key_values)
        kept = out[:, -logits_to_keep:] if logits_to_keep > 0 else out
        logits = self.lm_head(self.norm(kept))  # (B, T or logits_to_keep, V_draft)
        return Eagle3Output(logits=logits, hidden=out, past_key_values=past_key_values)

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Map draft-vocab ids (any shape) to target ids: id + d2t[id]."""
        return draft_ids + self.d2t[draft_ids]

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """Everything saved with the draft: all weights and buffers but the target embedding."""
        return {name: tensor for name, tensor in self.state_dict().items()
                if not name.startswith("embed_tokens.")}

    def fingerprint(self) -> str:
        """sha256 (16 hex) of the saved weights and buffers: which trained draft this is.

        Keys cached results (e.g. evaluation records) so that retraining a draft on the
        same layers never reuses the old draft's numbers.
        """
        digest = hashlib.sha256()
        for name, tensor in sorted(self.trainable_state_dict().items()):
            values = tensor.detach().cpu().contiguous()
            digest.update(f"{name}:{values.dtype}:{tuple(values.shape)}".encode())
            digest.update(values.reshape(-1).view(torch.uint8).numpy().tobytes())
        return digest.hexdigest()[:16]

    def save_pretrained(self, directory) -> Path:
        """``config.json`` (Eagle3Config, the target's identity, the weights' size and sha256,
        its own checksum) and ``model.safetensors``; non-finite weights are refused
        (FloatingPointError), and so is a draft that does not know its target (build it with
        ``from_target``)."""
        directory = Path(directory)
        if not self.target_identity:
            raise ValueError(f"draft for {directory} records no target (built without "
                             "from_target / from_state / load); set draft.target_identity = "
                             "actwave.integrity.model_identity(target) before saving")
        tensors = self.trainable_state_dict()
        require_finite_tensors(f"draft for {directory}", tensors)
        weights = save_tensors(directory / WEIGHTS_NAME, tensors)
        save_config_record(directory, self.config.to_dict(), format=CHECKPOINT_FORMAT,
                           weights=weights, target=self.target_identity)
        return directory

    @classmethod
    def load(cls, directory, target: nn.Module) -> "Eagle3Draft":
        """Load a ``save_pretrained`` draft, re-attaching (a copy of) the target embedding.

        Refuses (IntegrityError) a ``config.json`` that fails its self-checksum and weights
        that fail the recorded size or sha256; refuses (ValueError) a target other than the
        one the draft was trained for (``integrity.identity_mismatch``), naming both.
        """
        directory = Path(directory)
        repair = (f"call actwave.eagle3.train.train_draft with the arguments that made "
                  f"{directory}: it rebuilds the draft from its last checkpoint (notebook 06)")
        record = read_record(directory / "config.json", repair)
        if record.get("format") != CHECKPOINT_FORMAT:
            raise ValueError(f"{directory} is not an actwave EAGLE-3 draft "
                             f"(format {record.get('format')!r}, expected {CHECKPOINT_FORMAT!r})")
        config = Eagle3Config.from_dict(record["config"])
        check_target_config(config, target)
        check_draft_target(directory, record.get("target"), target)
        if "sha256" not in record.get("weights", {}):
            raise IntegrityError(directory / "config.json", "weights record", "a sha256",
                                 "none", repair)
        verify_file(directory / WEIGHTS_NAME, record["weights"], repair)
        draft = cls.from_state(config, load_file(directory / WEIGHTS_NAME), target)
        draft.target_identity = record["target"]
        return draft

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
        draft.target_identity = model_identity(target)
        return draft.to(tensors["fc.weight"].dtype)

    def check_target(self, target: nn.Module, check_name: bool = True) -> None:
        """Raise ValueError naming every way ``target`` differs from the one the draft is for."""
        check_target_config(self.config, target, check_name)

    def check_target_identity(self, target: nn.Module, where: str = "this draft") -> None:
        """Refuse a ``target`` whose identity (weights or files) is not the one the draft
        was made for (nothing to check for a draft that records none)."""
        if self.target_identity is not None:
            check_draft_target(where, self.target_identity, target)


def check_draft_target(draft: Path | str, recorded: dict | None, target: nn.Module) -> None:
    """Refuse ``target`` for a draft whose saved record names another target (ValueError
    naming both), or a record that names none."""
    require_model(recorded, target, f"draft {draft} was trained for target",
                  ", not for the target passed,",
                  f"draft {draft} records no target model (saved before drafts recorded their "
                  "target); retrain it",
                  "pass the target it was trained for, or train a draft for this one")


def save_tensors(path, tensors: dict[str, torch.Tensor]) -> dict:
    """Atomically write tensors (moved to CPU, made contiguous) as one safetensors file;
    -> its integrity record {"bytes", "sha256"}."""
    payload = {name: tensor.detach().contiguous().cpu() for name, tensor in tensors.items()}
    data = save(payload)
    atomic_write_bytes(Path(path), data)
    return bytes_record(data)
