"""``select --validate`` (actwave.tools.validate): candidates, budget, the Holm rule, and end to
end on the tiny Llama of test_cli with the smoke-study profile's data sizes (seconds)."""
import dataclasses
import json
import math
import shutil

import pytest

from actwave import index
from actwave.study import longrun, runs
from actwave.tools import cli, validate
from test_cli import NUM_LAYERS, model_folder  # noqa: F401  (the module-scoped fixture)

SMOKE = ["--validate-profile", "smoke-study"]


STUDY_64 = {"study": {"train": {"total_steps": 64}}}  # the budget part of the study profile

def select_result(rows_by_token_set):
    """A ``run_select`` result holding only what ``candidate_sets`` reads."""
    return {"num_layers": NUM_LAYERS, "proxy_token_set": "top",
            "token_sets": {name: {"methods": [
                {"label": label, "method": label, "layers": layers, "renyi2_pct": pct}
                for label, layers, pct in rows]} for name, rows in rows_by_token_set.items()}}


def test_candidates_are_distinct_proxy_picks_ranked_by_percentile():
    result = select_result({
        "all": [("renyi2_exhaustive", [1, 3, 8], 100.0), ("mrmr", [1, 5, 8], 99.0),
                ("last_k", [6, 7, 8], 100.0)],
        "top": [("renyi2_exhaustive", [1, 5, 8], 100.0), ("logdet_dpp", [2, 4, 5], 100.0),
                ("cka_farthest", [1, 2, 8], 40.0), ("random", [3, 4, 6], 100.0)]})
    picked = validate.candidate_sets(result, 5)
    # (2, 4, 5) is the default, last_k and random are no proxy's picks; ties: "top" first
    assert [c["layers"] for c in picked] == [[1, 5, 8], [1, 3, 8], [1, 2, 8]]
    assert picked[0]["label"] == "layers_1-5-8" and picked[0]["renyi2_pct"] == 100.0
    assert picked[0]["picked_by"] == ["renyi2_exhaustive@top", "mrmr@all"]
    assert len(validate.candidate_sets(result, 1)) == 1


def test_budget_falls_back_to_the_study_budget_until_rank_stability_exists(tmp_path):
    budget = validate.default_budget("smollm2-135m", STUDY_64, tmp_path)
    assert budget.steps == 64 and budget.note == validate.NOT_MEASURED
    assert budget.source.startswith("study.train.total_steps of profiles/study.yaml")
    assert "rank stability across budgets not yet measured" in budget.note
    (tmp_path / "12_rank_stability.csv").write_text(
        "model,train_steps,versus,predicts\nsmollm2-135m,32,2048,false\n"
        "smollm2-135m,128,2048,true\nsmollm2-135m,256,2048,true\ngemma3-270m,64,256,true\n")
    budget = validate.default_budget("smollm2-135m", STUDY_64, tmp_path)
    assert (budget.steps, budget.note) == (128, None)
    assert "12_rank_stability.csv" in budget.source and "predicts the one at 2048" in budget.source
    partial = validate.default_budget("gemma3-270m", STUDY_64, tmp_path)  # long runs not done
    assert partial.steps == 64 and "only up to 256 steps of the planned 2048" in partial.note
    (tmp_path / "12_rank_stability.csv").write_text(  # seed-0 rows alone are not used
        "model,train_steps,versus,predicts,seeds\nsmollm2-135m,64,2048,true,0\n"
        "smollm2-135m,256,2048,true,all\n")
    from_table = validate.default_budget("smollm2-135m", STUDY_64, tmp_path)
    assert from_table.steps == 256 and from_table.text == "longrun"  # measured on long runs
    assert validate.default_budget("smollm2-135m", STUDY_64, tmp_path / "none").text == "study"
    (tmp_path / "12_rank_stability.csv").write_text(  # measured, and no budget predicts
        "model,train_steps,versus,predicts,seeds\nsmollm2-135m,64,256,,all\n"
        "smollm2-135m,64,2048,false,all\nsmollm2-135m,1024,2048,false,all\n")
    largest = validate.default_budget("smollm2-135m", STUDY_64, tmp_path)
    assert (largest.steps, largest.note, largest.text) == (2048, None, "longrun")
    assert "the next shorter budget's ranking does not predict the one at 2048" in largest.source
    (tmp_path / "12_rank_stability.csv").write_text(  # 64 predicts by chance, 256 does not
        "model,train_steps,versus,predicts,seeds\ngemma3-270m,64,2048,true,all\n"
        "gemma3-270m,256,2048,false,all\ngemma3-270m,1024,2048,true,all\n")
    settled = validate.default_budget("gemma3-270m", STUDY_64, tmp_path)
    assert settled.steps == 1024 and "predicts the one at 2048" in settled.source


