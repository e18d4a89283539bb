"""What a model's steps cost: its shape from the config alone, the FLOPs and bytes of draft
training, and the measured rates (FLOP/s) that turn FLOPs into seconds for ``actwave plan``.

Every rate comes from a committed SmolLM2-135M measurement on 2 CPU cores and is scaled to
other models by FLOPs; ``RATE_SOURCES`` names the files.
"""
from __future__ import annotations

import csv
import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from actwave.config import cache_dir, repo_root

# results/cpu/steps.tsv: 2 passes × 7 methods + 2 HF baselines, 6 prompts × 64 tokens
EVAL_STEP = ("07_speculative", (2 * 7 + 2) * 6 * 64)
# The study's own timings (SmolLM2-135M on 2 CPU cores): notebook 09's fast-path decoding and
# notebook 12's long runs, whose per-step cost the benchmark's draft training underestimates.
STUDY_DECODING = Path("results/study/09_decoding_summary.csv")
LONGRUN_COSTS = Path("results/study/12_study_long_costs_smollm2-135m.csv")
# What those long runs trained (their records' ``train``): batch 2 × ≤ 320 tokens, a
# 16,384-token draft vocabulary, 3 TTT steps, scored on 400 held-out conversations.
LONGRUN_REFERENCE = {"batch_size": 2, "max_seq_len": 320, "draft_vocab_size": 16384,
                     "ttt_steps": 3, "eval_conversations": 400}
LONGRUN_FILL = 147_013 / (768 * 320)  # regenerated sequences fill 60% of 320 (results/benchmarks/draft.json)
# ShareGPT's original replies (a model without regenerated pools) fill 97% of 320: 39,630
# tokens in 64 steps × 2 (results/study/long/gemma3-270m/records/eagle3_default-s0-b64.json)
SHAREGPT_FILL = 39_630 / (64 * 2 * 320)


@dataclass
class Shape:
    """What the plan needs of a model: parameters and the sizes of its tensors."""

    name: str
    params: int
    layers: int       # N
    dim: int          # d
    vocab: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    tied: bool = True  # input embedding shared with the LM head

    @property
    def forward_flops(self) -> float:
        """FLOPs per token of a forward pass: 2 per weight that multiplies (the LM head
        included; an untied input embedding is a lookup)."""
        return 2.0 * (self.params - (0 if self.tied else self.vocab * self.dim))


# The model every rate was measured on: SmolLM2-135M (N=30, d=576, 134.5M parameters).
REFERENCE = Shape("smollm2-135m", 134_515_008, 30, 576, 49152, 9, 3, 64, 1536)


def _config(model: str):
    """The model's transformers config, without weights."""
    from transformers import AutoConfig

    from actwave.capture import models
    path = Path(model).expanduser()
    if path.is_file():
        record = json.loads(path.read_text())
        return AutoConfig.for_model(record.pop("model_type"), **record)
    if model in models.REGISTRY:
        cached = cache_dir() / "models" / model
        if (cached / "config.json").is_file():
            return AutoConfig.from_pretrained(cached, trust_remote_code=False)
        gguf = models.REGISTRY[model].locate()
        return AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                          trust_remote_code=False)
    name = models.resolve(model)
    models.refuse_custom_code(name, name)
    return AutoConfig.from_pretrained(name, trust_remote_code=False)


