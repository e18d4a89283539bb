"""The layer-set study: the sets, the records (resume from the repo), the statistics."""
import dataclasses
import itertools
import json
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from scipy import stats as scipy_stats

from actwave import index
from actwave.config import config_hash
from actwave.profile import build, parameters
from actwave.stats import selection
from actwave.stats.layerstats import layer_stats
from actwave.study import report, runs, stats as study_stats
from actwave.tools.runplan import load_profile
from conftest import tiny_model
from test_eagle3_train import _tiny_store

N = 12


def synthetic_stats(seed=0):
    """LayerStats of N+1 random correlated 'layers' (a random walk over depth)."""
    generator = torch.Generator().manual_seed(seed)
    steps = torch.randn(N + 1, 300, 12, generator=generator, dtype=torch.float64)
    return layer_stats(steps.cumsum(0))


def config(**changes):
    values = dict(model="test/tiny", seed=0, train_sequences=8, eval_sequences=4, max_seq_len=32,
                  regen_new_tokens=8, eval_new_tokens=8, capture_batch_size=4,
                  capture_dtype="float32", train_steps=3, warmup_steps=1, batch_size=2,
                  ttt_steps=2, lr=1e-3, draft_vocab_size=64, train_dtype="float32",
                  checkpoint_every=3, depth=2, tree_top_k=3, n_random=6, n_seeds=3,
                  extra_k="2,4", curve_factor=2)
    return runs.StudyConfig.from_flat({**values, **changes})


# ----------------------------------------------------------------------------- the config
STUDY_RESULTS = Path(__file__).resolve().parents[1] / "results" / "study"
COMMITTED = sorted(STUDY_RESULTS.glob("*/records/*.json"))


def study_profile_config(model: str) -> runs.StudyConfig:
    """The study config notebook 08 builds for ``model`` from profiles/study.yaml."""
    profile = load_profile("study")
    config = build("study", parameters(profile), model=model)
    extra = config.extra_k if model in profile["extra_k_models"].split(",") else ""
    return dataclasses.replace(config, extra_k=extra)


def test_committed_records_keep_their_keys():
    """Every committed study record is keyed by ``record_key(config, train, stores)``: the
    config built from profiles/study.yaml, the draft's TrainConfig, and the identities of
    the stores it would capture (capture config hash, the bundled target's digest, the
    record's text hashes) give exactly the record's key, so a fresh clone on any CPU reads
    every record instead of retraining."""
    assert {path.parent.parent.name for path in COMMITTED} == {"smollm2-135m", "gemma3-270m"}
    for path in COMMITTED:
        record = json.loads(path.read_text())
        config = study_profile_config(record["model"])
        train = config.train_config(record["layer_ids"], record["seed"], record["steps_factor"])
        assert config.flat() == record["study"], path.name
        assert json.loads(json.dumps(dataclasses.asdict(train))) == record["train"], path.name
        assert runs.StudyConfig.from_flat(record["study"]) == config, path.name
        identities = runs.expected_identities(config, record["data_hashes"])
        assert runs.key_of(config, train, identities) == record["key"], path.name


@pytest.mark.real_model
@pytest.mark.parametrize("model", ["smollm2-135m", "gemma3-270m"])
def test_committed_records_were_scored_on_the_pinned_text(model):
    """The regenerated text the study profile asks for is pinned in the repo (and nothing
    else is), and every committed record of the model was made on exactly that text: a
    fresh clone restores it, captures it and reads every record. A record over other text
    (made before a change of the splits, say) would be silently retrained by notebook 08;
    its key alone cannot tell, since it hashes the record's own text hashes."""
    from actwave.capture import models as model_zoo, regenerate
    from actwave.capture.store import regen_config, tokenize_split

    config = study_profile_config(model)
    pinned = STUDY_RESULTS / model_zoo.slug(model) / "regenerated"
    tokenizer = model_zoo.load_tokenizer(model)
    records = [json.loads(path.read_text()) for path in COMMITTED
               if path.parent.parent.name == model_zoo.slug(model)]
    expected = set()
    for split in ("train", "eval"):
        capture = config.capture_for(split)
        folder = regenerate.output_dir(regen_config(capture)).name
        expected.add(folder)
        assert (pinned / folder / "manifest.json").is_file(), f"{folder} is not pinned"
        regenerate.restore(regen_config(capture), pinned)
        _, text_hash = tokenize_split(capture, tokenizer)
        stale = sorted(f"{r['label']}__seed{r['seed']}" for r in records
                       if r["data_hashes"][split] != text_hash)
        assert not stale, f"{len(stale)} records scored on other {split} text: {stale[:5]}"
    assert {path.name for path in pinned.iterdir()} == expected


