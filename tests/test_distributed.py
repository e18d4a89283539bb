"""Many processes and online training: summed statistics, DDP, the target in the loop.

The two-process checks spawn 2 CPU processes on the gloo backend, as ``accelerate launch``
would (RANK / WORLD_SIZE / MASTER_ADDR env), once per module; every check compares them
with an independent one-process route.
"""
import csv
import json
import os
import socket

import pytest
import torch
import torch.multiprocessing as mp
from conftest import random_sequences, save_tiny_llama, tiny_model, tiny_store
from safetensors.torch import load_file, save_file

from actwave.capture.store import CaptureStore
from actwave.config import config_hash
from actwave.eagle3 import Eagle3Draft
from actwave.eagle3 import train as train_mod
from actwave.eagle3.online import OnlineSource, evaluate_online, online_batch, train_online
from actwave.eagle3.ttt import TTTLoss
from actwave.stats import layerstats as LS
from actwave.stats.analysis import AnalysisConfig, compute_layer_stats
from actwave.stats.distributed import layer_stats_all_processes

LAYERS = (1, 2, 3)
ANALYSIS = AnalysisConfig(filter="quantile", filter_value=0.3)
STATS_FIELDS = ("entropy", "renyi2", "cka", "cka_biased")
SEQUENCES = dict(n_sequences=10, seed=1)


def _config(**overrides) -> train_mod.TrainConfig:
    values = dict(layer_ids=LAYERS, ttt_steps=2, lr=3e-3, warmup_steps=1, total_steps=4,
                  batch_size=2, max_seq_len=64, draft_vocab_size=64, checkpoint_every=2)
    return train_mod.TrainConfig(**{**values, **overrides})


def _online_source() -> OnlineSource:
    return OnlineSource.from_sequences(random_sequences(**SEQUENCES), "online-test", "test")


def _weights(draft) -> dict[str, torch.Tensor]:
    return draft.trainable_state_dict()


def _history_losses(run_dir) -> list[float]:
    with (run_dir / "history.csv").open() as f:
        return [float(row["loss"]) for row in csv.DictReader(f)]


# ----------------------------------------------------------------------------- one process
def test_train_config_hash_unchanged():
    """No new TrainConfig field: the committed study records are keyed by these hashes."""
    assert config_hash(train_mod.TrainConfig(layer_ids=(2, 15, 27))) == "53e4f2762ae9"
    record = json.loads(open(os.path.join(os.path.dirname(__file__), "..", "results", "study",
                                          "smollm2-135m", "records",
                                          "eagle3_default__seed0.json")).read())
    assert config_hash(train_mod.TrainConfig(**record["train"])) == "d3b12fdf475c"


def test_partial_sums_of_token_shards_add_to_the_whole():
    """Two streams over disjoint tokens with one reference, sums added == one stream."""
    torch.manual_seed(0)
    hidden = torch.randn(3, 90, 6, dtype=torch.float64) * 2 + 5  # (L, n, d), far from 0
    whole = LS.layer_stats(hidden)
    reference = hidden[:, 40:50].mean(dim=1)  # any shared shift will do
    left, right = (LS.StreamingLayerStats(3, 6, chunk_tokens=7, reference=reference)
                   for _ in range(2))
    left.update(hidden[:, :31])
    right.update(hidden[:, 31:])
    for mine, theirs in zip(left.partial_sums(), right.partial_sums()):
        mine += theirs
    left.n_tokens += right.n_tokens
    left.n_seen += right.n_seen
    added = left.finalize()
    assert added.n_tokens == whole.n_tokens == 90
    for name in STATS_FIELDS:
        torch.testing.assert_close(getattr(added, name), getattr(whole, name), rtol=1e-10,
                                   atol=1e-12)
    torch.testing.assert_close(added.block(0, 2), whole.block(0, 2), rtol=1e-10, atol=1e-10)


def test_reference_of_wrong_shape_is_refused():
    with pytest.raises(ValueError, match=r"reference must be \(L=3, d=6\), got \(3, 5\)"):
        LS.StreamingLayerStats(3, 6, reference=torch.zeros(3, 5))


