"""On-policy regeneration: batched = unbatched greedy, resumable chunks, instant cache hits."""
import json
import shutil

import pytest
import torch
from conftest import tiny_model

from actwave.capture import data, regenerate as regen
from actwave.integrity import IntegrityError


@pytest.fixture(scope="module")
def tokenizer(smollm2):
    return smollm2[1]


@pytest.fixture(scope="module")
def tiny_target():
    return tiny_model("llama", vocab_size=49152)  # SmolLM2's vocabulary, random weights


def _config(**kw):
    base = dict(model="smollm2-135m", split="train", n_conversations=5, max_prompt_len=60,
                max_new_tokens=6, batch_size=2, batches_per_chunk=1, dtype="float32")
    return regen.RegenConfig(**{**base, **kw})


def _fresh(config):
    shutil.rmtree(regen.output_dir(config), ignore_errors=True)
    return config


def _greedy_reference(model, prompt, max_new_tokens):
    """Independent route: full forward over the growing sequence, no cache, no padding."""
    ids = torch.tensor([prompt])
    for _ in range(max_new_tokens):
        with torch.no_grad():
            next_token = model(ids).logits[0, -1].argmax()
        ids = torch.cat([ids, next_token.view(1, 1)], dim=1)
    return ids[0, len(prompt):].tolist()


def test_batched_left_padded_generation_equals_unbatched_greedy(tiny_target, tokenizer):
    conversations = data.sharegpt_split("train", 4)
    prompts = [data.prompt_ids(tokenizer, regen.user_turns(c["messages"])[0])[:40 + 7 * i]
               for i, c in enumerate(conversations)]
    assert len({len(p) for p in prompts}) > 1  # padding is really exercised
    stop_ids = [tokenizer.eos_token_id]
    batched = regen.generate_sorted(tiny_target, prompts, batch_size=4, max_new_tokens=5,
                                    stop_ids=stop_ids, pad_id=tokenizer.pad_token_id)
    for prompt, tokens in zip(prompts, batched):
        reference = _greedy_reference(tiny_target, prompt, 5)
        reference, _ = regen.cut_at_stop(reference, stop_ids)
        assert regen.cut_at_stop(tokens, stop_ids)[0] == reference


def test_stop_tokens_and_padding_are_cut():
    assert regen.cut_at_stop([5, 6, 2, 0, 0], [2]) == ([5, 6], True)
    assert regen.cut_at_stop([5, 6, 7], [2, 9]) == ([5, 6, 7], False)
    ids, mask = regen.left_pad([[1, 2, 3], [4]], pad_id=0)
    assert ids.tolist() == [[1, 2, 3], [0, 0, 4]] and mask.tolist() == [[1, 1, 1], [0, 0, 1]]


def test_user_turns_group_non_assistant_messages():
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "a"},
                {"role": "assistant", "content": "x"}, {"role": "user", "content": "b"},
                {"role": "user", "content": "c"}, {"role": "assistant", "content": "y"},
                {"role": "assistant", "content": "z"}, {"role": "user", "content": "d"}]
    assert [[m["content"] for m in t] for t in regen.user_turns(messages)] == \
        [["s", "a"], ["b", "c"], ["d"]]


def _interrupt_write(monkeypatch, at: int) -> list[str]:
    """Make the ``at``-th chunk write raise KeyboardInterrupt (a killed run); -> the names of
    every chunk write attempted, in order."""
    real_write, calls = regen._write_chunk, []

    def failing_write(path, records):
        calls.append(path.name)
        if len(calls) == at:
            raise KeyboardInterrupt("simulated interruption")
        return real_write(path, records)
    monkeypatch.setattr(regen, "_write_chunk", failing_write)
    return calls


