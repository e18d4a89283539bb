"""One source of parameters and the stage hand-over: profiles, library config defaults,
the indexes notebooks 01/05/06 write and later notebooks read.

The committed cpu results pin the cache keys: the library must rebuild exactly the store
and draft folders the cpu run recorded, from the cpu profile's values alone.
"""
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from actwave import config, index
from actwave.capture.store import CaptureConfig, store_dir, store_key, write_manifest
from actwave.eagle3.train import TrainConfig
from actwave.integrity import bytes_record
from actwave.profile import SECTIONS, build, fields, parameters, section
from actwave.stats.selection_report import DRAFT_SOURCES, SelectionConfig
from actwave.tools.runplan import load_profile

ROOT = Path(__file__).resolve().parents[1]
CPU_RESULTS = ROOT / "results" / "cpu"
CPU = parameters(load_profile("cpu"))
# Sections whose config dataclass defaults to the cpu profile's values (the train split's
# capture differs from the analysis split's by design; analysis builds several configs).
CPU_DEFAULT_SECTIONS = ("capture", "selection", "train", "eval")


def cpu_capture_configs():
    return index.capture_configs(CPU["models"], CPU["train_models"], CPU)


def cpu_train_config(layers) -> TrainConfig:
    return build("train", CPU, layer_ids=tuple(layers))


@pytest.mark.parametrize("name", CPU_DEFAULT_SECTIONS)
def test_library_defaults_are_the_cpu_profile(name):
    values = section(CPU, name)
    assert values, f"cpu.yaml has no {name} section"
    defaults = fields(name)
    for key, value in values.items():
        assert defaults[key] == value, \
            f"{SECTIONS[name]}.{key} defaults to {defaults[key]!r}, cpu.yaml {name}.{key}={value!r}"


# Store folders of the cpu profile's captures: keyed by the config and the digest of the
# bundled model's files (actwave.capture.store.store_key). Pinned: a change of key layout
# must be deliberate. The committed results/cpu indexes name the folders of the run that
# made them; they follow this layout once ./reproduce.sh reruns notebook 01.
CPU_STORES = {("smollm2-135m", "analysis"): "smollm2-135m-analysis-550050f6d359",
              ("gemma3-270m", "analysis"): "gemma3-270m-analysis-3fca4123f3a9",
              ("smollm2-135m", "train"): "smollm2-135m-train-1d627e144e7a"}


def test_capture_configs_rebuild_the_committed_cpu_stores(tmp_path, monkeypatch):
    monkeypatch.setenv("ACTWAVE_CACHE", str(tmp_path))
    configs = cpu_capture_configs()
    committed = json.loads((CPU_RESULTS / f"{index.STORES}.json").read_text())
    built = json.loads(json.dumps(index.stores_index(configs)))
    assert {m: {s: e["config"] for s, e in splits.items()} for m, splits in built.items()} \
        == {m: {s: e["config"] for s, e in splits.items()} for m, splits in committed.items()}
    assert list(configs) == [("smollm2-135m", "analysis"), ("gemma3-270m", "analysis"),
                             ("smollm2-135m", "train")]
    for (model, split), capture in configs.items():
        assert built[model][split]["store"] == f"capture/{CPU_STORES[model, split]}"
        assert store_dir(capture).name == CPU_STORES[model, split] == (
            f"{model}-{split}-{config.config_hash(store_key(capture))}")
    recorded = json.loads((CPU_RESULTS / "05_selection_config.json").read_text())["captures"]
    assert {m: config.config_hash(c) for (m, s), c in configs.items() if s == "analysis"} \
        == recorded  # the stores' config hashes (manifest "config_hash") are unchanged
    table = (CPU_RESULTS / "01_capture.csv").read_text()
    for model, split in configs:
        assert f"\n{model},{split}," in table


def test_draft_dirs_rebuild_the_committed_cpu_drafts(tmp_path, monkeypatch):
    """Draft folders (``<slug>-L<layers>-s<seed>-<key>``) are keyed by the train config, the
    target's file digest and both stores' content digests (here stand-ins: the real ones need
    the captured stores)."""
    monkeypatch.setenv("ACTWAVE_CACHE", str(tmp_path))
    stores = {"train": SimpleNamespace(digest="0" * 16), "analysis": SimpleNamespace(digest="1" * 16)}
    sets = json.loads((CPU_RESULTS / "05_candidate_sets.json").read_text())["smollm2-135m"]
    drafts = json.loads((CPU_RESULTS / "06_drafts.json").read_text())["smollm2-135m"]
    assert sorted(sets) == sorted(drafts) == sorted(DRAFT_SOURCES)
    folders = {}
    for label, layers in sets.items():
        train = cpu_train_config(layers)
        key = index.draft_key("smollm2-135m", train, stores["train"], stores["analysis"])
        folder = index.draft_dir("smollm2-135m", train, key)
        name = f"smollm2-135m-L{'-'.join(map(str, layers))}"
        assert folder == tmp_path / "drafts" / f"{name}-s0-{key}"
        assert drafts[label].startswith(f"drafts/{name}-")  # the committed run's folder name
        folders[label] = folder
    assert folders["eagle3_default"].name == "smollm2-135m-L2-15-27-s0-501b979f2aee"  # pinned
    other = index.draft_key("smollm2-135m", cpu_train_config(sets["eagle3_default"]),
                            SimpleNamespace(digest="2" * 16), stores["analysis"])
    assert other not in folders["eagle3_default"].name  # another train store: another draft
    with pytest.raises(ValueError, match=r"draft key must be a config hash.*'\.\./x'"):
        index.draft_dir("smollm2-135m", cpu_train_config(sets["eagle3_default"]), "../x")


