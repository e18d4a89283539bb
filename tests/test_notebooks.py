"""Every numbered notebook runs end to end with the smoke profile, in order, via papermill.

Each notebook must leave its tables in results/smoke/ (listed in its MANIFEST.json) and its
figures in the smoke figures folder; a notebook that swallowed an exception would not.
"""
import json
import os
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.py"))


@pytest.fixture(scope="module")
def smoke_env(tmp_path_factory):
    figures = tmp_path_factory.mktemp("figures")
    old = os.environ.get("ACTWAVE_FIGURES")
    os.environ["ACTWAVE_FIGURES"] = str(figures)
    (ROOT / "results" / "smoke").mkdir(parents=True, exist_ok=True)
    yield {"figures": figures, "results": ROOT / "results" / "smoke",
           "params": yaml.safe_load((ROOT / "profiles" / "smoke.yaml").read_text())}
    if old is None:
        os.environ.pop("ACTWAVE_FIGURES")
    else:
        os.environ["ACTWAVE_FIGURES"] = old


@pytest.mark.notebook
@pytest.mark.parametrize("source", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs_with_smoke_profile(source, smoke_env, tmp_path):
    import jupytext
    import papermill

    notebook = tmp_path / f"{source.stem}.ipynb"
    jupytext.write(jupytext.read(source), notebook)
    params = {**smoke_env["params"], "profile": "smoke"}
    papermill.execute_notebook(str(notebook), str(smoke_env["results"] / notebook.name),
                               parameters=params, kernel_name="python3",
                               cwd=str(ROOT / "notebooks"), progress_bar=False)
    manifest_path = smoke_env["results"] / "MANIFEST.json"
    made = json.loads(manifest_path.read_text()) if manifest_path.exists() else {}
    assert any(entry["notebook"] == source.stem for entry in made.values()), \
        f"{source.stem} wrote no table to {smoke_env['results']}"
