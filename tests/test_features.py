"""Cached target features (``eagle3.features``): the same batches as online training, resumable
chunked writes, checksums, layer subsets and refusals."""
import pytest
import torch
from conftest import random_sequences, tiny_model

from actwave.capture.forward import forward_with_states
from actwave.decoding.acceptance import sequence_acceptance
from actwave.eagle3 import features as features_mod
from actwave.eagle3.features import FeatureConfig, TargetFeatures, open_features, train_from_features
from actwave.eagle3.online import OnlineSource, online_batch, train_online
from actwave.eagle3.train import TrainConfig, make_batch, new_draft
from actwave.integrity import IntegrityError

LAYERS = (1, 2, 3)


def _source(n=7, seed=0) -> OnlineSource:
    return OnlineSource.from_sequences(random_sequences(n, seed), f"online-{seed}", "test")


def _config(**changes) -> TrainConfig:
    values = dict(layer_ids=LAYERS, ttt_steps=2, total_steps=6, warmup_steps=1, batch_size=2,
                  max_seq_len=32, draft_vocab_size=64, checkpoint_every=3, eval_sequences=1)
    return TrainConfig(**{**values, **changes})


def test_batches_equal_online_batches(tmp_path):
    target, source = tiny_model("llama"), _source()
    cached = open_features(source, target, FeatureConfig((3, 1, 2), "float32", batch_size=3,
                                                         sequences_per_chunk=4),
                           tmp_path, progress=False)
    assert cached.layers == (1, 2, 3, 4) and len(cached) == len(source)  # ℓ = N = 4 added
    data = cached.train_data(LAYERS)
    draft = new_draft(target, data, _config())
    for indices in ([0, 1], [5, 2, 6]):
        stored = make_batch(data, indices, target, draft, torch.device("cpu"))
        online = online_batch(source, indices, target, draft, torch.device("cpu"))
        assert stored.keys() == online.keys()
        valid = torch.zeros_like(online["input_ids"], dtype=torch.bool)  # (B, L)
        for row, i in enumerate(indices):
            valid[row, : source.input_ids[i].numel()] = True
        for name, tensor in online.items():
            # padding positions are never trained; their soft labels differ by route
            torch.testing.assert_close(stored[name][valid], tensor[valid], rtol=1e-5,
                                       atol=1e-5, msg=name)
        assert torch.equal(stored["label_mask"], online["label_mask"])


def test_scoring_inputs_are_the_single_sequence_forward(tmp_path):
    """Batch 1: each stored sequence is exactly its own unpadded forward, so a score from
    features equals the score with the target run per sequence."""
    target, source = tiny_model("qwen3"), _source(4, seed=2)
    data = open_features(source, target, FeatureConfig(LAYERS, "float32", batch_size=1),
                         tmp_path, progress=False).train_data(LAYERS)
    draft = new_draft(target, data, _config())
    for i in range(len(source)):
        logits, states, _ = forward_with_states(target, LAYERS, source.input_ids[i][None])
        assert torch.equal(data.target_states[i], states[0])
        assert torch.equal(data.argmax[i], logits[0].argmax(-1))
        direct = sequence_acceptance(draft, states[0], source.input_ids[i], logits[0].argmax(-1),
                                     source.loss_mask[i], depth=2)
        cached = sequence_acceptance(draft, data.target_states[i], data.input_ids[i],
                                     data.argmax[i], data.loss_mask[i], depth=2)
        assert torch.equal(direct.accepted, cached.accepted)


def test_training_from_features_tracks_online_training(tmp_path):
    target, source = tiny_model("llama"), _source()
    cached = open_features(source, target, FeatureConfig(LAYERS, "float32", batch_size=2),
                           tmp_path / "f", progress=False)
    stored = train_from_features(cached, target, _config(), tmp_path / "stored", progress=False)
    online = train_online(source, target, _config(), tmp_path / "online", progress=False)
    assert [r["loss"] for r in stored.history] == pytest.approx(
        [r["loss"] for r in online.history], rel=1e-4)
    again = train_from_features(cached, target, _config(), tmp_path / "stored", progress=False)
    assert again.history == stored.history  # finished: loaded, not retrained