def model_shape(model: str) -> Shape:
    """The model built on the meta device: parameter count (tied weights once) and sizes."""
    from transformers import AutoModelForCausalLM
    config = _config(model)
    with torch.device("meta"):
        built = AutoModelForCausalLM.from_config(config)
    text = config.get_text_config()
    heads = int(text.num_attention_heads)
    return Shape(name=str(model), params=sum(p.numel() for p in built.parameters()),
                 layers=int(text.num_hidden_layers), dim=int(text.hidden_size),
                 vocab=int(text.vocab_size), heads=heads,
                 kv_heads=int(getattr(text, "num_key_value_heads", None) or heads),
                 head_dim=int(getattr(text, "head_dim", None) or text.hidden_size // heads),
                 intermediate=int(text.intermediate_size),
                 tied=bool(getattr(config, "tie_word_embeddings", True)))


def draft_train_flops_per_token(shape: Shape, k: int, draft_vocab: int, ttt_steps: int,
                                seq_len: int) -> float:
    """Forward + backward FLOPs per token of one TTT unroll of an EAGLE-3 draft.

    fc 2·k·d² + Σ_steps [2·(2d·(h + 2h_kv)·d_h + h·d_h·d + 3·d·I + d·V_draft) + attention
    4·h·d_h·(keys seen)], ×3 for the backward pass (the draft's layer reads 2d inputs).
    """
    d, h, h_kv, d_h = shape.dim, shape.heads, shape.kv_heads, shape.head_dim
    per_step = 2 * (2 * d * (h + 2 * h_kv) * d_h + h * d_h * d + 3 * d * shape.intermediate
                    + d * draft_vocab)
    attention = sum(4 * h * d_h * ((seq_len + 1) / 2 + step) for step in range(ttt_steps))
    return 3.0 * (2 * k * d * d + ttt_steps * per_step + attention)


def draft_train_bytes(shape: Shape, k: int, draft_vocab: int, ttt_steps: int, batch: int,
                      seq_len: int, dtype_bytes: int) -> dict[str, float]:
    """Device memory of draft training, by part (an estimate from the shapes).

    Target weights (its LM head gives the soft labels); the draft's trainable weights with
    gradient and two AdamW moments in float32 (16 B/parameter) and its frozen embedding
    copy; activations kept for the backward pass per TTT step: draft-vocab logits,
    probabilities and their gradient (3·V_draft floats per token), ~20·d floats per token
    in the layer, eager attention scores and probabilities (2·h·T² floats per sequence).
    """
    d = shape.dim
    trainable = (k * d * d + 2 * d * (shape.heads + 2 * shape.kv_heads) * shape.head_dim
                 + shape.heads * shape.head_dim * d + 3 * d * shape.intermediate
                 + d * draft_vocab)
    tokens = batch * seq_len
    activations = 4 * ttt_steps * (tokens * (3 * draft_vocab + 20 * d)
                                   + batch * 2 * shape.heads * seq_len * seq_len)
    return {"target weights": shape.params * dtype_bytes, "draft + AdamW": 16 * trainable,
            "frozen embedding copy": shape.vocab * d * dtype_bytes, "activations": activations}


SUMMARY_COLUMNS = ("measure", "detail")


def _table(path: Path, columns: tuple[str, ...], delimiter: str = ",") -> list[dict]:
    """The rows of a CSV/TSV file, refused (ValueError naming the file) when it is not text
    or lacks one of ``columns``."""
    try:
        with path.open(newline="") as f:
            reader = csv.DictReader(f, delimiter=delimiter)
            rows = list(reader)
    except (UnicodeDecodeError, csv.Error) as err:
        raise ValueError(f"{path}: not a readable table ({err})") from err
    missing = [c for c in columns if c not in (reader.fieldnames or ())]
    if missing:
        raise ValueError(f"{path}: no column {missing[0]!r} (columns: {reader.fieldnames}); "
                         "expected a benchmarks/run_all.py summary.csv")
    return rows


def read_rates(summary: Path) -> dict[str, float]:
    """Effective FLOP/s of each kind of work, from a ``benchmarks/run_all.py`` summary and the
    cpu profile's ``steps.tsv``; every rate names its source in ``RATE_SOURCES``. A file
    that lacks a column or row is refused (ValueError) naming the file and the key."""
    rows = {row["measure"]: row for row in _table(summary, SUMMARY_COLUMNS)}

    def detail(prefix: str, pattern: str) -> float:
        row = next((r for m, r in rows.items() if m.startswith(prefix)), None)
        found = re.search(pattern, row["detail"]) if row else None
        if not found:
            raise ValueError(f"{summary}: no '{prefix}' row with {pattern!r} in its detail")
        return float(found.group(1).replace(",", ""))
    forward = REFERENCE.forward_flops
    train_flops = draft_train_flops_per_token(REFERENCE, 3, 8192, 3, 465)  # bench_train defaults
    steps_file = repo_root() / "results" / "cpu" / "steps.tsv"
    steps = {row["step"]: float(row["wall_s"])
             for row in _table(steps_file, ("step", "wall_s"), delimiter="\t")}
    if EVAL_STEP[0] not in steps:
        raise ValueError(f"{steps_file}: no step {EVAL_STEP[0]!r} (the evaluation rate)")
    return {
        **study_rates(REFERENCE),
        "capture": detail("capture /", r"^([\d.]+) vs") * forward,
        "regenerate": detail("batch 16", r"^([\d.]+) vs") * forward,
        "stats": stats_rate(next((r["detail"] for m, r in rows.items()
                                  if m.startswith("streaming (float64)")), "")),
        "train": detail("draft training", r"^([\d,.]+) tok/s") * train_flops,
        "eval": EVAL_STEP[1] * forward / steps[EVAL_STEP[0]],
    }


def study_rates(smol: Shape) -> dict[str, float]:
    """FLOP/s of notebook 09's decoding and notebook 12's long-run training and scoring,
    from the study's committed SmolLM2-135M tables (ValueError naming a missing one).

    Decoding: every row of a pass decodes the same greedy text, so tokens over seconds is
    the harmonic mean of the rows' tokens/s. Long runs: seconds per step over every scored
    budget, weighted by its drafts; scoring: seconds per record."""
    root = repo_root()
    rows = [row for row in _table(root / STUDY_DECODING, ("model", "benchmark", "tokens_per_s"))
            if row["model"] == smol.name and row["benchmark"] == "all"]
    if not rows:
        raise ValueError(f"{STUDY_DECODING}: no 'all' rows of {smol.name} (the decoding rate)")
    tokens_per_s = len(rows) / sum(1 / float(row["tokens_per_s"]) for row in rows)
    costs = _table(root / LONGRUN_COSTS, ("budget", "drafts", "train_seconds", "score_seconds"))
    if not costs:
        raise ValueError(f"{LONGRUN_COSTS}: no rows (the long-run rates)")
    drafts = sum(float(row["drafts"]) for row in costs)
    per_step = sum(float(r["drafts"]) * float(r["train_seconds"]) for r in costs) / sum(
        float(r["drafts"]) * float(r["budget"]) for r in costs)
    per_score = sum(float(r["drafts"]) * float(r["score_seconds"]) for r in costs) / drafts
    ref = LONGRUN_REFERENCE
    fill = ref["max_seq_len"] * LONGRUN_FILL
    draft = draft_train_flops_per_token(smol, 3, ref["draft_vocab_size"], ref["ttt_steps"],
                                        ref["max_seq_len"])
    return {"decode": tokens_per_s * smol.forward_flops,
            "longrun_train": ref["batch_size"] * fill * draft / per_step,
            "longrun_score": ref["eval_conversations"] * fill * draft / 3 / per_score}


def stats_rate(detail: str) -> float:
    """FLOP/s of the streaming statistics from a detail like ``L=31 n=16384 d=576: 217 tok/s``:
    every token costs L(L+1)/2 products of 2d² FLOPs."""
    found = re.search(r"L=(\d+) n=\d+ d=(\d+): ([\d.]+) tok/s", detail)
    if not found:
        raise ValueError(f"no 'L=.. n=.. d=..: .. tok/s' in the statistics row {detail!r}")
    L, d, rate = int(found.group(1)), int(found.group(2)), float(found.group(3))
    return rate * L * (L + 1) * d * d


RATE_SOURCES = ("rates (SmolLM2-135M, scaled by FLOPs): capture, regeneration, statistics and "
                "training from {summary}; evaluation from results/cpu/steps.tsv "
                f"(07_speculative); decoding from {STUDY_DECODING.as_posix()} (09); long runs "
                f"from {LONGRUN_COSTS.as_posix()} (12)")
