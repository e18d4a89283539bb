"""Regenerated-text pools: one declaration per (model, pool name), refused by name otherwise."""
import pytest
import yaml

from actwave.capture import pools
from actwave.capture.regenerate import RegenConfig, output_dir


def test_declared_pools_are_valid_configs_with_pinned_folder_names():
    declared = pools.pool_configs()
    assert "smollm2-135m" in declared and "gemma3-270m" not in declared
    for model, splits in declared.items():
        assert {"train", "eval"} <= set(splits)
        for name, config in splits.items():
            assert isinstance(config, RegenConfig) and config.model == model
            # only the eval pool reads the eval split: drafts never train on held-out prompts
            assert (config.split == "eval") == (name == "eval"), (name, config.split)
    train = pools.pool_config("smollm2-135m", "train")
    assert train.n_conversations >= 3000  # long runs see each sequence at most ~2 times
    assert output_dir(train).name.startswith("smollm2-135m-train-")


def test_unknown_pool_is_refused_by_name():
    with pytest.raises(ValueError, match="no regenerated-text pool for model 'gemma3-270m'"):
        pools.pool_config("gemma3-270m", "train")
    with pytest.raises(ValueError, match="no 'analysis' pool for 'smollm2-135m'"):
        pools.pool_config("smollm2-135m", "analysis")


def test_a_named_pool_reads_its_split_and_gets_its_own_folder(tmp_path, monkeypatch):
    fields = dict(max_prompt_len=160, max_new_tokens=160, dtype="bfloat16")
    (tmp_path / "pools.yaml").write_text(yaml.safe_dump({"smollm2-135m": {
        "train": {"n_conversations": 32, **fields},
        "bench": {"split": "train", "n_conversations": 64, "batch_size": 64, **fields}}}))
    monkeypatch.setenv("ACTWAVE_POOLS", str(tmp_path / "pools.yaml"))
    train, bench = (pools.pool_config("smollm2-135m", name) for name in ("train", "bench"))
    assert train.split == bench.split == "train"
    assert output_dir(bench) != output_dir(train)  # the same prompts, regenerated apart
    with pytest.raises(ValueError, match="no 'eval' pool for 'smollm2-135m'.*'bench', 'train'"):
        pools.pool_config("smollm2-135m", "eval")
