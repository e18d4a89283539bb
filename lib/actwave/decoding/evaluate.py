"""Speculative-decoding benchmark harness: τ, tokens/s and speedup with bootstrap CIs.

Per prompt, every method runs back to back on the same prompt in one process, our plain
greedy decoding first (the speedup baseline and the exactness reference), so machine
load drifts hit all methods alike. Methods, each a table row's ``label``: ``greedy``
(ours), the peer rows ``hf_generate`` (HF greedy ``generate``) and ``hf_prompt_lookup``
(HF prompt-lookup decoding), and one row per EAGLE-3 draft label.

Benchmarks: MT-bench (both turns; the second-turn prompt contains our greedy first-turn
answer, so every method sees the same prompt), HumanEval (the code prompt as the user
message) and held-out ShareGPT (first user turn of the ``eval`` split). Prompts longer
than ``max_prompt_tokens`` are skipped and counted.

Statistics and tables: ``actwave.decoding.report``. Raw per-prompt records go to a JSON file
keyed by the config hash; reruns resume.
"""
from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pandas as pd
import torch
from tqdm import tqdm
from transformers import GenerationConfig

from actwave.capture import data
from actwave.capture.models import DTYPES
from actwave.config import (atomic_write_json, cache_dir, config_hash, package_versions,
                            to_jsonable)
from actwave.decoding.report import GREEDY, acceptance_by_position, summarize
from actwave.decoding.speculative import generate, greedy_generate
from actwave.decoding.timing import synchronize
from actwave.decoding.tree import MODES, TreeShape
from actwave.eagle3 import Eagle3Draft
from actwave.integrity import Between, check_fields

log = logging.getLogger(__name__)
BENCHMARKS = ("mtbench", "humaneval", "sharegpt")


@dataclass
class EvalConfig:
    """One harness run (saved beside its records); defaults are the ``cpu`` profile's."""

    model: str = "smollm2-135m"
    dtype: str = "float32"
    benchmarks: tuple[str, ...] = BENCHMARKS
    n_prompts: int = 2                  # per benchmark
    max_turns: int = 1                  # 1: MT-bench first turns only
    max_new_tokens: int = 64
    max_prompt_tokens: int = 1024
    mode: str = "tree"
    depth: int = 4
    top_k: int = 4
    total_tokens: int = 16
    peers: bool = True                  # also time HF generate and HF prompt lookup
    prompt_lookup_tokens: int = 10
    n_bootstrap: int = 1000
    seed: int = 0

    def __post_init__(self):
        # Checked before any prompt runs: n_bootstrap=0 once crashed after all of them.
        check_fields(self, {name: Between(1) for name in (
            "n_prompts", "max_turns", "max_new_tokens", "max_prompt_tokens", "depth", "top_k",
            "total_tokens", "prompt_lookup_tokens", "n_bootstrap")} | {"seed": Between(0)},
            {"dtype": DTYPES, "mode": MODES, "benchmarks": BENCHMARKS})
        self.benchmarks = tuple(self.benchmarks)
        if not self.benchmarks:
            raise ValueError(f"benchmarks must name at least one of {BENCHMARKS}, got ()")


# ----------------------------------------------------------------------------- prompts
def benchmark_prompts(benchmark: str, n: int) -> list[dict]:
    """The first ``n`` prompts: {"benchmark", "prompt_id", "turns": [user texts]}."""
    if benchmark == "mtbench":
        rows = data.load_mtbench().select(range(n))
        return [{"benchmark": benchmark, "prompt_id": str(r["question_id"]), "turns": r["turns"]}
                for r in rows]
    if benchmark == "humaneval":
        rows = data.load_humaneval().select(range(n))
        return [{"benchmark": benchmark, "prompt_id": r["task_id"], "turns": [r["prompt"]]}
                for r in rows]
    if benchmark == "sharegpt":
        rows = data.sharegpt_split("eval", n)
        return [{"benchmark": benchmark, "prompt_id": r["id"],
                 "turns": [next(m["content"] for m in r["messages"] if m["role"] == "user")]}
                for r in rows]
    raise ValueError(f"unknown benchmark {benchmark!r}; choose from {BENCHMARKS}")


