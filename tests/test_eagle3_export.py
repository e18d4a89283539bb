"""Exports of EAGLE-3 drafts to vLLM speculators and SGLang/SpecForge formats, and the
layer ids each engine version reads (checked against each engine's rule re-implemented here)."""
import itertools
import json

import pytest
import torch
from safetensors.torch import load_file

from actwave.eagle3 import Eagle3Draft
from actwave.eagle3.export import (ENGINES, engine_layer_ids, engine_reads, export_specforge,
                                   export_speculators, load_specforge, load_speculators)
from conftest import tiny_model

LAYER_IDS = (2, 3)  # every engine of both formats can serve these on N = 4
VLLM_LAYER_IDS = (1, 2, 4)  # current vLLM also takes ℓ = N, the last block output


# Each engine's reading of eagle_aux_hidden_state_layer_ids, written from its source code:
# ids (depth order) -> the layers ℓ it captures, or None when it cannot capture them.
def _within(layers, low, high):
    return tuple(sorted(layers)) if all(low <= v <= high for v in layers) else None


def vllm_current(ids, n):  # EagleModelMixin: 0 = embeddings, id = output of block id-1
    return _within(ids, 0, n)


def vllm_before_36063(ids, n):  # input of block id (hidden + residual: none before block 0)
    return _within(ids, 1, n - 1)


def sglang_current(ids, n):  # PR 25454: +1 only when the first id is 1; input of block i
    return _within([i + 1 for i in ids] if ids[0] == 1 else ids, 0, n - 1)


def sglang_before_25454(ids, n):  # +1 always; a negative id is no block index
    return _within([i + 1 for i in ids], 1, n - 1) if min(ids) >= 0 else None


def specforge_hf(ids, n):  # forward hook on the output of 0-based block id; 3 aux layers
    return _within([i + 1 for i in ids], 1, n) if len(ids) == 3 else None


REFERENCE = {"vllm>=pr36063": vllm_current, "vllm<pr36063": vllm_before_36063,
             "sglang>=pr25454": sglang_current, "sglang<pr25454": sglang_before_25454,
             "specforge-hf": specforge_hf}


def test_every_engine_has_a_reference_rule():
    assert set(REFERENCE) == set(ENGINES)


@pytest.mark.parametrize("engine", sorted(REFERENCE))
@pytest.mark.parametrize("num_layers", [1, 2, 3, 5, 7])
def test_written_ids_are_read_as_the_trained_layers(engine, num_layers):
    """All sets of ℓ ∈ 0..N: the ids written read back as the set, and a refused set has
    no ids (in depth order, −1..N+1) that the engine would read as it."""
    reference = REFERENCE[engine]
    expressible = {}
    for k in range(1, num_layers + 2):
        for ids in itertools.combinations(range(-1, num_layers + 2), k):
            layers = reference(list(ids), num_layers)
            if layers is not None:
                expressible.setdefault(layers, ids)
    for k in range(1, num_layers + 2):
        for layers in itertools.combinations(range(num_layers + 1), k):
            try:
                ids = engine_layer_ids(layers, num_layers, engine)
            except ValueError:
                assert layers not in expressible, f"{engine} can read {expressible.get(layers)}"
                continue
            assert reference(ids, num_layers) == layers
            assert engine_reads(engine, ids, num_layers) == layers


def test_current_sglang_reads_old_minus_one_exports_wrongly():
    """The bug PR 25454 introduced for ℓ − 1 exports, and the ids that fix it."""
    assert sglang_current([10, 27, 28], 30) == (10, 27, 28)  # trained (11, 28, 29)
    assert engine_layer_ids((11, 28, 29), 30, "sglang>=pr25454") == [11, 28, 29]
    assert engine_layer_ids((11, 28, 29), 30, "sglang<pr25454") == [10, 27, 28]
    # smallest ℓ = 2: the ℓ − 1 form is read right by both SGLang rules
    ids = engine_layer_ids((2, 15, 27), 30, "sglang>=pr25454")
    assert ids == [1, 14, 26] and sglang_before_25454(ids, 30) == (2, 15, 27)


@pytest.mark.parametrize("layers, engine, message", [
    ((1, 15, 27), "sglang>=pr25454", "first id of 1"),
    ((2, 15, 30), "sglang>=pr25454", r"cannot capture layer\(s\) \[30\]"),
    ((0, 15, 27), "sglang<pr25454", r"cannot capture layer\(s\) \[0\]"),
    ((0, 15, 27), "vllm<pr36063", r"layer\(s\) \[0\]"),
    ((2, 15), "specforge-hf", "exactly 3"),
    ((15, 2, 27), "vllm>=pr36063", "strictly increasing"),
    ((2, 2, 27), "vllm>=pr36063", "strictly increasing"),
    ((2.0, 15, 27), "vllm>=pr36063", "ints"),
    ((2, 15, 27), "sglang", "unknown engine 'sglang'"),
])
def test_unrepresentable_sets_are_refused_with_the_reason(layers, engine, message):
    with pytest.raises(ValueError, match=message):
        engine_layer_ids(layers, 30, engine)


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


FORMATS = {"speculators": (export_speculators, load_speculators),
           "sglang": (export_specforge, load_specforge),
           "specforge-hf": (export_specforge, load_specforge)}


