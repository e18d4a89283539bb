"""Fault injection: kills, corrupted files, concurrent writers, NaN, wrong inputs.

Each test breaks one thing the way it breaks in practice (SIGKILL of a real process, a
flipped byte on disk, two processes on one folder) and checks that nothing wrong is
cached: the outcomes are the README's "What survives what" table.
"""
import json
import math
import multiprocessing
import os
import shutil
import signal
import time

import pytest
import torch
from conftest import tiny_model
from safetensors.torch import load_file, save

from actwave.capture import store
from actwave.config import cache_dir
from actwave.eagle3 import Eagle3Draft
from actwave.eagle3 import train as train_mod
from actwave.integrity import IntegrityError, LockedError, WriterLock, bytes_record
from actwave.stats import analysis

FORK = multiprocessing.get_context("fork")  # children inherit the tiny models: no re-import
TRAIN = dict(layer_ids=(1, 2, 3), ttt_steps=2, total_steps=6, warmup_steps=1, batch_size=2,
             max_seq_len=40, draft_vocab_size=64, checkpoint_every=2, eval_sequences=2)


@pytest.fixture(scope="module")
def tokenizer(smollm2):
    return smollm2[1]


@pytest.fixture(scope="module")
def target():
    return tiny_model("llama", vocab_size=49152)  # SmolLM2's vocabulary, random weights


def _config(seed, **kw):
    config = store.CaptureConfig(**{**dict(model="smollm2-135m", split="analysis", n_sequences=6,
                                           max_seq_len=40, batch_size=2, sequences_per_shard=2,
                                           seed=seed), **kw})
    shutil.rmtree(store.store_dir(config), ignore_errors=True)
    return config


def _shard_bytes(s):
    return [(s.path / sh["file"]).read_bytes() for sh in s.manifest["shards"]]


def _flip_byte(path, from_end=64):
    """Flip one data byte in place (same size: only a checksum can tell)."""
    time.sleep(0.02)  # a new mtime, as any later write has
    with open(path, "r+b") as f:
        f.seek(-from_end, os.SEEK_END)
        byte = f.read(1)
        f.seek(-from_end, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0xFF]))


def _count_writes(monkeypatch, kill_after=None):
    """Wrap store._write_shard: count shard writes; SIGKILL this process after the n-th."""
    real, calls = store._write_shard, []

    def write(path, columns):
        record = real(path, columns)
        calls.append(path.name)
        if len(calls) == kill_after:
            os.kill(os.getpid(), signal.SIGKILL)
        return record
    monkeypatch.setattr(store, "_write_shard", write)
    return calls


def _single_threaded(function, *args):
    # A forked child that enters the parent's OpenMP pool hangs (libgomp): one thread.
    torch.set_num_threads(1)
    function(*args)


def _child(function, *args):
    """A forked process that runs ``function(*args)`` (started)."""
    process = FORK.Process(target=_single_threaded, args=(function, *args))
    process.start()
    return process


def _in_child(function, *args):
    """Run ``function(*args)`` in a forked process; -> its exit code."""
    process = _child(function, *args)
    process.join(120)
    if process.exitcode is None:
        process.kill()
    return process.exitcode


@pytest.fixture(scope="module")
def reference_store(target, tokenizer):
    """An uninterrupted capture (never modified by a test)."""
    return store.run_capture(_config(300), target, tokenizer, progress=False)


@pytest.fixture(scope="module")
def reference(reference_store):
    """The shard bytes every recovered store must equal."""
    return _shard_bytes(reference_store)


def _weights(draft):
    return {k: v.clone() for k, v in draft.trainable_state_dict().items()}


