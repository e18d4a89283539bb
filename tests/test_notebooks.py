"""The smoke profile's notebooks (its `notebooks` key) run end to end, in order, via papermill:
on the bundled SmolLM2, and on a model given as a local folder (what `--model PATH` does).

Each run writes into fresh temporary results and figures folders ($ACTWAVE_RESULTS,
$ACTWAVE_FIGURES), so a notebook must leave its own tables (listed in MANIFEST.json) and
figures there; one that swallowed an exception, or relied on an earlier run's files, would
not.
"""
import json
from pathlib import Path

import pandas as pd
import pytest

from actwave.profile import parameters
from actwave.tools.runplan import load_profile, select_notebooks
from conftest import save_tiny_llama

ROOT = Path(__file__).resolve().parents[1]
SMOKE = load_profile("smoke")
NOTEBOOKS = select_notebooks(SMOKE)  # the smoke profile's notebooks, as reproduce.sh runs them


@pytest.fixture(scope="module")
def smoke_env(tmp_path_factory):
    figures, results = tmp_path_factory.mktemp("figures"), tmp_path_factory.mktemp("results")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("ACTWAVE_FIGURES", str(figures))
        patch.setenv("ACTWAVE_RESULTS", str(results))
        yield {"figures": figures, "results": results,
               "params": {k: v for k, v in parameters(SMOKE).items() if k != "notebooks"}}


def run_notebook(source: Path, params: dict, results: Path, tmp_path: Path) -> None:
    """Execute one notebook with papermill; assert it listed a table in the manifest."""
    import jupytext
    import papermill

    notebook = tmp_path / f"{source.stem}.ipynb"
    jupytext.write(jupytext.read(source), notebook)
    results.mkdir(parents=True, exist_ok=True)
    papermill.execute_notebook(str(notebook), str(results / notebook.name),
                               parameters=params, kernel_name="python3",
                               cwd=str(ROOT / "notebooks"), progress_bar=False)
    manifest_path = results / "MANIFEST.json"
    made = json.loads(manifest_path.read_text()) if manifest_path.exists() else {}
    assert any(entry["notebook"] == source.stem for entry in made.values()), \
        f"{source.stem} wrote no table to {results}"


@pytest.mark.notebook
def test_notebook_without_its_input_names_the_notebook_to_run(smoke_env, tmp_path):
    """Notebook 04 opened alone, before notebook 01 made the store index: a clear error."""
    import papermill

    with pytest.raises(papermill.PapermillExecutionError,
                       match=r"01_stores.json not found: run notebook 01_capture first"):
        run_notebook(ROOT / "notebooks" / "04_aggregate_entropy.py", {"profile": "nothing-run-yet"},
                     smoke_env["results"] / "nothing-run-yet", tmp_path)


@pytest.mark.notebook
@pytest.mark.real_model
@pytest.mark.parametrize("source", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs_with_smoke_profile(source, smoke_env, tmp_path):
    run_notebook(source, {**smoke_env["params"], "profile": "smoke"},
                 smoke_env["results"] / "smoke", tmp_path)


@pytest.mark.notebook
@pytest.mark.real_model
def test_pipeline_runs_on_a_local_model_folder(smollm2, smoke_env, tmp_path):
    """A tiny random Llama saved to a folder (N=8, SmolLM2's tokenizer) through the smoke
    profile's notebooks: figure, table and cache names must come from models.slug, not the path."""
    folder = save_tiny_llama(tmp_path / "tiny-llama", smollm2[1])
    results = smoke_env["results"] / "smoke-local"
    params = {**smoke_env["params"], "profile": "smoke-local", "models": str(folder),
              "train_models": str(folder)}
    for source in NOTEBOOKS:
        run_notebook(source, params, results, tmp_path)
    figures = sorted(path.name for path in smoke_env["figures"].glob("*tiny-llama*.png"))
    assert "06_training_curves_tiny-llama.png" in figures and len(figures) >= 5


STUDY_SMOKE = load_profile("smoke-study")


@pytest.mark.notebook
@pytest.mark.real_model
def test_study_notebooks_run_on_a_tiny_model_folder(smollm2, smoke_env, tmp_path):
    """The study's notebooks (smoke-study profile) on a tiny random Llama saved to a folder:
    records written by 08, a rerun of 08 trains nothing, 09 decodes, 10 reports from records."""
    folder = save_tiny_llama(tmp_path / "tiny-study", smollm2[1], hidden_size=32,
                             num_attention_heads=2, num_key_value_heads=1)
    results = smoke_env["results"] / "smoke-study"
    params = {**{k: v for k, v in parameters(STUDY_SMOKE).items() if k != "notebooks"},
              "profile": "smoke-study", "models": str(folder)}
    for source in select_notebooks(STUDY_SMOKE):
        run_notebook(source, params, results, tmp_path)
    records = sorted((results / "tiny-study" / "records").glob("*.json"))
    assert len(records) == STUDY_SMOKE["max_drafts"] + 1  # + the learning-curve run
    stamps = [path.stat().st_mtime_ns for path in records]
    run_notebook(ROOT / "notebooks" / "08_study_drafts.py", params, results, tmp_path)
    assert [path.stat().st_mtime_ns for path in records] == stamps  # resumed from the records
    assert (results / "10_proxy_correlations.csv").exists()
    assert (results / "09_offline_vs_decoding.csv").exists()
    walk = pd.read_csv(results / "12_study_long_walk_check_tiny-study.csv")  # the long runs' drafts decoded
    assert len(walk) and (walk["equal"] == walk["records"]).all()
    proxies = pd.read_csv(results / "12_study_long_proxy_correlations.csv")
    assert set(proxies["budget"]) == {2, 4} and (proxies["model"] == "tiny-study").all()
