"""Fault injection: kills, corrupted files, concurrent writers, NaN, wrong inputs.

Each test breaks one thing the way it breaks in practice (SIGKILL of a real process, a
flipped byte on disk, two processes on one folder) and checks that nothing wrong is
cached: the outcomes are the table of docs/FAULTS.md.
"""
import errno
import json
import math
import os
import shutil
import signal
import socket
import time

import pytest
import torch
from conftest import FORK, forked, hold_lock, tiny_model, wait_for_lock_record
from safetensors.torch import load_file, save

from actwave.capture import store
from actwave.config import cache_dir
from actwave.eagle3 import Eagle3Draft
from actwave.eagle3 import checkpoint as checkpoint_mod
from actwave.eagle3 import train as train_mod
from actwave.integrity import IntegrityError, LockedError, WriterLock, bytes_record
from actwave.stats import analysis

# The draft vocabulary is the whole target vocabulary: the random target's argmax tokens are
# not among the few reply tokens, and the loss counts only argmaxes the draft can propose, so
# a smaller one gives loss 0 at every step and weights that never change.
TRAIN = dict(layer_ids=(1, 2, 3), ttt_steps=2, total_steps=6, warmup_steps=1, batch_size=2,
             max_seq_len=40, draft_vocab_size=49152, checkpoint_every=2, eval_sequences=2)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One intra-op thread in this module. With two, a run checkpointed by a forked child
    and resumed by the parent differed from the uninterrupted reference in the last bits on
    an AVX-512/AMX Xeon (not on an AMD EPYC): a threading difference between parent and
    forked child, not the resume. With one thread both compute alike."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


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


def _in_child(function, *args):
    """Run ``function(*args)`` in a forked process; -> its exit code."""
    process = forked(function, *args)
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
    """A capture store and an uninterrupted training run on it: (store, weights, history,
    {checkpoint step: weights})."""
    train_store = reference_store
    out = tmp_path_factory.mktemp("reference")
    snapshots, real = {}, train_mod.save_checkpoint

    def save_and_keep(out_dir, step, draft, *args):
        snapshots[step] = _weights(draft)
        return real(out_dir, step, draft, *args)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(train_mod, "save_checkpoint", save_and_keep)
        result = train_mod.train_draft(train_store, target, train_mod.TrainConfig(**TRAIN), out,
                                       progress=False)
    return train_store, _weights(result.draft), result.history, snapshots


def test_training_has_a_signal(trained):
    """Without a loss the resume tests below would compare untouched initial weights."""
    _, weights, history, snapshots = trained
    assert all(row["loss"] > 1.0 and row["loss_1"] > 0 for row in history)
    assert history[-1]["loss"] < history[0]["loss"]
    assert sorted(snapshots) == [2, 4, 6] and _equal(snapshots[6], weights)
    floats = [name for name, value in weights.items() if value.is_floating_point()]
    assert len(floats) > 10
    for earlier, later in ((2, 4), (4, 6)):
        assert not [name for name in floats
                    if torch.equal(snapshots[earlier][name], snapshots[later][name])]


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


def _numbers(history):
    """Per-step losses, agreements, lr and tokens (not the wall-clock seconds)."""
    return [{k: v for k, v in row.items() if k != "seconds"} for row in history]


def test_kill_during_training_resumes_bit_identical(target, trained, tmp_path):
    train_store, weights, history, snapshots = trained
    assert _in_child(_train_killed, train_store, target, tmp_path, 4) == -signal.SIGKILL
    assert not (tmp_path / "config.json").exists()
    kept = load_file(tmp_path / "checkpoints" / "step-0000004" / "state.safetensors")
    assert _equal({k.removeprefix("draft."): v for k, v in kept.items()
                   if k.startswith("draft.")}, snapshots[4])
    assert not _equal(snapshots[4], weights)  # the resumed steps 5-6 have work to do
    result = train_mod.train_draft(train_store, target, train_mod.TrainConfig(**TRAIN), tmp_path,
                                   progress=False)
    assert _equal(_weights(result.draft), weights)
    assert _numbers(result.history) == _numbers(history)


