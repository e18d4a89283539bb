"""Everything that needs a GPU, in one run of under 8 minutes on one CUDA device.

    .venv/bin/python benchmarks/gpu_check.py [--out results/gpu-check] [--only NAME,..] [--dry-run]

Steps (each a subprocess with its own time limit; its output goes to ``<out>/<name>.log``):

- ``cuda_tests``: the CUDA tests (``tests/test_cuda.py``: statistics on the GPU equal the
  CPU's, the block-pair route's measured peak under its budget, fp32 speculative decoding
  equal to greedy on tiny models; ``tests/test_metrics.py -k cuda``).
- ``fp32_exact``: the real SmolLM2 in float32 on CUDA: speculative vs greedy exact-match rate
  (must be 100%) with peers and the auto tree (``bench_speculative.py``).
- ``bf16_match``: the same in bfloat16: the greedy match rate (near-ties may flip).
- ``smoke``: ``./reproduce.sh --profile smoke-cuda``, every notebook on the GPU.
- ``benchmarks``: ``run_all.py --size quick`` (capture, statistics, regeneration, training,
  speculative) into ``<out>/benchmarks/summary.csv``; ``python -m actwave.tools.plan --rates`` reads
  it for GPU time estimates.

``<out>/summary.md`` and ``summary.json`` list each step's exit status, wall time and the
lines of its log that carry results. ``--dry-run`` runs nothing on a GPU: it checks that every
step's program, script, test file and profile exists and prints the commands. It needs the
environment ``./reproduce.sh`` sets up (``.venv``, once, ~4 min) on the GPU machine.
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
QUICK_SPECULATIVE = ["--device", "cuda", "--n-prompts", "2", "--max-new-tokens", "64",
                     "--acceptance-prompts", "2"]
# name -> (command, time limit in seconds, pattern of the log lines the summary keeps); the
# limits add up to 470 s. The first step that loads SmolLM2 also dequantises it (20-80 s).
STEPS: dict[str, tuple[list[str], int, str]] = {
    "cuda_tests": ([PY, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_cuda.py",
                    "tests/test_metrics.py", "-k", "cuda"], 60, r"passed|failed|error"),
    "fp32_exact": ([PY, "benchmarks/bench_speculative.py", "--dtype", "float32",
                    *QUICK_SPECULATIVE], 100, r"^\s*(greedy|hf_|spec_)|^== "),
    "bf16_match": ([PY, "benchmarks/bench_speculative.py", "--dtype", "bfloat16",
                    *QUICK_SPECULATIVE], 60, r"^\s*(greedy|hf_|spec_)|^== "),
    "smoke": (["./reproduce.sh", "--profile", "smoke-cuda"], 150, r"^(==|step|wrote)|Error"),
    "benchmarks": ([PY, "benchmarks/run_all.py", "--size", "quick", "--only",
                    "capture,metrics,regenerate,train,speculative", "--out", "{out}/benchmarks"],
                   100, r"^\|"),
}


def resolve(command: list[str], out: Path) -> list[str]:
    return [part.replace("{out}", str(out)) for part in command]


def missing_parts(command: list[str]) -> list[str]:
    """Files a step's command names that do not exist: scripts, test files, the profile."""
    missing = [part for part in command
               if part.endswith((".py", ".sh")) and not (ROOT / part).is_file()]
    if "--profile" in command:
        profile = command[command.index("--profile") + 1]
        if not (ROOT / "profiles" / f"{profile}.yaml").is_file():
            missing.append(f"profiles/{profile}.yaml")
    return missing


def run_step(name: str, out: Path) -> dict:
    """Run one step with its time limit; -> its record for the summary."""
    command, limit, keep = STEPS[name]
    command = resolve(command, out)
    log = out / f"{name}.log"
    tic = time.perf_counter()
    with log.open("w") as handle:
        try:
            code = subprocess.run(command, cwd=ROOT, stdout=handle, stderr=subprocess.STDOUT,
                                  timeout=limit).returncode
        except subprocess.TimeoutExpired:
            code = 124
    lines = [line for line in log.read_text().splitlines() if re.search(keep, line)]
    return {"step": name, "exit": code, "seconds": round(time.perf_counter() - tic, 1),
            "limit_s": limit, "command": " ".join(command), "results": lines[-24:]}


def write_summary(out: Path, records: list[dict], device: str) -> None:
    lines = [f"# GPU check on {device}", "", "| step | exit | seconds | limit |",
             "| --- | ---: | ---: | ---: |"]
    lines += [f"| {r['step']} | {r['exit']} | {r['seconds']} | {r['limit_s']} |" for r in records]
    for record in records:
        lines += ["", f"## {record['step']}", "", f"`{record['command']}`", "", "```",
                  *record["results"], "```"]
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    (out / "summary.json").write_text(json.dumps({"device": device, "steps": records}, indent=1))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="results/gpu-check")
    parser.add_argument("--only", default=",".join(STEPS), help=f"of {','.join(STEPS)}")
    parser.add_argument("--dry-run", action="store_true")
    args = parser.parse_args(argv)
    names = [name.strip() for name in args.only.split(",") if name.strip()]
    unknown = [name for name in names if name not in STEPS]
    if unknown or not names:
        parser.error(f"--only: unknown steps {unknown}; known: {', '.join(STEPS)}")
    out = Path(args.out) if Path(args.out).is_absolute() else ROOT / args.out
    missing = {name: missing_parts(STEPS[name][0]) for name in names}
    if any(missing.values()):
        print(f"gpu_check: missing {missing}", file=sys.stderr)
        return 2
    if args.dry_run:
        for name in names:
            print(f"{name} (≤ {STEPS[name][1]} s): {' '.join(resolve(STEPS[name][0], out))}")
        return 0
    import torch
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    records = []
    for name in names:
        records.append(run_step(name, out))
        print(f"{name}: exit {records[-1]['exit']} in {records[-1]['seconds']} s", flush=True)
    write_summary(out, records, torch.cuda.get_device_name(0))
    return max(record["exit"] for record in records)


if __name__ == "__main__":
    sys.exit(main())
