"""Shared fixtures: tiny random-weight models of several architectures, offline settings."""
import multiprocessing
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("MPLBACKEND", "Agg")
# Tests share one cache folder (the dequantised real model is written there once).
os.environ.setdefault("ACTWAVE_CACHE", os.path.join(os.path.dirname(__file__), "..", ".cache", "actwave-test"))

import pytest
import torch
from transformers import (Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM,
                          Qwen3Config, Qwen3ForCausalLM)

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)


FORK = multiprocessing.get_context("fork")  # children inherit the tiny models: no re-import


def _single_threaded(function, *args):
    # A forked child that enters the parent's OpenMP pool hangs (libgomp): one thread.
    torch.set_num_threads(1)
    function(*args)


def forked(function, *args):
    """A forked process that runs ``function(*args)`` (started)."""
    process = FORK.Process(target=_single_threaded, args=(function, *args))
    process.start()
    return process


def hold_lock(folder, seconds):
    """Hold ``folder``'s WriterLock for ``seconds`` (run it in ``forked``)."""
    from actwave.integrity import WriterLock

    with WriterLock(folder):
        time.sleep(seconds)


def wait_for_lock_record(path):
    """Wait until the lock file ``path`` names its holder (the lock is taken first and its
    record written right after)."""
    while not path.exists() or not path.read_text():
        time.sleep(0.05)


def tiny_model(arch: str = "llama", seed: int = 0, **overrides):
    """A tiny random-weight causal LM in float32, eval mode."""
    torch.manual_seed(seed)
    kwargs = {**TINY, **overrides}
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**kwargs))
    elif arch == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(head_dim=16, **kwargs))
    elif arch == "gemma3":
        model = Gemma3ForCausalLM(Gemma3TextConfig(
            **{"head_dim": 16, "sliding_window": 8, "layer_types": None, **kwargs}))
    else:
        raise ValueError(arch)
    return model.eval()


def save_tiny_llama(folder, tokenizer, hidden_size: int = 64, num_attention_heads: int = 4,
                    num_key_value_heads: int = 2):
    """A tiny random Llama (N=8) with ``tokenizer``'s vocabulary saved to ``folder`` with the
    tokenizer: a model given by path, as ``--model PATH`` takes it. -> str(folder)."""
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=8, num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads, tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
    )).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def random_sequences(n_sequences: int = 8, seed: int = 0, vocab_size: int = 128) -> list[dict]:
    """Ragged random token sequences of 18-22 tokens (so padding is exercised); tokens from
    position 3 on count as the reply."""
    generator = torch.Generator().manual_seed(seed)
    sequences = []
    for row in range(n_sequences):
        length = 18 + row % 5
        ids = torch.randint(0, vocab_size, (length,), generator=generator).tolist()
        sequences.append({"input_ids": ids, "loss_mask": [pos >= 3 for pos in range(length)]})
    return sequences


def tiny_store(path, model, sequences: list[dict], sequences_per_shard: int | None = None,
               config_hash: str = "tiny"):
    """A real capture store of ``sequences`` (capture_batch per shard, float32 states,
    manifest with shard records) in the existing folder ``path``."""
    from actwave.capture import store as store_mod
    from actwave.integrity import model_identity

    per_shard = sequences_per_shard or len(sequences)
    shards = []
    for number, first in enumerate(range(0, len(sequences), per_shard)):
        chunk = sequences[first: first + per_shard]
        columns = store_mod.capture_batch(model, chunk, first, {0}, torch.float32)
        name = f"shard-{number:05d}.safetensors"
        record = store_mod._write_shard(path / name, columns)
        shards.append({"file": name, "n_tokens": int(columns["input_ids"].numel()),
                       "first_sequence": first, "n_sequences": len(chunk), **record})
    store_mod.write_manifest(path, {
        "num_layers": model.config.num_hidden_layers, "hidden_size": model.config.hidden_size,
        "vocab_size": model.config.vocab_size, "config_hash": config_hash,
        "model": model_identity(model), "n_sequences": len(sequences),
        "n_tokens": sum(s["n_tokens"] for s in shards), "complete": True, "shards": shards})
    return store_mod.CaptureStore(path)


@pytest.fixture(params=["llama", "qwen3", "gemma3"])
def any_tiny_model(request):
    return tiny_model(request.param)


@pytest.fixture(scope="module", params=["llama", "qwen3", "gemma3"])
def target(request):
    """One tiny target per architecture, shared by a test module (tests must not mutate it)."""
    return tiny_model(request.param)


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama")


@pytest.fixture(scope="session")
def smollm2():
    """The real bundled SmolLM2-135M (dequantised once into the test cache)."""
    from actwave.capture import models
    return models.load("smollm2-135m")


def pytest_collection_modifyitems(items):
    """Every test that uses the real SmolLM2 (directly or through another fixture) is a
    ``real_model`` test, so ``-m "not real_model"`` runs on tiny random models only."""
    for item in items:
        if "smollm2" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.real_model)