def test_disk_full_during_a_checkpoint_leaves_no_temp_folder(target, trained, tmp_path,
                                                             monkeypatch):
    train_store, weights, history, _ = trained
    config, real = train_mod.TrainConfig(**TRAIN), checkpoint_mod.atomic_write_json

    def disk_full_at_step_4(path, obj):
        if path.parent.name.startswith(".tmp-step-0000004-"):
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real(path, obj)
    monkeypatch.setattr(checkpoint_mod, "atomic_write_json", disk_full_at_step_4)
    with pytest.raises(OSError, match="No space left on device"):
        train_mod.train_draft(train_store, target, config, tmp_path, progress=False)
    checkpoints = tmp_path / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step-0000002"]
    # a SIGKILL mid-write runs no cleanup: the next start removes what it left
    leftover = checkpoints / ".tmp-step-0000004-killed"
    leftover.mkdir()
    (leftover / "state.safetensors").write_bytes(b"half a checkpoint")
    monkeypatch.setattr(checkpoint_mod, "atomic_write_json", real)
    result = train_mod.train_draft(train_store, target, config, tmp_path, progress=False)
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step-0000006"]
    assert _equal(_weights(result.draft), weights)
    assert _numbers(result.history) == _numbers(history)


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
    train_store, weights, _, _ = trained
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
    train_store, weights, _, _ = trained
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
    processes = [forked(_capture_counted, config, target, tokenizer, tmp_path / f"writer{i}")
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


def test_a_live_holder_is_named_and_a_dead_one_releases_the_lock(tmp_path):
    holder = forked(hold_lock, tmp_path, 30.0)
    wait_for_lock_record(tmp_path / ".lock")
    with pytest.raises(LockedError, match=rf"being written by pid {holder.pid} on host "
                                          rf".*lock file {tmp_path / '.lock'}"):
        WriterLock(tmp_path, timeout=0).__enter__()
    holder.kill()  # dies holding the lock: the kernel releases it, the record stays
    holder.join()
    assert json.loads((tmp_path / ".lock").read_text())["pid"] == holder.pid
    with WriterLock(tmp_path, timeout=0):
        assert json.loads((tmp_path / ".lock").read_text())["pid"] == os.getpid()
        with pytest.raises(LockedError, match="nested writers"):
            WriterLock(tmp_path, timeout=0).__enter__()
    assert not (tmp_path / ".lock").exists()


def test_foreign_records_follow_the_kernel_lock(tmp_path):
    """The rule (docs/FAULTS.md): a record nobody flocks is overwritten whatever host or
    pid it names; a held lock blocks whatever its record says, and a timeout names it."""
    (tmp_path / ".lock").write_text(json.dumps({"pid": os.getpid(), "host": "other-node"}))
    with WriterLock(tmp_path, timeout=0):  # a reused pid / another host's leftover: taken
        assert json.loads((tmp_path / ".lock").read_text())["host"] != "other-node"
    (tmp_path / ".lock").write_text("")  # a writer died between locking and recording
    with WriterLock(tmp_path, timeout=0):
        pass
    holder = forked(hold_lock, tmp_path, 30.0)
    try:
        wait_for_lock_record(tmp_path / ".lock")
        # as a holder on another NFS client would write it: only the record names the host
        (tmp_path / ".lock").write_text(json.dumps({"pid": 4242, "host": "other-node"}))
        tic = time.monotonic()
        with pytest.raises(LockedError, match=r"by pid 4242 on host 'other-node' \(lock file "
                                              r".*\.lock\); waited 0\.[3-9]"):
            WriterLock(tmp_path, timeout=0.3, poll=0.05).__enter__()
        assert time.monotonic() - tic < 5
    finally:
        holder.kill()
        holder.join()


def _race(folder, barrier, rounds, log_path):
    """Per round: meet the other takers, take the round's lock, log enter/exit around a
    short critical section."""
    for round_ in range(rounds):
        barrier.wait()
        with WriterLock(folder / f"round-{round_:03d}", poll=0.001):
            with open(log_path, "a") as f:
                f.write(f"{round_} enter {os.getpid()}\n")
                f.flush()
                time.sleep(0.002)  # a window in which a second writer would show
                f.write(f"{round_} exit {os.getpid()}\n")


def test_lock_race_admits_one_writer_at_a_time(tmp_path):
    """100 rounds of 4 processes released at once onto a lock left by another process
    (the unlink+create takeover let two in, 2-3 times in 100)."""
    rounds, takers = 100, 4
    for round_ in range(rounds):  # a leftover record of a dead writer of this host
        (tmp_path / f"round-{round_:03d}").mkdir()
        (tmp_path / f"round-{round_:03d}" / ".lock").write_text(
            json.dumps({"pid": 999_999_999, "host": socket.gethostname()}))
    barrier, log_path = FORK.Barrier(takers), tmp_path / "log"
    processes = [forked(_race, tmp_path, barrier, rounds, log_path) for _ in range(takers)]
    for process in processes:
        process.join(300)
    assert [p.exitcode for p in processes] == [0] * takers
    lines = log_path.read_text().split("\n")[:-1]
    assert len(lines) == 2 * rounds * takers
    for enter, leave in zip(lines[::2], lines[1::2]):  # strictly enter, exit of the same writer
        assert enter.split()[1] == "enter" and leave == enter.replace("enter", "exit")


# ----------------------------------------------------------------------------- NaN
def test_nan_stops_training_and_nothing_is_saved_complete(target, trained, tmp_path,
                                                         monkeypatch):
    train_store, weights, _, _ = trained
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


def test_nan_in_the_eval_store_is_never_marked_complete(target, trained, tmp_path):
    train_store = trained[0]
    eval_path = shutil.copytree(train_store.path, tmp_path / "eval")
    manifest = json.loads((eval_path / "manifest.json").read_text())
    manifest.pop("record_sha256")
    shard = manifest["shards"][0]  # the eval_sequences=2 scored sequences
    columns = load_file(eval_path / shard["file"])
    columns["hidden"] = torch.full_like(columns["hidden"], math.nan)
    shard.update(store._write_shard(eval_path / shard["file"], columns))  # a valid checksum
    store.write_manifest(eval_path, manifest)  # and a valid record: only the values are bad
    with pytest.raises(FloatingPointError, match=r"held-out evaluation at step 2: loss_0 = nan "
                                                 r".*nothing is marked complete"):
        train_mod.train_draft(train_store, target, train_mod.TrainConfig(**TRAIN),
                              tmp_path / "run", progress=False,
                              eval_store=store.CaptureStore(eval_path))
    assert not (tmp_path / "run" / "config.json").exists()
    assert not (tmp_path / "run" / "draft").exists()


@pytest.mark.parametrize("bad", [dict(grad_clip=math.nan), dict(lr=math.inf), dict(gamma=math.nan),
                                 dict(betas=(0.9, 1.0)), dict(weight_decay=-1.0),
                                 dict(total_steps=6.0), dict(layer_ids=(1, 2.7)),
                                 dict(layer_ids=(True, 2)), dict(layer_ids=("2",)),
                                 dict(layer_ids=None), dict(layer_ids=3)])
def test_train_config_refuses_bad_numbers(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        train_mod.TrainConfig(**{**TRAIN, **bad})


def _stage_configs():
    """(config class, valid keyword arguments) of every stage config."""
    from actwave.capture.regenerate import RegenConfig
    from actwave.decoding.evaluate import EvalConfig
    from actwave.eagle3.config import Eagle3Config
    from actwave.stats.selection_report import SelectionConfig
    from actwave.stats.sensitivity import BootstrapConfig
    from actwave.study.longrun import LongRunConfig
    from actwave.study.runs import StudyConfig

    study = dict(model="tiny", seed=0, eval_sequences=4, eval_new_tokens=8, depth=2,
                 capture=store.CaptureConfig(n_sequences=8, max_seq_len=32, regen_new_tokens=8,
                                             source="regenerated"),
                 train=train_mod.TrainConfig(total_steps=3, warmup_steps=1, ttt_steps=2,
                                             max_seq_len=32, draft_vocab_size=64),
                 tree_top_k=3, n_random=6, n_seeds=3, extra_k="2,4", curve_factor=2)
    eagle = dict(layer_ids=(1, 2), target_hidden_size=64, hidden_size=64, intermediate_size=128,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6,
                 target_vocab_size=128, draft_vocab_size=64)
    return {"CaptureConfig": (store.CaptureConfig, {}), "EvalConfig": (EvalConfig, {}),
            "RegenConfig": (RegenConfig, dict(model="m", n_conversations=2, max_prompt_len=8,
                                              max_new_tokens=4)),
            "TrainConfig": (train_mod.TrainConfig, dict(layer_ids=(1, 2))),
            "Eagle3Config": (Eagle3Config, eagle), "AnalysisConfig": (analysis.AnalysisConfig, {}),
            "SelectionConfig": (SelectionConfig, {}), "BootstrapConfig": (BootstrapConfig, {}),
            "StudyConfig": (StudyConfig, study),
            "LongRunConfig": (LongRunConfig, dict(model="tiny"))}


@pytest.mark.parametrize("name, bad, message", [
    ("CaptureConfig", dict(n_sequences=2.5), "n_sequences must be an int, got 2.5"),
    ("CaptureConfig", dict(n_sequences=True), "n_sequences must be an int, got True"),
    ("CaptureConfig", dict(seed=1.5), "seed must be an int, got 1.5"),
    ("CaptureConfig", dict(split="test"), "split='test'; allowed"),
    ("CaptureConfig", dict(model=None), "model must be a str"),
    ("EvalConfig", dict(n_bootstrap=0), "n_bootstrap must be >= 1, got 0"),
    ("EvalConfig", dict(mode="beam"), "mode='beam'; allowed: \\['chain', 'tree'\\]"),
    ("EvalConfig", dict(peers="yes"), "peers must be True or False"),
    ("EvalConfig", dict(benchmarks=("mtbench", "gsm8k")), "benchmarks element='gsm8k'"),
    ("RegenConfig", dict(max_new_tokens=4.0), "max_new_tokens must be an int"),
    ("RegenConfig", dict(seed=-1), "seed must be >= 0"),
    ("TrainConfig", dict(lm_head_init="zeros"), "lm_head_init='zeros'; allowed"),
    ("TrainConfig", dict(eval_sequences=True), "eval_sequences must be an int"),
    ("Eagle3Config", dict(rms_norm_eps=math.nan), "rms_norm_eps must be a finite number"),
    ("Eagle3Config", dict(head_dim=16.0), "head_dim must be an int"),
    ("Eagle3Config", dict(rope_parameters=None), "rope_parameters must be a dict"),
    ("AnalysisConfig", dict(filter_value=math.inf), "filter_value must be a finite number"),
    ("AnalysisConfig", dict(max_tokens=1e4), "max_tokens must be an int"),
    ("SelectionConfig", dict(dpp_theta=0.0), r"dpp_theta must be > 0.0"),
    ("BootstrapConfig", dict(resolutions=(0.5, math.nan)), "resolutions element must be a finite"),
    ("StudyConfig", dict(eval_sequences=0), "eval_sequences must be >= 1, got 0"),
    ("StudyConfig", dict(depth=3), "depth=3 exceeds train.ttt_steps=2"),
    ("StudyConfig", dict(eval_new_tokens=32), r"regen_new_tokens=32 must lie in 1..max_seq_len"),
    ("LongRunConfig", dict(multipliers=(1, 4.0)), "multipliers element must be an int"),
    ("LongRunConfig", dict(decay_fraction=0.0), r"decay_fraction must lie in \(0.0, 1.0\]"),
])
def test_stage_configs_refuse_wrong_types_and_ranges(name, bad, message):
    cls, valid = _stage_configs()[name]
    cls(**valid)  # the valid arguments pass
    with pytest.raises(ValueError, match=message):
        cls(**{**valid, **bad})


def test_every_stage_config_is_checked_field_by_field():
    """Each stage config refuses a float posing as every one of its int fields."""
    import dataclasses
    import typing

    for name, (cls, valid) in _stage_configs().items():
        instance = cls(**valid)
        hints = typing.get_type_hints(cls)
        ints = [f.name for f in dataclasses.fields(cls) if hints[f.name] is int]
        assert ints, name
        for field in ints:
            with pytest.raises(ValueError, match=rf"{field} must be an int"):
                cls(**{**valid, field: getattr(instance, field) + 0.5})


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
    train_store, _, _, _ = trained
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


@pytest.mark.parametrize("carrier", ["config.json", "tokenizer_config.json"])
def test_a_model_with_its_own_code_is_refused_without_a_prompt(tmp_path, monkeypatch, carrier):
    from transformers import LlamaConfig

    from actwave.capture import models

    LlamaConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                intermediate_size=128).save_pretrained(tmp_path)
    marker = tmp_path / "ran"
    (tmp_path / "modeling_evil.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    auto_map = {"AutoModelForCausalLM": "modeling_evil.EvilForCausalLM",
                "AutoConfig": "modeling_evil.EvilConfig"}
    record = json.loads((tmp_path / carrier).read_text()) if carrier == "config.json" else {}
    (tmp_path / carrier).write_text(json.dumps({**record, "auto_map": auto_map}))
    monkeypatch.setattr("builtins.input", lambda *a: pytest.fail("prompted the user"))
    with pytest.raises(ValueError, match=rf"asks to run its own code: .*{carrier} has auto_map "
                                         r".*never runs code shipped with a model"):
        models.load(str(tmp_path))
    assert not marker.exists()


@pytest.fixture
def plan_config(tmp_path):
    """A config file of the tests' tiny Llama, as a plan takes it."""
    from conftest import TINY
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps({"model_type": "llama", **TINY}))
    return str(path)


