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

Statistics (``summarize``): τ = Σ emitted / Σ verification rounds (EAGLE), tokens/s =
Σ tokens / Σ seconds, speedup = tokens/s ÷ greedy tokens/s on the same prompts, exact-
match rate and matched-prefix share vs our greedy; 95%
percentile-bootstrap CIs resample prompts (both MT-bench turns together), seeded.
Raw per-prompt records go to a JSON file keyed by the config hash; reruns resume.
"""
from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import pandas as pd
import torch
from tqdm import tqdm
from transformers import GenerationConfig

from actwave.capture import data
from actwave.capture.models import DTYPES
from actwave.config import (atomic_write_json, cache_dir, config_hash, package_versions,
                            to_jsonable)
from actwave.decoding.speculative import MODES, generate, greedy_generate
from actwave.decoding.timing import synchronize
from actwave.eagle3 import Eagle3Draft
from actwave.integrity import Between, check_fields

log = logging.getLogger(__name__)
BENCHMARKS = ("mtbench", "humaneval", "sharegpt")
GREEDY = "greedy"


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
    def run(input_ids: torch.Tensor) -> dict:
        result = generate(target, draft, input_ids, config.max_new_tokens, mode=config.mode,
                          depth=config.depth, top_k=config.top_k,
                          total_tokens=config.total_tokens, eos_token_ids=eos, seed=config.seed)
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


# ----------------------------------------------------------------------------- statistics
def bootstrap_ci(statistic: Callable[[np.ndarray], np.ndarray], n_units: int, n_bootstrap: int,
                 seed: int, level: float = 0.95) -> tuple[float, float]:
    """Percentile bootstrap over units: statistic(indices (B, n_units)) -> (B,) values."""
    rng = np.random.default_rng(seed)
    draws = statistic(rng.integers(0, n_units, size=(n_bootstrap, n_units)))
    tail = 100 * (1 - level) / 2
    low, high = np.nanpercentile(draws, [tail, 100 - tail])
    return float(low), float(high)


def _per_prompt(records: pd.DataFrame) -> pd.DataFrame:
    """Sums per (benchmark, prompt, method): tokens, seconds, emitted, rounds, exact turns."""
    frame = records.assign(
        emitted=records["n_tokens"] - 1,
        rounds=pd.to_numeric(records["target_forwards"], errors="coerce") - 1,
        exact=records["exact_match"].astype(float), turns=1)
    return frame.groupby(["benchmark", "prompt_id", "method"], sort=True)[
        ["n_tokens", "seconds", "emitted", "rounds", "exact", "turns", "match_prefix"]
    ].sum().reset_index()


def _method_row(mine: pd.DataFrame, greedy: pd.DataFrame, n_bootstrap: int, seed: int) -> dict:
    """Point estimates and CIs for one method over aligned per-prompt rows."""
    tokens, seconds = mine["n_tokens"].to_numpy(float), mine["seconds"].to_numpy(float)
    base_tokens, base_seconds = greedy["n_tokens"].to_numpy(float), greedy["seconds"].to_numpy(float)
    emitted, rounds = mine["emitted"].to_numpy(float), mine["rounds"].to_numpy(float)

    def rate(idx):
        return tokens[idx].sum(-1) / seconds[idx].sum(-1)

    def speedup(idx):
        return rate(idx) / (base_tokens[idx].sum(-1) / base_seconds[idx].sum(-1))

    def tau(idx):
        return emitted[idx].sum(-1) / rounds[idx].sum(-1)

    everything = np.arange(len(mine))
    row = {"n_prompts": len(mine), "n_turns": int(mine["turns"].sum()),
           "exact_match_rate": float(mine["exact"].sum() / mine["turns"].sum()),
           # share of greedy's tokens reproduced before the first divergence (bf16 near-ties)
           "match_prefix_frac": float(mine["match_prefix"].sum() / base_tokens.sum())}
    has_rounds = bool(np.isfinite(rounds).all() and rounds.sum() > 0)
    for name, statistic in (("tokens_per_s", rate), ("speedup", speedup), ("tau", tau)):
        if name == "tau" and not has_rounds:
            row.update(tau=np.nan, tau_lo=np.nan, tau_hi=np.nan)
            continue
        low, high = bootstrap_ci(statistic, len(mine), n_bootstrap, seed)
        row.update({name: float(statistic(everything)), f"{name}_lo": low, f"{name}_hi": high})
    return row


def summarize(records: pd.DataFrame, n_bootstrap: int = 1000, seed: int = 0) -> pd.DataFrame:
    """One row per (benchmark incl. "all", label): τ, tokens/s, speedup (+ CIs), exactness;
    records keep the label under ``method``."""
    if records.empty:
        raise ValueError("no records to summarise (all prompts skipped or none run)")
    per_prompt = _per_prompt(records)
    pooled = per_prompt.assign(prompt_id=per_prompt["benchmark"] + "/" + per_prompt["prompt_id"],
                               benchmark="all")
    rows = []
    for benchmark, group in pd.concat([per_prompt, pooled]).groupby("benchmark", sort=True):
        by_method = {m: g.sort_values("prompt_id").reset_index(drop=True)
                     for m, g in group.groupby("method", sort=True)}
        greedy = by_method[GREEDY]
        for method, mine in by_method.items():
            if list(mine["prompt_id"]) != list(greedy["prompt_id"]):
                raise ValueError(f"method {method!r} has records for other prompts than greedy "
                                 f"on {benchmark!r}; cannot pair them for the speedup")
            rows.append({"benchmark": benchmark, "label": method,
                         **_method_row(mine, greedy, n_bootstrap, seed)})
    return pd.DataFrame(rows)


def acceptance_by_position(records: pd.DataFrame) -> pd.DataFrame:
    """Per (benchmark, label) and draft position i ≥ 1: the share of rounds accepting ≥ i
    draft tokens (``reach``) and P(accept ≥ i | accept ≥ i−1) (``conditional``)."""
    rows = []
    speculative = records[records["accept_counts"].notna()]
    for (benchmark, method), group in speculative.groupby(["benchmark", "method"], sort=True):
        width = max(len(h) for h in group["accept_counts"])
        histogram = np.zeros(width + 1)  # one empty bin: the first unreached position shows 0
        for counts in group["accept_counts"]:
            histogram[: len(counts)] += counts
        reach = histogram[::-1].cumsum()[::-1] / histogram.sum()  # reach[i] = P(accepted >= i)
        for position in range(1, width + 1):
            rows.append({"benchmark": benchmark, "label": method, "position": position,
                         "reach": float(reach[position]),
                         "conditional": float(reach[position] / reach[position - 1])
                         if reach[position - 1] > 0 else np.nan})
    return pd.DataFrame(rows, columns=["benchmark", "label", "position", "reach", "conditional"])


# ----------------------------------------------------------------------------- tables
def main_table(summary: pd.DataFrame, layer_ids: dict[str, tuple[int, ...]]) -> pd.DataFrame:
    """Wide table: one row per label, per benchmark τ and speedup with their 95% CIs.

    layer_ids: {label: layer ids} for draft rows (peer rows get an empty cell).
    """
    rows = []
    for label, group in summary.groupby("label", sort=True):
        row = {"label": label, "layer_ids": ",".join(map(str, layer_ids.get(label, ())))}
        for record in group.itertuples():
            for stat in ("tau", "speedup"):
                value, low, high = (getattr(record, s) for s in (stat, f"{stat}_lo", f"{stat}_hi"))
                row[f"{record.benchmark}_{stat}"] = value
                row[f"{record.benchmark}_{stat}_ci"] = "" if np.isnan(value) else f"[{low:.2f}, {high:.2f}]"
        rows.append(row)
    return pd.DataFrame(rows)


def read_selection_scores(path: Path | str) -> pd.DataFrame:
    """Notebook 05's ``05_selection.csv`` as long rows (model, token_set, layer_ids, score,
    value).

    Score columns are the numeric ones (percentile columns ``*_pct`` included);
    ``layer_ids`` cells are "a,b,c". The score of a set depends on the set, not on the
    method that picked it, so duplicates are dropped.
    """
    table = pd.read_csv(path)
    missing = [c for c in ("model", "token_set", "layer_ids") if c not in table.columns]
    if missing:
        raise ValueError(f"{path}: missing columns {missing}; found {list(table.columns)}")
    table = table.assign(layer_ids=table["layer_ids"].map(
        lambda s: tuple(int(x) for x in str(s).split(","))))
    scores = [c for c in table.select_dtypes("number").columns if c not in ("k", "seed")]
    keys = ["model", "token_set", "layer_ids"]
    long = table.melt(id_vars=keys, value_vars=scores, var_name="score", value_name="value")
    return long.dropna(subset=["value"]).drop_duplicates([*keys, "score"])


def tau_vs_scores(taus: pd.DataFrame, scores: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Join measured τ per draft with its selection scores; rank correlations per score.

    taus: columns model, label, layer_ids (tuple), tau. scores: ``read_selection_scores``.
    -> (joined rows, correlations: model ("all" = pooled), token_set, score, n, Spearman ρ
    and Kendall τ_b with p-values). Pooled rows rank τ within each model first.
    """
    from scipy.stats import kendalltau, spearmanr

    keys = ["model", "token_set", "score"]
    joined = taus.merge(scores, on=["model", "layer_ids"], how="inner")
    joined = joined.assign(tau_rank=joined.groupby(keys)["tau"].rank(pct=True),
                           value_rank=joined.groupby(keys)["value"].rank(pct=True))
    rows = []
    pooled = joined.assign(model="all", tau=joined["tau_rank"], value=joined["value_rank"])
    for (model, token_set, score), group in pd.concat([joined, pooled]).groupby(keys, sort=True):
        if len(group) < 3 or group["value"].nunique() < 2 or group["tau"].nunique() < 2:
            continue
        rho, rho_p = spearmanr(group["value"], group["tau"])
        kendall, kendall_p = kendalltau(group["value"], group["tau"])
        rows.append({"model": model, "token_set": token_set, "score": score, "n": len(group),
                     "spearman": rho, "spearman_p": rho_p, "kendall": kendall, "kendall_p": kendall_p})
    columns = ["model", "token_set", "score", "n", "spearman", "spearman_p", "kendall", "kendall_p"]
    return joined.drop(columns=["tau_rank", "value_rank"]), pd.DataFrame(rows, columns=columns)
