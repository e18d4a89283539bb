"""EAGLE-3 draft model and draft vocabulary, on tiny random Llama / Qwen3 / Gemma3 targets."""
import pytest
import torch
from conftest import TINY, tiny_model
from transformers import DynamicCache, LlamaConfig

from actwave.eagle3 import Eagle3Config, Eagle3Draft, build_draft_vocab, coverage, token_frequencies
from actwave.eagle3.layers import RotaryEmbedding


def make_draft(target, layer_ids=(1, 2, 4), draft_vocab_size=48):
    torch.manual_seed(1)
    return Eagle3Draft.from_target(target, layer_ids, draft_vocab_size=draft_vocab_size).eval()


def random_inputs(batch=2, steps=6, hidden=64, seed=2):
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, 128, (batch, steps), generator=generator)
    hidden_states = torch.randn(batch, steps, hidden, generator=generator)
    position_ids = torch.arange(steps).expand(batch, steps)
    return input_ids, hidden_states, position_ids


def additive(allowed: torch.Tensor) -> torch.Tensor:
    """bool (T, S) -> additive float mask (1, 1, T, S)."""
    blocked = torch.full(allowed.shape, torch.finfo(torch.float32).min)
    return torch.where(allowed, torch.zeros(()), blocked)[None, None]


@pytest.mark.parametrize("layer_ids", [(4,), (0, 3), (1, 2, 3, 4)])
def test_from_target_shapes_any_k(target, layer_ids):
    draft = make_draft(target, layer_ids)
    k = len(layer_ids)
    assert draft.layer_ids == layer_ids
    assert draft.fc.in_features == k * 64 and draft.fc.out_features == 64
    fused = draft.fuse(torch.randn(2, 5, k * 64))
    assert fused.shape == (2, 5, 64)
    input_ids, _, position_ids = random_inputs(steps=5)
    out = draft(input_ids, fused, position_ids)
    assert out.logits.shape == (2, 5, 48) and out.hidden.shape == (2, 5, 64)
    with pytest.raises(ValueError, match="k\\*H_target"):
        draft.fuse(torch.randn(2, 5, (k + 1) * 64))


def test_hyper_parameters_come_from_target(target):
    config = make_draft(target).config
    text_config = target.config
    assert config.num_key_value_heads == 2 and config.head_dim == text_config.head_dim
    assert config.target_num_layers == 4 and config.target_vocab_size == 128
    assert config.intermediate_size == text_config.intermediate_size
    expected_theta = (text_config.rope_parameters["full_attention"]["rope_theta"]
                      if "full_attention" in text_config.rope_parameters
                      else text_config.rope_parameters["rope_theta"])
    assert config.rope_theta == expected_theta


def test_embedding_is_targets_input_embedding_and_frozen(target):
    draft = make_draft(target)
    input_ids, _, _ = random_inputs()
    with torch.no_grad():
        # Independent route: HF's hidden_states[0] is the target's scaled input embedding.
        reference = target(input_ids, output_hidden_states=True).hidden_states[0]
    assert torch.allclose(draft.embed_tokens(input_ids), reference, atol=1e-6)
    assert not draft.embed_tokens.weight.requires_grad
    assert draft.embed_tokens.weight.data_ptr() != target.get_input_embeddings().weight.data_ptr()
    draft.train()
    _, hidden, position_ids = random_inputs()
    draft(input_ids, hidden, position_ids).logits.sum().backward()
    assert draft.embed_tokens.weight.grad is None
    assert draft.fc.weight.grad is None  # fc is not used when hidden is given directly
    assert draft.midlayer.self_attn.q_proj.weight.grad is not None
    assert draft.lm_head.weight.grad is not None


def test_gemma_embedding_scaling_reproduced():
    gemma = tiny_model("gemma3")
    draft = make_draft(gemma)
    input_ids = torch.arange(10)[None]
    raw = gemma.get_input_embeddings().weight[input_ids]
    assert torch.allclose(draft.embed_tokens(input_ids), raw * 64 ** 0.5, atol=1e-5)


@pytest.mark.parametrize("bad", [(5,), (-1,), (1, 1), ()])
def test_layer_id_validation(llama, bad):
    with pytest.raises(ValueError, match=r"0\.\.4|distinct|empty"):
        Eagle3Draft.from_target(llama, bad)


def test_layer_id_error_names_id_and_range(llama):
    with pytest.raises(ValueError, match=r"7 .*0\.\.4"):
        Eagle3Draft.from_target(llama, (1, 7))