def _equal(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def trained(target, reference_store, tmp_path_factory):
    """A capture store and an uninterrupted training run on it: (store, weights, history)."""
    train_store = reference_store
    out = tmp_path_factory.mktemp("reference")
    result = train_mod.train_draft(train_store, target, train_mod.TrainConfig(**TRAIN), out,
                                   progress=False)
    return train_store, _weights(result.draft), result.history


# ----------------------------------------------------------------------------- kills
def _capture_killed(config, target, tokenizer, kill_after):
    _count_writes(pytest.MonkeyPatch(), kill_after=kill_after)
    store.run_capture(config, target, tokenizer, progress=False)


def test_kill_during_capture_resumes_bit_identical(target, tokenizer, reference, monkeypatch):
    config = _config(302)
    assert _in_child(_capture_killed, config, target, tokenizer, 2) == -signal.SIGKILL
    folder = store.store_dir(config)
    assert (folder / ".lock").exists()  # left by the killed writer: stale, taken over below
    calls = _count_writes(monkeypatch)
    resumed = store.run_capture(config, target, tokenizer, progress=False)
    assert calls == ["shard-00001.safetensors", "shard-00002.safetensors"]
    assert _shard_bytes(resumed) == reference and not (folder / ".lock").exists()


def _train_killed(train_store, target, out, kill_at_step):
    real = train_mod.save_checkpoint

    def save_then_die(out_dir, step, *args):
        real(out_dir, step, *args)
        if step == kill_at_step:
            os.kill(os.getpid(), signal.SIGKILL)
    train_mod.save_checkpoint = save_then_die
    train_mod.train_draft(train_store, target, train_mod.TrainConfig(**TRAIN), out,
                          progress=False)


def test_kill_during_training_resumes_bit_identical(target, trained, tmp_path):
    train_store, weights, history = trained
    assert _in_child(_train_killed, train_store, target, tmp_path, 4) == -signal.SIGKILL
    assert not (tmp_path / "config.json").exists()
    result = train_mod.train_draft(train_store, target, train_mod.TrainConfig(**TRAIN), tmp_path,
                                   progress=False)
    assert _equal(_weights(result.draft), weights)
    assert [row["loss"] for row in result.history] == [row["loss"] for row in history]


# ----------------------------------------------------------------------------- corruption
def test_corrupted_shard_is_refused_then_recaptured_alone(target, tokenizer, reference,
                                                         monkeypatch):
    config = _config(303)
    captured = store.run_capture(config, target, tokenizer, progress=False)
    _flip_byte(captured.path / "shard-00001.safetensors")
    reopened = store.CaptureStore(captured.path)
    with pytest.raises(IntegrityError, match=r"shard-00001.safetensors: sha256 expected [0-9a-f]"
                                             r"{64}, found [0-9a-f]{64}; repair: .*run_capture"):
        reopened.column("entropy")
    calls = _count_writes(monkeypatch)
    repaired = store.run_capture(config, target, tokenizer, progress=False)
    assert calls == ["shard-00001.safetensors"]
    assert _shard_bytes(repaired) == reference
    (captured.path / "manifest.json").write_text('{"complete": tr')
    with pytest.raises(IntegrityError, match="manifest.json: content expected valid JSON"):
        store.CaptureStore(captured.path)
    assert _shard_bytes(store.run_capture(config, target, tokenizer, progress=False)) == reference
    assert len(calls) == 4  # an unreadable manifest vouches for no shard: all recaptured


def test_corrupted_layer_stats_are_refused_then_recomputed(reference_store):
    captured = reference_store
    config = analysis.AnalysisConfig()
    first = analysis.compute_layer_stats(captured, config, progress=False, name="faults")
    folder = next((cache_dir() / "layer_stats").glob("faults-*"))
    _flip_byte(folder / "stats.safetensors")
    with pytest.raises(IntegrityError,
                       match="stats.safetensors: sha256 expected .*compute_layer_stats"):
        analysis.load_layer_stats(folder)
    again = analysis.compute_layer_stats(captured, config, progress=False, name="faults")
    assert torch.allclose(again.cka, first.cka, rtol=1e-12, atol=0)
    assert torch.allclose(again.entropy, first.entropy, rtol=1e-12, atol=0)


def test_corrupted_checkpoint_is_refused_and_a_missing_tensor_too(target, trained, tmp_path):
    train_store, weights, _ = trained
    config = train_mod.TrainConfig(**TRAIN)
    assert _in_child(_train_killed, train_store, target, tmp_path, 4) == -signal.SIGKILL
    checkpoint = tmp_path / "checkpoints" / "step-0000004"
    state = load_file(checkpoint / "state.safetensors")
    del state["draft.fc.weight"]
    data = save(state)
    (checkpoint / "state.safetensors").write_bytes(data)
    meta = json.loads((checkpoint / "meta.json").read_text())
    (checkpoint / "meta.json").write_text(json.dumps({**meta, "state": bytes_record(data)}))
    with pytest.raises(IntegrityError, match=r"missing \['fc.weight'\]; repair: delete"):
        train_mod.train_draft(train_store, target, config, tmp_path, progress=False)
    _flip_byte(checkpoint / "state.safetensors")
    with pytest.raises(IntegrityError, match=r"state.safetensors: sha256 expected .* delete"):
        train_mod.train_draft(train_store, target, config, tmp_path, progress=False)
    shutil.rmtree(checkpoint)  # the repair the message names
    result = train_mod.train_draft(train_store, target, config, tmp_path, progress=False)
    assert _equal(_weights(result.draft), weights)


def test_corrupted_draft_is_refused_then_rebuilt_from_its_checkpoint(target, trained, tmp_path):
    train_store, weights, _ = trained
    config = train_mod.TrainConfig(**TRAIN)
    train_mod.train_draft(train_store, target, config, tmp_path, progress=False)
    _flip_byte(tmp_path / "draft" / "model.safetensors")
    with pytest.raises(IntegrityError, match="model.safetensors: sha256 expected .*train_draft"):
        Eagle3Draft.load(tmp_path / "draft", target)
    rebuilt = train_mod.train_draft(train_store, target, config, tmp_path, progress=False)
    assert _equal(_weights(rebuilt.draft), weights)
    assert _equal(_weights(Eagle3Draft.load(tmp_path / "draft", target)), weights)


# ----------------------------------------------------------------------------- concurrency
def _capture_counted(config, target, tokenizer, log_path):
    calls = _count_writes(pytest.MonkeyPatch())
    store.run_capture(config, target, tokenizer, progress=False)
    log_path.write_text(str(len(calls)))


def test_two_concurrent_capture_writers(target, tokenizer, reference, tmp_path):
    config = _config(305)
    processes = [_child(_capture_counted, config, target, tokenizer, tmp_path / f"writer{i}")
                 for i in range(2)]
    for process in processes:
        process.join(120)
    assert [p.exitcode for p in processes] == [0, 0]
    # one captured every shard; the other waited on the lock and found the store finished
    assert sorted(int((tmp_path / f"writer{i}").read_text()) for i in range(2)) == [0, 3]
    finished = store.open_store(config)
    assert _shard_bytes(finished) == reference
    assert sorted(p.name for p in finished.path.iterdir()) == [
        "manifest.json", "shard-00000.safetensors", "shard-00001.safetensors",
        "shard-00002.safetensors"]


def _hold_lock(folder, seconds):
    with WriterLock(folder):
        time.sleep(seconds)


def test_lock_names_its_holder_and_stale_locks_are_taken_over(tmp_path):
    holder = _child(_hold_lock, tmp_path, 3.0)
    # the lock file is created first and filled right after: wait until it names its holder
    while not (tmp_path / ".lock").exists() or not (tmp_path / ".lock").read_text():
        time.sleep(0.05)
    with pytest.raises(LockedError, match=rf"being written by pid {holder.pid} on host"):
        WriterLock(tmp_path, timeout=0).__enter__()
    holder.kill()  # dies holding the lock
    holder.join()
    assert (tmp_path / ".lock").exists()
    with WriterLock(tmp_path, timeout=0):
        assert json.loads((tmp_path / ".lock").read_text())["pid"] == os.getpid()
    assert not (tmp_path / ".lock").exists()
    (tmp_path / ".lock").write_text("")  # a writer died between creating and filling it
    with pytest.raises(LockedError):
        WriterLock(tmp_path, timeout=0).__enter__()  # young: perhaps still being written
    os.utime(tmp_path / ".lock", (time.time() - 120, time.time() - 120))
    with WriterLock(tmp_path, timeout=0):
        pass


# ----------------------------------------------------------------------------- NaN
def test_nan_stops_training_and_nothing_is_saved_complete(target, trained, tmp_path,
                                                         monkeypatch):
    train_store, weights, _ = trained
    config = train_mod.TrainConfig(**TRAIN)
    real, steps = train_mod.make_batch, []

    def poisoned(*args):
        batch = real(*args)
        steps.append(1)
        if len(steps) == 3:  # training step 3: after the step-2 checkpoint
            batch["target_states"] = torch.full_like(batch["target_states"], math.nan)
        return batch
    monkeypatch.setattr(train_mod, "make_batch", poisoned)
    with pytest.raises(FloatingPointError, match=r"step 3: non-finite loss .*step-0000002"):
        train_mod.train_draft(train_store, target, config, tmp_path, progress=False)
    assert not (tmp_path / "config.json").exists() and not (tmp_path / "draft").exists()
    kept = load_file(tmp_path / "checkpoints" / "step-0000002" / "state.safetensors")
    assert all(torch.isfinite(v).all() for v in kept.values() if v.is_floating_point())
    monkeypatch.setattr(train_mod, "make_batch", real)
    resumed = train_mod.train_draft(train_store, target, config, tmp_path, progress=False)
    assert _equal(_weights(resumed.draft), weights)


@pytest.mark.parametrize("bad", [dict(grad_clip=math.nan), dict(lr=math.inf), dict(gamma=math.nan),
                                 dict(betas=(0.9, 1.0)), dict(weight_decay=-1.0),
                                 dict(total_steps=6.0), dict(layer_ids=(1, 2.7)),
                                 dict(layer_ids=(True, 2)), dict(layer_ids=("2",)),
                                 dict(layer_ids=None), dict(layer_ids=3)])
def test_train_config_refuses_bad_numbers(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        train_mod.TrainConfig(**{**TRAIN, **bad})


# ----------------------------------------------------------------------------- wrong inputs
def test_wrong_model_for_a_capture_config_is_refused(target, tokenizer, reference):
    gemma = tiny_model("gemma3", vocab_size=49152)
    gemma.name_or_path = "gemma3-270m"
    with pytest.raises(ValueError, match="model 'gemma3-270m' was passed with a capture config "
                                         "for 'smollm2-135m'"):
        store.run_capture(_config(306), gemma, tokenizer, progress=False)
    with pytest.raises(ValueError, match=r"torch.bfloat16 but config.dtype='float32'"):
        store.run_capture(_config(306), tiny_model("llama", vocab_size=49152).bfloat16(),
                          tokenizer, progress=False)
    config = _config_kept(300)
    other = tiny_model("llama", seed=1, vocab_size=49152)  # same shapes, other weights
    with pytest.raises(ValueError, match="made with another model .*weights_sha256"):
        store.run_capture(config, other, tokenizer, progress=False)
    assert _shard_bytes(store.open_store(config)) == reference


def _config_kept(seed):
    """The config of an existing store (``_config`` would delete it)."""
    return store.CaptureConfig(model="smollm2-135m", split="analysis", n_sequences=6,
                               max_seq_len=40, batch_size=2, sequences_per_shard=2, seed=seed)


def test_finished_draft_from_another_store_is_refused(target, trained, tmp_path):
    train_store, _, _ = trained
    config = train_mod.TrainConfig(**TRAIN)
    train_mod.train_draft(train_store, target, config, tmp_path / "run", progress=False)
    other = shutil.copytree(train_store.path, tmp_path / "other")
    manifest = json.loads((other / "manifest.json").read_text())
    (other / "manifest.json").write_text(json.dumps({**manifest, "config_hash": "another"}))
    with pytest.raises(IntegrityError, match="manifest.json: record_sha256 expected"):
        store.CaptureStore(other)  # an edit without its checksum
    store.write_manifest(other, {**manifest, "config_hash": "another"})  # another store's digest
    with pytest.raises(ValueError, match="holds a draft trained on capture store"):
        train_mod.train_draft(store.CaptureStore(other), target, config, tmp_path / "run",
                              progress=False)


@pytest.mark.parametrize("ids", [[[5, 49152]], [[-1, 5]], [[5.0, 6.0]]])
def test_generate_refuses_token_ids_outside_the_vocabulary(target, ids):
    from actwave.decoding import speculative

    draft = Eagle3Draft.from_target(target, (1, 2, 3), 64)
    with pytest.raises(ValueError, match=r"token ids in 0..49151"):
        speculative.generate(target, draft, torch.tensor(ids), 4)


@pytest.mark.parametrize("layers", [(1, 2.7), (True, 2), ("2",)])
def test_drafts_and_stores_refuse_layer_ids_that_are_not_ints(target, reference_store, layers):
    with pytest.raises(ValueError, match="element must be an int"):
        Eagle3Draft.from_target(target, layers, 64)
    with pytest.raises(ValueError, match="element must be an int"):
        next(reference_store.iter_shards(layers=layers))


def test_a_killed_but_unreaped_holder_is_dead():
    """A lock held by a killed process its parent has not reaped (a zombie) is stale."""
    import subprocess
    import time

    from actwave.integrity import _alive

    child = subprocess.Popen(["sleep", "30"])
    assert _alive(child.pid)
    child.kill()
    time.sleep(0.2)  # killed, not yet waited for: a zombie
    assert not _alive(child.pid)
    child.wait()
