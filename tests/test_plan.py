"""actwave.tools.plan and .costs: shapes from configs on the meta device, the plan's sizes, and its refusals."""
from __future__ import annotations

import json

import pytest
from conftest import TINY, tiny_model

from actwave.stats import blockstats
from actwave.stats.layerstats import StreamingLayerStats
from actwave.profile import build, parameters
from actwave.tools import costs, plan
from actwave.tools.runplan import load_profile

LLAMA_8B = "profiles/configs/llama-3.1-8b.json"


@pytest.fixture
def tiny_config(tmp_path):
    """A config file of the tests' tiny Llama, as a plan takes it."""
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps({"model_type": "llama", **TINY}))
    return str(path)


def test_meta_shape_counts_the_parameters_of_the_built_model(tiny_config):
    shape = costs.model_shape(tiny_config)
    built = tiny_model()  # real weights: an independent count
    assert shape.params == sum(p.numel() for p in built.parameters())
    assert (shape.layers, shape.dim, shape.vocab, shape.heads, shape.kv_heads) == (4, 64, 128, 4, 2)


def test_llama_8b_config_has_the_published_parameter_count():
    from actwave.config import repo_root
    shape = costs.model_shape(str(repo_root() / LLAMA_8B))
    assert shape.params == 8_030_261_248  # Llama-3.1-8B
    assert (shape.layers, shape.dim, shape.vocab, shape.tied) == (32, 4096, 128256, False)
    assert shape.forward_flops == 2 * (8_030_261_248 - 128256 * 4096)


def test_committed_rates_parse_and_a_missing_row_is_named(tmp_path):
    from actwave.config import repo_root
    rates = costs.read_rates(repo_root() / "results" / "benchmarks" / "summary.csv")
    assert set(rates) == {"capture", "regenerate", "stats", "train", "eval", "decode",
                          "longrun_train", "longrun_score"}
    assert all(value > 1e8 for value in rates.values())  # FLOP/s of a real machine
    broken = tmp_path / "summary.csv"
    broken.write_text("benchmark,measure,ratio,target,detail,bench_seconds\n")
    with pytest.raises(ValueError, match="no 'capture /' row"):
        costs.read_rates(broken)


def test_the_study_plan_predicts_the_study_s_own_measured_times():
    """Notebook 09's prediction vs the seconds in its per-reply records (a second route to the
    summary's tokens/s), and notebook 12's per-step time vs its cost table."""
    import csv
    import glob
    from actwave.config import repo_root
    from actwave.eagle3.schedule import cost
    root = repo_root()
    rates = costs.read_rates(root / "results" / "benchmarks" / "summary.csv")
    profile = {**parameters(load_profile("cpu")), **parameters(load_profile("study"))}
    predicted = plan.decode_needs(costs.REFERENCE, profile, rates)[0].seconds
    measured = sum(json.loads(line)["seconds"]
                   for path in glob.glob(str(root / "results/study/smollm2-135m/09_decoding-*"
                                             / "prompt-*.jsonl"))
                   for line in open(path) if '"seconds"' in line)
    assert measured > 0 and abs(predicted / measured - 1) < 0.15
    config = build("longrun", profile, model="smollm2-135m")
    assert {key: getattr(config, key) for key in ("batch_size", "max_seq_len",
                                                   "draft_vocab_size", "ttt_steps")} == {
        key: costs.LONGRUN_REFERENCE[key] for key in ("batch_size", "max_seq_len",
                                                     "draft_vocab_size", "ttt_steps")}
    training = plan.longrun_needs(costs.REFERENCE, profile, rates)[1]
    with open(root / costs.LONGRUN_COSTS) as f:
        largest = max(csv.DictReader(f), key=lambda row: (int(row["budget"]), int(row["drafts"])))
    steps = cost(config.schedule())["wsd"]
    per_step = training.seconds / (int(profile["longrun_seeds"]) * plan.KEY_SETS * steps)
    assert abs(per_step / float(largest["seconds_per_step"]) - 1) < 0.25
    # a model without regenerated pools trains on ShareGPT's longer original replies
    unpooled = costs.Shape("no-pools", *list(vars(costs.REFERENCE).values())[1:])
    ratio = plan.longrun_needs(unpooled, profile, rates)[1].seconds / training.seconds
    assert ratio == pytest.approx(costs.SHAREGPT_FILL / costs.LONGRUN_FILL) and ratio > 1.5


