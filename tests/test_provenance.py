"""Nothing stale, ever: every artifact is keyed by the content digests of its inputs, every
JSON record carries its own checksum, and a wrong input is refused naming both sides.

Chain: model files (``models.model_digest``) -> capture store (key: config + model digest;
``CaptureStore.digest``: its shard records) -> layer statistics, drafts, study records
(keys: store digests) -> evaluation runs (key: draft weights + target identity).
"""
import json
import re
import shutil

import pytest
import torch
from conftest import random_sequences, tiny_model, tiny_store
from test_cli import tiny_tokenizer
from test_speculative import StubTokenizer, random_draft
from transformers import LlamaConfig, LlamaForCausalLM

from actwave import index
from actwave.capture import models, store
from actwave.decoding import evaluate as evaluate_mod
from actwave.decoding.evaluate import EvalConfig, evaluate
from actwave.eagle3 import Eagle3Draft
from actwave.eagle3 import train as train_mod
from actwave.integrity import (IntegrityError, content_digest, read_record, write_record)
from actwave.stats import analysis
from actwave.tools import cli


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


def save_model(folder, tokenizer, seed: int) -> str:
    """A tiny random Llama (N=8) with its tokenizer saved to ``folder`` (a model by path)."""
    torch.manual_seed(seed)
    LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=8,
        num_attention_heads=4, num_key_value_heads=2, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def capture_config(folder, **changes) -> store.CaptureConfig:
    return store.CaptureConfig(**{**dict(model=str(folder), split="analysis", n_sequences=6,
                                         max_seq_len=32, batch_size=3, sequences_per_shard=2,
                                         seed=0), **changes})


# ----------------------------------------------------------------------------- records
def test_checksummed_records_round_trip_and_refuse_edits_or_no_checksum(tmp_path):
    path = tmp_path / "record.json"
    written = write_record(path, {"layers": (1, 2, 3), "seconds": 0.25})
    assert read_record(path, "rewrite it") == {"layers": [1, 2, 3], "seconds": 0.25}
    assert written["record_sha256"] == json.loads(path.read_text())["record_sha256"]
    record = json.loads(path.read_text())
    path.write_text(json.dumps({**record, "seconds": 250.0}))
    with pytest.raises(IntegrityError, match=r"record.json: record_sha256 expected .*repair: rewrite"):
        read_record(path, "rewrite it")
    path.write_text(json.dumps({"layers": [1, 2, 3], "seconds": 0.25}))
    with pytest.raises(IntegrityError, match="record.json: record_sha256 expected a self-checksum"):
        read_record(path, "rewrite it")
    path.write_text(json.dumps(record, indent=None))  # layout does not matter, content does
    assert read_record(path, "rewrite it")["seconds"] == 0.25
    assert content_digest({"a": [1, 2]}) == content_digest({"a": (1, 2)}) != content_digest({"a": [2, 1]})


# ----------------------------------------------------------------------------- item 1
def test_new_weights_at_the_same_path_never_reuse_the_old_store(tokenizer, tmp_path, monkeypatch):
    """``select --model <folder>``: the second model saved into the same folder gets its
    own store (the folder's digest is computed on every call, no model object needed)."""
    folder = tmp_path / "m"
    argv = ["select", "--model", str(folder), "--sequences", "4", "--max-seq-len", "32",
            "--method", "mrmr", "--json", str(tmp_path / "out.json")]
    save_model(folder, tokenizer, seed=0)
    assert cli.main(argv) == 0
    first = json.loads((tmp_path / "out.json").read_text())
    save_model(folder, tokenizer, seed=1)  # same path, same shapes, other weights
    assert cli.main(argv) == 0
    second = json.loads((tmp_path / "out.json").read_text())
    assert second["model_digest"] == models.model_digest(str(folder)) != first["model_digest"]
    assert second["store"] != first["store"] and second["store_digest"] != first["store_digest"]
    assert second["token_sets"] != first["token_sets"]  # statistics of the new weights

    # "./m" in two directories: another model, another store; the same model, the same one
    def store_of_dot_m(directory, seed):
        save_model(tmp_path / directory / "m", tokenizer, seed)
        monkeypatch.chdir(tmp_path / directory)
        return store.store_dir(capture_config("./m"))

    assert store_of_dot_m("a", seed=1) != store_of_dot_m("b", seed=2)
    assert store_of_dot_m("c", seed=1) == store_of_dot_m("a", seed=1)


