"""benchmarks/run_all.py: the summary entry point (the metrics benchmark runs for real, small)."""
from __future__ import annotations

import importlib
import json

import pytest

from actwave.config import native_bf16, repo_root


@pytest.fixture
def run_all(monkeypatch):
    monkeypatch.syspath_prepend(str(repo_root() / "benchmarks"))
    return importlib.import_module("run_all")


def test_quick_metrics_summary_is_written(run_all, tmp_path, monkeypatch):
    monkeypatch.setitem(run_all.SIZES, "quick", {
        **run_all.SIZES["quick"], "metrics": ["--layers", "4", "--tokens", "600", "--dim", "32",
                                              "--compare-layers", "3", "--compare-tokens", "200",
                                              "--chunk", "256"]})
    table = run_all.main(["--size", "quick", "--only", "metrics", "--out", str(tmp_path)])
    assert list(table["benchmark"]) == ["metrics", "metrics"]
    assert (table["ratio"] > 0).all()
    assert "max |diff|" in table["detail"].iloc[0]
    diff = float(table["detail"].iloc[0].rsplit(" ", 1)[1])
    assert diff < 1e-8  # the two routes of the metrics benchmark agree
    assert (tmp_path / "summary.md").read_text().count("| metrics") == 2
    assert json.loads((tmp_path / "summary.json").read_text())["size"] == "quick"


def test_unknown_benchmark_is_refused(run_all, capsys):
    with pytest.raises(SystemExit):
        run_all.main(["--only", "capture,warp"])
    assert "warp" in capsys.readouterr().err


def test_drafts_come_from_the_bench_draft_then_the_notebook_manifest_when_cached(
        run_all, tmp_path, monkeypatch):
    monkeypatch.setenv("ACTWAVE_CACHE", str(tmp_path / "cache"))
    (tmp_path / "cache" / "drafts" / "a").mkdir(parents=True)
    bench_draft, manifest = tmp_path / "draft.json", tmp_path / "06_drafts.json"
    missing = tmp_path / "missing.json"
    manifest.write_text(json.dumps({"smollm2-135m": {"eagle3_default": "drafts/a",
                                                     "entropy_cka_filtered": "drafts/gone"}}))
    assert run_all.draft_arguments(missing, manifest) == ["--draft", "drafts/a"]
    bench_draft.write_text(json.dumps({"draft": "drafts/b/draft"}))
    assert run_all.draft_arguments(bench_draft, manifest) == ["--draft", "drafts/a"]  # not cached
    (tmp_path / "cache" / "drafts" / "b" / "draft").mkdir(parents=True)
    assert run_all.draft_arguments(bench_draft, manifest) == ["--draft", "drafts/b/draft"]
    manifest.write_text(json.dumps({"smollm2-135m": {"eagle3_default": "drafts/gone"}}))
    assert run_all.draft_arguments(missing, manifest) == []
    assert run_all.draft_arguments(missing, missing) == []


def test_speculative_summary_rows_mark_random_drafts_and_report_shapes(monkeypatch):
    import pandas as pd

    from actwave.decoding.tree import TreeShape
    monkeypatch.syspath_prepend(str(repo_root() / "benchmarks"))
    bench = importlib.import_module("bench_speculative")
    table = pd.DataFrame({"label": ["greedy", "hf_prompt_lookup", "spec_fixed", "spec_auto"],
                          "speedup": [1.0, 0.8, 0.5, 0.7], "tau": [float("nan")] * 2 + [1.25, 1.4],
                          "exact_match_rate": [1.0] * 4, "n_prompts": [10] * 4})
    table["speedup_per_tau"] = table.speedup / table.tau
    table["lookup_share"] = [float("nan")] * 3 + [0.4]
    shape = TreeShape("chain", 3, 1, 4, 2.1, 0.2, 1.05, lookup=2)
    info = {"shape": shape, "fixed": dict(mode="tree", depth=4, top_k=4, total_tokens=16)}
    rows = bench.summary_rows(table, info, trained=False)
    assert [r["ratio"] for r in rows] == [0.8, 0.5, 0.7]
    assert rows[0]["measure"].endswith("(fp32)") and "RANDOM" in rows[2]["measure"]
    assert "speedup/tau 0.40" in rows[1]["detail"] and "tree 4/4/16" in rows[1]["detail"]
    assert "auto: chain 3/1/4 + lookup 2, predicted 1.05x at tau 2.10" in rows[2]["detail"]
    assert "lookup rounds 40%" in rows[2]["detail"] and "lookup" not in rows[1]["detail"]
    info |= {"tables": {"target": object()}, "dtype": "float32",
             "route_gain": {"routed_tokens_per_s": 21.0, "stock_tokens_per_s": 14.0, "identical": True}}
    info["fixed_shape"] = shape
    info["per_benchmark"] = {"spec_auto": "mtbench 0.80x tau 1.50, humaneval 0.60x tau 1.30"}
    routed = bench.summary_rows(table, info, trained=True)
    assert "tree 4/4/16, predicted 1.05x at tau 2.10" in routed[2]["detail"]
    assert "; mtbench 0.80x tau 1.50, humaneval 0.60x tau 1.30; exact" in routed[3]["detail"]
    assert "mtbench" not in routed[2]["detail"]  # the fixed pass had no split given
    assert routed[0]["ratio"] == pytest.approx(1.5) and "outputs identical" in routed[0]["detail"]
    assert routed[0]["measure"] == "greedy routed / stock linears tok/s (fp32)"
    assert all(r["measure"].endswith("(fp32, routed linears)") for r in routed[1:])


