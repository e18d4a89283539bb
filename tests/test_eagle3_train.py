"""EAGLE-3 training: TTT unroll vs an explicit rollout, soft labels, training, resume."""
import csv

import pytest
import torch
from conftest import random_sequences, tiny_model, tiny_store

from actwave.capture.forward import hidden_states
from actwave.eagle3 import Eagle3Draft
from actwave.eagle3 import train as train_mod
from actwave.eagle3.ttt import ttt_attention_mask, unroll

LAYERS = (1, 2, 3)


def _tiny_store(path, model, n_sequences=8, seed=0):
    return tiny_store(path, model, random_sequences(n_sequences, seed))


def _naive_rollout(draft, fused, input_ids, steps):
    """Independent route: step i at index t re-run as one explicit causal sequence
    [step-0 inputs 0..t, step-1..i inputs at index t] with positions [0..t, t+1..t+i],
    feeding the previous step's output hidden explicitly; no custom mask, no cache."""
    width = input_ids.shape[0] - 1
    padded = torch.cat([input_ids, input_ids.new_zeros(steps)])
    logits = torch.zeros(steps, width, draft.config.draft_vocab_size)
    own_hidden = {}
    for step in range(steps):
        for t in range(width):
            later = range(1, step + 1)
            ids = [padded[s + 1] for s in range(t + 1)] + [padded[t + 1 + j] for j in later]
            hidden = [fused[s] for s in range(t + 1)] + [own_hidden[j - 1, t] for j in later]
            positions = list(range(t + 1)) + [t + j for j in range(1, step + 1)]
            out = draft(torch.stack(ids)[None], torch.stack(hidden)[None],
                        torch.tensor(positions)[None])
            logits[step, t] = out.logits[0, -1]
            own_hidden[step, t] = out.hidden[0, -1]
    return logits


def test_ttt_attention_mask_pattern():
    mask = ttt_attention_mask(3, 2, torch.float32)[0, 0] == 0
    expected = torch.tensor([[1, 0, 0, 1, 0, 0, 1, 0, 0],
                             [1, 1, 0, 0, 1, 0, 0, 1, 0],
                             [1, 1, 1, 0, 0, 1, 0, 0, 1]], dtype=torch.bool)
    assert torch.equal(mask, expected)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_unroll_matches_explicit_rollout(arch):
    target = tiny_model(arch)
    torch.manual_seed(1)
    draft = Eagle3Draft.from_target(target, LAYERS, draft_vocab_size=64).eval()
    input_ids = torch.randint(0, 128, (2, 9))
    states = torch.randn(2, 9, 3 * 64)
    with torch.no_grad():
        fused = draft.fuse(states)
        step_logits = unroll(draft, states, input_ids, ttt_steps=3)
        for row in range(2):
            naive = _naive_rollout(draft, fused[row], input_ids[row], 3)
            for step in range(3):
                torch.testing.assert_close(step_logits[step][row], naive[step],
                                           atol=1e-5, rtol=1e-5)


def test_soft_labels_match_target_forward():
    """Soft labels from the stored ℓ=N state == the target's own logits (Gemma3: softcap)."""
    target = tiny_model("gemma3", final_logit_softcapping=5.0)
    input_ids = torch.randint(0, 128, (2, 7))
    last = hidden_states(target, input_ids)[-1]  # (B, T, D)
    vocab_ids = torch.arange(0, 128, 3)
    probs = train_mod.target_draft_probs(target, last, vocab_ids)
    with torch.no_grad():
        expected = torch.softmax(target(input_ids).logits[..., vocab_ids], dim=-1)
    torch.testing.assert_close(probs, expected, atol=1e-5, rtol=1e-4)


def test_batch_indices_cover_each_epoch_and_split_ranks():
    """10 sequences, 2 per rank, 2 ranks: steps 0, 1 and rank 0 of step 2 are epoch 0."""
    rank0, rank1 = ([train_mod.batch_indices(10, 2, step, seed=3, rank=rank, world_size=2)
                     for step in range(3)] for rank in (0, 1))
    epoch0 = rank0[0] + rank1[0] + rank0[1] + rank1[1] + rank0[2]
    assert sorted(epoch0) == list(range(10))
    assert rank0[0] != rank1[0]
    assert train_mod.batch_indices(10, 2, 7, seed=3) == train_mod.batch_indices(10, 2, 7, seed=3)
    assert train_mod.batch_indices(10, 2, 7, seed=3) != train_mod.batch_indices(10, 2, 7, seed=4)


