"""Figures and tables: byte-stable files, manifests, helpers return figures."""
import json
import os

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from actwave import config, plots  # noqa: E402


def _demo_figure(seed: int = 0):
    plots.setup_style()
    rng = np.random.default_rng(seed)
    cka = rng.uniform(size=(6, 6))
    cka = (cka + cka.T) / 2
    np.fill_diagonal(cka, 1.0)
    return plots.plot_cka_heatmap(cka, compartments=[(0, 2), (3, 5)], marked_layers=[2, 3],
                                  title="demo")


def test_save_figure_is_byte_stable_and_manifested(tmp_path):
    first = plots.save_figure(_demo_figure(), "02_demo", "02_layer_entropy", tmp_path / "a")
    second = plots.save_figure(_demo_figure(), "02_demo", "02_layer_entropy", tmp_path / "b")
    plt.close("all")
    assert [p.name for p in first] == ["02_demo.png", "02_demo.pdf"]
    for a, b in zip(first, second):
        assert a.read_bytes() == b.read_bytes(), a.name
    assert b"CreationDate" not in first[1].read_bytes()
    manifest = json.loads((tmp_path / "a" / "MANIFEST.json").read_text())
    assert manifest == {"02_demo": {"notebook": "02_layer_entropy",
                                    "files": ["02_demo.pdf", "02_demo.png"]}}


def test_manifest_merges_entries_and_env_sets_default_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("ACTWAVE_FIGURES", str(tmp_path))
    fig = _demo_figure()
    plots.save_figure(fig, "03_b", "03_cka_geometry")
    plots.save_figure(fig, "02_a", "02_layer_entropy")
    plots.save_figure(fig, "03_b", "03_cka_geometry_v2")
    plt.close("all")
    text = (tmp_path / "MANIFEST.json").read_text()
    manifest = json.loads(text)
    assert list(manifest) == ["02_a", "03_b"]  # sorted keys on disk
    assert manifest["03_b"]["notebook"] == "03_cka_geometry_v2"


@pytest.mark.parametrize("bad", ["", "a/b", ".hidden"])
def test_bad_names_rejected(tmp_path, bad):
    with pytest.raises(ValueError, match="plain file stem"):
        plots.save_figure(plt.figure(), bad, "nb", tmp_path)
    plt.close("all")


def test_save_table_deterministic_sorted_and_formatted(tmp_path):
    df = pd.DataFrame({"model": ["b", "a", "a"], "score": [1 / 3, 2.0, float("nan")],
                       "layer_ids": [(2, 15, 27), (1, 2, 3), (4, 5, 6)]})
    shuffled = df.iloc[[2, 0, 1]]
    paths_a = plots.save_table(df, "05_selection", "05_layer_selection", tmp_path / "a")
    paths_b = plots.save_table(shuffled, "05_selection", "05_layer_selection", tmp_path / "b")
    for a, b in zip(paths_a, paths_b):
        assert a.read_bytes() == b.read_bytes(), a.name
    csv_lines = paths_a[0].read_text().splitlines()
    assert csv_lines == ["model,score,layer_ids", 'a,2,"1,2,3"', 'a,,"4,5,6"',
                         'b,0.333333,"2,15,27"']
    markdown = paths_a[1].read_text().splitlines()
    assert markdown[0].startswith("| model | ") and set(markdown[1]) <= set("|-: ")
    assert "0.333333" in markdown[4] and "2,15,27" in markdown[4]
    manifest = json.loads((tmp_path / "a" / "MANIFEST.json").read_text())
    assert manifest["05_selection"]["files"] == ["05_selection.csv", "05_selection.md"]


def test_save_table_errors(tmp_path):
    with pytest.raises(TypeError, match="DataFrame"):
        plots.save_table({"a": [1]}, "t", "nb", tmp_path)
    with pytest.raises(ValueError, match="sort_by"):
        plots.save_table(pd.DataFrame({"a": [1]}), "t", "nb", tmp_path, sort_by=["zzz"])