def test_passes_note_warns_only_when_the_budget_repeats_the_text():
    assert "pass 4 times over the 128 training texts" in validate._passes_note(256, 2, 128)
    assert validate._passes_note(128, 2, 128) is None  # two passes: no note
    assert validate._passes_note(1024, 2, 3200) is None  # the long runs' pool at 1,024 steps


def records(label, layers, accepted_by_seed, roots=10):
    """Study-like records of one set: per seed, per sequence accepted tokens of ``roots``."""
    return [{"label": label, "layer_ids": layers, "seed": seed, "offline": {"per_sequence": [
        {"accepted": a, "roots": roots} for a in accepted]}}
        for seed, accepted in enumerate(accepted_by_seed)]


def test_holm_rule_recommends_only_a_significantly_better_set():
    base = [[2, 3, 2, 3, 2, 3, 2, 3]] * 3
    arms = {"eagle3_default": records("eagle3_default", [2, 4, 5], base),
            "same": records("same", [1, 3, 8], [[3, 2, 3, 2, 2, 3, 2, 3]] * 3),
            "better": records("better", [1, 5, 8], [[6, 7, 6, 7, 6, 7, 6, 7]] * 3)}
    rows = {row["label"]: row for row in validate.compare(arms, alpha=0.05, n_bootstrap=500)}
    assert rows["better"]["better"] and rows["better"]["diff"] == pytest.approx(0.4)
    assert rows["better"]["holm_level"] == pytest.approx(1 - 0.05 / 2)  # first step: α/2
    assert not rows["same"]["better"] and rows["same"]["holm_level"] == pytest.approx(0.95)
    assert rows["same"]["ci_low"] <= 0 <= rows["same"]["ci_high"]
    chosen = validate.recommend(list(rows.values()), (2, 4, 5))
    assert chosen["layers"] == [1, 5, 8] and "Holm lower bound" in chosen["why"]
    del arms["better"]
    chosen = validate.recommend(validate.compare(arms, alpha=0.05, n_bootstrap=500), (2, 4, 5))
    assert chosen["label"] == "eagle3_default" and chosen["layers"] == [2, 4, 5]


def run_validate(folder, tmp_path, *extra):
    out = tmp_path / "validate.json"
    argv = ["select", "--model", str(folder), "--sequences", "6", "--max-seq-len", "48",
            "--validate", "--candidates", "2", *SMOKE, "--json", str(out), *extra]
    assert cli.main(argv) == 0
    return json.loads(out.read_text())


def test_validate_trains_scores_and_recommends_the_default(model_folder, tmp_path,  # noqa: F811
                                                           capsys, monkeypatch):
    result = run_validate(model_folder, tmp_path)
    printed = capsys.readouterr().out
    validation = result["validation"]
    assert validation["budget"]["steps"] == 2 and validation["seeds"] == 3  # smoke budget
    assert len(validation["rows"]) == 2
    assert all(math.isfinite(r["diff"]) for r in validation["rows"])
    assert all(r["tau_hat"] >= 1.0 for r in validation["rows"])
    assert not any(r["better"] for r in validation["rows"])
    assert result["recommendation"]["layers"] == [2, 4, 5]
    assert list(result["engine_ids"]) == ["recommended"]
    assert "validation: 3 sets × 3 seeds = 9 drafts of 2 steps" in printed
    assert "Holm" in printed and validate.NOT_MEASURED in printed
    assert "RECOMMENDATION: (2, 4, 5) (eagle3_default)" in printed

    monkeypatch.setattr(runs, "train_draft", lambda *a, **k: pytest.fail("draft retrained"))
    again = run_validate(model_folder, tmp_path)  # every record read back: nothing trains
    assert again["validation"]["rows"] == validation["rows"]