def _config(**overrides):
    values = dict(layer_ids=LAYERS, ttt_steps=3, lr=3e-3, warmup_steps=3, total_steps=60,
                  batch_size=4, max_seq_len=64, draft_vocab_size=64, checkpoint_every=30, seed=0)
    return train_mod.TrainConfig(**{**values, **overrides})


def test_training_reduces_loss_and_reloads(tmp_path):
    target = tiny_model("llama")
    with torch.no_grad():  # a peaked target, so the soft CE is far above its entropy floor
        target.lm_head.weight.mul_(20.0)
    (tmp_path / "store").mkdir()
    capture = _tiny_store(tmp_path / "store", target)
    result = train_mod.train_draft(capture, target, _config(), tmp_path / "run", progress=False,
                                   eval_store=capture)
    losses = [row["loss"] for row in result.history]
    assert len(losses) == 60
    assert sum(losses[-5:]) / 5 < 0.8 * sum(losses[:5]) / 5
    with (tmp_path / "run" / "history.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 60 and {"acc_0", "acc_2", "loss_1"} <= set(rows[0])
    assert 0.0 <= result.metrics["acc_0"] <= 1.0
    again = train_mod.train_draft(capture, target, _config(), tmp_path / "run", progress=False)
    for name, tensor in result.draft.trainable_state_dict().items():
        torch.testing.assert_close(again.draft.trainable_state_dict()[name], tensor)
    evaluated = train_mod.evaluate_draft(again.draft, capture, target, ttt_steps=3)
    assert evaluated["acc_0"] == pytest.approx(result.metrics["acc_0"], abs=1e-6)


def test_resume_equals_uninterrupted(tmp_path, monkeypatch):
    target = tiny_model("llama")
    (tmp_path / "store").mkdir()
    capture = _tiny_store(tmp_path / "store", target)
    config = _config(total_steps=8, checkpoint_every=4, warmup_steps=2)
    straight = train_mod.train_draft(capture, target, config, tmp_path / "straight", progress=False)

    original_row = train_mod.history_row

    def crash_after_checkpoint(step, *args):
        if step == 6:
            raise KeyboardInterrupt("simulated crash")
        return original_row(step, *args)

    monkeypatch.setattr(train_mod, "history_row", crash_after_checkpoint)
    with pytest.raises(KeyboardInterrupt):
        train_mod.train_draft(capture, target, config, tmp_path / "resumed", progress=False)
    assert (tmp_path / "resumed" / "checkpoints" / "step-0000004").is_dir()
    monkeypatch.setattr(train_mod, "history_row", original_row)
    resumed = train_mod.train_draft(capture, target, config, tmp_path / "resumed", progress=False)
    assert [r["loss"] for r in resumed.history] == [r["loss"] for r in straight.history]
    for name, tensor in straight.draft.trainable_state_dict().items():
        assert torch.equal(resumed.draft.trainable_state_dict()[name], tensor), name


def test_bad_config_values_raise():
    with pytest.raises(ValueError, match="dtype"):
        _config(dtype="float16")
    with pytest.raises(ValueError, match="warmup_steps"):
        _config(warmup_steps=60)


def test_bfloat16_autocast_trains_finite(tmp_path):
    target = tiny_model("gemma3")
    (tmp_path / "store").mkdir()
    capture = _tiny_store(tmp_path / "store", target, n_sequences=4)
    config = _config(total_steps=3, warmup_steps=1, checkpoint_every=3, dtype="bfloat16")
    result = train_mod.train_draft(capture, target, config, tmp_path / "run", progress=False)
    assert all(torch.isfinite(torch.tensor(row["loss"])) for row in result.history)
    assert result.draft.fc.weight.dtype == torch.float32  # fp32 master weights under autocast
