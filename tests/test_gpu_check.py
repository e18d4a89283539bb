"""benchmarks/gpu_check.py without a GPU: its steps name things that exist, with arguments
their programs accept, within the 8-minute budget."""
from __future__ import annotations

import importlib

import pytest
import yaml

from actwave.config import repo_root
from actwave.tools import runplan


@pytest.fixture
def gpu_check(monkeypatch):
    monkeypatch.syspath_prepend(str(repo_root() / "benchmarks"))
    return importlib.import_module("gpu_check")


def test_dry_run_lists_every_step_and_the_limits_fit_8_minutes(gpu_check, capsys):
    assert gpu_check.main(["--dry-run"]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert [line.split(" ")[0] for line in printed] == list(gpu_check.STEPS)
    assert sum(limit for _, limit, _ in gpu_check.STEPS.values()) <= 8 * 60


def test_speculative_steps_parse_with_the_benchmark_parser(gpu_check):
    bench = importlib.import_module("bench_speculative")
    dtypes = set()
    for name in ("fp32_exact", "bf16_match"):
        command = gpu_check.STEPS[name][0]
        args = bench.parse_args(command[command.index("benchmarks/bench_speculative.py") + 1:])
        assert args.device == "cuda"
        dtypes.add(args.dtype)
    assert dtypes == {"float32", "bfloat16"}


def test_benchmark_step_names_known_benchmarks_and_size(gpu_check):
    run_all = importlib.import_module("run_all")
    command = gpu_check.STEPS["benchmarks"][0]
    assert command[command.index("--size") + 1] in run_all.SIZES
    assert set(command[command.index("--only") + 1].split(",")) <= set(run_all.BENCHMARKS)


def test_smoke_cuda_profile_is_the_smoke_profile_on_cuda(gpu_check):
    command = gpu_check.STEPS["smoke"][0]
    name = command[command.index("--profile") + 1]
    profile = runplan.load_profile(name)
    assert profile == {**runplan.load_profile("smoke"), "device": "cuda"}
    assert runplan.select_notebooks(profile)  # reproduce.sh accepts it


def test_test_step_names_existing_cuda_tests(gpu_check):
    command = gpu_check.STEPS["cuda_tests"][0]
    files = [part for part in command if part.startswith("tests/")]
    assert files and all((repo_root() / part).is_file() for part in files)
    assert "def test_" in (repo_root() / "tests" / "test_cuda.py").read_text()


def test_unknown_step_and_missing_script_are_refused(gpu_check, monkeypatch, capsys):
    with pytest.raises(SystemExit):
        gpu_check.main(["--only", "smoke,warp"])
    assert "unknown steps ['warp']" in capsys.readouterr().err
    monkeypatch.setitem(gpu_check.STEPS, "smoke", (["benchmarks/gone.py"], 10, "x"))
    assert gpu_check.main(["--dry-run", "--only", "smoke"]) == 2
    assert "benchmarks/gone.py" in capsys.readouterr().err


def test_summary_lists_steps_with_their_results(gpu_check, tmp_path):
    records = [{"step": "smoke", "exit": 0, "seconds": 1.5, "limit_s": 150,
                "command": "./reproduce.sh --profile smoke-cuda", "results": ["== 01_capture"]}]
    gpu_check.write_summary(tmp_path, records, "NVIDIA H200")
    text = (tmp_path / "summary.md").read_text()
    assert "| smoke | 0 | 1.5 | 150 |" in text and "== 01_capture" in text
    assert yaml.safe_load((tmp_path / "summary.json").read_text())["device"] == "NVIDIA H200"