@pytest.mark.parametrize("engine", sorted(ENGINES))
def test_export_load_round_trip_identical_logits(target, tmp_path, engine):
    layer_ids = (1, 2, 3) if engine == "specforge-hf" else LAYER_IDS
    export, load = FORMATS[ENGINES[engine].fmt]
    draft = trained_looking_draft(target, layer_ids)
    export(draft, tmp_path, "org/target", engine=engine)
    loaded = load(tmp_path, target).eval()  # the engine recorded in the export reads the ids
    assert loaded.layer_ids == layer_ids
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
    assert record["draft_vocab_size"] == 40
    assert record["transformer_layer_config"]["vocab_size"] == 128
    assert record["speculators_config"]["verifier"]["name_or_path"] == "org/target"
    block = record["actwave"]
    assert "hidden_states[ℓ]" in block["layer_id_convention"]
    assert block["engine"] == "vllm>=pr36063" and "36063" in block["engine_rule_source"]
    assert block["read_as_trained_by"] == ["vllm>=pr36063"]  # ℓ = N: not the older vLLM
    names = set(load_file(tmp_path / "model.safetensors"))
    assert {"fc.weight", "layers.0.hidden_norm.weight", "layers.0.self_attn.q_proj.weight",
            "norm.weight", "lm_head.weight", "d2t", "t2d"} <= names
    assert not any(name.startswith(("midlayer.", "embed_tokens.")) for name in names)


@pytest.mark.parametrize("layer_ids, ids, readers", [
    ((2, 3), [1, 2], ["sglang>=pr25454", "sglang<pr25454"]),
    ((0, 2, 3), [0, 2, 3], ["sglang>=pr25454"]),
    ((3,), [3], ["sglang>=pr25454"]),
])
def test_specforge_config_records_ids_engine_and_readers(llama, tmp_path, layer_ids, ids,
                                                         readers):
    export_specforge(trained_looking_draft(llama, layer_ids), tmp_path, "org/target")
    record = json.loads((tmp_path / "config.json").read_text())
    assert record["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == ids
    assert sglang_current(ids, 4) == layer_ids
    block = record["actwave"]
    assert block["engine"] == "sglang>=pr25454" and "25454" in block["engine_rule_source"]
    assert block["read_as_trained_by"] == readers and block["layer_ids"] == list(layer_ids)
    assert record["architectures"] == ["LlamaForCausalLMEagle3"]
    names = set(load_file(tmp_path / "model.safetensors"))
    assert {"fc.weight", "midlayer.self_attn.q_proj.weight", "norm.weight", "lm_head.weight",
            "d2t", "t2d"} <= names


def test_exports_refuse_what_their_engine_cannot_serve(llama, tmp_path):
    with pytest.raises(ValueError, match="first id of 1"):
        export_specforge(trained_looking_draft(llama, (1, 2, 3)), tmp_path)
    with pytest.raises(ValueError, match=r"layer\(s\) \[4\]"):
        export_specforge(trained_looking_draft(llama, (2, 4)), tmp_path)
    with pytest.raises(ValueError, match="does not read the speculators format"):
        export_speculators(trained_looking_draft(llama), tmp_path, "org/t", engine="sglang<pr25454")
    assert not (tmp_path / "config.json").exists()


def test_specforge_hf_export_is_no_server_config(llama, tmp_path):
    """Its ℓ − 1 ids ((1, 2, 3) -> [0, 1, 2]) would be read by SGLang as other layers:
    they are never written where a server looks for its config."""
    draft = trained_looking_draft(llama, (1, 2, 3))
    export_specforge(draft, tmp_path / "hf", engine="specforge-hf")
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == [
        "model.safetensors", "specforge_draft_config.json"]  # no config.json
    record = json.loads((tmp_path / "hf" / "specforge_draft_config.json").read_text())
    ids = record["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    assert ids == [0, 1, 2] and specforge_hf(ids, 4) == (1, 2, 3)
    assert sglang_current(ids, 4) == (0, 1, 2)  # what SGLang would feed: the wrong layers
    assert record["actwave"]["read_as_trained_by"] == ["specforge-hf"]
    assert load_specforge(tmp_path / "hf", llama).layer_ids == (1, 2, 3)
    export_specforge(trained_looking_draft(llama, (2, 3)), tmp_path / "sglang")
    with pytest.raises(ValueError, match="already holds config.json of another export format"):
        export_specforge(draft, tmp_path / "sglang", engine="specforge-hf")
    with pytest.raises(ValueError, match="already holds specforge_draft_config.json"):
        export_specforge(trained_looking_draft(llama, (2, 3)), tmp_path / "hf")
    with pytest.raises(ValueError, match="already holds specforge_draft_config.json"):
        export_speculators(trained_looking_draft(llama, (2, 3)), tmp_path / "hf", "org/t")
    assert not (tmp_path / "hf" / "config.json").exists()


def test_loading_reads_ids_by_the_recorded_or_current_engine(llama, tmp_path):
    """An older actwave export (no engine recorded) wrote ℓ − 1; a foreign checkpoint is
    read as a current SGLang would read it."""
    export_specforge(trained_looking_draft(llama, (2, 3)), tmp_path)
    record = json.loads((tmp_path / "config.json").read_text())
    record["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [0, 2]
    del record["actwave"]["engine"]
    (tmp_path / "config.json").write_text(json.dumps(record))
    assert load_specforge(tmp_path, llama).layer_ids == (1, 3)
    del record["actwave"]
    (tmp_path / "config.json").write_text(json.dumps(record))
    assert load_specforge(tmp_path, llama).layer_ids == (0, 2)
    assert load_specforge(tmp_path, llama, engine="sglang<pr25454").layer_ids == (1, 3)


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