def test_statistics_lines_equal_the_accumulator_formulas(tiny_config):
    shape = costs.model_shape(tiny_config)
    rates = dict.fromkeys(("capture", "regenerate", "stats", "train", "eval", "decode",
                           "longrun_train", "longrun_score"), 1e9)
    profile = {**parameters(load_profile("cpu")), "notebooks": "02"}
    budget = blockstats.fixed_bytes(5, 64) + 3 * 8 * 64 * 64
    lines = plan.plan_needs(shape, profile, rates, "block_pairs", budget)
    assert lines[0].bytes_needed == StreamingLayerStats.accumulator_bytes(5, 64)
    assert lines[0].limit == ""  # not the route that runs
    assert lines[1].bytes_needed == blockstats.peak_bytes(5, 64, budget) <= budget
    assert "5 passes" in lines[1].detail  # 15 pairs, 3 a pass


def test_plan_prints_every_step_and_fits(tiny_config, capsys):
    code = plan.main(["--model", tiny_config, "--profile", "cpu", "--memory-gib", "8",
                      "--disk-gib", "10"])
    out = capsys.readouterr()
    assert code == 0 and out.err == ""
    for step in ("01 capture analysis store", "02 statistics, all_pairs route",
                 "06 train 6 drafts", "07 speculative evaluation", "total time"):
        assert step in out.out


def test_plan_refuses_naming_the_setting_to_change(tiny_config, capsys):
    assert plan.main(["--model", tiny_config, "--disk-gib", "0.001"]) == 2
    assert "change capture.n_sequences or capture.max_seq_len" in capsys.readouterr().err
    assert plan.main(["--model", tiny_config, "--memory-gib", "0.001", "--disk-gib", "10"]) == 2
    err = capsys.readouterr().err
    assert "02 statistics, all_pairs route: needs" in err and "route='block_pairs'" in err
    assert "change train.batch_size, train.max_seq_len or train.draft_vocab_size" in err


def test_llama_8b_gpu_plan_refuses_disk_and_points_to_the_block_route(capsys):
    from actwave.config import repo_root
    args = ["--model", str(repo_root() / LLAMA_8B), "--profile", "gpu", "--memory-gib", "128",
            "--disk-gib", "64", "--device-memory-gib", "40"]
    assert plan.main(args) == 2
    err = capsys.readouterr().err
    assert "needs 71.2 GiB of device memory, 40.0 GiB available" in err
    assert plan.main(args + ["--stats-route", "block_pairs", "--stats-budget-gib", "16"]) == 2
    captured = capsys.readouterr()
    assert "02 statistics, all_pairs route" not in captured.err
    assert "(not run)" in captured.out
    assert "5 passes" in captured.out  # 561 blocks of 128 MiB, ~120 a pass


def test_unknown_profile_and_model_are_refused(capsys):
    assert plan.main(["--model", "smollm2-135m", "--profile", "nope"]) == 2
    assert "unknown profile 'nope'" in capsys.readouterr().err
    assert plan.main(["--model", "no-such-model"]) == 2
    assert "unknown model 'no-such-model'" in capsys.readouterr().err


def test_study_plan_prints_the_study_steps_with_times(tiny_config, capsys):
    from actwave.tools import cli
    code = cli.main(["plan", "--model", tiny_config, "--profile", "study", "--memory-gib", "8",
                     "--disk-gib", "10"])
    out = capsys.readouterr()
    assert code == 0 and out.err == ""
    rows = {line[2:36].strip(): line for line in out.out.splitlines() if line.startswith("  ")}
    for step in ("08 regenerate train + eval replies", "08 capture train store",
                 "09 decoding check", "10 study report", "11 filter variants",
                 "11 compartment bootstrap"):
        assert step in rows, f"{step} missing from the study plan"
    assert any(step.startswith("08 train ≤ ") for step in rows)
    assert not any(step[:2] in {"01", "06", "07"} for step in rows)
    total = rows["total time"].split()[2:4]
    assert float(total[0]) > 0 and total[1] in {"s", "min", "h"}


def test_plan_without_model_covers_the_profiles_models(tiny_config, monkeypatch, capsys):
    shape = costs.model_shape(tiny_config)
    monkeypatch.setattr(plan, "model_shape", lambda name: costs.Shape(name, *list(vars(shape).values())[1:]))
    assert plan.main(["--profile", "study", "--memory-gib", "8", "--disk-gib", "10"]) == 0
    out = capsys.readouterr().out
    assert "plan · smollm2-135m" in out and "plan · gemma3-270m" in out
    assert out.count("08 train ≤ ") == 2