# ----------------------------------------------------------------------------- item 2
def test_recapturing_a_deleted_store_gives_new_downstream_keys(tokenizer, tmp_path):
    folder = save_model(tmp_path / "keyed", tokenizer, seed=3)
    config = capture_config(folder)
    shutil.rmtree(store.store_dir(config), ignore_errors=True)
    first = store.run_capture(config, progress=False)
    settings = analysis.AnalysisConfig(max_tokens=16)
    train = train_mod.TrainConfig(layer_ids=(2, 4, 5), total_steps=2, warmup_steps=0)
    keys = (analysis._cache_key(first, settings), index.draft_key(folder, train, first, first))
    stats_first = analysis.compute_layer_stats(first, settings, progress=False)
    # "delete the store to recapture": here with a model object of other weights
    shutil.rmtree(first.path)
    other, _ = models.load(folder)
    with torch.no_grad():
        other.model.layers[3].mlp.down_proj.weight.mul_(1.5)
    second = store.run_capture(config, other, tokenizer, progress=False)
    assert second.path == first.path and second.digest != first.digest
    assert analysis._cache_key(second, settings) != keys[0]
    assert index.draft_key(folder, train, second, second) != keys[1]
    stats_second = analysis.compute_layer_stats(second, settings, progress=False)
    assert not torch.equal(stats_second.entropy, stats_first.entropy)  # not the old artifact


def test_train_draft_refuses_a_store_of_another_target(tmp_path):
    target_a, target_b = tiny_model("llama", seed=0), tiny_model("llama", seed=1)
    (tmp_path / "store").mkdir()
    store_a = tiny_store(tmp_path / "store", target_a, random_sequences(4))
    config = train_mod.TrainConfig(layer_ids=(1, 2, 3), total_steps=2, warmup_steps=0,
                                   draft_vocab_size=64)
    weights = (store_a.manifest["model"]["weights_sha256"],
               models_weights(target_b))
    with pytest.raises(ValueError, match=rf"training store .*store was captured with target .*"
                                         rf"{weights[0]}.*target passed is .*{weights[1]}"):
        train_mod.train_draft(store_a, target_b, config, tmp_path / "run", progress=False)
    with pytest.raises(ValueError, match="evaluation store"):
        train_mod.train_draft(store_a, target_a, config, tmp_path / "run", progress=False,
                              eval_store=tiny_store_of(tmp_path / "eval", target_b))
    assert not (tmp_path / "run" / "config.json").exists()


def models_weights(model) -> str:
    from actwave.integrity import model_fingerprint
    return model_fingerprint(model)["weights_sha256"]


def tiny_store_of(path, model):
    path.mkdir()
    return tiny_store(path, model, random_sequences(2))


def test_draft_load_refuses_another_target_and_names_both(tokenizer, tmp_path):
    target_a, target_b = tiny_model("llama", seed=0), tiny_model("llama", seed=1)
    draft = Eagle3Draft.from_target(target_a, (1, 2, 3), 64)
    draft.save_pretrained(tmp_path / "draft")
    Eagle3Draft.load(tmp_path / "draft", target_a)
    with pytest.raises(ValueError, match=rf"draft .*draft was trained for target .*"
                                         rf"{models_weights(target_a)}.*not for the target passed"
                                         rf".*{models_weights(target_b)}"):
        Eagle3Draft.load(tmp_path / "draft", target_b)
    with pytest.raises(ValueError, match="no file digest on both sides"):  # in-memory, bf16
        Eagle3Draft.load(tmp_path / "draft", tiny_model("llama", seed=0).to(torch.bfloat16))
    # a target loaded from files is recognised in another dtype by its files' digest
    folder = save_model(tmp_path / "target", tokenizer, seed=4)
    fp32, _ = models.load(folder)
    Eagle3Draft.from_target(fp32, (2, 4, 5), 64).save_pretrained(tmp_path / "by-files")
    bf16, _ = models.load(folder, dtype=torch.bfloat16)
    assert Eagle3Draft.load(tmp_path / "by-files", bf16).target_identity["digest"] \
        == models.model_digest(folder)
    save_model(folder, tokenizer, seed=5)  # new weights behind the same path
    with pytest.raises(ValueError, match="digest"):
        Eagle3Draft.load(tmp_path / "by-files", models.load(folder)[0])