def test_a_candidate_forced_better_is_recommended(model_folder, tmp_path,  # noqa: F811
                                                  capsys, monkeypatch):
    """Scoring injection, not a constructed target (drafts would need hundreds of steps to
    learn a one-layer signal: too slow here): the records of the top candidate are rewritten
    so each held-out root accepts one token more, a τ̂ gain of 1.0 on every sequence and
    seed; the rule must then recommend that set and export it."""
    real_run_draft = runs.run_draft
    first = run_validate(model_folder, tmp_path)  # the trained records (cached)
    top = first["validation"]["rows"][0]["label"]
    capsys.readouterr()

    def boosted(study_set, seed, *args, **kwargs):
        record = real_run_draft(study_set, seed, *args, **kwargs)
        if study_set.label == top:
            for row in record["offline"]["per_sequence"]:
                row["accepted"] += row["roots"]
        return record

    monkeypatch.setattr(runs, "run_draft", boosted)
    result = run_validate(model_folder, tmp_path, "--engine", "vllm>=pr36063")
    rows = {row["label"]: row for row in result["validation"]["rows"]}
    assert rows[top]["better"] and rows[top]["holm_lower"] > 0
    assert result["recommendation"]["label"] == top
    layers = result["recommendation"]["layers"]
    assert result["engine_ids"]["recommended"]["vllm>=pr36063"]["ids"] == layers
    assert f"RECOMMENDATION: {tuple(layers)} ({top})" in capsys.readouterr().out


def test_validate_on_the_long_runs_text_reads_committed_records(model_folder, tmp_path,  # noqa: F811
                                                                capsys, monkeypatch):
    """--validate-text longrun: every (set, seed) is a long-run job at the budget on the
    smoke-study profile's pools (6 train / 3 held-out conversations); a committed long-run
    record with the same layers, seed and key is read instead of trained."""
    monkeypatch.setenv("ACTWAVE_CACHE", str(tmp_path / "cache"))
    extra = ("--validate-text", "longrun", "--budget", "4")
    validation = run_validate(model_folder, tmp_path, *extra)["validation"]
    assert validation["text"]["kind"] == "longrun" and validation["text"]["reused"] == []
    assert (validation["text"]["train_texts"], validation["text"]["eval_texts"]) == (6, 3)
    assert "on the long runs' text (6 train-pool conversations, 3 held-out" in \
        capsys.readouterr().out
    assert all(math.isfinite(r["diff"]) for r in validation["rows"])
    own = tmp_path / "cache" / validation["records_dir"].removeprefix("<cache>/")
    made = sorted((own / "records").glob("*.json"))
    assert len(made) == 9 and all(longrun.load_record(path)["budget"] == 4 for path in made)

    committed = tmp_path / "study-long"  # seed-0 records under the study's own labels
    (committed / "records").mkdir(parents=True)
    for path in (p for p in made if "-s0-" in p.name):
        shutil.copy(path, committed / "records" / path.name.replace("layers_", "study_"))
    shutil.rmtree(own)
    monkeypatch.setattr(longrun, "results_folder", lambda *args: committed)
    trained, run_job = [], longrun.run_job
    monkeypatch.setattr(longrun, "run_job",
                        lambda job, *a, **k: trained.append(job.seed) or run_job(job, *a, **k))
    again = run_validate(model_folder, tmp_path, *extra)["validation"]
    assert sorted(trained) == [1, 1, 1, 2, 2, 2]  # seed 0 of every set was read
    assert len(again["text"]["reused"]) == 3
    assert [r["diff"] for r in again["rows"]] == [r["diff"] for r in validation["rows"]]


