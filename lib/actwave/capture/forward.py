"""Hidden-state capture, in the layer convention of docs/METHODS.md §2.

Layer index ℓ ∈ {0..N} is the number of decoder blocks applied: ℓ=0 is the embedding
output, ℓ=N the last block's output *before* the final norm. HF's ``hidden_states[ℓ]``
matches for ℓ < N; its last entry is after the final norm, so ℓ=N is taken by a hook on
the last block. This is also the input to block ℓ, which is what EAGLE-3, vLLM and SGLang
capture for their default ``(2, N//2, N-3)``.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Sequence

import torch

from actwave.capture.models import decoder_layers, final_norm, num_layers
from actwave.stats.metrics import entropy_and_argmax_of_logits


def validate_layers(layer_ids: Sequence[int], num_layers: int) -> tuple[int, ...]:
    """Layer ids as a tuple, each checked to lie in 0..N."""
    ids = tuple(int(i) for i in layer_ids)
    if not ids:
        raise ValueError("layer_ids is empty; give at least one layer index in 0..N")
    bad = [i for i in ids if not 0 <= i <= num_layers]
    if bad:
        raise ValueError(f"layer index {bad[0]} out of range: this model has N={num_layers} "
                         f"decoder blocks, so layer ids must lie in 0..{num_layers}")
    return ids


@contextmanager
def _last_block_output(model):
    """Record the output of the last decoder block (ℓ=N, before the final norm)."""
    store: dict[str, torch.Tensor] = {}

    def hook(_module, _args, output):
        store["h"] = output[0] if isinstance(output, tuple) else output

    handle = decoder_layers(model)[-1].register_forward_hook(hook)
    try:
        yield store
    finally:
        handle.remove()


def _decoder_forward(model, input_ids, **kwargs):
    """Run the decoder stack (no LM head) with all hidden states; -> (outputs, h_N)."""
    with _last_block_output(model) as last:
        outputs = model.get_decoder()(input_ids=input_ids, output_hidden_states=True,
                                      return_dict=True, **kwargs)
    return outputs, last["h"]


def _stack_states(outputs, last_prenorm: torch.Tensor) -> torch.Tensor:
    """All N+1 states with ℓ=N replaced by the pre-norm output -> (N+1, B, T, D)."""
    states = list(outputs.hidden_states)
    states[-1] = last_prenorm
    return torch.stack(states)  # (N+1, B, T, D)


@torch.no_grad()
def hidden_states(model, input_ids: torch.Tensor,
                  attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """All hidden states of a batch: input_ids (B, T) -> (N+1, B, T, D)."""
    outputs, last = _decoder_forward(model, input_ids, attention_mask=attention_mask)
    return _stack_states(outputs, last)


@torch.no_grad()
def valid_states(model, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """All N+1 states of the unmasked tokens of a padded batch, for a capture store.

    input_ids, attention_mask: (B, T) -> (states (N+1, n, D) in ``dtype``, ℓ=N states
    (n, D) in the compute dtype), tokens in row-major (sequence, position) order. Each
    layer's valid rows go straight into one preallocated tensor: no stacked compute-dtype
    copy of every state (the same values as stacking, gathering, then converting).
    """
    outputs, last = _decoder_forward(model, input_ids, attention_mask=attention_mask)
    by_layer = list(outputs.hidden_states[:-1]) + [last]
    valid = attention_mask.bool()
    out = torch.empty(len(by_layer), int(valid.sum()), last.shape[-1], dtype=dtype,
                      device=last.device)
    for layer, state in enumerate(by_layer):
        out[layer] = state[valid]
    return out, last[valid]


def target_logits(model, last_prenorm: torch.Tensor,
                  vocab_ids: torch.Tensor | None = None) -> torch.Tensor:
    """The target's logits from its ℓ=N state: (..., D) -> (..., V), or (..., len(vocab_ids)).

    Applies the final norm, the LM head and (Gemma-2 style) logit soft-capping, so stored
    ℓ=N states give back the target's distribution without storing logits. ``vocab_ids``
    computes only those rows of the head (a draft vocabulary: 8-32k of 49-262k rows).
    """
    head = model.get_output_embeddings()
    normed = final_norm(model)(last_prenorm)
    if vocab_ids is None:
        logits = head(normed)
    else:
        bias = None if head.bias is None else head.bias[vocab_ids]
        logits = torch.nn.functional.linear(normed, head.weight[vocab_ids], bias)
    cap = getattr(model.config.get_text_config(), "final_logit_softcapping", None)
    if cap:
        logits = torch.tanh(logits / cap) * cap
    return logits


@torch.no_grad()
def entropy_and_argmax(model, last_prenorm: torch.Tensor, chunk: int = 1024):
    """Predictive entropy (nats, fp32) and argmax per token: (n, D) -> ((n,), (n,)).

    Chunked so a 262k-token vocabulary never materialises logits for all tokens at once.
    """
    entropies, argmaxes = [], []
    for part in last_prenorm.split(chunk):
        entropy, argmax = entropy_and_argmax_of_logits(target_logits(model, part))
        entropies.append(entropy)
        argmaxes.append(argmax)
    return torch.cat(entropies), torch.cat(argmaxes)


@contextmanager
def _layer_inputs(model, layer_ids: tuple[int, ...]):
    """Record states ℓ in ``layer_ids`` during a forward: ℓ < N is the input of block ℓ (a
    pre-hook), ℓ = N the last block's output. -> dict ℓ -> (B, T, D), filled by the forward.

    Hooks instead of ``output_hidden_states``: only the k states a draft reads are kept.
    """
    blocks = decoder_layers(model)
    store: dict[int, torch.Tensor] = {}

    def pre_hook(layer, args, kwargs):
        store[layer] = args[0] if args else kwargs["hidden_states"]

    handles = [blocks[layer].register_forward_pre_hook(
        lambda _m, args, kwargs, layer=layer: pre_hook(layer, args, kwargs), with_kwargs=True)
        for layer in set(layer_ids) if layer < len(blocks)]
    if len(blocks) in layer_ids:
        def post_hook(_module, _args, output):
            store[len(blocks)] = output[0] if isinstance(output, tuple) else output
        handles.append(blocks[-1].register_forward_hook(post_hook))
    try:
        yield store
    finally:
        for handle in handles:
            handle.remove()


def forward_with_states(model, layer_ids: Sequence[int], input_ids: torch.Tensor,
                        logits_to_keep: int = 0, **kwargs):
    """One target forward returning logits and the chosen layers' states.

    For speculative decoding: accepts ``cache`` (or ``past_key_values``), ``position_ids``
    and a 4D ``attention_mask`` like the model itself. -> (logits (B, T', V), states
    (B, T, k·D), cache), states concatenated in ``layer_ids`` order; T' = T, or the last
    ``logits_to_keep`` positions when > 0 (a prefill needs one row of the LM head, not T).
    """
    ids = validate_layers(layer_ids, num_layers(model))
    if "past_key_values" in kwargs:  # transformers 5.2x renamed the argument to `cache`
        kwargs["cache"] = kwargs.pop("past_key_values")
    n_blocks = num_layers(model)
    with _layer_inputs(model, ids + (n_blocks,)) as by_layer:
        outputs = model.get_decoder()(input_ids=input_ids, use_cache=True, return_dict=True,
                                      **kwargs)
    states = torch.cat([by_layer[i] for i in ids], dim=-1)  # (B, T, k·D)
    last = by_layer[n_blocks]
    kept = last[:, -logits_to_keep:] if logits_to_keep > 0 else last
    return target_logits(model, kept), states, outputs.cache