def test_interrupted_write_resumes_and_equals_one_pass(tmp_path, monkeypatch):
    target, source = tiny_model("llama"), _source(9)
    config = FeatureConfig(LAYERS, sequences_per_chunk=2, batch_size=2)
    whole = features_mod.compute_features(source, target, config, tmp_path / "a", progress=False)
    original, calls = features_mod._chunk_columns, []

    def crash(*args):
        if len(calls) == 2:
            raise KeyboardInterrupt("simulated crash")
        calls.append(args[1])
        return original(*args)
    monkeypatch.setattr(features_mod, "_chunk_columns", crash)
    with pytest.raises(KeyboardInterrupt):
        features_mod.compute_features(source, target, config, tmp_path / "b", progress=False)
    monkeypatch.setattr(features_mod, "_chunk_columns", original)
    resumed = features_mod.compute_features(source, target, config, tmp_path / "b",
                                            progress=False)
    a, b = TargetFeatures(whole, source), TargetFeatures(resumed, source)
    assert [c["sha256"] for c in a.record["chunks"]] == [c["sha256"] for c in b.record["chunks"]]
    assert len(a.record["chunks"]) == 5 and a.digest == b.digest


def test_digest_ignores_the_layer_union_but_not_the_values(tmp_path):
    target, source = tiny_model("llama"), _source(3)
    small = open_features(source, target, FeatureConfig((1, 2)), tmp_path, progress=False)
    large = open_features(source, target, FeatureConfig((0, 1, 3)), tmp_path, progress=False)
    assert small.folder != large.folder and small.digest == large.digest
    subset = open_features(source, target, FeatureConfig((3, 0)), tmp_path, progress=False)
    assert subset.folder == large.folder  # found, not computed again
    assert len(list(tmp_path.glob("features-*"))) == 2
    fp32 = open_features(source, target, FeatureConfig((1, 2), "float32"), tmp_path,
                         progress=False)
    other = open_features(source, tiny_model("llama", seed=1), FeatureConfig((1, 2)), tmp_path,
                          progress=False)
    assert len({small.digest, fp32.digest, other.digest}) == 3
    assert torch.equal(small.train_data((1,)).target_states[1],
                       large.train_data((1,)).target_states[1])


def test_bad_layers_targets_sources_and_bytes_are_refused(tmp_path):
    target, source = tiny_model("llama"), _source(3)
    with pytest.raises(ValueError, match="layer"):
        open_features(source, target, FeatureConfig((1, 9)), tmp_path, progress=False)
    with pytest.raises(ValueError, match="at least one layer"):
        FeatureConfig(())
    with pytest.raises(ValueError, match="storage_dtype"):
        FeatureConfig((1,), storage_dtype="int8")
    cached = open_features(source, target, FeatureConfig((1, 2)), tmp_path, progress=False)
    with pytest.raises(ValueError, match=r"layers \[3\] are not in features"):
        cached.train_data((1, 3))
    with pytest.raises(ValueError, match="were computed by"):
        train_from_features(cached, tiny_model("llama", seed=1), _config(layer_ids=(1, 2)),
                            tmp_path / "run", progress=False)
    with pytest.raises(ValueError, match="were computed from online-0"):
        TargetFeatures(cached.folder, _source(3, seed=5))
    chunk = cached.folder / cached.record["chunks"][0]["file"]
    data = bytearray(chunk.read_bytes())
    data[-1] ^= 0xFF
    chunk.write_bytes(bytes(data))
    with pytest.raises(IntegrityError, match="sha256"):
        TargetFeatures(cached.folder, source).train_data((1,))