@pytest.mark.parametrize("option", ["--memory-gib", "--disk-gib", "--device-memory-gib",
                                    "--stats-budget-gib"])
@pytest.mark.parametrize("value", ["nan", "inf", "1e12", "0", "-4"])
def test_plan_refuses_limits_that_would_make_anything_fit(plan_config, capsys, option, value):
    from actwave.tools import plan

    given = {"--memory-gib": "8", "--disk-gib": "10", option: value}
    args = ["--model", plan_config, *[item for pair in given.items() for item in pair]]
    assert plan.main(args) == 2
    captured = capsys.readouterr()
    assert captured.out == ""  # no plan, no "fits"
    assert f"actwave plan: {option} must be a number of GiB in (0, 1,048,576]" in captured.err
    assert f"got {float(value)!r}" in captured.err


@pytest.mark.parametrize("content, named", [
    ("step\twall_s\n01_capture\t3\n", "no column 'measure'"),
    ("benchmark,measure,detail\nx,capture / 1,3.0 vs\n", "no 'batch 16' row"),
    ("\x89PNG\r\n\x1a\n\xff\xfe\xfd", "not a readable table"),
])
def test_plan_names_a_wrong_rates_file_and_the_missing_key(plan_config, tmp_path, capsys,
                                                            content, named):
    from actwave.tools import plan

    rates = tmp_path / "rates.csv"
    rates.write_bytes(content.encode("latin-1"))
    assert plan.main(["--model", plan_config, "--memory-gib", "8", "--disk-gib", "10",
                      "--rates", str(rates)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"actwave plan: {rates}: ") and named in err and "Traceback" not in err