def test_bench_draft_trains_on_the_pool_and_resumes_from_the_pin(tmp_path, monkeypatch):
    """train_draft.py on a tiny Llama with its own pools file: replies regenerated and
    pinned chunk by chunk, the draft trained from cached features into the cache, its cost recorded; with
    the regeneration cache gone, a rerun restores the pinned text and finds the finished
    draft (no step retrained)."""
    import shutil

    import yaml
    from conftest import save_tiny_llama
    from test_cli import tiny_tokenizer

    monkeypatch.setenv("ACTWAVE_CACHE", str(tmp_path / "cache"))
    monkeypatch.syspath_prepend(str(repo_root() / "benchmarks"))
    train_draft = importlib.import_module("train_draft")
    folder = save_tiny_llama(tmp_path / "tiny-bench-llama", tiny_tokenizer(), hidden_size=32)
    pool = dict(max_prompt_len=56, max_new_tokens=8, batch_size=2, dtype="float32",
                batches_per_chunk=1)
    (tmp_path / "pools.yaml").write_text(yaml.safe_dump(
        {str(folder): {"bench": {"split": "train", "n_conversations": 3, **pool},
                       "eval": {"n_conversations": 2, **pool}}}))
    monkeypatch.setenv("ACTWAVE_POOLS", str(tmp_path / "pools.yaml"))
    monkeypatch.setenv("ACTWAVE_PINNED", str(tmp_path / "pinned"))
    argv = ["--model", str(folder), "--layers", "1,3,5", "--conversations", "3",
            "--max-seq-len", "64", "--steps", "3", "--warmup-steps", "1",
            "--checkpoint-every", "2", "--draft-vocab-size", "64", "--eval-conversations", "2",
            "--out", str(tmp_path / "out")]
    draft_dir = train_draft.main(argv)
    assert draft_dir.parent == tmp_path / "cache" / "drafts"  # the one draft cache
    assert draft_dir.name.startswith("tiny-bench-llama-L1-3-5-s0-")
    record = json.loads((tmp_path / "out" / "draft.json").read_text())
    assert (tmp_path / "cache" / record["draft"] / "config.json").exists()
    assert record["train_config"]["layer_ids"] == [1, 3, 5] and record["train_steps"] == 3
    native = "bfloat16" if native_bf16() else "float32"  # what "auto" trains in here
    assert record["budget"]["dtype"] == "auto" and record["train_config"]["dtype"] == native
    assert record["train_seconds"] > 0 and record["train_tokens"] > 0
    assert record["regen_conversations"] == 3 and 0 < record["regen_new_tokens"] <= 3 * 8
    for part in ("train", "held_out"):  # per-TTT-step agreement on 2 seen + 2 held-out sequences
        agreement = record["agreement"][part]
        assert agreement["n_sequences"] == 2 and all(0 <= agreement[f"acc_{i}"] <= 1 for i in range(3))
    assert [row["step"] for row in record["held_out_curve"]] == [2, 3]  # every checkpoint
    pinned = list((tmp_path / "pinned").glob("*/manifest.json"))
    assert len(pinned) == 2  # the bench pool's replies and the held-out eval pool's
    history = (draft_dir / "history.csv").read_text()
    shutil.rmtree(tmp_path / "cache" / "regenerated")
    assert train_draft.main(argv) == draft_dir
    assert (draft_dir / "history.csv").read_text() == history
    assert record["budget"]["lm_head_init"] == record["train_config"]["lm_head_init"] == "target"
    head_random = train_draft.main(argv + ["--lm-head-init", "random"])
    assert head_random != draft_dir  # the head's init is part of the draft's key
    record = json.loads((tmp_path / "out" / "draft.json").read_text())
    assert record["budget"]["lm_head_init"] == record["train_config"]["lm_head_init"] == "random"
    other = "float32" if native == "bfloat16" else "bfloat16"
    in_other = train_draft.main(argv + ["--dtype", other])
    assert in_other not in (draft_dir, head_random)  # the training dtype is keyed too
    record = json.loads((tmp_path / "out" / "draft.json").read_text())
    assert record["budget"]["dtype"] == record["train_config"]["dtype"] == other
    assert (tmp_path / "cache" / "regenerated").is_dir()


def test_bench_round_prints_every_route_and_marks_the_chosen_one(monkeypatch):
    from actwave.decoding.linear_routes import RouteTable

    monkeypatch.syspath_prepend(str(repo_root() / "benchmarks"))
    bench_round = importlib.import_module("bench_round")
    table = RouteTable(model="tiny", device="cpu", dtype="torch.float32", threads=2, rows=[1, 2, 3, 4],
                       routes=["linear", "weight_left", "linear", "linear"],
                       seconds={"linear": [0.022, 0.030, 0.1, 0.04], "weight_left": [0.05, 0.025, 0.2, 0.06]})
    line = bench_round.route_line("tiny", table)
    assert "linear / weight_left by row count" in line
    assert "1: 22*/50, 2: 30/25*, 4: 40*/60" in line  # row 3 is not among the printed counts
