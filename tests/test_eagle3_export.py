"""Exports of EAGLE-3 drafts to vLLM speculators and SGLang/SpecForge formats."""
import json

import pytest
import torch
from safetensors.torch import load_file

from actwave.eagle3 import Eagle3Draft
from actwave.eagle3.export import (export_specforge, export_speculators, load_specforge,
                                   load_speculators, sglang_layer_ids)
from conftest import tiny_model

LAYER_IDS = (1, 2, 3)  # SGLang can serve these (not ℓ = N = 4)
VLLM_LAYER_IDS = (1, 2, 4)  # vLLM also takes ℓ = N, the last block output


def trained_looking_draft(target, layer_ids=LAYER_IDS):
    """An untrained draft with non-default norms, so every tensor's export is exercised."""
    torch.manual_seed(1)
    counts = torch.arange(128).flip(0).float()  # favours low ids: a non-trivial vocab
    counts[[100, 120]] = 1000.0
    draft = Eagle3Draft.from_target(target, layer_ids, draft_vocab_size=40, token_counts=counts)
    with torch.no_grad():
        for norm in (draft.norm, draft.midlayer.hidden_norm, draft.midlayer.input_layernorm):
            norm.weight.uniform_(0.5, 1.5)
    return draft.eval()


def draft_inputs(draft, steps=6, seed=3):
    generator = torch.Generator().manual_seed(seed)
    width = len(draft.layer_ids) * draft.config.target_hidden_size
    target_states = torch.randn(1, steps, width, generator=generator)
    input_ids = torch.randint(0, 128, (1, steps), generator=generator)
    return target_states, input_ids, torch.arange(steps)[None]


def our_logits(draft, target_states, input_ids, position_ids):
    with torch.no_grad():
        return draft(input_ids, draft.fuse(target_states), position_ids).logits


@pytest.mark.parametrize("export, load", [(export_speculators, load_speculators),
                                          (export_specforge, load_specforge)])
def test_export_load_round_trip_identical_logits(target, tmp_path, export, load):
    draft = trained_looking_draft(target)
    export(draft, tmp_path, "org/target")
    loaded = load(tmp_path, target).eval()
    assert loaded.layer_ids == LAYER_IDS
    inputs = draft_inputs(draft)
    assert torch.equal(our_logits(draft, *inputs), our_logits(loaded, *inputs))
    assert loaded.config == draft.config
    assert torch.equal(loaded.d2t, draft.d2t) and torch.equal(loaded.t2d, draft.t2d)


def test_speculators_config_and_names(llama, tmp_path):
    draft = trained_looking_draft(llama, VLLM_LAYER_IDS)
    export_speculators(draft, tmp_path, "org/target", ["LlamaForCausalLM"])
    record = json.loads((tmp_path / "config.json").read_text())
    assert record["speculators_model_type"] == "eagle3"
    assert record["eagle_aux_hidden_state_layer_ids"] == list(VLLM_LAYER_IDS)  # vLLM: ℓ as given
    assert record["norm_before_residual"] is False  # vLLM defaults to True when absent
    assert record["draft_vocab_size"] == 40 and record["transformer_layer_config"]["vocab_size"] == 128
    assert record["speculators_config"]["verifier"]["name_or_path"] == "org/target"
    assert "hidden_states[ℓ]" in record["actwave"]["layer_id_convention"]
    names = set(load_file(tmp_path / "model.safetensors"))
    assert {"fc.weight", "layers.0.hidden_norm.weight", "layers.0.self_attn.q_proj.weight",
            "norm.weight", "lm_head.weight", "d2t", "t2d"} <= names
    assert not any(name.startswith(("midlayer.", "embed_tokens.")) for name in names)


def test_specforge_config_uses_sglang_minus_one_ids(llama, tmp_path):
    draft = trained_looking_draft(llama, layer_ids=(0, 2, 3))
    export_specforge(draft, tmp_path, "org/target")
    record = json.loads((tmp_path / "config.json").read_text())
    ids = record["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    assert ids == [-1, 1, 2]
    # SGLang captures the input of block id+1 = HF hidden_states[id+1]: our ℓ again.
    assert tuple(i + 1 for i in ids) == draft.layer_ids
    assert record["architectures"] == ["LlamaForCausalLMEagle3"]
    names = set(load_file(tmp_path / "model.safetensors"))
    assert {"fc.weight", "midlayer.self_attn.q_proj.weight", "norm.weight", "lm_head.weight",
            "d2t", "t2d"} <= names


def test_speculators_warns_for_embedding_layer(llama, tmp_path):
    with pytest.warns(UserWarning, match="layer id 0"):
        export_speculators(trained_looking_draft(llama, (0, 2)), tmp_path, "org/target")


def test_specforge_rejects_last_layer(llama, tmp_path):
    with pytest.raises(ValueError, match="layer id 4"):
        export_specforge(trained_looking_draft(llama, layer_ids=(1, 4)), tmp_path)
    assert sglang_layer_ids((1, 2), 4) == [0, 1]


def test_load_speculators_rejects_unsupported_variant(llama, tmp_path):
    export_speculators(trained_looking_draft(llama), tmp_path, "org/target")
    record = json.loads((tmp_path / "config.json").read_text())
    record["norm_before_residual"] = True
    (tmp_path / "config.json").write_text(json.dumps(record))
    with pytest.raises(ValueError, match="norm_before_residual"):
        load_speculators(tmp_path, llama)


def test_load_refuses_other_target(llama, tmp_path):
    export_speculators(trained_looking_draft(llama), tmp_path, "org/target")
    with pytest.raises(ValueError, match="vocab size 130"):
        load_speculators(tmp_path, tiny_model("llama", vocab_size=130))


def test_speculators_library_reproduces_our_logits(llama, tmp_path):
    """vLLM's speculators (0.9) loads the export; its modules give our logits."""
    pytest.importorskip("speculators", reason="speculators==0.9.0 is not installed")
    from speculators import SpeculatorModel
    draft = trained_looking_draft(llama, VLLM_LAYER_IDS)
    target_dir = tmp_path / "target"
    llama.save_pretrained(target_dir)
    export_speculators(draft, tmp_path / "draft", str(target_dir), llama.config.architectures)
    model = SpeculatorModel.from_pretrained(str(tmp_path / "draft")).eval()
    # speculators 0.9 pins transformers<=5.19; under 5.24 HF pre-fills the missing
    # embedding, so speculators' "still NaN" check skips loading it from the verifier.
    model._load_verifier_weights(overwrite_embed_tokens=True)
    assert model.target_layer_ids == list(VLLM_LAYER_IDS)
    model.config.transformer_layer_config._attn_implementation = "eager"
    target_states, input_ids, position_ids = draft_inputs(draft)
    steps = input_ids.shape[1]
    causal = torch.full((steps, steps), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        layer_input = torch.cat([model.embed_tokens(input_ids), model.fc(target_states)], -1)
        rotary = model.rotary_emb(layer_input, position_ids)
        out = model.layers[0](layer_input, attention_mask=causal, position_ids=position_ids,
                              position_embeddings=rotary)
        their_logits = model.lm_head(model.norm(out))
    ours = our_logits(draft, target_states, input_ids, position_ids)
    assert torch.allclose(their_logits, ours, atol=1e-5)
    assert torch.equal(model.d2t, draft.d2t) and torch.equal(model.t2d, draft.t2d)
