"""Capture over many processes: 2 gloo processes write the one-process store.

The processes are spawned as ``accelerate launch`` would start them (RANK / WORLD_SIZE /
MASTER_ADDR env), once per module, and capture a tiny Llama saved to a folder; every check
compares their store with ``run_capture`` in this process (float32 states: bit-identical).
ShareGPT is read from a file of its first conversations (every capture would otherwise
parse the whole 125 MB file, in every process).
"""
import json
import os
import shutil
import socket

import pytest
import torch
import torch.multiprocessing as mp
from conftest import save_tiny_llama

from actwave.capture import data as data_mod
from actwave.capture import distributed
from actwave.capture import store as store_mod
from actwave.capture.models import slug
from actwave.config import config_hash

CAPTURE = dict(split="analysis", n_sequences=9, max_seq_len=40, batch_size=2,
               sequences_per_shard=2, storage_dtype="float32")  # 5 shards, the last of 1 sequence
TIMING = ("seconds",)


def _config(folder) -> store_mod.CaptureConfig:
    return store_mod.CaptureConfig(model=str(folder), **CAPTURE)


def _arguments(folder) -> list[str]:
    return ["--model", str(folder)] + [part for name, value in CAPTURE.items()
                                       for part in (f"--{name}", str(value))]


def _shard_bytes(store) -> dict[str, bytes]:
    return {s["file"]: (store.path / s["file"]).read_bytes() for s in store.manifest["shards"]}


def _without_timing(manifest: dict) -> dict:
    return {key: value for key, value in manifest.items() if key not in TIMING}


def _use_sharegpt(path) -> None:
    data_mod.sharegpt_path = lambda: path


@pytest.fixture(scope="module", autouse=True)
def small_sharegpt(tmp_path_factory):
    """The bundled ShareGPT file's first 2·10^6 characters (its complete records are read):
    11 analysis-split records with an assistant token in their first 40 tokens."""
    path = tmp_path_factory.mktemp("sharegpt") / "sharegpt-head.json"
    with data_mod.sharegpt_path().open(encoding="utf-8") as f:
        path.write_text(f.read(2 * 10**6), encoding="utf-8")
    real = data_mod.sharegpt_path
    _use_sharegpt(path)
    yield path
    data_mod.sharegpt_path = real


@pytest.fixture(scope="module")
def folder(tmp_path_factory, small_sharegpt):
    from test_cli import tiny_tokenizer

    return save_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-capture-llama",
                           tiny_tokenizer(), hidden_size=32)


@pytest.fixture(scope="module")
def one_process(folder, tmp_path_factory):
    """``run_capture`` in this process (one thread, as each spawned process runs)."""
    cache = tmp_path_factory.mktemp("cache-1proc")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("ACTWAVE_CACHE", str(cache))
            return store_mod.run_capture(_config(folder), progress=False)
    finally:
        torch.set_num_threads(threads)


# ----------------------------------------------------------------------------- one process
def test_process_r_takes_every_w_th_pending_shard():
    assert distributed.shards_of_process([0, 1, 2, 3, 4], 1, 2) == [1, 3]
    assert distributed.shards_of_process([3, 4], 0, 2) == [3]
    assert distributed.shards_of_process([4], 1, 2) == []


@pytest.mark.parametrize("rank, world_size, message", [
    (2, 2, r"rank=2; allowed: an int in 0..1 \(world_size=2\)"),
    (-1, 2, r"rank=-1; allowed: an int in 0..1"),
    (0, 0, r"world_size=0; allowed: an int >= 1"),
    (0, 1.5, r"world_size=1.5; allowed: an int >= 1"),
    (True, 2, r"rank=True; allowed: an int in 0..1"),
])
def test_bad_rank_or_world_size_is_refused(rank, world_size, message):
    with pytest.raises(ValueError, match=message):
        distributed.shards_of_process([0, 1, 2], rank, world_size)


def test_command_line_in_one_process_is_run_capture(folder, one_process, tmp_path, monkeypatch,
                                                    capsys):
    monkeypatch.setenv("ACTWAVE_CACHE", str(tmp_path / "cache"))
    distributed.main(_arguments(folder))
    store = store_mod.open_store(_config(folder))
    assert capsys.readouterr().out.startswith(f"{one_process.n_tokens} tokens in 5 shards over 1 ")
    assert _shard_bytes(store) == _shard_bytes(one_process)


# ----------------------------------------------------------------------------- two processes
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _failing_write(rank: int, fail_at: int):
    """store._write_shard that raises on this process's ``fail_at``-th shard (1-based)."""
    real, calls = store_mod._write_shard, []

    def write(path, columns):
        calls.append(path.name)
        if len(calls) == fail_at:
            raise RuntimeError(f"simulated failure on process {rank}")
        return real(path, columns)
    return write, calls


def _error_of(work) -> str:
    try:
        work()
    except Exception as err:
        return f"{type(err).__name__}: {err}"
    return "no error"


