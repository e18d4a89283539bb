"""actwave.stats.analysis on a tiny synthetic capture store written in the real shard format."""
from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import save_file

from actwave.capture.store import CaptureStore, write_manifest
from actwave.integrity import IntegrityError, file_record, write_record
from actwave.stats import layerstats as LS
from actwave.stats import metrics as M
from actwave.stats.analysis import (AnalysisConfig, compute_layer_stats, load_layer_stats,
                                    token_keep_mask, token_settings)

N_LAYERS, DIM, SHARD_SIZES = 3, 8, (50, 70, 40)


def write_store(path, seed: int = 0) -> dict:
    """Shards + manifest as actwave.capture.store writes them; returns the concatenated columns."""
    g = torch.Generator().manual_seed(seed)
    path.mkdir(parents=True)
    shards, parts = [], []
    for index, n in enumerate(SHARD_SIZES):
        base = torch.randn(n, DIM, generator=g)
        hidden = torch.stack([base * (layer + 1) + torch.randn(n, DIM, generator=g) * layer + 50
                              for layer in range(N_LAYERS + 1)]).to(torch.bfloat16)  # (N+1, n, D)
        columns = {"hidden": hidden, "input_ids": torch.randint(0, 100, (n,), generator=g),
                   "entropy": torch.rand(n, generator=g) * 5,
                   "argmax": torch.randint(0, 100, (n,), generator=g),
                   "loss_mask": torch.rand(n, generator=g) < 0.7,
                   "special": torch.rand(n, generator=g) < 0.1,
                   "seq_index": torch.full((n,), index), "position": torch.arange(n)}
        name = f"shard-{index:05d}.safetensors"
        save_file(columns, str(path / name))
        shards.append({"file": name, "n_tokens": n, "first_sequence": index, "n_sequences": 1,
                       **file_record(path / name)})
        parts.append(columns)
    manifest = {"num_layers": N_LAYERS, "hidden_size": DIM, "n_tokens": sum(SHARD_SIZES),
                "storage_dtype": "bfloat16", "complete": True, "config_hash": f"fake{seed}",
                "n_sequences": len(SHARD_SIZES), "shards": shards}
    write_manifest(path, manifest)
    return {k: torch.cat([p[k] for p in parts], dim=1 if k == "hidden" else 0) for k in parts[0]}


@pytest.fixture
def store(tmp_path, monkeypatch):
    monkeypatch.setenv("ACTWAVE_CACHE", str(tmp_path / "cache"))
    columns = write_store(tmp_path / "store")
    return CaptureStore(tmp_path / "store"), columns


def expected_keep(columns: dict, quantile: float) -> torch.Tensor:
    """Independent reference of the filter: candidates, then ⌈q(m−1)⌉-th order statistic."""
    candidates = ~columns["special"] & columns["loss_mask"]
    ordered = sorted(columns["entropy"][candidates].tolist())
    threshold = ordered[math.ceil(quantile * (len(ordered) - 1))]
    return candidates & (columns["entropy"] >= threshold)


def test_compute_layer_stats_equals_one_shot_on_kept_tokens(store):
    capture, columns = store
    config = AnalysisConfig(filter="quantile", filter_value=0.5, only_loss_mask=True)
    stats = compute_layer_stats(capture, config, progress=False)
    keep = expected_keep(columns, 0.5)
    kept = columns["hidden"][:, keep].to(torch.float64)  # (N+1, n_kept, D)
    assert stats.n_tokens == int(keep.sum()) and stats.n_seen == sum(SHARD_SIZES)
    assert stats.layers == tuple(range(N_LAYERS + 1))
    for a in range(N_LAYERS + 1):
        assert float(stats.entropy[a]) == pytest.approx(float(M.matrix_entropy(kept[a])), abs=1e-9)
        for b in range(N_LAYERS + 1):
            assert float(stats.cka[a, b]) == pytest.approx(
                float(M.linear_cka(kept[a], kept[b], debiased=True)), abs=1e-9)
            assert float(stats.cka_biased[a, b]) == pytest.approx(
                float(M.linear_cka(kept[a], kept[b])), abs=1e-9)
    parts = [(kept[i] - kept[i].mean(0)) / (kept[i] - kept[i].mean(0)).norm() for i in (0, 3)]
    assert LS.aggregate_entropy(stats, [0, 3]) == pytest.approx(
        float(M.matrix_entropy(torch.cat(parts, dim=1))), abs=1e-8)


def test_cache_hit_returns_equal_stats_without_reading_shards(store, monkeypatch):
    capture, _ = store
    config = AnalysisConfig(filter="threshold", filter_value=2.0)
    first = compute_layer_stats(capture, config, progress=False)
    monkeypatch.setattr(capture, "iter_shards", lambda *a, **k: pytest.fail("cache was not used"))
    second = compute_layer_stats(capture, config, progress=False)
    for name in ("entropy", "renyi2", "cka", "cka_biased"):
        assert torch.equal(getattr(first, name), getattr(second, name))
    assert first.cov.keys() == second.cov.keys()
    assert torch.equal(first.cov[(1, 2)], second.cov[(1, 2)])