class FakeStore:
    """What ``record_key`` and ``draft_cache_key`` read of a CaptureStore."""

    def __init__(self, digest="abc", dataset_hash="text1"):
        self.digest = digest  # the shards' bits too
        self.manifest = {"config_hash": "cfg", "model_digest": "model",
                         "dataset_hash": dataset_hash}


def test_record_key_hashes_the_flat_layout_and_store_identities():
    """The key is the hash of the flat study dict (the pre-nesting layout), the draft's
    TrainConfig and each store's identity; the stored bits key only the draft cache."""
    stores = {"train": FakeStore(), "eval": FakeStore()}
    train = config().train_config((1, 2, 3), 0)
    identity = {"config_hash": "cfg", "model_digest": "model", "dataset_hash": "text1"}
    key = runs.record_key(config(), train, stores)
    assert key == config_hash({"study": config().flat(), "train": dataclasses.asdict(train),
                               "stores": {"train": identity, "eval": identity}})
    other_bits = {"train": FakeStore(digest="other"), "eval": FakeStore()}
    assert runs.record_key(config(), train, other_bits) == key  # another CPU's capture
    assert runs.draft_cache_key(key, other_bits) != runs.draft_cache_key(key, stores)
    other_text = {"train": FakeStore(dataset_hash="text2"), "eval": FakeStore()}
    assert runs.record_key(config(), train, other_text) != key


def test_nested_study_config_fills_captures_and_drafts():
    study = config()
    assert study.capture_for("train") == study.capture
    assert study.capture.split == "train" and study.capture.model == "test/tiny"
    eval_capture = study.capture_for("eval")
    assert (eval_capture.split, eval_capture.n_sequences, eval_capture.regen_new_tokens) == \
        ("eval", 4, 8)
    curve = study.train_config((3, 1), 5, steps_factor=2)
    assert (curve.layer_ids, curve.seed, curve.total_steps, curve.checkpoint_every) == \
        ((3, 1), 5, 6, 1)
    with pytest.raises(ValueError, match="train.max_seq_len=32 differs"):
        dataclasses.replace(study, capture=dataclasses.replace(study.capture, max_seq_len=64))
    with pytest.raises(ValueError, match="capture.source='sharegpt'"):
        dataclasses.replace(study, capture=dataclasses.replace(study.capture, source="sharegpt"))
    with pytest.raises(ValueError, match="missing \\['curve_factor'\\]"):
        runs.StudyConfig.from_flat({k: v for k, v in study.flat().items() if k != "curve_factor"})


@pytest.mark.parametrize("num_layers", range(7, 41))
def test_eagle3_rule_extends_the_default(num_layers):
    assert runs.eagle3_rule(num_layers, 3) == selection.eagle3_default(num_layers)
    assert runs.eagle3_rule(num_layers, 2) == (2, num_layers - 3)
    if num_layers >= 10:
        assert len(runs.eagle3_rule(num_layers, 4)) == 4
    else:
        with pytest.raises(ValueError, match="distinct layers"):
            runs.eagle3_rule(num_layers, 4)


def test_study_sets_are_distinct_and_seeded_as_specified():
    stats = {"all": synthetic_stats(0), "filtered": synthetic_stats(1)}
    sets = runs.study_sets(stats, N, config())
    layer_sets = [s.layer_ids for s in sets]
    assert len(layer_sets) == len(set(layer_sets))
    default = [s for s in sets if s.kind == "default"]
    assert default[0].layer_ids == selection.eagle3_default(N) and default[0].seeds == 3
    assert sum(s.seeds == 3 for s in sets if s.kind == "selected") == 2
    randoms = [s for s in sets if s.kind == "random"]
    assert len(randoms) == 6 and {s.label.split("_")[1] for s in randoms} == {"low", "mid", "high"}
    assert {len(s.layer_ids) for s in sets if s.kind == "extra_k"} == {2, 4}
    assert (N,) in layer_sets  # the single top layer