# ----------------------------------------------------------------------------- item 4
def test_a_flipped_layer_id_in_a_draft_record_is_refused(tmp_path):
    target = tiny_model("llama")
    Eagle3Draft.from_target(target, (1, 2, 3), 64).save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    text = path.read_text()
    match = re.search(r'"layer_ids": \[\s*1,\s*2,\s*3', text)
    flipped = bytearray(text.encode())
    flipped[match.end() - 1] ^= 0x01  # '3' -> '2': one bit
    path.write_bytes(bytes(flipped))
    assert json.loads(path.read_text())["config"]["layer_ids"] == [1, 2, 2]
    with pytest.raises(IntegrityError, match=r"config.json: record_sha256 expected .*train_draft"):
        Eagle3Draft.load(tmp_path, target)


def test_removed_or_unhashed_shard_records_leave_a_store_incomplete(tokenizer, tmp_path):
    folder = save_model(tmp_path / "shards", tokenizer, seed=6)
    config = capture_config(folder)
    shutil.rmtree(store.store_dir(config), ignore_errors=True)
    captured = store.run_capture(config, progress=False)
    path, digest = captured.path, captured.digest
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["n_sequences"] == 6 and len(manifest["shards"]) == 3
    cut = {**manifest, "shards": manifest["shards"][:2],
           "n_tokens": sum(s["n_tokens"] for s in manifest["shards"][:2])}
    (path / "manifest.json").write_text(json.dumps(cut))  # removed without its checksum
    with pytest.raises(IntegrityError, match="manifest.json: record_sha256"):
        store.CaptureStore(path)
    store.write_manifest(path, cut)  # removed and re-checksummed: still incomplete by count
    with pytest.raises(ValueError, match="incomplete: its shard records hold 4 of 6 sequences"):
        store.CaptureStore(path)
    unhashed = {**manifest, "shards": [{k: v for k, v in s.items() if k != "sha256"}
                                       for s in manifest["shards"]]}
    store.write_manifest(path, unhashed)
    with pytest.raises(ValueError, match="shard records without a sha256"):
        store.CaptureStore(path)
    (path / manifest["shards"][0]["file"]).write_bytes(b"corrupt")  # and a corrupt shard
    repaired = store.run_capture(config, progress=False)  # the repair: unhashed = recaptured
    assert repaired.digest == digest and repaired.column("entropy").numel() == repaired.n_tokens
    store.write_manifest(path, cut)
    assert store.run_capture(config, progress=False).digest == digest  # the missing shard


# ----------------------------------------------------------------------------- item 3
EVAL = EvalConfig(benchmarks=("humaneval",), n_prompts=2, max_turns=1, max_new_tokens=4,
                  peers=False, mode="chain", depth=2, n_bootstrap=10)


@pytest.fixture(scope="module")
def eval_runs(tmp_path_factory):
    """Two finished runs (drafts of other weights) in one out_dir."""
    llama = tiny_model("llama")
    out = tmp_path_factory.mktemp("eval")
    draft = random_draft(llama)
    other = random_draft(llama)
    with torch.no_grad():
        other.fc.weight.add_(0.01)
    first = evaluate(llama, StubTokenizer(), {"d": draft}, EVAL, [], out_dir=out / "a")
    evaluate(llama, StubTokenizer(), {"d": other}, EVAL, [], out_dir=out / "b")
    run_a, = (out / "a").iterdir()
    run_b, = (out / "b").iterdir()
    return llama, draft, run_a, run_b, first


