"""reproduce.sh refuses what it cannot do before any notebook starts, with one clear line;
each notebook gets only the parameters it declares and a quiet, readable log."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from actwave.tools import runplan

ROOT = Path(__file__).resolve().parents[1]
STAMPED = ("requirements.txt", "requirements-assets.txt", "pyproject.toml")


@pytest.fixture(scope="module")
def checkout(tmp_path_factory) -> Path:
    """reproduce.sh in a scratch folder whose .venv is a stand-in for this interpreter,
    stamped as up to date, so the script never installs anything."""
    folder = tmp_path_factory.mktemp("checkout")
    for name in ("reproduce.sh", "jupytext.toml", *STAMPED):
        shutil.copy2(ROOT / name, folder / name)
    for name in ("profiles", "notebooks", "jupyter"):
        shutil.copytree(ROOT / name, folder / name)
    python = folder / ".venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    python.chmod(0o755)
    # The same stamp reproduce.sh computes: sha256 of the three files, first 16 hex digits.
    stamp = hashlib.sha256(b"".join((folder / n).read_bytes() for n in STAMPED)).hexdigest()
    (folder / ".venv" / ".actwave-stamp").write_text(stamp[:16] + "\n")
    return folder


def reproduce(checkout: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(checkout / "reproduce.sh"), *args], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "HF_HUB_OFFLINE": "1"})


@pytest.mark.parametrize("args, message", [
    (["--profile"], "--profile needs a value"),
    (["--profile", "--only", "01"], "--profile needs a value"),
    (["--profile", "smoke", "--only"], "--only needs a value"),
    (["--profile", "smoke", "--model", ""], "--model needs a value"),
    (["--frobnicate"], "unknown argument: --frobnicate"),
    (["--compare", "--only", "01"], "--compare takes only --profile"),
    (["--profile", "../profiles/smoke"], "'../profiles/smoke' is not a profile name"),
    (["--profile", "nosuch"], "unknown profile 'nosuch'; known profiles: cpu, gpu, smoke"),
    (["--profile", "smoke", "--only", "99"], "--only '99': no notebook 99 in this profile"),
    (["--profile", "smoke", "--only", "two"], "notebook numbers must be like 01,02"),
    (["--profile", "smoke", "--model", "nonexistent"], "'nonexistent': no such model folder"),
    (["--profile", "smoke", "--model", "no-org/no-model"], "not in the local Hugging Face cache"),
])
def test_refuses_with_one_line_before_any_notebook(checkout, args, message):
    result = reproduce(checkout, *args)
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") == 1 and message in result.stderr, result.stderr
    assert "[setup]" not in result.stdout and "_capture" not in result.stdout


def test_refuses_a_model_folder_without_config(checkout, tmp_path):
    result = reproduce(checkout, "--profile", "smoke", "--model", str(tmp_path))
    assert result.returncode == 2 and "has no config.json" in result.stderr


def test_lab_serves_notebooks_with_the_jupytext_viewer_by_default(checkout, tmp_path):
    """`./reproduce.sh lab` starts JupyterLab whose settings open .py files as notebooks."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {**os.environ, "JUPYTER_RUNTIME_DIR": str(tmp_path / "runtime"),
           "JUPYTER_CONFIG_DIR": str(tmp_path / "config"),
           "JUPYTERLAB_SETTINGS_DIR": str(tmp_path / "settings")}
    lab = subprocess.Popen(["bash", str(checkout / "reproduce.sh"), "lab", "--no-browser",
                            "--allow-root", f"--port={port}", "--IdentityProvider.token=t"],
                           env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = (f"http://127.0.0.1:{port}/lab/api/settings/"
           "@jupyterlab/docmanager-extension:plugin?token=t")
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(url, timeout=10) as response:
                    settings = json.loads(response.read())
                break
            except OSError:
                assert lab.poll() is None and time.monotonic() < deadline, "lab did not start"
                time.sleep(0.5)
    finally:
        lab.terminate()
        lab.wait(timeout=30)
    viewers = settings["schema"]["properties"]["defaultViewers"]["default"]
    assert viewers["python"] == "Jupytext Notebook"


def test_profile_notebooks_key_and_only_select_in_order(tmp_path):
    (tmp_path / "notebooks").mkdir()
    for name in ("01_a", "02_b", "08_c"):
        (tmp_path / "notebooks" / f"{name}.py").write_text("")
    chosen = runplan.select_notebooks({"notebooks": "01,02"}, root=tmp_path)
    assert [p.stem for p in chosen] == ["01_a", "02_b"]
    assert [p.stem for p in runplan.select_notebooks({}, root=tmp_path)] == ["01_a", "02_b",
                                                                            "08_c"]
    assert [p.stem for p in runplan.select_notebooks({}, "8,1", root=tmp_path)] == ["01_a",
                                                                                   "08_c"]
    with pytest.raises(runplan.Refusal, match="no notebook 08 in this profile"):
        runplan.select_notebooks({"notebooks": "01,02"}, "08", root=tmp_path)
    with pytest.raises(runplan.Refusal, match=r"lists notebooks \['05'\], which do not exist"):
        runplan.select_notebooks({"notebooks": "01,05"}, root=tmp_path)


PROBE = '''# ---
# jupyter:
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% tags=["parameters"]
profile = "cpu"
steps = 3  # a comment
label = "x"

# %%
import os
from tqdm import tqdm
for _ in tqdm(range(steps), desc="probe steps"):
    pass
with open(os.path.join(os.environ["ACTWAVE_FIGURES"], "probe.txt"), "w") as out:
    out.write(label)
print("label is", label)
'''


def test_notebook_gets_only_declared_parameters(tmp_path):
    source = tmp_path / "05_probe.py"
    source.write_text(PROBE)
    assert runplan.notebook_parameters(source) == ["profile", "steps", "label"]
    values = runplan.notebook_values(source, "smoke", {"steps": 2, "lr": 0.1, "notebooks": "05"},
                                     model="my-org/model")
    assert values == {"steps": 2, "profile": "smoke"}


def test_run_log_is_quiet_and_names_what_the_step_wrote(tmp_path):
    """`runplan run` in its own process, as reproduce.sh calls it (repo root, results and
    figures folders pointed at tmp_path): a kernel over encrypted sockets, no unknown-parameter or
    cell-marker lines, the notebook's tqdm bar as text, the file it wrote listed at the end."""
    for folder in ("notebooks", "profiles", "figures"):
        (tmp_path / folder).mkdir()
    source = tmp_path / "notebooks" / "05_probe.py"
    source.write_text(PROBE)
    (tmp_path / "profiles" / "smoke.yaml").write_text('label: "tweaked"\nlr: 0.1\n')
    script = ("import pathlib, sys; from actwave.tools import runplan; "
              "runplan.repo_root = lambda: pathlib.Path(sys.argv[1]); "
              "sys.exit(runplan.main(sys.argv[2:]))")
    result = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path), "run", str(source), "--profile", "smoke"],
        capture_output=True, text=True, timeout=300,
        env={**os.environ, "ACTWAVE_FIGURES": str(tmp_path / "figures"),
             "ACTWAVE_RESULTS": str(tmp_path / "results")})
    log = result.stdout + result.stderr
    assert result.returncode == 0, log
    assert (tmp_path / "results" / "smoke" / "05_probe.ipynb").exists()
    assert (tmp_path / "figures" / "probe.txt").read_text() == "tweaked"
    assert "Passed unknown parameter" not in log and "without encryption" not in log
    assert "IProgress" not in log and "Executing Cell" not in log
    assert "probe steps: 100%" in log and "label is tweaked" in log
    assert "05_probe wrote 1 files: figures/probe.txt" in log