def test_store_shard_ids_out_of_range_are_refused(tmp_path):
    (tmp_path / "store").mkdir()
    store = tiny_store(tmp_path / "store", tiny_model("llama"), random_sequences(4),
                       sequences_per_shard=2)
    assert [s["hidden"].shape[1] for s in store.iter_shards(shard_ids=[1])] \
        == [store.manifest["shards"][1]["n_tokens"]]
    with pytest.raises(ValueError, match="shard id 2 out of range.*ids 0..1"):
        next(store.iter_shards(shard_ids=[2]))


def test_online_batch_equals_store_batch(tmp_path):
    """Same sequences: the target in the loop gives the store route's batch."""
    target = tiny_model("llama")
    (tmp_path / "store").mkdir()
    store = tiny_store(tmp_path / "store", target, random_sequences(**SEQUENCES))
    data = train_mod.load_sequences(store, LAYERS)
    source = _online_source()
    draft = train_mod.new_draft(target, data, _config())
    assert torch.equal(train_mod.new_draft(target, source, _config()).d2t, draft.d2t)
    indices = [7, 0, 4]  # lengths 20, 18, 22: two rows padded
    stored = train_mod.make_batch(data, indices, target, draft, torch.device("cpu"))
    online = online_batch(source, indices, target, draft, torch.device("cpu"))
    lengths = torch.tensor([source.input_ids[i].numel() for i in indices])
    valid = torch.arange(22)[None, :] < lengths[:, None]  # (B, L)
    for name in ("input_ids", "label_mask", "target_argmax"):
        assert torch.equal(online[name], stored[name]), name
    torch.testing.assert_close(online["target_states"], stored["target_states"],
                               rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(online["target_probs"][valid], stored["target_probs"][valid],
                               rtol=1e-5, atol=1e-6)


def test_online_evaluation_equals_store_evaluation(tmp_path):
    """Held-out TTT agreement of a draft: the target in the loop = the stored states."""
    target = tiny_model("llama")
    (tmp_path / "store").mkdir()
    store = tiny_store(tmp_path / "store", target, random_sequences(**SEQUENCES))
    data = train_mod.load_sequences(store, LAYERS)
    draft = train_mod.new_draft(target, data, _config())
    stored = train_mod.evaluate_data(draft, data, target, ttt_steps=3, batch_size=3)
    online = evaluate_online(draft, _online_source(), target, ttt_steps=3, batch_size=3)
    assert online["n_tokens"] == stored["n_tokens"] and online["n_sequences"] == 10
    for i in range(3):
        assert online[f"loss_{i}"] == pytest.approx(stored[f"loss_{i}"], rel=1e-5)
        assert online[f"acc_{i}"] == pytest.approx(stored[f"acc_{i}"], abs=1e-9)
        assert 0.0 <= online[f"acc_{i}"] <= 1.0


def test_online_training_equals_store_training(tmp_path):
    target = tiny_model("llama")
    (tmp_path / "store").mkdir()
    store = tiny_store(tmp_path / "store", target, random_sequences(**SEQUENCES))
    config = _config(total_steps=6, checkpoint_every=3)
    from_store = train_mod.train_draft(store, target, config, tmp_path / "store-run",
                                       progress=False)
    online = train_online(_online_source(), target, config, tmp_path / "online-run",
                          progress=False)
    assert [r["tokens"] for r in online.history] == [r["tokens"] for r in from_store.history]
    torch.testing.assert_close(torch.tensor([r["loss"] for r in online.history]),
                               torch.tensor([r["loss"] for r in from_store.history]),
                               rtol=1e-5, atol=1e-6)
    for name, tensor in _weights(from_store.draft).items():
        torch.testing.assert_close(_weights(online.draft)[name], tensor, rtol=1e-4, atol=1e-5)
    record = json.loads((tmp_path / "online-run" / "config.json").read_text())
    assert record["store_digest"] == "online-test" and record["n_train_sequences"] == 10
    with pytest.raises(ValueError, match="trained on capture store online-test"):
        train_mod.train_draft(store, target, config, tmp_path / "online-run", progress=False)


def test_online_resume_equals_uninterrupted(tmp_path, monkeypatch):
    """Online training shares the checkpoints: a run killed after a checkpoint resumes to
    the uninterrupted run's losses and weights."""
    target = tiny_model("llama")
    config = _config(total_steps=6, checkpoint_every=3)
    straight = train_online(_online_source(), target, config, tmp_path / "straight",
                            progress=False)
    original_row = train_mod.history_row

    def crash_after_checkpoint(step, *args):
        if step == 5:
            raise KeyboardInterrupt("simulated crash")
        return original_row(step, *args)

    monkeypatch.setattr(train_mod, "history_row", crash_after_checkpoint)
    with pytest.raises(KeyboardInterrupt):
        train_online(_online_source(), target, config, tmp_path / "resumed", progress=False)
    monkeypatch.setattr(train_mod, "history_row", original_row)
    resumed = train_online(_online_source(), target, config, tmp_path / "resumed",
                           progress=False)
    assert [r["loss"] for r in resumed.history] == [r["loss"] for r in straight.history]
    for name, tensor in _weights(straight.draft).items():
        assert torch.equal(_weights(resumed.draft)[name], tensor), name


def test_online_source_rejects_bad_sequences():
    with pytest.raises(ValueError, match="sequence 1 has fewer than 2 tokens"):
        OnlineSource.from_sequences([{"input_ids": [1, 2], "loss_mask": [0, 1]},
                                     {"input_ids": [3], "loss_mask": [1]}], "h", "p")


def test_online_command_line_trains_from_a_model_folder(tmp_path, monkeypatch):
    """``python -m actwave.eagle3.online`` on a tiny Llama folder: ShareGPT sequences
    tokenised as a capture would, recorded as online data, no capture store written."""
    from test_cli import tiny_tokenizer

    from actwave.eagle3 import online

    monkeypatch.setenv("ACTWAVE_CACHE", str(tmp_path / "cache"))
    folder = save_tiny_llama(tmp_path / "tiny-online-llama", tiny_tokenizer(), hidden_size=32)
    online.main(["--model", folder, "--sequences", "3", "--layers", "2,4,5",
                 "--out", str(tmp_path / "run"), "--total_steps", "2", "--warmup_steps", "0",
                 "--max_seq_len", "48", "--draft_vocab_size", "64", "--checkpoint_every", "2"])
    record = json.loads((tmp_path / "run" / "config.json").read_text())
    assert record["complete"] and record["config"]["layer_ids"] == [2, 4, 5]
    assert record["store_digest"].startswith("online-") and record["n_train_sequences"] == 3
    assert record["store"] == f"online:{folder}/train"
    assert not (tmp_path / "cache" / "capture").exists()


def test_statistics_command_line_in_one_process(tmp_path, monkeypatch, capsys):
    """``python -m actwave.stats.distributed`` without a process group is the one-process pass."""
    from actwave.stats import distributed

    monkeypatch.setenv("ACTWAVE_CACHE", str(tmp_path / "cache"))
    (tmp_path / "store").mkdir()
    store = tiny_store(tmp_path / "store", tiny_model("llama"), random_sequences(4))
    distributed.main(["--store", str(tmp_path / "store"), "--filter", "quantile",
                      "--filter-value", "0.3"])
    printed = [line.split() for line in capsys.readouterr().out.splitlines()]
    expected = compute_layer_stats(store, ANALYSIS, progress=False)
    assert printed[0][:5] == [str(expected.n_tokens), "tokens", "over", "1", "processes"]
    assert [float(row[3]) for row in printed[1:]] == pytest.approx(expected.entropy.tolist(),
                                                                    abs=1e-6)


# ----------------------------------------------------------------------------- two processes
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two_process_worker(rank: int, port: int, work) -> None:
    """One of 2 gloo processes, set up as ``accelerate launch`` sets them up."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      ACCELERATE_USE_CPU="true", ACTWAVE_CACHE=str(work / "cache-2proc"))
    torch.set_num_threads(1)
    from accelerate import Accelerator

    accelerator = Accelerator()
    assert (accelerator.num_processes, accelerator.process_index) == (2, rank)
    target = tiny_model("llama")
    store = CaptureStore(work / "store")
    stats = layer_stats_all_processes(store, ANALYSIS)
    save_file({name: getattr(stats, name) for name in STATS_FIELDS}
              | {"n_tokens": torch.tensor(stats.n_tokens), "block_0_4": stats.block(0, 4)},
              work / f"stats-rank{rank}.safetensors")
    train_mod.train_draft(store, target, _config(), work / "ddp-store", progress=False)
    train_online(_online_source(), target, _config(), work / "ddp-online", progress=False)
    torch.distributed.destroy_process_group()


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory):
    """A 4-shard store (rank 0 streams shards 0 and 2, rank 1 shards 1 and 3), then the
    2-process statistics, DDP store training and DDP online training on it."""
    work = tmp_path_factory.mktemp("two-processes")
    (work / "store").mkdir()
    tiny_store(work / "store", tiny_model("llama"), random_sequences(**SEQUENCES),
               sequences_per_shard=3, config_hash="two-processes")
    mp.spawn(_two_process_worker, args=(_free_port(), work), nprocs=2, join=True)
    return work


def test_two_process_statistics_equal_one_process(two_processes, monkeypatch):
    monkeypatch.setenv("ACTWAVE_CACHE", str(two_processes / "cache-1proc"))
    one = compute_layer_stats(CaptureStore(two_processes / "store"), ANALYSIS, progress=False)
    assert one.n_tokens > 100
    for rank in (0, 1):
        two = load_file(two_processes / f"stats-rank{rank}.safetensors")
        assert int(two["n_tokens"]) == one.n_tokens
        for name in STATS_FIELDS:
            torch.testing.assert_close(two[name], getattr(one, name), rtol=1e-9, atol=1e-12)
        torch.testing.assert_close(two["block_0_4"], one.block(0, 4), rtol=1e-9, atol=1e-9)


def _mean_of_ranks_training(store, target, config, world_size: int = 2):
    """Independent route to the documented DDP semantics, in one process: rank r takes
    ``batch_indices(..., r, W)``, the update is the gradient of the mean of the per-rank
    losses, clipped, AdamW. -> (draft, rank 0's losses, rank 0's token counts)."""
    data = train_mod.load_sequences(store, config.layer_ids, config.max_seq_len)
    draft = train_mod.new_draft(target, data, config)
    params = [p for p in draft.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=config.lr, betas=config.betas,
                                  weight_decay=config.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: train_mod.lr_factor(
        step, config.warmup_steps, config.total_steps))
    module = TTTLoss(draft, config.ttt_steps, config.gamma)
    losses, tokens = [], []
    for step in range(config.total_steps):
        ranks = [train_mod.batch_indices(len(data), config.batch_size, step, config.seed, rank,
                                         world_size) for rank in range(world_size)]
        outputs = [module(**train_mod.make_batch(data, indices, target, draft,
                                                 torch.device("cpu"))) for indices in ranks]
        (sum(out.loss for out in outputs) / world_size).backward()
        torch.nn.utils.clip_grad_norm_(params, config.grad_clip)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(outputs[0].loss.detach()))
        tokens.append(sum(data.input_ids[i].numel() for i in ranks[0]))
    return draft, losses, tokens


def test_two_process_ddp_training_is_the_mean_of_rank_gradients(two_processes):
    target = tiny_model("llama")
    store = CaptureStore(two_processes / "store")
    reference, losses, tokens = _mean_of_ranks_training(store, target, _config())
    trained = Eagle3Draft.load(two_processes / "ddp-store" / "draft", target)
    for name, tensor in _weights(reference).items():
        torch.testing.assert_close(_weights(trained)[name], tensor, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(torch.tensor(_history_losses(two_processes / "ddp-store")),
                               torch.tensor(losses), rtol=1e-5, atol=1e-6)
    with (two_processes / "ddp-store" / "history.csv").open() as f:
        assert [int(float(row["tokens"])) for row in csv.DictReader(f)] == tokens


def test_two_process_online_training_equals_store_training(two_processes):
    target = tiny_model("llama")
    store_run = Eagle3Draft.load(two_processes / "ddp-store" / "draft", target)
    online_run = Eagle3Draft.load(two_processes / "ddp-online" / "draft", target)
    for name, tensor in _weights(store_run).items():
        torch.testing.assert_close(_weights(online_run)[name], tensor, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(torch.tensor(_history_losses(two_processes / "ddp-online")),
                               torch.tensor(_history_losses(two_processes / "ddp-store")),
                               rtol=1e-5, atol=1e-6)
