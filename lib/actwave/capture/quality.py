"""How degenerate is a regenerated text? Repetition and budget hits, per reply.

A base model answering chat prompts greedily (Gemma-3-270M here) often falls into a loop:
the same phrase repeated until the token budget runs out. Drafts trained on such text learn
to predict loops, and their acceptance measures that, not the target's useful
distribution. Two measures, both per assistant reply:

- repeated-n-gram share: the fraction of the reply's n-grams (token ids) that already
  occurred earlier in the same reply (0 for text without repeats, → 1 for a loop);
- budget hit: the reply ended because the token budget ran out, not at a stop token.
"""
from __future__ import annotations

import statistics
from pathlib import Path
from typing import Iterable, Sequence


def repeated_ngram_share(tokens: Sequence[int], n: int = 4) -> float:
    """Fraction of the n-grams of ``tokens`` seen earlier in ``tokens`` (0.0 when it has
    no n-gram)."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    seen, repeats, total = set(), 0, 0
    for start in range(len(tokens) - n + 1):
        gram = tuple(tokens[start: start + n])
        repeats += gram in seen
        total += 1
        seen.add(gram)
    return repeats / total if total else 0.0


def reply_texts(conversations: Iterable[dict]) -> list[str]:
    """Every assistant message of conversations ``{"messages": [{"role", "content"}]}``."""
    return [m["content"] for c in conversations for m in c["messages"]
            if m["role"] == "assistant"]


def degeneracy(replies: Sequence[Sequence[int]], max_new_tokens: int, n: int = 4) -> dict:
    """Summary over replies (token ids, stop token excluded): median and mean repeated
    n-gram share, share of replies at the budget (``len >= max_new_tokens - 1``: a reply
    cut at the budget holds all of it), and the number of replies."""
    if not replies:
        raise ValueError("no replies to measure")
    shares = [repeated_ngram_share(r, n) for r in replies]
    at_budget = sum(len(r) >= max_new_tokens - 1 for r in replies)
    return {"replies": len(replies), f"median_repeated_{n}gram": statistics.median(shares),
            f"mean_repeated_{n}gram": statistics.fmean(shares),
            "budget_hit_share": at_budget / len(replies)}


def pinned_conversations(folder, verified: bool = True) -> tuple[dict, list[dict]]:
    """(manifest, conversations) of a pinned regeneration folder, chunks verified against
    their sha256; ``verified=False`` reads pins made before chunks had checksums (the 1×
    study's) as they are."""
    from actwave.capture.regenerate import _dataset, _load_manifest  # one reader of chunks
    from actwave.integrity import parse_json_lines
    folder = Path(folder)
    manifest = _load_manifest(folder / "manifest.json")
    if manifest is None:
        raise FileNotFoundError(f"{folder} holds no manifest.json: not a regeneration folder")
    if verified:
        return manifest, _dataset(folder, manifest).to_list()
    return manifest, [row for chunk in manifest["chunks"]
                      for row in parse_json_lines((folder / chunk["file"]).read_bytes())]


def main(argv: list[str] | None = None) -> None:
    """``python -m actwave.capture.quality FOLDER... [--csv PATH]``: the degeneracy of pinned
    regenerations (one row per folder; the model's tokenizer counts the tokens)."""
    import argparse
    import csv

    from actwave.capture.models import load_tokenizer

    parser = argparse.ArgumentParser(description="repetition and budget hits of regenerated text")
    parser.add_argument("folders", nargs="+", help="pinned regeneration folders")
    parser.add_argument("--csv", help="also write the rows to this CSV file")
    parser.add_argument("--unverified", action="store_true",
                        help="read pins made before chunks had checksums (the 1x study's)")
    args = parser.parse_args(argv)
    rows = []
    for folder in args.folders:
        manifest, conversations = pinned_conversations(folder, not args.unverified)
        config = manifest["config"]
        tokenizer = load_tokenizer(config["model"])
        replies = [tokenizer(text, add_special_tokens=False)["input_ids"]
                   for text in reply_texts(conversations)]
        rows.append({"folder": Path(folder).name, "model": config["model"],
                     "dtype": config["dtype"], "verified": not args.unverified,
                     **degeneracy(replies, config["max_new_tokens"])})
        print(rows[-1])
    if args.csv:
        with open(args.csv, "w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=list(rows[0]), lineterminator="\n")
            writer.writeheader()
            writer.writerows(rows)


if __name__ == "__main__":
    main()