def load_drafts(target, draft_dirs: dict[str, str | Path]) -> dict:
    """{label: draft dir} -> {label: Eagle3Draft in the target's dtype}; relative dirs are
    under ``cache_dir()`` (as notebook 06 records them). Checked against ``target``."""
    dtype = next(target.parameters()).dtype
    drafts = {}
    for label, directory in draft_dirs.items():
        path = Path(directory) if Path(directory).is_absolute() else cache_dir() / directory
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"draft {label!r}: no saved draft at {path}")
        drafts[label] = Eagle3Draft.load(path, target).to(dtype).eval()
    return drafts


# ----------------------------------------------------------------------------- methods
Method = Callable[[torch.Tensor], dict]


def _hf_method(target, config: EvalConfig, eos: list[int], **extra) -> Method:
    generation = GenerationConfig(max_new_tokens=config.max_new_tokens, do_sample=False,
                                  eos_token_id=eos, pad_token_id=eos[0] if eos else 0, **extra)

    def run(input_ids: torch.Tensor) -> dict:
        out = target.generate(input_ids, attention_mask=torch.ones_like(input_ids),
                              generation_config=generation)
        return {"tokens": out[0, input_ids.shape[1]:].tolist()}
    return run


def _draft_method(target, draft, config: EvalConfig, eos: list[int]) -> Method:
    shape = TreeShape(config.mode, config.depth, config.top_k, config.total_tokens)

    def run(input_ids: torch.Tensor) -> dict:
        result = generate(target, draft, input_ids, config.max_new_tokens, shape=shape,
                          eos_token_ids=eos, seed=config.seed)
        return {"tokens": result.tokens, "tau": result.tau, "accept_counts": result.accept_counts,
                "target_forwards": result.target_forwards, "draft_forwards": result.draft_forwards,
                "timings": result.timings}
    return run


def build_methods(target, drafts: dict, config: EvalConfig, eos: list[int]) -> dict[str, Method]:
    """Our greedy first, then peers, then one method per draft label."""
    methods: dict[str, Method] = {
        GREEDY: lambda ids: {"tokens": greedy_generate(target, ids, config.max_new_tokens, eos).tokens}}
    if config.peers:
        methods["hf_generate"] = _hf_method(target, config, eos)
        methods["hf_prompt_lookup"] = _hf_method(
            target, config, eos, prompt_lookup_num_tokens=config.prompt_lookup_tokens)
    for label, draft in drafts.items():
        if label in methods:
            raise ValueError(f"draft label {label!r} clashes with a built-in method name")
        methods[label] = _draft_method(target, draft, config, eos)
    return methods


def _timed(method: Method, input_ids: torch.Tensor) -> dict:
    """Run one method; wall-clock seconds with CUDA work synchronised."""
    synchronize(input_ids.device)
    began = time.perf_counter()
    out = method(input_ids)
    synchronize(input_ids.device)
    return {**out, "seconds": time.perf_counter() - began}


def _record(item: dict, turn: int, method: str, n_prompt: int, out: dict, reference: list[int]) -> dict:
    tokens = out["tokens"]
    prefix = next((i for i, (a, b) in enumerate(zip(tokens, reference)) if a != b),
                  min(len(tokens), len(reference)))
    return {"benchmark": item["benchmark"], "prompt_id": item["prompt_id"], "turn": turn,
            "method": method, "prompt_tokens": n_prompt, "n_tokens": len(tokens),
            "seconds": out["seconds"], "exact_match": tokens == reference,
            "match_prefix": prefix, "tau": out.get("tau"), "accept_counts": out.get("accept_counts"),
            "target_forwards": out.get("target_forwards"), "draft_forwards": out.get("draft_forwards"),
            "timings": out.get("timings"), "tokens": tokens}