def test_interrupted_run_resumes_to_identical_output(tiny_target, tokenizer, monkeypatch):
    reference = regen.regenerate(_fresh(_config(seed=201)), tiny_target, tokenizer, progress=False)
    config = _fresh(_config(seed=202))  # seed is provenance only: same text, own cache folder
    calls = _interrupt_write(monkeypatch, at=2)
    with pytest.raises(KeyboardInterrupt):
        regen.regenerate(config, tiny_target, tokenizer, progress=False)
    manifest = json.loads((regen.output_dir(config) / "manifest.json").read_text())
    assert not manifest["complete"] and [c["file"] for c in manifest["chunks"]] == ["chunk-00000.jsonl"]
    resumed = regen.regenerate(config, tiny_target, tokenizer, progress=False)
    assert calls[:3] == ["chunk-00000.jsonl", "chunk-00001.jsonl", "chunk-00001.jsonl"]
    assert len(calls) == 4  # chunks 1 (retried) and 2; chunk 0 was not regenerated
    assert resumed.to_list() == reference.to_list() and len(resumed) == 5
    manifest = json.loads((regen.output_dir(config) / "manifest.json").read_text())
    assert manifest["complete"] and manifest["new_tokens"] > 0
    assert (regen.output_dir(config) / "config.json").exists()


def test_cache_hit_never_generates(tiny_target, tokenizer, monkeypatch):
    config = _fresh(_config(seed=203, n_conversations=3))
    first = regen.regenerate(config, tiny_target, tokenizer, progress=False)

    def fail(*args, **kwargs):
        raise AssertionError("cache hit must not generate or load a model")
    monkeypatch.setattr(tiny_target, "generate", fail)
    monkeypatch.setattr(regen, "load", fail)
    assert regen.regenerate(config, progress=False).to_list() == first.to_list()


def test_pinned_text_restores_an_empty_cache_without_generating(tiny_target, tokenizer,
                                                                 monkeypatch, tmp_path):
    config = _fresh(_config(seed=204, n_conversations=3))
    assert regen.pin(config, tmp_path) is None  # nothing finished yet
    first = regen.regenerate(config, tiny_target, tokenizer, progress=False)
    pinned = regen.pin(config, tmp_path)
    assert pinned.name == regen.output_dir(config).name
    _fresh(config)  # another machine: empty cache, committed pinned copy

    def fail(*args, **kwargs):
        raise AssertionError("restored text must not be regenerated")
    monkeypatch.setattr(tiny_target, "generate", fail)
    monkeypatch.setattr(regen, "load", fail)
    assert regen.restore(config, tmp_path)
    assert regen.regenerate(config, progress=False).to_list() == first.to_list()
    assert not regen.restore(config, tmp_path)  # a finished cache is left alone


def test_pinned_text_of_another_config_is_refused(tiny_target, tokenizer, tmp_path):
    config = _fresh(_config(seed=205, n_conversations=2))
    regen.regenerate(config, tiny_target, tokenizer, progress=False)
    other = _config(seed=206, n_conversations=2)
    shutil.copytree(regen.pin(config, tmp_path), tmp_path / regen.output_dir(_fresh(other)).name)
    with pytest.raises(ValueError, match="pinned regeneration .* made under config"):
        regen.restore(other, tmp_path)


def test_partial_pin_resumes_on_another_machine(tiny_target, tokenizer, monkeypatch, tmp_path):
    reference = regen.regenerate(_fresh(_config(seed=207)), tiny_target, tokenizer, progress=False)
    config = _fresh(_config(seed=208))
    calls = _interrupt_write(monkeypatch, at=3)
    with pytest.raises(KeyboardInterrupt):
        regen.regenerate(config, tiny_target, tokenizer, progress=False, pinned_dir=tmp_path)
    pinned = tmp_path / regen.output_dir(config).name
    assert sorted(p.name for p in pinned.glob("chunk-*")) == ["chunk-00000.jsonl", "chunk-00001.jsonl"]
    _fresh(config)  # a fresh machine: only the committed pin
    calls.clear()
    resumed = regen.regenerate(config, tiny_target, tokenizer, progress=False, pinned_dir=tmp_path)
    assert calls == ["chunk-00002.jsonl"] and resumed.to_list() == reference.to_list()
    assert json.loads((pinned / "manifest.json").read_text())["complete"]