def test_unknown_override_rejected(llama):
    with pytest.raises(TypeError, match="hidden_dim"):
        Eagle3Draft.from_target(llama, (1,), hidden_dim=3)
    draft = Eagle3Draft.from_target(llama, (1,), intermediate_size=96)
    assert draft.midlayer.mlp.up_proj.out_features == 96


@pytest.mark.parametrize("changes, message", [
    (dict(hidden_size=32), "hidden size 32"),
    (dict(vocab_size=130), "vocab size 130"),
    (dict(num_hidden_layers=2), r"layer ids \[4\] outside 0\.\.2"),
])
def test_check_target_names_mismatch(llama, changes, message):
    draft = make_draft(llama)
    draft.check_target(llama)
    other = tiny_model("llama", **changes)
    with pytest.raises(ValueError, match=message):
        draft.check_target(other)


def test_check_target_names_model(llama):
    draft = make_draft(llama)
    draft.config.target_model = "org/model-a"
    other = tiny_model("llama")
    other.name_or_path = "org/model-b"  # where actwave.capture.models.load records the name
    with pytest.raises(ValueError, match="model-b"):
        draft.check_target(other)
    draft.check_target(other, check_name=False)
    other.name_or_path = "org/model-a"
    draft.check_target(other)


def test_cache_step_by_step_equals_full_sequence(target):
    draft = make_draft(target)
    input_ids, hidden, position_ids = random_inputs(steps=7)
    with torch.no_grad():
        full = draft(input_ids, hidden, position_ids)
        cache = DynamicCache()
        chunks = [(0, 3), (3, 4), (4, 7)]
        stepped = [draft(input_ids[:, a:b], hidden[:, a:b], position_ids[:, a:b],
                         past_key_values=cache) for a, b in chunks]
    assert cache.get_seq_length() == 7
    assert torch.allclose(torch.cat([o.logits for o in stepped], 1), full.logits, atol=1e-5)
    assert torch.allclose(torch.cat([o.hidden for o in stepped], 1), full.hidden, atol=1e-5)
    cache.crop(-3)
    assert cache.get_seq_length() == 4


def test_logits_to_keep_computes_only_the_last_rows(llama):
    draft = make_draft(llama)
    input_ids, hidden, position_ids = random_inputs(steps=6)
    with torch.no_grad():
        full = draft(input_ids, hidden, position_ids)
        last_two = draft(input_ids, hidden, position_ids, logits_to_keep=2)
    assert last_two.logits.shape[1] == 2 and last_two.hidden.shape == full.hidden.shape
    assert torch.allclose(last_two.logits, full.logits[:, -2:], atol=1e-6)


def test_causal_4d_mask_equals_none(llama):
    draft = make_draft(llama)
    input_ids, hidden, position_ids = random_inputs(steps=6)
    causal = additive(torch.ones(6, 6, dtype=torch.bool).tril())
    with torch.no_grad():
        plain = draft(input_ids, hidden, position_ids).logits
        masked = draft(input_ids, hidden, position_ids, attention_mask=causal).logits
        full_mask = draft(input_ids, hidden, position_ids, attention_mask=additive(
            torch.ones(6, 6, dtype=torch.bool))).logits
    assert torch.allclose(plain, masked, atol=1e-6)
    assert not torch.allclose(plain[:, :-1], full_mask[:, :-1], atol=1e-3)


def test_tree_mask_on_cache_matches_sequential_branch(llama):
    """Prefix in the cache, then two sibling branches in one pass with a tree mask."""
    draft = make_draft(llama)
    input_ids, hidden, _ = random_inputs(batch=1, steps=6)
    prefix, branch_b = slice(0, 3), slice(5, 6)  # branch a is positions 3..4
    positions = torch.tensor([[0, 1, 2, 3, 4, 3]])  # branch b sits at depth 1 like a[0]
    allowed = torch.tensor([[1, 0, 0], [1, 1, 0], [0, 0, 1]], dtype=torch.bool)
    tree_mask = additive(torch.cat([torch.ones(3, 3, dtype=torch.bool), allowed], 1))
    with torch.no_grad():
        cache = DynamicCache()
        draft(input_ids[:, prefix], hidden[:, prefix], positions[:, prefix], past_key_values=cache)
        tree = draft(input_ids[:, 3:], hidden[:, 3:], positions[:, 3:],
                     attention_mask=tree_mask, past_key_values=cache).logits
        ids_b = torch.cat([input_ids[:, prefix], input_ids[:, branch_b]], 1)
        hidden_b = torch.cat([hidden[:, prefix], hidden[:, branch_b]], 1)
        sequential_b = draft(ids_b, hidden_b, torch.arange(4)[None]).logits[:, -1]
        sequential_a = draft(input_ids[:, :5], hidden[:, :5], positions[:, :5]).logits[:, 3:]
    assert torch.allclose(tree[:, 2], sequential_b, atol=1e-5)
    assert torch.allclose(tree[:, :2], sequential_a, atol=1e-5)