def _two_process_worker(rank: int, port: int, work, folder, sharegpt) -> None:
    """One of 2 gloo processes, as ``accelerate launch`` sets them up: a whole capture by
    the command line; one that fails on process 1's second shard, then its resumption; one
    where process 1 holds another model."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      ACCELERATE_USE_CPU="true", ACTWAVE_CACHE=str(work / "cache-whole"))
    torch.set_num_threads(1)
    _use_sharegpt(sharegpt)
    distributed.main(_arguments(folder))
    report = {}

    os.environ["ACTWAVE_CACHE"] = str(work / "cache-resumed")
    store_mod._write_shard, calls = _failing_write(rank, fail_at=2 if rank == 1 else 0)
    report["failed"] = _error_of(lambda: distributed.capture_all_processes(_config(folder)))
    partial = store_mod.store_dir(_config(folder))
    if rank == 0:
        shutil.copy(partial / "manifest.json", work / "partial-manifest.json")
        report["inodes"] = {p.name: p.stat().st_ino for p in partial.glob("shard-*")}
    torch.distributed.barrier()
    store_mod._write_shard, calls = _failing_write(rank, fail_at=0)
    distributed.main(_arguments(folder))
    report["resumed_writes"] = calls

    os.environ["ACTWAVE_CACHE"] = str(work / "cache-mismatch")
    model, tokenizer = store_mod.load(str(folder))
    if rank == 1:
        with torch.no_grad():
            model.lm_head.weight[0, 0] += 1.0
    report["mismatch"] = _error_of(lambda: distributed.capture_all_processes(
        _config(folder), model, tokenizer, progress=False))
    (work / f"report-rank{rank}.json").write_text(json.dumps(report))
    torch.distributed.destroy_process_group()


@pytest.fixture(scope="module")
def two_processes(folder, small_sharegpt, tmp_path_factory):
    work = tmp_path_factory.mktemp("two-process-capture")
    mp.spawn(_two_process_worker, args=(_free_port(), work, folder, small_sharegpt), nprocs=2,
             join=True)
    reports = [json.loads((work / f"report-rank{rank}.json").read_text()) for rank in (0, 1)]
    return work, reports


def _store_path(cache, folder):
    """Where ``store_dir`` puts the capture under the cache root ``cache``."""
    config = _config(folder)
    key = config_hash(store_mod.store_key(config))  # config + digest of the model's files
    return cache / "capture" / f"{slug(config.model)}-{config.split}-{key}"


def _store_in(cache, folder) -> store_mod.CaptureStore:
    return store_mod.CaptureStore(_store_path(cache, folder))


def test_two_process_capture_equals_one_process(two_processes, one_process, folder):
    work, _ = two_processes
    two = _store_in(work / "cache-whole", folder)
    assert two.complete and len(two.manifest["shards"]) == 5
    assert _shard_bytes(two) == _shard_bytes(one_process)
    assert _without_timing(two.manifest) == _without_timing(one_process.manifest)
    assert not (two.path / ".lock").exists()


def test_interrupted_two_process_capture_resumes(two_processes, one_process, folder):
    """Process 1 fails on its second shard (shard 3): every process raises, process 0 still
    records the round's finished shard 2; the resumed run captures only shards 3 and 4 (one
    each) and leaves the store of one process."""
    work, reports = two_processes
    assert reports[1]["failed"] == "RuntimeError: simulated failure on process 1"
    assert reports[0]["failed"] == ("RuntimeError: capture process 1 failed: RuntimeError: "
                                    "simulated failure on process 1 (the shards already in the "
                                    "manifest are kept; a rerun resumes after them)")
    partial = json.loads((work / "partial-manifest.json").read_text())
    assert not partial["complete"]
    assert [s["file"] for s in partial["shards"]] == [store_mod.shard_name(n) for n in (0, 1, 2)]
    assert [r["resumed_writes"] for r in reports] == [[store_mod.shard_name(3)],
                                                      [store_mod.shard_name(4)]]
    resumed = _store_in(work / "cache-resumed", folder)
    kept = {s["file"]: (resumed.path / s["file"]).stat().st_ino for s in partial["shards"]}
    assert kept == {name: reports[0]["inodes"][name] for name in kept}  # not rewritten
    assert _shard_bytes(resumed) == _shard_bytes(one_process)
    assert _without_timing(resumed.manifest) == _without_timing(one_process.manifest)


def test_a_process_with_another_model_is_refused_by_all(two_processes, folder):
    work, reports = two_processes
    assert reports[1]["mismatch"].startswith("ValueError: capture store ")
    assert "was made with another model" in reports[1]["mismatch"]
    assert reports[0]["mismatch"].startswith("RuntimeError: capture process 1 failed: ValueError")
    assert not list(_store_path(work / "cache-mismatch", folder).glob("shard-*"))