def test_corrupted_or_deleted_chunk_is_named_and_the_repair_works(tiny_target, tokenizer):
    config = _fresh(_config(seed=209, n_conversations=4))
    reference = regen.regenerate(config, tiny_target, tokenizer, progress=False)
    chunk = regen.output_dir(config) / "chunk-00001.jsonl"
    data_bytes = chunk.read_bytes()
    chunk.write_bytes(data_bytes.replace(b'"', b"'", 1))  # same size, one byte flipped
    with pytest.raises(IntegrityError, match="chunk-00001.jsonl.*sha256.*delete"):
        regen.regenerate(config, progress=False)
    chunk.write_bytes(data_bytes[: len(data_bytes) // 2])  # truncated
    with pytest.raises(IntegrityError, match="chunk-00001.jsonl"):
        regen.regenerate(config, progress=False)
    chunk.unlink()  # the repair the message names
    assert regen.regenerate(config, tiny_target, tokenizer, progress=False).to_list() == \
        reference.to_list()


def test_another_model_cannot_resume_a_regeneration(tiny_target, tokenizer):
    config = _fresh(_config(seed=210, n_conversations=4))
    regen.regenerate(config, tiny_target, tokenizer, progress=False)
    (regen.output_dir(config) / "chunk-00001.jsonl").unlink()
    other = tiny_model("llama", vocab_size=49152, seed=1)
    with pytest.raises(ValueError, match="written by another model"):
        regen.regenerate(config, other, tokenizer, progress=False)


def test_regenerated_conversations_keep_user_turns(tiny_target, tokenizer):
    config = _fresh(_config(seed=204, n_conversations=4, turns=2, max_prompt_len=120))
    result = regen.regenerate(config, tiny_target, tokenizer, progress=False)
    source = {c["id"]: c["messages"] for c in data.sharegpt_split("train", 40)}
    assert result.column_names == ["id", "messages"] and len(result) == 4
    multi_turn = 0
    for row in result:
        original_turns = regen.user_turns(source[row["id"]])
        replies = [m for m in row["messages"] if m["role"] == "assistant"]
        kept = [m for m in row["messages"] if m["role"] != "assistant"]
        assert kept == [m for turn in original_turns[: len(replies)] for m in turn]
        assert 1 <= len(replies) <= 2 and row["messages"][-1]["role"] == "assistant"
        originals = {m["content"] for m in source[row["id"]] if m["role"] == "assistant"}
        assert not any(r["content"] in originals for r in replies)  # replaced, not copied
        multi_turn += len(replies) == 2
    assert multi_turn >= 1  # the second turn's prompt held the regenerated first reply


def test_prompt_too_long_is_skipped_and_counted(tiny_target, tokenizer):
    config = _fresh(_config(seed=205, n_conversations=2, max_prompt_len=40))
    result = regen.regenerate(config, tiny_target, tokenizer, progress=False)
    manifest = json.loads((regen.output_dir(config) / "manifest.json").read_text())
    assert manifest["skipped_long_prompt"] > 0 and len(result) == 2
    for row in result:
        first_turn = regen.user_turns(row["messages"])[0]
        assert len(data.prompt_ids(tokenizer, first_turn)) <= 40


def test_stale_cache_and_missing_tokenizer_are_refused(tiny_target, tokenizer):
    config = _fresh(_config(seed=206, n_conversations=1))
    stale = {"config_hash": "000000000000", "data_hash": "x", "chunks": [], "complete": False}
    (regen.output_dir(config) / "manifest.json").write_text(json.dumps(stale))
    with pytest.raises(ValueError, match="stale regeneration cache"):
        regen.regenerate(config, tiny_target, tokenizer, progress=False)
    with pytest.raises(ValueError, match="tokenizer"):
        regen.regenerate(_fresh(config), tiny_target, None, progress=False)


@pytest.mark.parametrize("bad", [dict(n_conversations=0), dict(turns=0), dict(dtype="fp8"),
                                 dict(split="test"), dict(max_new_tokens=0)])
def test_bad_config_values_are_refused(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        _config(**bad)


def test_a_reply_with_unicode_line_separators_round_trips(tmp_path):
    """JSON strings keep U+2028, U+0085 and friends unescaped (ensure_ascii=False); a reader
    that split at them (``str.splitlines``) cut a record in two. One line per record."""
    records = [{"id": "a", "messages": [{"role": "assistant", "content": "x\u2028y\u0085z\x0c"}]},
               {"id": "b", "messages": []}]
    path = tmp_path / "chunk-00000.jsonl"
    record = regen._write_chunk(path, records)
    assert regen._read_chunk(path, record, 2) == records