def test_stratified_random_draws_from_each_third():
    stats = synthetic_stats(0)
    score = selection.renyi2_score(stats)
    candidates = range(1, N + 1)
    subsets = selection.all_subsets(list(candidates), 3)
    cuts = np.quantile(score(subsets).numpy(), [1 / 3, 2 / 3])
    picks = runs.stratified_random(score, candidates, 3, 9, exclude=[(1, 2, 3)], seed=0)
    assert len({layers for _, layers in picks}) == 9 and (1, 2, 3) not in dict(picks).values()
    for label, layers in picks:
        value = float(score(torch.tensor([layers]))[0])
        band = label.split("_")[1]
        if band == "low":
            assert value <= cuts[0] + 1e-12
        if band == "high":
            assert value >= cuts[1] - 1e-12


def test_draft_order_puts_first_seeds_first():
    sets = [runs.StudySet("a", (1,), "default", 3), runs.StudySet("b", (2,), "random", 1)]
    assert [(s.label, i) for s, i in runs.draft_order(sets)] == [
        ("a", 0), ("b", 0), ("a", 1), ("a", 2)]


# ----------------------------------------------------------------------------- records
@pytest.fixture(scope="module")
def tiny_study(tmp_path_factory):
    target = tiny_model("llama")
    root = tmp_path_factory.mktemp("study")
    (root / "train").mkdir()
    (root / "eval").mkdir()
    stores = {"train": _tiny_store(root / "train", target, 8, seed=0),
              "eval": _tiny_store(root / "eval", target, 4, seed=1)}
    with pytest.MonkeyPatch.context() as patch:  # the drafts: a draft cache of this module
        patch.setenv("ACTWAVE_CACHE", str(root / "cache"))
        yield target, stores, root


def test_run_draft_writes_a_record_and_a_rerun_reads_it(tiny_study, monkeypatch):
    target, stores, root = tiny_study
    study_set = runs.StudySet("eagle3_default", (1, 2, 3), "default", 1)
    record = runs.run_draft(study_set, 0, config(), target, stores, root / "results")
    assert record["offline"]["tau_hat"] >= 1.0
    assert len(record["offline"]["per_sequence"]) == 4
    assert all(r["roots"] > 0 for r in record["offline"]["per_sequence"])
    assert runs.record_path(root / "results", "eagle3_default", 0).exists()
    train = config().train_config(study_set.layer_ids, 0)
    cache_key = runs.draft_cache_key(record["key"], stores)  # the record's and the bits'
    folder = index.draft_dir("test/tiny", train, cache_key)
    assert folder.parent == root / "cache" / "drafts"  # the one draft cache
    assert folder.name == f"test--tiny-L1-2-3-s0-{cache_key}"
    assert (folder / "draft" / "config.json").exists()

    def no_training(*args, **kwargs):
        raise AssertionError("a finished record must not be retrained")

    monkeypatch.setattr(runs, "train_draft", no_training)
    again = runs.run_draft(study_set, 0, config(), target, stores, root / "results")
    assert again == record
    with pytest.raises(AssertionError, match="must not be retrained"):  # another budget
        runs.run_draft(study_set, 0, config(train_steps=4), target, stores, root / "results")
    monkeypatch.setitem(stores["eval"].manifest, "dataset_hash", "other-text")
    with pytest.raises(AssertionError, match="must not be retrained"):  # other held-out text
        runs.run_draft(study_set, 0, config(), target, stores, root / "results")


def test_curve_run_records_offline_tau_per_checkpoint(tiny_study):
    target, stores, root = tiny_study
    study_set = runs.StudySet("eagle3_default", (1, 2, 3), "default", 1)
    record = runs.run_draft(study_set, 0, config(train_steps=4), target, stores,
                            root / "curve", steps_factor=2)
    assert [p["step"] for p in record["curve"]] == [2, 4, 6, 8]
    assert all(p["tau_hat"] >= 1.0 for p in record["curve"])
    assert record["curve"][-1]["tokens"] > record["curve"][0]["tokens"]


