"""The capture store: resumable, byte-identical shards, clear errors on bad caches."""
import json
import shutil

import pytest
import torch
from conftest import tiny_model

from actwave.capture import store
from actwave.capture.regenerate import regenerate
from actwave.integrity import IntegrityError


@pytest.fixture(scope="module")
def tokenizer(smollm2):
    return smollm2[1]


@pytest.fixture
def tiny_target():
    return tiny_model("llama", vocab_size=49152)  # SmolLM2's vocabulary, random weights


def _config(**kw):
    base = dict(model="smollm2-135m", split="analysis", n_sequences=6, max_seq_len=40,
                batch_size=2, sequences_per_shard=2, seed=0)
    return store.CaptureConfig(**{**base, **kw})


def _fresh(config):
    shutil.rmtree(store.store_dir(config), ignore_errors=True)
    return config


def _shard_bytes(s):
    return [(s.path / sh["file"]).read_bytes() for sh in s.manifest["shards"]]


def test_interrupted_capture_resumes_to_identical_shards(tiny_target, tokenizer, monkeypatch):
    reference = store.run_capture(_fresh(_config(seed=101)), tiny_target, tokenizer, progress=False)
    reference_bytes = _shard_bytes(reference)
    config = _fresh(_config(seed=102))
    real_write, calls = store._write_shard, []

    def failing_write(path, columns):
        calls.append(path)
        if len(calls) == 2:
            raise KeyboardInterrupt("simulated interruption")
        return real_write(path, columns)
    monkeypatch.setattr(store, "_write_shard", failing_write)
    with pytest.raises(KeyboardInterrupt):
        store.run_capture(config, tiny_target, tokenizer, progress=False)
    partial = store.CaptureStore(store.store_dir(config), require_complete=False)
    assert not partial.complete and len(partial.manifest["shards"]) == 1
    with pytest.raises(ValueError, match="incomplete"):
        store.open_store(config)
    monkeypatch.setattr(store, "_write_shard", real_write)
    resumed = store.run_capture(config, tiny_target, tokenizer, progress=False)
    assert resumed.complete and len(calls) == 2  # the finished shard was not recomputed
    assert _shard_bytes(resumed) == reference_bytes


def test_store_columns_and_layer_slices(tiny_target, tokenizer):
    s = store.run_capture(_fresh(_config(seed=103)), tiny_target, tokenizer, progress=False)
    assert s.num_layers == 4 and s.hidden_size == 64
    n = s.n_tokens
    for name in store.COLUMNS:
        assert s.column(name).shape == (n,)
    assert s.column("loss_mask").any() and not s.column("loss_mask").all()
    assert s.column("special")[s.column("position") == 0].all()   # BOS-like first token
    full = torch.cat([sh["hidden"] for sh in s.iter_shards()], dim=1)
    picked = torch.cat([sh["hidden"] for sh in s.iter_shards(layers=[4, 0])], dim=1)
    assert full.shape == (5, n, 64) and full.dtype == torch.bfloat16
    assert torch.equal(picked, full[[4, 0]])
    with pytest.raises(ValueError, match="out of range"):
        next(s.iter_shards(layers=[5]))
    with pytest.raises(ValueError, match="unknown column"):
        s.column("logits")


def test_stale_and_corrupted_caches_are_refused(tiny_target, tokenizer):
    config = _fresh(_config(seed=104))
    s = store.run_capture(config, tiny_target, tokenizer, progress=False)
    manifest = json.loads((s.path / "manifest.json").read_text())
    manifest["complete"], manifest["dataset_hash"] = False, "0000"
    store.write_manifest(s.path, manifest)  # a consistent (checksummed) but stale record
    with pytest.raises(ValueError, match="stale capture cache"):
        store.run_capture(config, tiny_target, tokenizer, progress=False)
    (s.path / "manifest.json").write_text("{not json")
    with pytest.raises(IntegrityError, match="manifest.json: content expected valid JSON"):
        store.CaptureStore(s.path)
    good = store.run_capture(_fresh(_config(seed=105)), tiny_target, tokenizer, progress=False)
    (good.path / good.manifest["shards"][0]["file"]).write_bytes(b"garbage")
    with pytest.raises(IntegrityError, match="shard-00000.safetensors: size expected"):
        good.column("entropy")


def test_bad_config_values():
    with pytest.raises(ValueError, match="dtype='float8'"):
        store.CaptureConfig(dtype="float8")
    with pytest.raises(ValueError, match="n_sequences must be >= 1"):
        store.CaptureConfig(n_sequences=0)


def test_regenerated_source_stores_the_targets_own_replies(tiny_target, tokenizer):
    """The stored replies are the regenerated ones (whose tokens test_regenerate proves to be
    the target's greedy output): their decoded text is the regeneration's reply, and the
    first reply token is the target's argmax at the generation prompt. Later tokens are a
    re-tokenisation of the decoded text, which need not repeat the generated ids."""
    config = _fresh(_config(seed=106, n_sequences=3, max_seq_len=64, source="regenerated",
                            regen_new_tokens=8, sequences_per_shard=3))
    s = store.run_capture(config, tiny_target, tokenizer, progress=False)
    replies = [next(m["content"] for m in row["messages"] if m["role"] == "assistant")
               for row in regenerate(store.regen_config(config), progress=False)]
    ids, mask, argmax = s.column("input_ids"), s.column("loss_mask"), s.column("argmax")
    seq = s.column("seq_index")
    for index in range(s.manifest["n_sequences"]):
        reply = ((seq == index) & mask).nonzero().flatten()
        assert replies[index] and replies[index] in tokenizer.decode(ids[reply])
        assert ids[reply[0]] == argmax[reply[0] - 1]


def test_source_values_are_checked():
    with pytest.raises(ValueError, match="source='web'"):
        store.CaptureConfig(source="web")
    with pytest.raises(ValueError, match="regen_new_tokens=600"):
        store.CaptureConfig(source="regenerated", max_seq_len=512, regen_new_tokens=600)


def test_analysis_captures_match_notebook_01_keys():
    built = store.analysis_captures(["smollm2-135m"], n_sequences=8, max_seq_len=96, seed=0)
    direct = store.CaptureConfig(model="smollm2-135m", split="analysis", n_sequences=8,
                                 max_seq_len=96, seed=0)
    assert store.store_dir(built["smollm2-135m"]) == store.store_dir(direct)