def test_bad_mask_shape_rejected(llama):
    draft = make_draft(llama)
    input_ids, hidden, position_ids = random_inputs(steps=4)
    with pytest.raises(ValueError, match="attention_mask must have shape"):
        draft(input_ids, hidden, position_ids, attention_mask=torch.zeros(1, 1, 4, 5))


def test_rotary_matches_transformers_llama3_scaling():
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64}
    hf_config = LlamaConfig(**{**TINY, "rope_parameters": rope})
    config = Eagle3Config(layer_ids=(1,), target_hidden_size=64, hidden_size=64,
                          intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                          head_dim=16, rms_norm_eps=1e-6, rope_parameters=rope,
                          max_position_embeddings=256, target_vocab_size=128, draft_vocab_size=8)
    position_ids = torch.arange(300)[None]
    cos, sin = RotaryEmbedding(config)(position_ids, torch.float32)
    hf_cos, hf_sin = LlamaRotaryEmbedding(hf_config)(torch.zeros(1), position_ids)
    assert torch.allclose(cos[:, 0], hf_cos, atol=1e-6) and torch.allclose(sin[:, 0], hf_sin, atol=1e-6)


def test_config_round_trip_and_unknown_field(llama):
    config = make_draft(llama).config
    assert Eagle3Config.from_dict(config.to_dict()) == config
    with pytest.raises(ValueError, match="unknown Eagle3Config fields"):
        Eagle3Config.from_dict({**config.to_dict(), "bogus": 1})


def test_d2t_t2d_consistent_with_counts(llama):
    counts = torch.zeros(128, dtype=torch.long)
    frequent = torch.tensor([100, 5, 77, 42, 9, 64])
    counts[frequent] = torch.tensor([50, 40, 30, 20, 10, 5])
    draft = Eagle3Draft.from_target(llama, (1, 2), draft_vocab_size=4, token_counts=counts)
    target_ids = draft.draft_to_target(torch.arange(4))
    assert target_ids.tolist() == [5, 42, 77, 100]  # top-4 by count, ordered by target id
    assert draft.t2d.sum() == 4 and draft.t2d[target_ids].all()
    assert torch.equal(draft.lm_head.weight, llama.lm_head.weight[target_ids])


def test_build_draft_vocab_pads_with_low_ids():
    counts = torch.zeros(20)
    counts[[15, 3]] = torch.tensor([2.0, 7.0])
    d2t, t2d = build_draft_vocab(counts, 5)
    target_ids = torch.arange(5) + d2t
    assert target_ids.tolist() == [0, 1, 2, 3, 15]
    assert torch.equal(t2d.nonzero().flatten(), target_ids)
    with pytest.raises(ValueError, match="1..20"):
        build_draft_vocab(counts, 21)


def test_token_frequencies_respects_loss_mask():
    ids = [torch.tensor([[1, 2, 2, 3]]), torch.tensor([3, 3, 0])]
    masks = [torch.tensor([[0, 1, 1, 1]]), torch.tensor([1, 0, 1])]
    counts = token_frequencies(ids, masks, vocab_size=5)
    assert counts.tolist() == [1, 0, 2, 2, 0]
    assert token_frequencies(ids, None, 5).tolist() == [1, 1, 2, 3, 0]
    with pytest.raises(ValueError, match="0..4"):
        token_frequencies([torch.tensor([5])], None, 5)


def test_coverage_fraction():
    t2d = torch.zeros(10, dtype=torch.bool)
    t2d[[1, 2]] = True
    assert coverage(t2d, torch.tensor([[1, 2, 3, 4]])) == pytest.approx(0.5)


