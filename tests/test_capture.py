"""Capture: layer indexing against block hooks, pre-norm last layer, entropy, resumable store."""
import torch
import pytest
from conftest import tiny_model

from actwave.capture import forward, store
from actwave.capture.models import decoder_layers, final_norm


def _states_by_block_hooks(model, input_ids):
    """Independent route: ℓ = input of block ℓ (pre-hooks); ℓ = N = output of the last block."""
    seen = {}
    blocks = decoder_layers(model)
    handles = []
    for idx, block in enumerate(blocks):
        def pre(_m, args, kwargs, idx=idx):
            seen[idx] = (args[0] if args else kwargs["hidden_states"]).clone()
        handles.append(block.register_forward_pre_hook(pre, with_kwargs=True))

    def post(_m, _args, output):
        seen[len(blocks)] = (output[0] if isinstance(output, tuple) else output).clone()
    handles.append(blocks[-1].register_forward_hook(post))
    with torch.no_grad():
        model(input_ids)
    for h in handles:
        h.remove()
    return torch.stack([seen[i] for i in range(len(blocks) + 1)])


def test_hidden_states_match_block_hooks(any_tiny_model):
    input_ids = torch.randint(0, 128, (2, 12))
    states = forward.hidden_states(any_tiny_model, input_ids)
    assert states.shape == (5, 2, 12, 64)
    torch.testing.assert_close(states, _states_by_block_hooks(any_tiny_model, input_ids))


def test_last_layer_is_pre_norm(any_tiny_model):
    input_ids = torch.randint(0, 128, (1, 9))
    states = forward.hidden_states(any_tiny_model, input_ids)
    hf_last = any_tiny_model(input_ids, output_hidden_states=True).hidden_states[-1]
    assert not torch.allclose(states[-1], hf_last, atol=1e-3)
    torch.testing.assert_close(final_norm(any_tiny_model)(states[-1]), hf_last)


def test_target_logits_from_last_state(any_tiny_model):
    input_ids = torch.randint(0, 128, (1, 9))
    states = forward.hidden_states(any_tiny_model, input_ids)
    logits = any_tiny_model(input_ids).logits
    torch.testing.assert_close(forward.target_logits(any_tiny_model, states[-1]), logits)


def test_entropy_matches_float64_reference():
    model = tiny_model("llama", seed=3)
    input_ids = torch.randint(0, 128, (1, 16))
    last = forward.hidden_states(model, input_ids)[-1, 0]                 # (T, D)
    entropy, argmax = forward.entropy_and_argmax(model, last, chunk=5)
    logits64 = model(input_ids).logits[0].double()
    probs = logits64.softmax(-1)
    reference = -(probs * probs.log()).sum(-1)
    torch.testing.assert_close(entropy.double(), reference, atol=1e-5, rtol=1e-5)
    assert torch.equal(argmax, logits64.argmax(-1))


def test_padding_does_not_change_valid_states():
    model = tiny_model("llama")
    seqs = [{"input_ids": list(range(3, 13)), "loss_mask": [False] * 5 + [True] * 5},
            {"input_ids": list(range(20, 26)), "loss_mask": [True] * 6}]
    batch = store.capture_batch(model, seqs, 0, {3}, torch.float32)
    alone = store.capture_batch(model, seqs[1:], 1, {3}, torch.float32)
    torch.testing.assert_close(batch["hidden"][:, 10:], alone["hidden"], atol=1e-5, rtol=1e-4)
    assert batch["seq_index"].tolist() == [0] * 10 + [1] * 6
    assert batch["position"].tolist() == list(range(10)) + list(range(6))
    assert batch["special"].tolist()[:2] == [True, False]
    assert batch["loss_mask"].tolist() == seqs[0]["loss_mask"] + seqs[1]["loss_mask"]


def test_forward_with_states_orders_layers(any_tiny_model):
    input_ids = torch.randint(0, 128, (1, 7))
    states = forward.hidden_states(any_tiny_model, input_ids)
    logits, chosen, cache = forward.forward_with_states(any_tiny_model, (4, 1), input_ids)
    torch.testing.assert_close(chosen, torch.cat([states[4], states[1]], -1))
    assert cache.get_seq_length() == 7


def test_layer_out_of_range_is_refused():
    with pytest.raises(ValueError, match="layer index 5 out of range.*0..4"):
        forward.forward_with_states(tiny_model(), (1, 5), torch.zeros(1, 3, dtype=torch.long))


def test_target_logits_on_a_vocabulary_subset(any_tiny_model):
    states = forward.hidden_states(any_tiny_model, torch.randint(0, 128, (1, 6)))
    vocab_ids = torch.tensor([5, 0, 77, 127])
    full = forward.target_logits(any_tiny_model, states[-1])
    torch.testing.assert_close(forward.target_logits(any_tiny_model, states[-1], vocab_ids),
                               full[..., vocab_ids])


def test_valid_states_equal_stacked_gathered_then_converted(any_tiny_model):
    input_ids = torch.randint(0, 128, (2, 10))
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[1, 6:] = 0
    stacked = forward.hidden_states(any_tiny_model, input_ids, mask)[:, mask.bool()]
    states, last = forward.valid_states(any_tiny_model, input_ids, mask, torch.bfloat16)
    assert states.shape == (5, 16, 64) and states.dtype == torch.bfloat16
    assert torch.equal(states, stacked.to(torch.bfloat16))  # bit-identical stored values
    assert torch.equal(last, stacked[-1])


def test_forward_with_states_embedding_layer_and_kept_logits(any_tiny_model):
    input_ids = torch.randint(0, 128, (1, 7))
    states = forward.hidden_states(any_tiny_model, input_ids)
    logits, chosen, _ = forward.forward_with_states(any_tiny_model, (0, 2), input_ids,
                                                    logits_to_keep=1)
    torch.testing.assert_close(chosen, torch.cat([states[0], states[2]], -1))
    torch.testing.assert_close(logits, any_tiny_model(input_ids).logits[:, -1:])
