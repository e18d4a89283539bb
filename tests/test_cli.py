"""``python -m actwave select`` on a tiny random Llama saved to a folder with its own tiny
byte-level BPE tokenizer (no real model needed)."""
import csv
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from actwave.capture import data
from actwave.capture.store import CaptureStore
from actwave.eagle3.export import ENGINES, engine_reads
from actwave.profile import build, parameters
from actwave.tools import cli
from actwave.tools.runplan import load_profile

SPECIAL = ["<|bos|>", "<|end|>", "<|user|>", "<|assistant|>", "<|system|>"]
CHAT_TEMPLATE = ("{{ '<|bos|>' }}{% for m in messages %}{{ '<|' + m['role'] + '|>' + m['content']"
                 " + '<|end|>' }}{% endfor %}{% if add_generation_prompt %}"
                 "{{ '<|assistant|>' }}{% endif %}")
NUM_LAYERS = 8  # EAGLE-3 default (2, 4, 5)


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level BPE (any text tokenizes) with 100 merges learnt from ShareGPT replies."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=256 + len(SPECIAL) + 100, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    texts = [m["content"] for row in data.sharegpt_split("eval", n=20) for m in row["messages"]]
    tokenizer.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<|bos|>",
                                   eos_token="<|end|>", pad_token="<|end|>",
                                   additional_special_tokens=SPECIAL[2:],
                                   chat_template=CHAT_TEMPLATE)


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("models") / "tiny-select-llama"
    tokenizer = tiny_tokenizer()
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
        num_hidden_layers=NUM_LAYERS, num_attention_heads=4, num_key_value_heads=2,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
    )).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def run(folder, tmp_path, *extra):
    out = tmp_path / "select.json"
    argv = ["select", "--model", str(folder), "--sequences", "6", "--max-seq-len", "48",
            "--json", str(out), *extra]
    assert cli.main(argv) == 0
    return json.loads(out.read_text())


def test_select_prints_sets_percentiles_and_engine_ids(model_folder, tmp_path, capsys):
    result = run(model_folder, tmp_path)
    printed = capsys.readouterr().out
    assert result["num_layers"] == NUM_LAYERS and result["n_subsets"] == 56  # C(8, 3)
    assert list(result["token_sets"]) == ["all tokens", "top 50% entropy"]
    filtered = result["token_sets"]["top 50% entropy"]
    assert 0 < filtered["n_tokens"] < result["token_sets"]["all tokens"]["n_tokens"]
    labels = {row["label"] for row in filtered["methods"]}
    assert {"renyi2_exhaustive", "eagle3_default", "mrmr", "cka_farthest"} <= labels
    top, default = result["picks"]["top_proxy"], result["picks"]["eagle3_default"]
    assert top["renyi2_pct"] == 100.0  # the exhaustive argmax of that very score
    assert default["layers"] == [2, 4, 5] and 0 < default["renyi2_pct"] <= 100
    assert result["recommendation"]["layers"] == default["layers"]  # not the proxy pick
    assert list(result["engine_ids"]) == ["recommended"]  # exports: the recommended set only
    for engine, entry in result["engine_ids"]["recommended"].items():
        if "ids" in entry:  # each engine's own rule reads the ids as the chosen layers
            assert list(engine_reads(engine, entry["ids"], NUM_LAYERS)) == default["layers"]
    assert result["engine_ids"]["recommended"]["sglang>=pr25454"] == {"ids": [1, 3, 4]}
    assert set(result["engine_ids"]["recommended"]) == set(ENGINES)
    assert f"EAGLE-3 default                    {tuple(default['layers'])}" in printed
    assert "[1, 3, 4]" in printed and "sglang>=pr25454" in printed
    assert f"renyi2_exhaustive         {tuple(top['layers'])}" in printed
    assert f"RECOMMENDATION: {tuple(default['layers'])} (eagle3_default)" in printed


def test_select_on_regenerated_replies_captures_the_targets_own_text(model_folder, tmp_path,
                                                                    monkeypatch):
    monkeypatch.setenv("ACTWAVE_CACHE", str(tmp_path / "cache"))
    original = run(model_folder, tmp_path)
    regenerated = run(model_folder, tmp_path, "--source", "regenerated", "--regen-new-tokens", "8")
    store = CaptureStore(tmp_path / "cache" / regenerated["store"])  # relative to the cache
    assert store.manifest["config"]["source"] == "regenerated"
    assert regenerated["store_digest"] != original["store_digest"]
    assert list((tmp_path / "cache" / "regenerated").iterdir())  # the replies, cached


def test_select_says_what_the_proxies_are_evidence_of(model_folder, tmp_path, capsys):
    """Without --validate: the proxies are no evidence of acceptance, the study's committed
    tables are cited (read at run time), and the default is recommended."""
    result = run(model_folder, tmp_path)
    printed = capsys.readouterr().out
    assert "not draft acceptance" in printed and "no validation run" in printed
    assert result["evidence"][0].startswith("The proxies")
    # the tiny model is outside the study: every bundled model's committed result is cited
    assert "The study has no result for tiny-select-llama" in printed
    table = Path(__file__).parents[1] / "results/study/10_sets_vs_default_smollm2-135m.csv"
    row = next(r for r in csv.DictReader(table.open()) if r["label"].endswith("@filtered")
               and r["label"].startswith("renyi2_exhaustive"))
    assert "results/study/10_sets_vs_default_smollm2-135m.csv" in printed
    # the seed × sequence CI where the set has 3 seeds, else the flagged sequence-only one
    low, high = (("vs_default_ci_low", "vs_default_ci_high") if row["vs_default_ci_low"]
                 else ("vs_default_seq_ci_low", "vs_default_seq_ci_high"))
    assert (f"renyi2_exhaustive@filtered ({row['layer_ids']}): Δτ̂ "
            f"{float(row['vs_default_diff']):+.4f} ") in printed
    assert f"95% CI {float(row[low]):+.4f}, {float(row[high]):+.4f}" in printed
    assert "smollm2-135m: no proxy ranks trained drafts" in printed