def test_save_load_round_trip(target, tmp_path):
    draft = make_draft(target)
    with torch.no_grad():
        draft.norm.weight.mul_(1.5)  # make sure trained-looking weights survive
    draft.save_pretrained(tmp_path)
    from safetensors.torch import load_file
    saved = load_file(tmp_path / "model.safetensors")
    assert not any(name.startswith("embed_tokens") for name in saved)
    assert {"fc.weight", "midlayer.hidden_norm.weight", "lm_head.weight", "d2t", "t2d"} <= set(saved)
    loaded = Eagle3Draft.load(tmp_path, target).eval()
    input_ids, hidden, position_ids = random_inputs()
    with torch.no_grad():
        assert torch.equal(draft(input_ids, hidden, position_ids).logits,
                           loaded(input_ids, hidden, position_ids).logits)
    assert torch.equal(loaded.d2t, draft.d2t) and loaded.config == draft.config
    with pytest.raises(ValueError, match="hidden size 32"):
        Eagle3Draft.load(tmp_path, tiny_model("llama", hidden_size=32))


def test_bfloat16_draft_keeps_float32_rope(llama):
    draft = make_draft(llama).to(torch.bfloat16)
    assert draft.rotary_emb.inv_freq.dtype == torch.float32
    input_ids, hidden, position_ids = random_inputs()
    out = draft(input_ids, hidden.to(torch.bfloat16), position_ids)
    assert out.logits.dtype == torch.bfloat16 and torch.isfinite(out.logits.float()).all()


def test_qwen2_target_without_head_dim():
    from transformers import Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(0)
    qwen2 = Qwen2ForCausalLM(Qwen2Config(**TINY)).eval()
    assert getattr(qwen2.config, "head_dim", None) is None  # derived as H / heads
    draft = make_draft(qwen2)
    assert draft.config.head_dim == 16 and draft.midlayer.self_attn.q_proj.out_features == 64
    input_ids, hidden, position_ids = random_inputs()
    assert draft(input_ids, hidden, position_ids).logits.shape == (2, 6, 48)


def test_set_vocab_rejects_inconsistent_maps(llama):
    draft = make_draft(llama)
    d2t, t2d = draft.d2t.clone(), draft.t2d.clone()
    t2d[127] = ~t2d[127]  # one id more or less than d2t names
    with pytest.raises(ValueError, match="disagree"):
        draft.set_vocab(d2t, t2d)
    with pytest.raises(ValueError, match="disagree"):
        draft.set_vocab(d2t + 500, draft.t2d.clone())


def test_lm_head_init_random_differs_from_target(llama):
    torch.manual_seed(1)
    draft = Eagle3Draft.from_target(llama, (1,), draft_vocab_size=16, lm_head_init="random")
    rows = llama.lm_head.weight[draft.draft_to_target(torch.arange(16))]
    assert not torch.allclose(draft.lm_head.weight, rows)
    with pytest.raises(ValueError, match="lm_head_init"):
        Eagle3Draft.from_target(llama, (1,), lm_head_init="zeros")


@pytest.mark.real_model
def test_real_smollm2_draft_round_trip(smollm2, tmp_path):
    from actwave.capture.forward import forward_with_states
    target, tokenizer = smollm2
    draft = Eagle3Draft.from_target(target, (2, 15, 27), draft_vocab_size=8192).eval()
    assert draft.config.target_model == "smollm2-135m" and draft.config.target_num_layers == 30
    input_ids = tokenizer("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        _, states, _ = forward_with_states(target, draft.layer_ids, input_ids)
        embeds = target(input_ids, output_hidden_states=True).hidden_states[0]
        positions = torch.arange(input_ids.shape[1] - 1)[None]
        out = draft(input_ids[:, 1:], draft.fuse(states[:, :-1]), positions)
    assert torch.equal(draft.embed_tokens(input_ids), embeds)
    assert out.logits.shape == (1, input_ids.shape[1] - 1, 8192) and torch.isfinite(out.logits).all()
    draft.save_pretrained(tmp_path)
    loaded = Eagle3Draft.load(tmp_path, target).eval()
    with torch.no_grad():
        again = loaded(input_ids[:, 1:], loaded.fuse(states[:, :-1]), positions)
    assert torch.equal(out.logits, again.logits)


def test_gemma_embedding_scale_cancels_in_input_norm():
    """Why serving with an unscaled shared embedding is safe: RMSNorm is scale-invariant."""
    draft = make_draft(tiny_model("gemma3"))
    input_ids, hidden, position_ids = random_inputs()
    with torch.no_grad():
        scaled = draft(input_ids, hidden, position_ids).logits
        draft.embed_tokens.embed_scale.fill_(1.0)
        unscaled = draft(input_ids, hidden, position_ids).logits
    # Equal up to the eps inside the norm (the tiny model's embeddings are ~0.02).
    assert torch.allclose(scaled, unscaled, atol=1e-3)
    assert not torch.equal(scaled, unscaled)