def test_capture_configs_need_trained_models_among_models():
    values = {"seed": 0, "capture_n_sequences": 2, "capture_max_seq_len": 64,
              "train_capture_n_sequences": 3, "train_capture_source": "regenerated",
              "train_capture_regen_new_tokens": 16}
    with pytest.raises(ValueError, match=r"train_models \['b'\] are not in models \['a'\]"):
        index.capture_configs("a", "b", values)
    configs = index.capture_configs("a, ", "a", values)
    assert configs["a", "train"].regen_new_tokens == 16 and configs["a", "train"].n_sequences == 3
    assert configs["a", "analysis"].source == "sharegpt"
    assert configs["a", "analysis"].regen_new_tokens == CaptureConfig.regen_new_tokens


def test_candidate_sets_take_the_combined_method():
    unfiltered = {"eagle3_default": (2, 15, 27), "first_k": (1, 2, 3), "renyi2_exhaustive": (2, 28, 29),
                  "logdet_dpp": (5, 6, 7)}
    filtered = {"renyi2_exhaustive": (11, 28, 29), "logdet_dpp": (8, 9, 10),
                "entropy_topk": (26, 27, 29), "cka_farthest": (1, 3, 30)}
    sets = SelectionConfig().candidate_sets(unfiltered, filtered)
    assert sets["entropy_cka_filtered"] == [11, 28, 29] and sets["cka_only"] == [1, 3, 30]
    other = SelectionConfig(combined_method="logdet_dpp").candidate_sets(unfiltered, filtered)
    assert other["entropy_cka_unfiltered"] == [5, 6, 7]
    assert other["entropy_cka_filtered"] == [8, 9, 10]
    assert other["control_adjacent_early"] == [1, 2, 3]


def test_stores_index_round_trip_opens_the_indexed_store(tmp_path, monkeypatch):
    monkeypatch.setenv("ACTWAVE_CACHE", str(tmp_path / "cache"))
    capture = CaptureConfig(model="smollm2-135m", split="analysis", n_sequences=2)
    folder = store_dir(capture)
    (folder / "shard-00000.safetensors").write_bytes(b"stand-in")  # opened by size only
    write_manifest(folder, {"complete": True, "config": config.to_jsonable(capture),
                            "n_sequences": 2, "n_tokens": 3, "shards": [
                                {"file": "shard-00000.safetensors", "first_sequence": 0,
                                 "n_sequences": 2, "n_tokens": 3, **bytes_record(b"stand-in")}]})
    results = tmp_path / "results" / "p"
    built = index.stores_index({("smollm2-135m", "analysis"): capture})
    assert built["smollm2-135m"]["analysis"]["store"] == f"capture/{folder.name}"
    config.atomic_write_json(results / f"{index.STORES}.json", built)
    assert index.open_stores(results, ["smollm2-135m"], "analysis")["smollm2-135m"].path == folder
    with pytest.raises(ValueError, match=r"no 'train' store for \['smollm2-135m'\].*train_models"):
        index.open_stores(results, ["smollm2-135m"], "train")
    with pytest.raises(ValueError, match=r"nothing for \['z'\].*run notebook 01_capture"):
        index.open_stores(results, ["z"], "analysis")
    # a later run for some models replaces their entries and keeps the other models'
    known = {"gemma3-270m": {"analysis": {"store": "capture/g", "config": {}}},
             "smollm2-135m": {"train": {"store": "capture/old", "config": {}}}}
    assert index.stores_index({("smollm2-135m", "analysis"): capture}, known) == {
        "gemma3-270m": known["gemma3-270m"], **built}


def test_missing_index_names_the_notebook_to_run(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"06_drafts.json not found: run notebook "
                                                r"06_train_drafts first \(same profile: p\)"):
        index.read_index(tmp_path / "p", index.DRAFTS, ["m"])
    with pytest.raises(ValueError, match=r"unknown index 'x'"):
        index.read_index(tmp_path, "x", ["m"])


def test_results_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv("ACTWAVE_RESULTS", raising=False)
    assert config.results_dir("cpu") == ROOT / "results" / "cpu"
    monkeypatch.setenv("ACTWAVE_RESULTS", str(tmp_path))
    assert config.results_dir("smoke") == tmp_path / "smoke"
    with pytest.raises(ValueError, match=r"plain name.*'\.\./x'"):
        config.results_dir("../x")


def test_explain_default_compares_with_the_combined_method():
    from test_selection import random_stats

    from actwave.stats.selection_report import compare_methods, explain_default

    stats = random_stats(12, seed=6)
    rows = compare_methods(stats, {"eagle3_default": ("eagle3_default", {}),
                                   "entropy_topk": ("entropy_topk", {})})
    topk = next(row["layers"] for row in rows if row["label"] == "entropy_topk")
    strict = SelectionConfig(combined_method="entropy_topk", competitive_percentile=100.5)
    text = explain_default(stats, rows, strict)
    assert text.startswith("the default (2, 6, 9) is **not competitive**")
    assert f"(entropy_topk set {tuple(sorted(topk))})" in text
    lenient = SelectionConfig(combined_method="entropy_topk", competitive_percentile=0.0)
    assert "is **competitive**" in explain_default(stats, rows, lenient)


@pytest.mark.parametrize("flags, native", [(["avx2", "avx512f"], False),
                                           (["avx2", "avx512_bf16", "avx512f"], True),
                                           (["amx_bf16", "amx_tile"], True), ([], False)])
def test_native_bf16_reads_the_cpu_flags(monkeypatch, flags, native):
    monkeypatch.setattr(config, "cpu_flags", lambda: flags)
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    assert config.native_bf16() is native