def test_recorded_counts_and_refused_mismatching_cache(store):
    capture, columns = store
    config = AnalysisConfig(filter="quantile", filter_value=0.5)
    stats = compute_layer_stats(capture, config, progress=False, name="probe")
    folder = next((capture.path.parent / "cache" / "layer_stats").glob("probe-*"))
    record = json.loads((folder / "config.json").read_text())
    counts = record["token_counts"]
    assert counts["n_candidates"] == int((~columns["special"]).sum())
    assert counts["n_used"] == stats.n_tokens == counts["n_filter_kept"]
    assert counts["filter_kept_fraction"] == pytest.approx(stats.n_tokens / counts["n_candidates"])
    record["config"]["analysis"]["filter_value"] = 0.8
    (folder / "config.json").write_text(json.dumps(record))  # an edit without its checksum
    with pytest.raises(IntegrityError, match="config.json: record_sha256 expected"):
        load_layer_stats(folder)
    write_record(folder / "config.json", record)  # consistent, but made for another config
    with pytest.raises(ValueError, match="were made for"):
        compute_layer_stats(capture, config, progress=False, name="probe")
    assert load_layer_stats(folder).n_tokens == stats.n_tokens  # loads when no key is given


def test_float32_cross_products_match_float64_and_key_the_cache(store):
    capture, _ = store
    exact = compute_layer_stats(capture, AnalysisConfig(), progress=False)
    fast = compute_layer_stats(capture, AnalysisConfig(matmul_dtype="float32"), progress=False)
    assert fast.n_tokens == exact.n_tokens
    assert not torch.equal(fast.cov[(0, 3)], exact.cov[(0, 3)])  # a separate artifact
    for name in ("entropy", "renyi2", "cka", "cka_biased"):
        torch.testing.assert_close(getattr(fast, name), getattr(exact, name),
                                   rtol=1e-5, atol=1e-6)


def test_too_large_accumulators_are_refused_before_streaming(store, monkeypatch):
    from actwave.stats import analysis
    capture, _ = store
    need = LS.StreamingLayerStats.accumulator_bytes(N_LAYERS + 1, DIM)
    assert analysis.check_memory(N_LAYERS + 1, DIM, "cpu") == need
    monkeypatch.setattr(analysis, "available_bytes", lambda device: need - 1)
    with pytest.raises(MemoryError, match=r"4 layers × d=8 need .* GiB"):
        compute_layer_stats(capture, AnalysisConfig(), progress=False)
    # an 8B Llama (33 states × 4096) needs ~75 GB: more than one 80 GB GPU has free
    assert 70e9 < LS.StreamingLayerStats.accumulator_bytes(33, 4096) < 80e9


def test_max_tokens_subsample_is_seeded(store):
    capture, _ = store
    first = compute_layer_stats(capture, AnalysisConfig(max_tokens=60, seed=1), progress=False)
    other = compute_layer_stats(capture, AnalysisConfig(max_tokens=60, seed=2), progress=False)
    assert first.n_tokens == other.n_tokens == 60
    assert not torch.equal(first.entropy, other.entropy)


def test_config_errors(store):
    with pytest.raises(ValueError, match="filter must be one of"):
        AnalysisConfig(filter="top")
    with pytest.raises(ValueError, match=r"\[0, 1\)"):
        AnalysisConfig(filter="quantile", filter_value=1.5)
    with pytest.raises(ValueError, match="matmul_dtype must be one of"):
        AnalysisConfig(matmul_dtype="bfloat16")
    capture, _ = store
    with pytest.raises(ValueError, match="survive the filter"):
        compute_layer_stats(capture, AnalysisConfig(filter="threshold", filter_value=99.0),
                            progress=False)


def test_token_settings_labels_and_configs(store):
    settings = token_settings(0.75, max_tokens=60, seed=3, with_special=True)
    assert list(settings) == ["all tokens", "top 25% entropy", "all + special"]
    assert settings["all tokens"] == AnalysisConfig(filter="none", max_tokens=60, seed=3)
    assert settings["top 25% entropy"] == AnalysisConfig(filter="quantile", filter_value=0.75,
                                                         max_tokens=60, seed=3)
    assert settings["all + special"] == AnalysisConfig(filter="none", exclude_special=False,
                                                       max_tokens=60, seed=3)
    assert list(token_settings(0.5)) == ["all tokens", "top 50% entropy"]
    assert token_settings(0.5)["all tokens"].max_tokens is None
    # the label says what the filter keeps: about the top half of the candidate tokens
    capture, columns = store
    _, counts = token_keep_mask(capture, token_settings(0.5)["top 50% entropy"])
    candidates = int((~columns["special"]).sum())
    assert counts["n_candidates"] == candidates
    assert abs(counts["n_filter_kept"] - candidates / 2) <= 1
    with pytest.raises(ValueError, match=r"\[0, 1\)"):
        token_settings(1.2)
