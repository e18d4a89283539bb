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

Statistics and tables: ``actwave.decoding.report``.

Raw records (with ``out_dir``) go to the run folder ``<out_dir>/<run_name>-<key>/``, the
key hashing the config, the methods, the drafts' layer ids and weight digests and the
target's identity (weights, dtype, file digest): ``prompt-XXXXX.jsonl`` (one record per
line, per prompt, numbered by the prompt's place in the run) and ``manifest.json`` (a
checksummed record: the key, the expected prompts, per finished prompt its file, record
count, size and sha256; ``complete`` once every prompt is in). One writer per folder
(``WriterLock``); a rerun resumes at the missing prompts. On read, every file is checked
against its record: a flipped byte, a dropped or added line, a file from another run, an
edited value or a prompt the run does not have is refused with an ``IntegrityError``
naming the file and the repair (delete that prompt's file: only that prompt reruns).
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
from actwave.config import atomic_write_bytes, cache_dir, config_hash, package_versions
from actwave.decoding.report import GREEDY, acceptance_by_position, summarize
from actwave.decoding.speculative import generate, greedy_generate
from actwave.decoding.timing import STALL_RETRIES, stalled, synchronize
from actwave.decoding.tree import MODES, TreeShape
from actwave.eagle3 import Eagle3Draft
from actwave.integrity import (Between, IntegrityError, WriterLock, bytes_record, check_fields,
                               dump_json_lines, parse_json_lines,
                               model_identity, read_record, require_int, require_real, verify_once,
                               write_record)

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
    lookup: int = 0                     # prompt-lookup rounds of <= lookup tokens (0: none)
    peers: bool = True                  # also time HF generate and HF prompt lookup
    prompt_lookup_tokens: int = 10
    n_bootstrap: int = 1000
    seed: int = 0

    def __post_init__(self):
        # Checked before any prompt runs: n_bootstrap=0 once crashed after all of them.
        check_fields(self, {name: Between(1) for name in (
            "n_prompts", "max_turns", "max_new_tokens", "max_prompt_tokens", "depth", "top_k",
            "total_tokens", "prompt_lookup_tokens", "n_bootstrap")}
            | {name: Between(0) for name in ("seed", "lookup")},
            {"dtype": DTYPES, "mode": MODES, "benchmarks": BENCHMARKS})
        self.benchmarks = tuple(self.benchmarks)
        if not self.benchmarks:
            raise ValueError(f"benchmarks must name at least one of {BENCHMARKS}, got ()")

    def shape(self) -> TreeShape:
        """The draft shape these settings name (no cost-model prediction)."""
        return TreeShape(self.mode, self.depth, self.top_k, self.total_tokens, lookup=self.lookup)


# ----------------------------------------------------------------------------- prompts
def benchmark_prompts(benchmark: str, n: int) -> list[dict]:
    """The first ``n`` prompts (all of them if the benchmark has fewer: MT-bench 80,
    HumanEval 164): {"benchmark", "prompt_id", "turns": [user texts]}."""
    if benchmark == "mtbench":
        rows = data.load_mtbench()
        rows = rows.select(range(min(n, rows.num_rows)))
        return [{"benchmark": benchmark, "prompt_id": str(r["question_id"]), "turns": r["turns"]}
                for r in rows]
    if benchmark == "humaneval":
        rows = data.load_humaneval()
        rows = rows.select(range(min(n, rows.num_rows)))
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
    shape = config.shape()

    def run(input_ids: torch.Tensor) -> dict:
        result = generate(target, draft, input_ids, config.max_new_tokens, shape=shape,
                          eos_token_ids=eos, seed=config.seed)
        return {"tokens": result.tokens, "tau": result.tau, "accept_counts": result.accept_counts,
                "target_forwards": result.target_forwards, "draft_forwards": result.draft_forwards,
                "lookup_rounds": result.lookup_rounds, "timings": result.timings}
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
    """Run one method; wall-clock seconds with CUDA work synchronised, timed again when the
    process was stopped during the measurement (``stalled``)."""
    for attempt in range(STALL_RETRIES + 1):
        synchronize(input_ids.device)
        began, cpu_began = time.perf_counter(), time.process_time()
        out = method(input_ids)
        synchronize(input_ids.device)
        wall, cpu = time.perf_counter() - began, time.process_time() - cpu_began
        if not stalled(wall, cpu, input_ids.device):
            break
        log.warning("a measurement spent %.1f s of wall time on %.1f s of CPU time (the "
                    "process was stopped?); %s", wall, cpu,
                    "timing it again" if attempt < STALL_RETRIES else "keeping it")
    return {**out, "seconds": wall}


def _record(item: dict, turn: int, method: str, prompt: list[int], out: dict,
            reference: list[int]) -> dict:
    """One method's output on one prompt; ``prompt_ids`` on our greedy record only (the
    text an offline walk re-scores: ``acceptance.walk_check``)."""
    tokens = out["tokens"]
    prefix = next((i for i, (a, b) in enumerate(zip(tokens, reference)) if a != b),
                  min(len(tokens), len(reference)))
    return {"benchmark": item["benchmark"], "prompt_id": item["prompt_id"], "turn": turn,
            "method": method, "prompt_tokens": len(prompt),
            "prompt_ids": prompt if method == GREEDY else None, "n_tokens": len(tokens),
            "seconds": out["seconds"], "exact_match": tokens == reference,
            "match_prefix": prefix, "tau": out.get("tau"), "accept_counts": out.get("accept_counts"),
            "target_forwards": out.get("target_forwards"), "draft_forwards": out.get("draft_forwards"),
            "lookup_rounds": out.get("lookup_rounds"), "timings": out.get("timings"),
            "tokens": tokens}


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
        records += [_record(item, turn, name, ids, out, reference) for name, out in outputs.items()]
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

    drafts: {label: Eagle3Draft}, each checked against ``target`` (config, and the target
    identity it records). With ``out_dir``, raw records are saved after every prompt into
    the run folder ``<out_dir>/<run_name>-<key>/`` (module docstring) and prompts already
    there are verified and skipped on a rerun.
    """
    for label, draft in drafts.items():
        draft.check_target(target)
        draft.check_target_identity(target, f"{label!r}")
    methods = build_methods(target, drafts, config, list(eos_token_ids))
    target_identity = {k: v for k, v in model_identity(target).items() if k != "name"}
    identity = {"config": config, "methods": list(methods),
                "layer_ids": {label: list(d.layer_ids) for label, d in drafts.items()},
                "weights": {label: d.fingerprint() for label, d in drafts.items()},
                "target": target_identity, "format": RUN_FORMAT}
    items = [item for benchmark in config.benchmarks
             for item in benchmark_prompts(benchmark, config.n_prompts)]
    if out_dir is None:
        records = _run_items(items, tokenizer, methods, config, target, None)
    else:
        folder = run_folder(out_dir, run_name, identity)
        with WriterLock(folder):
            run = EvalRun(folder, config_hash(identity), items, list(methods))
            run.open(identity)
            records = _run_items(items, tokenizer, methods, config, target, run)
    frame = pd.DataFrame([r for r in records if r["method"] is not None])
    return {"records": frame, "summary": summarize(frame, config.n_bootstrap, config.seed),
            "acceptance": acceptance_by_position(frame)}


def _run_items(items: list[dict], tokenizer, methods: dict[str, Method], config: EvalConfig,
               target, run: "EvalRun | None") -> list[dict]:
    """Records of every item, those a run already holds read back; -> in item order."""
    done = run.records() if run is not None else {}
    device = next(target.parameters()).device
    todo = [i for i, item in enumerate(items) if i not in done]
    log.info("%d prompts (%d already recorded), methods %s", len(items), len(items) - len(todo),
             list(methods))
    if todo:
        _warm_up(methods, tokenizer, device)
    for index in tqdm(todo, desc="prompts", ascii=True):
        item = items[index]
        done[index] = run_item(item, tokenizer, methods, config, device) or [_skipped(item)]
        if run is not None:
            run.add(index, done[index])
    if run is not None:
        run.finish()
    return [record for index in range(len(items)) for record in done[index]]


def _skipped(item: dict) -> dict:
    """Marker for a prompt over max_prompt_tokens, so a rerun does not retry it."""
    return {"benchmark": item["benchmark"], "prompt_id": item["prompt_id"], "method": None}


# ----------------------------------------------------------------------------- records
# v3: prompt_ids on greedy records; v4: a stop token accepted inside a round ends the run
RUN_FORMAT = "actwave-eval-run-v5"
MANIFEST = "manifest.json"


def run_folder(out_dir: Path | str, run_name: str, identity: dict) -> Path:
    """``<out_dir>/<run_name>-<key>``, the key hashing ``identity`` (see ``evaluate``)."""
    if not run_name or "/" in run_name or run_name.startswith("."):
        raise ValueError(f"run_name must be a plain file-name stem, got {run_name!r}")
    return Path(out_dir) / f"{run_name}-{config_hash(identity)}"


def prompt_file(index: int) -> str:
    return f"prompt-{index:05d}.jsonl"


class EvalRun:
    """The records of one evaluation run on disk (module docstring): verified reads,
    atomic per-prompt writes, a checksummed manifest. Use under the folder's WriterLock."""

    def __init__(self, folder: Path, key: str, items: list[dict], methods: list[str]):
        self.folder, self.key, self.methods = Path(folder), key, list(methods)
        self.expected = [[item["benchmark"], str(item["prompt_id"])] for item in items]
        self.manifest: dict = {}

    @property
    def manifest_path(self) -> Path:
        return self.folder / MANIFEST

    def _repair(self) -> str:
        return (f"delete {self.folder}: evaluate reruns every prompt (or restore the folder "
                "from where it was copied)")

    def _prompt_repair(self, path: Path) -> str:
        return f"delete {path}: the next evaluate call with the same arguments reruns only that prompt"

    def open(self, identity: dict) -> None:
        """Read and check the manifest (or start one); entries whose file is gone are
        dropped so that their prompts rerun (the repair of a bad prompt file)."""
        self.folder.mkdir(parents=True, exist_ok=True)
        if not self.manifest_path.exists():
            self.manifest = {"format": RUN_FORMAT, "key": self.key, "identity": identity,
                             "versions": package_versions(), "expected": self.expected,
                             "prompts": [], "complete": False}
            return
        manifest = read_record(self.manifest_path, self._repair())
        for field, want in (("format", RUN_FORMAT), ("key", self.key),
                            ("expected", self.expected)):
            if manifest.get(field) != want:
                raise IntegrityError(self.manifest_path, field, want, manifest.get(field),
                                     self._repair())
        kept = []
        for entry in manifest.get("prompts", []):
            if (self.folder / str(entry.get("file"))).is_file():
                kept.append(entry)
            else:
                log.warning("%s: prompt file %s is missing; rerunning that prompt",
                            self.folder, entry.get("file"))
                manifest["complete"] = False
        manifest["prompts"] = kept
        self.manifest = manifest

    def records(self) -> dict[int, list[dict]]:
        """{prompt index: its verified records} for every prompt the manifest holds."""
        out: dict[int, list[dict]] = {}
        for entry in self.manifest["prompts"]:
            index = self._entry_index(entry)
            if index in out:
                raise IntegrityError(self.manifest_path, "prompts", "each once",
                                     f"{entry['file']} twice", self._repair())
            out[index] = self._read_prompt(index, entry)
        if self.manifest.get("complete") and len(out) != len(self.expected):
            raise IntegrityError(self.manifest_path, "prompts", len(self.expected), len(out),
                                 self._repair())
        return out

    def _entry_index(self, entry: dict) -> int:
        pair = [entry.get("benchmark"), entry.get("prompt_id")]
        if pair not in self.expected:
            raise IntegrityError(self.manifest_path, "prompt", f"one of the run's "
                                 f"{len(self.expected)} prompts", pair, self._repair())
        index = self.expected.index(pair)
        if entry.get("file") != prompt_file(index):
            raise IntegrityError(self.manifest_path, f"file of prompt {pair}",
                                 prompt_file(index), entry.get("file"), self._repair())
        return index

    def _read_prompt(self, index: int, entry: dict) -> list[dict]:
        path = self.folder / entry["file"]
        repair = self._prompt_repair(path)
        if "sha256" not in entry:
            raise IntegrityError(path, "manifest record", "a sha256", "none", repair)
        verify_once(path, entry, repair)
        try:
            records = parse_json_lines(path.read_bytes())
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise IntegrityError(path, "content", "JSON lines", str(err), repair) from err
        if len(records) != entry.get("n_records"):
            raise IntegrityError(path, "records", entry.get("n_records"), len(records), repair)
        try:
            self._check_records(index, records)
        except (KeyError, TypeError, ValueError) as err:
            raise IntegrityError(path, "records", "one per turn and method of this prompt",
                                 str(err), repair) from err
        return records

    def _check_records(self, index: int, records: list[dict]) -> None:
        """One record per (turn 1..T, method), all for this prompt, with sane values (or a
        single skip marker)."""
        benchmark, prompt_id = self.expected[index]
        for record in records:
            if [record["benchmark"], str(record["prompt_id"])] != [benchmark, prompt_id]:
                raise ValueError(f"a record of prompt {record['benchmark']}/{record['prompt_id']}")
        if len(records) == 1 and records[0]["method"] is None:
            return
        turns = max(require_int("turn", r["turn"], 1) for r in records)
        pairs = sorted((r["turn"], r["method"]) for r in records)
        expected = sorted((turn, method) for turn in range(1, turns + 1) for method in self.methods)
        if pairs != expected:
            raise ValueError(f"(turn, method) pairs {pairs}, expected {expected}")
        for record in records:
            require_real("seconds", record["seconds"], 0.0, low_open=True)
            if require_int("n_tokens", record["n_tokens"], 0) != len(record["tokens"]):
                raise ValueError(f"n_tokens {record['n_tokens']} != {len(record['tokens'])} tokens")

    def add(self, index: int, records: list[dict]) -> None:
        """Write one prompt's records, then the manifest naming them."""
        name = prompt_file(index)
        data = dump_json_lines(records)
        atomic_write_bytes(self.folder / name, data)
        benchmark, prompt_id = self.expected[index]
        self.manifest["prompts"] = [e for e in self.manifest["prompts"] if e["file"] != name]
        self.manifest["prompts"].append({"benchmark": benchmark, "prompt_id": prompt_id,
                                         "file": name, "n_records": len(records),
                                         **bytes_record(data)})
        self.manifest["prompts"].sort(key=lambda e: e["file"])
        self.manifest = write_record(self.manifest_path, self.manifest)
        self.manifest.pop("record_sha256", None)

    def finish(self) -> None:
        """Mark the run complete once every expected prompt is recorded."""
        complete = len(self.manifest["prompts"]) == len(self.expected)
        if complete != self.manifest.get("complete") or not self.manifest_path.exists():
            self.manifest["complete"] = complete
            self.manifest = write_record(self.manifest_path, self.manifest)
            self.manifest.pop("record_sha256", None)


def load_run(folder: Path | str) -> pd.DataFrame:
    """The verified records of a finished run folder (as ``evaluate`` wrote them)."""
    folder = Path(folder)
    manifest = read_record(folder / MANIFEST, f"delete {folder} and rerun evaluate")
    items = [{"benchmark": b, "prompt_id": p} for b, p in manifest["expected"]]
    run = EvalRun(folder, manifest["key"], items, manifest["identity"]["methods"])
    run.open(manifest["identity"])
    if not run.manifest.get("complete"):
        raise IntegrityError(folder / MANIFEST, "complete", True, False,
                             "rerun evaluate with the same arguments: it runs the missing prompts")
    done = run.records()
    records = [r for index in range(len(items)) for r in done[index]]
    return pd.DataFrame([r for r in records if r["method"] is not None])
