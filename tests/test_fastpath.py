"""The one decoding comparison (``actwave.decoding.fastpath``): both shapes under measured
linear routes, exact against greedy, and the path notebooks 07/09 and the benchmark share."""
import importlib

import pytest
import torch

from actwave.config import repo_root
from actwave.decoding import fastpath, linear_routes
from actwave.decoding.evaluate import EvalConfig
from actwave.eagle3 import Eagle3Draft
from test_speculative import StubTokenizer

NOTEBOOKS = ("07_speculative.py", "09_study_decoding.py")


def _config(**changes):
    base = dict(benchmarks=("humaneval", "sharegpt"), n_prompts=1, max_turns=1, max_new_tokens=6,
                peers=False, mode="tree", depth=3, top_k=2, total_tokens=6, n_bootstrap=20)
    return EvalConfig(**{**base, **changes})


@pytest.mark.parametrize("routes", fastpath.ROUTES)
def test_both_shapes_decode_exactly_and_say_what_ran(llama, tmp_path, routes, monkeypatch):
    torch.manual_seed(0)
    drafts = {name: Eagle3Draft.from_target(llama, layers, draft_vocab_size=96).eval()
              for name, layers in (("a", (1, 2, 4)), ("b", (0, 3, 4)))}
    result = fastpath.compare(llama, StubTokenizer(), drafts, _config(), [], routes=routes,
                              acceptance_prompts=2, out_dir=tmp_path, run_name="t")
    summary = result.summary()
    assert set(summary["pass"]) == {"fixed", "auto"} and set(summary["routes"]) == {routes}
    assert (summary["exact_match_rate"] == 1.0).all()
    assert set(summary[summary["pass"] == "fixed"]["shape"]) == {"tree 3/2/6"}
    auto = summary[summary["pass"] == "auto"]["shape"].iloc[0]
    assert auto.startswith(f"auto: {result.auto.mode} {result.auto.depth}/")
    assert sorted(result.reach) == [1, 2, 4, 8] and 0 <= result.reach[1][0] <= 1
    draft_rows = summary[summary["label"].isin(["a", "b"])]
    assert draft_rows["predicted_speedup"].notna().all()
    assert draft_rows["predicted_speedup"].to_numpy() == pytest.approx(
        (draft_rows["predicted_tau"] * draft_rows["predicted_speedup_per_tau"]).to_numpy())
    fixed_rows = draft_rows[draft_rows["pass"] == "fixed"]
    assert (fixed_rows["predicted_tau"] == result.shapes["fixed"].expected_tokens).all()
    assert summary.loc[summary["label"] == "greedy", "predicted_speedup"].isna().all()
    assert result.shapes["fixed"].total_tokens == 6 and result.shapes["fixed"].round_seconds > 0
    assert ("draft a" in result.tables) == (routes == "measured")
    assert all(linear_routes.active(module) is None for module in (llama, *drafts.values()))
    assert len(list(tmp_path.glob("t-fixed-*/manifest.json"))) == 1  # one run folder per pass
    assert len(list(tmp_path.glob("t-auto-*/manifest.json"))) == 1
    monkeypatch.syspath_prepend(str(repo_root() / "benchmarks"))
    split = importlib.import_module("bench_speculative").per_benchmark(result, "a")
    assert sorted(split) == ["spec_auto", "spec_fixed"]
    for name, text in split.items():  # the benchmark's per-benchmark split: each pass's rows
        rows = summary[(summary["pass"] == name[5:]) & (summary["label"] == "a")
                       & (summary["benchmark"] != "all")]
        assert text.startswith("humaneval ") and ", sharegpt " in text and len(rows) == 2


def test_bad_routes_and_no_drafts_are_refused(llama):
    with pytest.raises(ValueError, match="routes='fast'; allowed"):
        fastpath.compare(llama, StubTokenizer(), {"a": Eagle3Draft.from_target(llama, (1, 2))},
                         _config(), [], routes="fast")
    with pytest.raises(ValueError, match="at least one draft"):
        fastpath.compare(llama, StubTokenizer(), {}, _config(), [])


class Reached(Exception):
    pass


def test_notebooks_and_benchmark_decode_through_the_same_function(monkeypatch):
    """bench_speculative's comparison reaches ``fastpath.compare``; notebooks 07 and 09 call
    it too (their sources), so a cited speedup has one code path."""
    def reached(*args, **kwargs):
        raise Reached(sorted(kwargs))
    monkeypatch.setattr(fastpath, "compare", reached)
    monkeypatch.syspath_prepend(str(repo_root() / "benchmarks"))
    bench = importlib.import_module("bench_speculative")
    args = bench.parse_args(["--n-prompts", "1", "--max-new-tokens", "4", "--device", "cpu"])
    with pytest.raises(Reached):
        bench.compare(args)
    for name in NOTEBOOKS:
        source = (repo_root() / "notebooks" / name).read_text()
        assert "fastpath.compare(" in source, name


def test_auto_shape_prompts_are_held_out_from_the_timed_ones_of_each_benchmark():
    """The reach behind the auto shape comes from the decoded benchmarks, in turn, past the
    prompts an evaluation of ``skip`` prompts per benchmark times."""
    from actwave.decoding import costmodel
    from actwave.decoding.evaluate import benchmark_prompts
    tokenizer = StubTokenizer()
    held_out = costmodel.held_out_prompts(tokenizer, 4, ("mtbench", "humaneval"), skip=3,
                                          max_tokens=10_000)

    def ids(item):
        return tokenizer.apply_chat_template([{"role": "user", "content": item["turns"][0]}],
                                             True, True, True)["input_ids"]
    mtbench, humaneval = benchmark_prompts("mtbench", 5), benchmark_prompts("humaneval", 5)
    expected = [ids(mtbench[3]), ids(humaneval[3]), ids(mtbench[4]), ids(humaneval[4])]
    assert [prompt[0].tolist() for prompt in held_out] == expected
    assert len(costmodel.held_out_prompts(tokenizer, 200, ("mtbench",), skip=70,
                                          max_tokens=10_000)) == 10  # MT-bench has 80
    with pytest.raises(ValueError, match="no held-out prompts of <= 5 tokens"):
        costmodel.held_out_prompts(tokenizer, 2, ("humaneval",), skip=0, max_tokens=5)