def test_study_evidence_is_read_from_the_tables_at_run_time(tmp_path):
    """Numbers, aliases and the proxy verdict come from the tables found, not from code."""
    (tmp_path / "10_sets_vs_default_foo.csv").write_text(
        "label,layer_ids,n_seeds,tau_hat,vs_default_diff,vs_default_ci_low,vs_default_ci_high,"
        "vs_default_seq_ci_low,vs_default_seq_ci_high\n"
        'eagle3_default,"2,5,9",3,1.5,,,,,\n'
        'greedy_aggregate_entropy,"1,7,9",3,1.6,0.1,0.05,0.15,0.06,0.14\n'
        'renyi2_exhaustive@filtered,"3,7,9",1,1.4,-0.1,,,-0.2,-0.01\n')
    (tmp_path / "08_sets_foo.csv").write_text(
        'label,layer_ids,aliases\ngreedy_aggregate_entropy,"1,7,9","renyi2_exhaustive,mrmr"\n'
        'renyi2_exhaustive@filtered,"3,7,9",\n')
    (tmp_path / "10_proxy_correlations.csv").write_text(
        "proxy,token_set,n,spearman,spearman_p,kendall,kendall_p,model\n"
        "renyi2,all,20,0.8,0.001,0.6,0.001,foo\nlogdet,all,20,0.1,0.6,0.1,0.6,foo\n")
    (tmp_path / "12_study_long_sets_foo.csv").write_text(
        "label,budget,n_seeds,tau_hat,diff,ci_low,ci_high,p,primary,p_holm\n"
        "eagle3_default,64,3,1.2,,,,,,\neagle3_default,256,3,1.36,,,,,,\n"
        "last_k,64,3,1.1,-0.1,-0.2,-0.05,0.005,False,0.01\n"
        "last_k,256,3,1.3,-0.06,-0.08,-0.04,0.004,False,0.008\n"
        "renyi2_exhaustive@filtered,256,3,1.3,-0.02,-0.03,-0.01,0.002,True,0.002\n"
        "eagle3_default,1024,1,1.5,,,,,,\nlast_k,1024,1,1.4,-0.1,,,,,\n")  # 1024: under way
    lines = "\n".join(validate.study_evidence("foo", tmp_path))
    assert "foo, long runs at 256 steps" in lines and "default τ̂ 1.3600, 3 seeds" in lines
    assert "last_k: Δτ̂ -0.0600 [95% CI -0.0800, -0.0400], Holm p 0.008" in lines
    assert "@filtered: Δτ̂ -0.0200 [95% CI -0.0300, -0.0100], p 0.002 (the primary" in lines
    assert "Δτ̂ -0.1000 [95% CI -0.2000" not in lines  # only the largest budget
    assert "EAGLE-3 default (2,5,9) τ̂ 1.5000, 3 seeds" in lines
    assert ("renyi2_exhaustive (= greedy_aggregate_entropy) (1,7,9): Δτ̂ +0.1000 "
            "[95% CI +0.0500, +0.1500]") in lines
    assert "renyi2_exhaustive@filtered (3,7,9): Δτ̂ -0.1000 [sequence-only 95% CI" in lines
    assert "foo: renyi2 (all tokens) ranks trained drafts" in lines  # Holm p 0.002
    assert "no result for" not in lines
    assert "No committed study tables" in validate.study_evidence("foo", tmp_path / "none")[0]


def test_the_study_profile_gives_the_study_stores():
    """``study_config`` maps profiles/study.yaml as notebook 08 does: the same train / eval
    capture keys as the committed store index, so --validate reads the study's stores and
    pinned regenerated text instead of regenerating."""
    from actwave.capture.store import store_key
    from actwave.config import config_hash, results_dir
    from actwave.tools.runplan import load_profile

    config = validate.study_config("smollm2-135m", load_profile("study"), 64)
    entries = index.read_index(results_dir("study"), index.STUDY_STORES, ["smollm2-135m"])
    for split in ("train", "eval"):
        capture = config.capture_for(split)
        assert entries["smollm2-135m"][split]["config"] == json.loads(
            json.dumps(dataclasses.asdict(capture)))
        folder = index.store_path(entries["smollm2-135m"][split])
        assert folder.name.endswith(config_hash(store_key(capture)))  # config + model files
    assert config.train_config((2, 15, 27), 0).total_steps == 64