def run_item(item: dict, tokenizer, methods: dict[str, Method], config: EvalConfig,
             device) -> list[dict]:
    """All turns of one prompt through every method -> records ([] if the prompt is too long).

    Later turns append our greedy answer to the conversation (MT-bench turn 2).
    """
    messages, records = [], []
    for turn, text in enumerate(item["turns"][: config.max_turns], start=1):
        messages.append({"role": "user", "content": text})
        ids = data.prompt_ids(tokenizer, messages)
        if len(ids) > config.max_prompt_tokens:
            return records if turn > 1 else []
        input_ids = torch.tensor([ids], device=device)
        outputs = {name: _timed(method, input_ids) for name, method in methods.items()}
        reference = outputs[GREEDY]["tokens"]
        records += [_record(item, turn, name, len(ids), out, reference) for name, out in outputs.items()]
        messages.append({"role": "assistant",
                         "content": tokenizer.decode(reference, skip_special_tokens=True)})
    return records


def _warm_up(methods: dict[str, Method], tokenizer, device) -> None:
    """One short untimed call per method (lazy initialisation, allocator growth)."""
    ids = torch.tensor([data.prompt_ids(tokenizer, [{"role": "user", "content": "Hello!"}])],
                       device=device)
    for method in methods.values():
        method(ids)


def evaluate(target, tokenizer, drafts: dict, config: EvalConfig, eos_token_ids: list[int],
             out_dir: Path | str | None = None, run_name: str = "speculative") -> dict[str, pd.DataFrame]:
    """Run every method on every benchmark prompt -> {"records", "summary", "acceptance"}.

    drafts: {label: Eagle3Draft}. With ``out_dir``, raw records are saved after every
    prompt to ``<out_dir>/<run_name>-<hash>.json`` (hash of the config, draft labels,
    layer ids and weight fingerprints) and prompts already there are skipped on a rerun.
    """
    for label, draft in drafts.items():
        draft.check_target(target)
    methods = build_methods(target, drafts, config, list(eos_token_ids))
    identity = {"config": config, "methods": list(methods),
                "layer_ids": {label: list(d.layer_ids) for label, d in drafts.items()},
                "weights": {label: d.fingerprint() for label, d in drafts.items()}}
    path = Path(out_dir) / f"{run_name}-{config_hash(identity)}.json" if out_dir else None
    records = _load_records(path)
    done = {(r["benchmark"], r["prompt_id"]) for r in records}
    device = next(target.parameters()).device
    items = [item for benchmark in config.benchmarks
             for item in benchmark_prompts(benchmark, config.n_prompts)]
    todo = [item for item in items if (item["benchmark"], item["prompt_id"]) not in done]
    log.info("%d prompts (%d already recorded), methods %s", len(items), len(items) - len(todo),
             list(methods))
    if todo:
        _warm_up(methods, tokenizer, device)
    for item in tqdm(todo, desc="prompts", ascii=True):
        records += run_item(item, tokenizer, methods, config, device) or [_skipped(item)]
        if path is not None:
            atomic_write_json(path, {**to_jsonable(identity), "versions": package_versions(),
                                     "records": records})
    frame = pd.DataFrame([r for r in records if r["method"] is not None])
    return {"records": frame, "summary": summarize(frame, config.n_bootstrap, config.seed),
            "acceptance": acceptance_by_position(frame)}


def _skipped(item: dict) -> dict:
    """Marker for a prompt over max_prompt_tokens, so a rerun does not retry it."""
    return {"benchmark": item["benchmark"], "prompt_id": item["prompt_id"], "method": None}


def _load_records(path: Path | None) -> list[dict]:
    if path is None or not path.exists():
        return []
    return json.loads(path.read_text())["records"]