def test_corrupted_record_names_the_file(tmp_path):
    path = tmp_path / "records" / "x__seed0.json"
    path.parent.mkdir()
    path.write_text("{not json")
    with pytest.raises(ValueError, match="x__seed0.json"):
        runs.load_record(path)


# ----------------------------------------------------------------------------- statistics
def fake_records(label, accepted, roots=10, kind="selected", layers=(1, 2, 3)):
    """Records of one set: accepted (n_seeds, n_sequences) per-sequence sums."""
    out = []
    for seed, row in enumerate(np.atleast_2d(accepted)):
        per = [{"sequence": i, "roots": roots, "accepted": int(a), "reached": [int(a)],
                "accepted_topk": int(a), "reached_topk": [int(a)], "walk_tau": math.nan,
                "walk_rounds": 0} for i, a in enumerate(row)]
        tau = 1 + row.sum() / (roots * len(row))
        out.append({"label": label, "seed": seed, "kind": kind, "layer_ids": list(layers),
                    "steps_factor": 1, "offline": {"per_sequence": per, "tau_hat": tau,
                                                    "tau_hat_topk": tau,
                                                    "step_acceptance": [0.5]}})
    return out


def test_paired_difference_sign_and_na_rule():
    rng = np.random.default_rng(0)
    base = rng.integers(2, 8, size=(3, 30))
    reference = fake_records("eagle3_default", base, kind="default")
    better = fake_records("b", base + 2)
    result = study_stats.paired_difference(better, reference, n_bootstrap=500)
    assert result["diff"] == pytest.approx(0.2)
    assert 0 < result["ci_low"] <= result["diff"] <= result["ci_high"]
    same = study_stats.paired_difference(fake_records("c", base), reference, n_bootstrap=200)
    assert same["seq_ci_low"] == same["seq_ci_high"] == 0.0
    one_seed = study_stats.paired_difference(fake_records("d", base[:1]), reference,
                                             n_bootstrap=200)
    assert math.isnan(one_seed["ci_low"]) and not math.isnan(one_seed["seq_ci_low"])


def test_bootstrap_tau_equals_a_loop_over_cells():
    rng = np.random.default_rng(1)
    accepted, roots = rng.integers(0, 9, (3, 5)).astype(float), rng.integers(5, 9, (3, 5)).astype(float)
    seed_rows, cols = rng.integers(0, 3, (4, 3)), rng.integers(0, 5, (4, 5))
    fast = study_stats._boot_tau(accepted, roots, seed_rows, cols)
    for b in range(4):
        a = sum(accepted[s, c] for s in seed_rows[b] for c in cols[b])
        r = sum(roots[s, c] for s in seed_rows[b] for c in cols[b])
        assert fast[b] == pytest.approx(1 + a / r)


def test_permutation_p_matches_exact_enumeration():
    x = np.array([0.3, 1.2, 0.7, 2.0, 1.9, 0.1])
    y = np.array([1.0, 1.5, 0.9, 2.2, 1.4, 0.2])
    observed = scipy_stats.spearmanr(x, y)[0]
    exact = np.mean([abs(scipy_stats.spearmanr(x, np.array(p))[0]) >= abs(observed) - 1e-12
                     for p in itertools.permutations(y)])
    result = study_stats.rank_correlation(x, y, n_permutations=4000, seed=0)
    assert result["spearman"] == pytest.approx(observed)
    assert result["spearman_p"] == pytest.approx(exact, abs=0.02)
    assert math.isnan(study_stats.rank_correlation([1, 2], [2, 1])["spearman"])