def test_save_json_sorted_and_manifested(tmp_path):
    path = plots.save_json({"m": {"z": [1, 2], "a": [3]}}, "05_candidate_sets", "05", tmp_path)
    assert json.loads(path.read_text()) == {"m": {"a": [3], "z": [1, 2]}}
    assert path.read_text().index('"a"') < path.read_text().index('"z"')
    assert "05_candidate_sets" in json.loads((tmp_path / "MANIFEST.json").read_text())


def test_plot_helpers_return_figures_with_expected_content():
    plots.setup_style()
    curves = pd.DataFrame({"layer": list(range(5)) * 2, "entropy": np.arange(10.0),
                           "filter": ["none"] * 5 + ["top50"] * 5, "model": "m"})
    fig = plots.plot_layer_curves(curves, y="entropy", hue="filter", col="model",
                                  marked_layers={"m": [2]})
    assert len(fig.axes[0].lines) >= 3  # two curves + the marked layer

    pairs = torch.arange(16.0).reshape(4, 4)
    fig = plots.plot_pair_heatmap(pairs, layers=[1, 2, 3, 4], marked_pairs=[(4, 2)])
    assert len(fig.axes[0].patches) == 1

    fig = plots.plot_subset_distribution(np.arange(100.0), {"default": 49.0, "best": 99.0})
    labels = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert labels == ["default (50.0%)", "best (100.0%)"]

    table = pd.DataFrame({"method": ["a", "b"], "percentile": [10.0, 90.0], "model": "m"})
    fig = plots.plot_method_scores(table, col="model")
    assert fig.axes[0].get_title() == "m"
    plt.close("all")


def test_plot_helper_errors():
    with pytest.raises(ValueError, match="square"):
        plots.plot_cka_heatmap(np.zeros((2, 3)))
    with pytest.raises(ValueError, match="layer labels"):
        plots.plot_cka_heatmap(np.zeros((2, 2)), layers=[0, 1, 2])
    with pytest.raises(ValueError, match="columns"):
        plots.plot_layer_curves(pd.DataFrame({"layer": [0]}), y="missing")
    with pytest.raises(ValueError, match="empty"):
        plots.plot_subset_distribution([], {})
    plt.close("all")


def test_layer_table_from_layer_stats():
    from actwave.stats.layerstats import layer_stats

    hidden = torch.randn(3, 50, 8, generator=torch.Generator().manual_seed(0))  # (L, n, d)
    stats = layer_stats(hidden)
    table = plots.layer_table(stats, model="m", token_set="all")
    assert list(table.columns) == ["model", "token_set", "layer", "entropy", "renyi2",
                                   "entropy_norm", "n_tokens"]
    assert table["layer"].tolist() == [0, 1, 2]
    assert np.allclose(table["entropy_norm"], stats.entropy.numpy() / np.log(8))
    assert (table["renyi2"] <= table["entropy"] + 1e-12).all()  # H₂ ≤ H₁


def test_figures_byte_stable_across_processes(tmp_path):
    """Fresh interpreters with different hash seeds (set order, font subsetting) agree."""
    import subprocess
    import sys

    script = ("import sys, numpy as np\nfrom actwave import plots\nplots.setup_style()\n"
              "fig = plots.plot_cka_heatmap(np.eye(5) * 0.5 + 0.5, compartments=[(0, 2)], "
              "marked_layers=[1], title='ℓ H₂')\nplots.save_figure(fig, 'f', 'nb', sys.argv[1])\n")
    outputs = []
    for seed in ("1", "2"):
        out = tmp_path / seed
        env = {**os.environ, "PYTHONHASHSEED": seed, "MPLBACKEND": "Agg"}
        subprocess.run([sys.executable, "-c", script, str(out)], check=True, env=env)
        outputs.append({p.name: p.read_bytes() for p in out.iterdir()})
    assert outputs[0] == outputs[1] and set(outputs[0]) == {"f.png", "f.pdf", "MANIFEST.json"}


def test_relative_figures_dir_is_taken_from_the_repo_root(monkeypatch):
    monkeypatch.setenv("ACTWAVE_FIGURES", "results/x/figures")
    assert plots.default_figures_dir() == config.repo_root() / "results" / "x" / "figures"