def test_select_rerun_reads_the_cache_and_other_k(model_folder, tmp_path, monkeypatch, capsys):
    run(model_folder, tmp_path)  # makes the cache if the test above did not run
    capsys.readouterr()
    monkeypatch.setattr("actwave.capture.store.load", lambda *a, **k: pytest.fail("model reloaded"))
    result = run(model_folder, tmp_path, "--k", "2", "--engine", "vllm>=pr36063",
                 "--method", "mrmr")
    assert "eagle3_default" not in result["picks"]  # EAGLE-3's default exists for k = 3 only
    labels = [row["label"] for row in result["token_sets"]["all tokens"]["methods"]]
    assert sorted(labels) == ["mrmr", "renyi2_exhaustive"]  # the recommended one always runs
    assert len(result["picks"]["top_proxy"]["layers"]) == 2 and result["n_subsets"] == 28
    assert result["recommendation"] is None  # no default to recommend for k = 2
    assert list(result["engine_ids"]["top_proxy (unvalidated)"]) == ["vllm>=pr36063"]
    printed = capsys.readouterr().out
    assert "D eagle3_default" not in printed and "RECOMMENDATION: none" in printed


def test_k_beyond_the_models_layers_is_refused(model_folder, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["select", "--model", str(model_folder), "--sequences", "6",
                  "--max-seq-len", "48", "--k", "9"])
    assert exit_info.value.code == 2
    assert "k must be an int in [1, 8]" in capsys.readouterr().err


@pytest.mark.parametrize("flags, message", [
    (["--k", "0"], "--k must be ≥ 1, got 0"),
    (["--filter-quantile", "1.5"], r"--filter-quantile must be in \[0, 1\), got 1.5"),
    (["--max-tokens", "2"], "--max-tokens must be 0"),
    (["--engine", "sglang"], "invalid choice: 'sglang'"),
    (["--validate", "--candidates", "0"], "--candidates must be ≥ 1, got 0"),
    (["--validate", "--seeds", "1"], "--seeds must be ≥ 3 .*got 1"),
    (["--validate", "--budget", "0"], "--budget must be ≥ 1 training step, got 0"),
    (["--validate", "--k", "2"], "--validate compares with the EAGLE-3 default.*got 2"),
    (["--validate", "--alpha", "0.5"], r"--alpha must be in \(0, 0.5\).*got 0.5"),
])
def test_bad_arguments_are_refused_before_any_work(flags, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["select", "--model", "no-such-model", *flags])
    assert exit_info.value.code == 2
    assert re.search(message, capsys.readouterr().err)


def test_defaults_are_the_cpu_profile():
    """So the command reads the caches ./reproduce.sh left (same capture and stats keys):
    every option named as a cpu profile parameter defaults to its value, but the device (the
    machine's); the configs it builds are the notebooks'."""
    values = parameters(load_profile("cpu"))
    args = vars(cli.build_parser().parse_args(["select", "--model", "smollm2-135m"]))
    shared = sorted(set(values) & set(args) - {"device"})
    assert {"capture_n_sequences", "capture_max_seq_len", "capture_dtype", "capture_batch_size",
            "filter_quantile", "max_tokens", "matmul_dtype", "k", "seed"} <= set(shared)
    assert {dest: args[dest] for dest in shared} == {dest: values[dest] for dest in shared}
    assert build("capture", args, model="m", split="analysis") == \
        build("capture", values, model="m", split="analysis")
    assert build("analysis", args) == build("analysis", values)


def test_module_entry_point_runs():
    done = subprocess.run([sys.executable, "-m", "actwave", "select", "--help"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "--filter-quantile" in done.stdout


def test_help_lists_every_subcommand():
    done = subprocess.run([sys.executable, "-m", "actwave", "--help"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0
    for name in ("select", *cli.DELEGATES):
        assert re.search(rf"^\s+{name}\s", done.stdout, re.M), f"{name} not in actwave --help"


@pytest.mark.parametrize("command", ["select", *cli.DELEGATES])
def test_every_subcommand_has_its_own_help(command, capsys, monkeypatch):
    monkeypatch.setattr(sys, "path", list(sys.path))  # bench's run_all.py adds benchmarks/
    with pytest.raises(SystemExit) as exit_info:
        cli.main([command, "--help"])
    assert exit_info.value.code == 0
    assert "usage:" in capsys.readouterr().out


def test_console_script_is_the_cli():
    import tomllib
    pyproject = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    assert pyproject["project"]["scripts"] == {"actwave": "actwave.tools.cli:main"}


def test_delegates_pass_their_arguments_and_exit_status(monkeypatch):
    from actwave.tools import compare
    seen = []
    monkeypatch.setattr(compare, "main", lambda argv: seen.append(argv) or 3)
    assert cli.main(["compare", "--profile", "study"]) == 3
    assert seen == [["--profile", "study"]]