def test_summary_and_correlations_over_sets():
    rng = np.random.default_rng(2)
    records = fake_records("eagle3_default", rng.integers(2, 8, (3, 20)), kind="default")
    sets_rows = [{"label": "eagle3_default", **{f"{p}_{s}": 0.0 for p in runs.PROXIES
                                                 for s in runs.SETTINGS}}]
    for i in range(6):
        records += fake_records(f"r{i}", rng.integers(0, 3, (1, 20)) + i, kind="random")
        sets_rows.append({"label": f"r{i}", **{f"{p}_{s}": float(i) for p in runs.PROXIES
                                               for s in runs.SETTINGS}})
    summary = report.summary_table(records, n_bootstrap=200)
    assert summary["tau_hat"].is_monotonic_decreasing
    assert summary.loc[summary["label"] == "r5", "vs_default_ci_low"].isna().all()
    correlations = report.proxy_correlations(summary, pd.DataFrame(sets_rows),
                                             n_permutations=500)
    proxy = [0.0 if label == "eagle3_default" else float(label[1]) for label in summary["label"]]
    expected = scipy_stats.spearmanr(proxy, summary["tau_hat"])[0]
    assert (correlations["n"] == 7).all()
    assert correlations["spearman"].to_numpy() == pytest.approx(expected)
    assert report.noise_floor(summary) > 0


def test_long_proxy_correlations_rank_each_budget_s_seed_means():
    rng = np.random.default_rng(3)
    labels = [f"s{i}" for i in range(6)]
    proxies = pd.DataFrame([{"label": label, **{f"{p}_{s}": float(rng.normal()) for p in runs.PROXIES
                                               for s in runs.SETTINGS}} for label in labels])
    curves = pd.DataFrame([{"budget": budget, "label": label, "tau_hat": float(rng.normal())}
                           for budget in (64, 2048) for label in labels + ["not_scored"]])
    table = report.long_proxy_correlations(curves, proxies, n_permutations=200)
    assert len(table) == 2 * len(runs.PROXIES) * len(runs.SETTINGS) and (table["n"] == 6).all()
    row = table[(table.budget == 2048) & (table.proxy == "logdet") & (table.token_set == "filtered")]
    at_2048 = curves[curves.budget == 2048].merge(proxies, on="label")  # the proxy-less set drops
    expected = scipy_stats.spearmanr(at_2048["logdet_filtered"], at_2048["tau_hat"])[0]
    assert row["spearman"].item() == pytest.approx(expected)


def test_study_stores_index_reads_notebook_08s_first_layout_and_names_it(tmp_path):
    assert index.read_whole_index(tmp_path, index.STUDY_STORES) == {}
    # notebook 08's first layout, {model: {split: folder}}, as committed in results/study
    (tmp_path / "08_stores.json").write_text(json.dumps({"smollm2-135m": {"train": "x"}}))
    assert index.read_index(tmp_path, index.STUDY_STORES, ["smollm2-135m"]) == {
        "smollm2-135m": {"train": "x"}}
    assert index.store_path("capture/x") == index.store_path({"store": "capture/x"})
    with pytest.raises(ValueError, match=r"nothing for \['gemma3-270m'\].*08_study_drafts"):
        index.open_stores(tmp_path, ["gemma3-270m"], "train", index.STUDY_STORES)
    with pytest.raises(ValueError, match=r"08_study_drafts made no 'eval' store.*\['train'\]"):
        index.open_stores(tmp_path, ["smollm2-135m"], "eval", index.STUDY_STORES)
    with pytest.raises(ValueError, match="'06_drafts' is not a store index"):
        index.open_stores(tmp_path, ["smollm2-135m"], "train", index.DRAFTS)


def test_depth_correlations_read_the_layer_ids_of_each_trained_triple():
    summary = pd.DataFrame({"label": ["a", "b", "c", "d", "e"], "k": [3, 3, 3, 3, 2],
                            "layer_ids": ["1,2,3", (2, 3, 9), "4,5,6", [1, 8, 20], (7, 8)],
                            "tau_hat": [1.5, 1.1, 1.4, 1.0, 9.9]})
    table = report.depth_correlations(summary, n_permutations=200).set_index("feature")
    assert (table["n"] == 4).all()  # the k = 2 set is left out
    deepest = [3, 9, 6, 20]
    assert table.loc["deepest", "spearman"] == pytest.approx(
        scipy_stats.spearmanr(deepest, [1.5, 1.1, 1.4, 1.0])[0])
    assert table.loc["deepest", "spearman"] == pytest.approx(-1.0)
    assert table.loc["spread", "kendall"] == pytest.approx(
        scipy_stats.kendalltau([2, 7, 2, 19], [1.5, 1.1, 1.4, 1.0])[0])
