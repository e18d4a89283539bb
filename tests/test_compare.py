"""actwave.tools.compare: regenerated tables against the committed ones, to stated tolerances."""
from __future__ import annotations

import json
import subprocess

import pandas as pd
import pytest

from actwave.tools import compare

SELECTION = pd.DataFrame({
    "model": ["smollm2-135m", "smollm2-135m"],
    "label": ["eagle3_default", "renyi2_exhaustive"],
    "layer_ids": ["2,15,27", "11,28,29"],
    "renyi2": [2.5031, 3.74015],
    "renyi2_pct": [47.9167, 99.7549],
    "n_subsets": [4060, 4060],
})


def test_identical_tables_match():
    report = compare.compare_tables("05_selection.csv", SELECTION, SELECTION.copy())
    assert report.ok and report.worst == 0


def test_relative_perturbation_of_1e7_matches():
    fresh = SELECTION.copy()
    fresh["renyi2"] *= 1 + 1e-7
    report = compare.compare_tables("05_selection.csv", SELECTION, fresh)
    assert report.ok
    assert 0 < report.worst < 2e-7


def test_perturbed_value_is_a_mismatch_naming_row_and_column():
    fresh = SELECTION.copy()
    fresh.loc[1, "renyi2"] = 3.7409  # 2e-4 relative: beyond rtol 1e-4
    report = compare.compare_tables("05_selection.csv", SELECTION, fresh)
    assert not report.ok and len(report.problems) == 1
    assert "renyi2" in report.problems[0] and "renyi2_exhaustive" in report.problems[0]


def test_changed_layer_set_is_a_mismatch_even_when_scores_agree():
    fresh = SELECTION.copy()
    fresh.loc[1, "layer_ids"] = "11,28,30"
    report = compare.compare_tables("05_selection.csv", SELECTION, fresh)
    assert not report.ok
    assert "'11,28,30' vs committed '11,28,29'" in report.problems[0]


def test_integer_cells_must_match_exactly():
    fresh = SELECTION.copy()
    fresh.loc[0, "n_subsets"] = 4061
    assert not compare.compare_tables("05_selection.csv", SELECTION, fresh).ok


def test_missing_column_or_row_is_a_mismatch():
    assert not compare.compare_tables("05_selection.csv", SELECTION,
                                      SELECTION.drop(columns="renyi2")).ok
    assert not compare.compare_tables("05_selection.csv", SELECTION, SELECTION.iloc[:1]).ok


def test_timing_columns_are_skipped_and_intervals_compared_by_number():
    committed = pd.DataFrame({"label": ["a"], "tau": [1.26], "tau_ci": ["[1.23, 1.29]"],
                              "speedup": [0.51], "seconds": [81.6]})
    fresh = committed.assign(speedup=[0.9], seconds=[40.0], tau_ci=["[1.2301, 1.29]"])
    report = compare.compare_tables("07_speculative_main.csv", committed, fresh)
    assert report.ok and report.skipped == ["speedup", "seconds"]
    fresh = fresh.assign(tau_ci=["[1.23, 1.50]"])
    assert not compare.compare_tables("07_speculative_main.csv", committed, fresh).ok


def test_rules_give_statistics_tighter_tolerances_than_trained_drafts():
    assert compare.rule_for("02_layer_entropy.csv", "entropy") == compare.Tolerance(1e-4, 1e-6)
    assert compare.rule_for("05_selection.csv", "renyi2_pct").atol == 0.25
    assert compare.rule_for("07_speculative_summary.csv", "tau").rtol == 5e-2
    assert compare.rule_for("07_speculative_summary.csv", "tokens_per_s_lo") is compare.SKIP


def test_candidate_sets_json_must_match_exactly():
    committed = {"smollm2-135m": {"cka_only": [1, 3, 30], "eagle3_default": [2, 15, 27]}}
    assert compare.compare_json("05_candidate_sets.json", committed, json.loads(
        json.dumps(committed))).ok
    fresh = {"smollm2-135m": {"cka_only": [1, 4, 30], "eagle3_default": [2, 15, 27]}}
    report = compare.compare_json("05_candidate_sets.json", committed, fresh)
    assert report.problems == ["smollm2-135m/cka_only: [1, 4, 30] vs committed [1, 3, 30] "
                               "(must match exactly)"]


@pytest.fixture
def committed_repo(tmp_path, monkeypatch):
    """A git repository with results/cpu/05_selection.csv committed."""
    def run(*args):
        subprocess.run(["git", *args], cwd=tmp_path, check=True, capture_output=True)

    run("init", "-q")
    (tmp_path / "results" / "cpu").mkdir(parents=True)
    SELECTION.to_csv(tmp_path / "results" / "cpu" / "05_selection.csv", index=False)
    run("add", ".")
    run("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "tables")
    monkeypatch.setattr(compare, "repo_root", lambda: tmp_path)
    return tmp_path / "results" / "cpu" / "05_selection.csv"


def test_main_compares_working_tree_with_head(committed_repo, capsys):
    assert compare.main(["--profile", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "1 of 1 tables match" in out and "byte-identical" in out
    fresh = SELECTION.copy()
    fresh["renyi2"] *= 1 + 1e-7
    fresh.to_csv(committed_repo, index=False)
    assert compare.main(["--profile", "cpu"]) == 0
    assert "largest relative difference 1.0e-07" in capsys.readouterr().out
    SELECTION.assign(layer_ids=["2,15,27", "4,17,18"]).to_csv(committed_repo, index=False)
    assert compare.main(["--profile", "cpu"]) == 1
    out = capsys.readouterr().out
    assert "MISMATCH  05_selection.csv" in out and "differ: 05_selection.csv" in out
    committed_repo.unlink()
    assert compare.main(["--profile", "cpu"]) == 1
    assert "not regenerated" in capsys.readouterr().out
    assert compare.main(["--profile", "smoke"]) == 2
    assert compare.main(["--profile", "../cpu"]) == 2
    assert "not a profile name" in capsys.readouterr().err