def _copy(run, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(run, out / run.name)
    return out, out / run.name


def _lines(path):
    return path.read_text().splitlines()


def _set_lines(path, lines):
    path.write_text("\n".join(lines) + "\n")


def _seconds_times_1000(path):
    records = [json.loads(line) for line in _lines(path)]
    records[0]["seconds"] *= 1000
    _set_lines(path, [json.dumps(r, sort_keys=True) for r in records])


def _flip_byte(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


CORRUPTIONS = {
    "flipped byte": (_flip_byte, "prompt-00000.jsonl: sha256 expected"),
    "dropped line": (lambda p: _set_lines(p, _lines(p)[:-1]), "prompt-00000.jsonl: size expected"),
    "seconds x1000": (_seconds_times_1000, "prompt-00000.jsonl: (size|sha256) expected"),
    "truncated": (lambda p: p.write_bytes(p.read_bytes()[:40]), "prompt-00000.jsonl: size expected"),
}


@pytest.mark.parametrize("case", sorted(CORRUPTIONS))
def test_a_corrupt_prompt_file_is_refused_by_name_and_its_deletion_repairs(case, eval_runs,
                                                                           tmp_path, monkeypatch):
    llama, draft, run_a, _, first = eval_runs
    out, run = _copy(run_a, tmp_path)
    corrupt, message = CORRUPTIONS[case]
    corrupt(run / "prompt-00000.jsonl")
    with pytest.raises(IntegrityError, match=message + ".*repair: delete .*prompt-00000.jsonl"):
        evaluate(llama, StubTokenizer(), {"d": draft}, EVAL, [], out_dir=out)
    with pytest.raises(IntegrityError, match="prompt-00000.jsonl"):
        evaluate_mod.load_run(run)
    (run / "prompt-00000.jsonl").unlink()  # the repair the message names
    ran = []
    real = evaluate_mod.run_item
    monkeypatch.setattr(evaluate_mod, "run_item", lambda item, *a: ran.append(item) or real(item, *a))
    again = evaluate(llama, StubTokenizer(), {"d": draft}, EVAL, [], out_dir=out)
    assert [item["prompt_id"] for item in ran] == [first["records"]["prompt_id"][0]]  # only it
    assert len(again["records"]) == len(first["records"]) == 4
    assert evaluate_mod.load_run(run)["prompt_id"].tolist() == first["records"]["prompt_id"].tolist()


def test_counts_keys_and_prompts_are_checked_even_with_consistent_checksums(eval_runs, tmp_path):
    llama, draft, run_a, run_b, _ = eval_runs

    def refused(prepare, message):
        out, run = _copy(run_a, tmp_path / prepare.__name__)
        prepare(run)
        with pytest.raises(IntegrityError, match=message):
            evaluate(llama, StubTokenizer(), {"d": draft}, EVAL, [], out_dir=out)

    def manifest_of(run):
        return read_record(run / "manifest.json", "")

    def chunk_from_another_run(run):
        shutil.copy(run_b / "prompt-00001.jsonl", run / "prompt-00001.jsonl")

    def dropped_line_rerecorded(run):  # the manifest entry rewritten to match the short file
        path = run / "prompt-00000.jsonl"
        _set_lines(path, _lines(path)[:-1])
        manifest = manifest_of(run)
        entry = manifest["prompts"][0]
        entry.update(bytes=path.stat().st_size,
                     sha256=__import__("hashlib").sha256(path.read_bytes()).hexdigest())
        write_record(run / "manifest.json", manifest)

    def extra_prompt(run):
        manifest = manifest_of(run)
        manifest["prompts"].append({**manifest["prompts"][1], "prompt_id": "HumanEval/99"})
        write_record(run / "manifest.json", manifest)

    def edited_manifest(run):  # an unchecksummed edit of the manifest
        record = json.loads((run / "manifest.json").read_text())
        record["prompts"][0]["n_records"] = 1
        (run / "manifest.json").write_text(json.dumps(record))

    def truncated_manifest(run):
        path = run / "manifest.json"
        path.write_bytes(path.read_bytes()[:100])

    def manifest_of_another_run(run):
        shutil.copy(run_b / "manifest.json", run / "manifest.json")

    refused(chunk_from_another_run, r"prompt-00001.jsonl: (size|sha256) expected")
    refused(dropped_line_rerecorded, r"prompt-00000.jsonl: records expected 2, found 1")
    refused(extra_prompt, r"manifest.json: prompt expected one of the run's 2 prompts, found "
                          r"\['humaneval', 'HumanEval/99'\]")
    refused(edited_manifest, r"manifest.json: record_sha256 expected")
    refused(truncated_manifest, r"manifest.json: content expected valid JSON.*repair: delete")
    refused(manifest_of_another_run, r"manifest.json: key expected")
    # the repair of a bad manifest: delete the run folder, everything reruns
    out, run = _copy(run_a, tmp_path / "repair")
    truncated_manifest(run)
    shutil.rmtree(run)
    assert len(evaluate(llama, StubTokenizer(), {"d": draft}, EVAL, [], out_dir=out)["records"]) == 4


def test_evaluation_keys_hold_the_target(eval_runs, tmp_path):
    """Another target with the same config gets another run folder (and a draft made for
    one target is refused with another)."""
    llama, draft, run_a, _, _ = eval_runs
    other_target = tiny_model("llama", seed=7)
    with pytest.raises(ValueError, match="was trained for target"):
        evaluate(other_target, StubTokenizer(), {"d": draft}, EVAL, [], out_dir=tmp_path)
    evaluate(other_target, StubTokenizer(), {}, EVAL, [], out_dir=tmp_path)
    evaluate(llama, StubTokenizer(), {}, EVAL, [], out_dir=tmp_path)
    assert len(list(tmp_path.glob("*/manifest.json"))) == 2
