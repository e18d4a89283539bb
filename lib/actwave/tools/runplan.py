"""What ``reproduce.sh`` runs, checked before any notebook starts.

``python -m actwave.tools.runplan notebooks --profile P [--only NN,..] [--model ID]`` prints the
notebook sources to run, one per line, or refuses with one line on stderr and exit status 2:
an unknown or path-like profile, an ``--only`` that names no notebook of the profile, a
``--model`` that is neither a bundled name, a local model folder nor an HF id in the local
HF cache.

``python -m actwave.tools.runplan run NOTEBOOK --profile P [--model ID]`` executes one notebook
with papermill into ``results/<profile>/``, passing only the profile's parameters
(``actwave.profile.parameters``: a section's keys named as notebook parameters) the notebook
declares in its ``parameters`` cell (papermill warns about any other), on a kernel whose
sockets are CurveZMQ-encrypted (ipykernel warns about plain TCP). The log shows the
notebook's own output and progress bars, then the files the step wrote.

A profile may list its notebooks with the key ``notebooks: "01,02,..."`` (default: every
numbered notebook); that key is for this module, not a notebook parameter.
"""
from __future__ import annotations

import argparse
import ast
import logging
import re
import sys
import tempfile
import time
from pathlib import Path

import yaml
from jupyter_client import KernelManager

from actwave.config import repo_root, results_dir
from actwave.profile import parameters

PROFILE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]*")
PARAMETERS_MARKER = '# %% tags=["parameters"]\n'
RUNNER_KEYS = ("notebooks",)  # profile keys read here, never passed to a notebook


class Refusal(ValueError):
    """A request reproduce.sh cannot carry out; the message is the one line it prints."""


def profile_path(name: str, root: Path | None = None) -> Path:
    """``profiles/<name>.yaml``; refuses path-like or unknown names, listing the known ones."""
    folder = (root or repo_root()) / "profiles"
    known = sorted(p.stem for p in folder.glob("*.yaml"))
    if not PROFILE_NAME.fullmatch(name):
        raise Refusal(f"profile {name!r} is not a profile name (a name, not a path); "
                      f"known profiles: {', '.join(known)}")
    if name not in known:
        raise Refusal(f"unknown profile {name!r}; known profiles: {', '.join(known)}")
    return folder / f"{name}.yaml"


def load_profile(name: str, root: Path | None = None) -> dict:
    """The profile's {key: value or section} mapping (``actwave.profile``), checked: every
    section and key is known and every value a scalar."""
    values = yaml.safe_load(profile_path(name, root).read_text()) or {}
    if not isinstance(values, dict):
        raise Refusal(f"profile {name!r} is not a YAML mapping of key: value")
    try:
        parameters(values)
    except ValueError as err:
        raise Refusal(f"profile {name!r}: {err}") from None
    return values


def numbered_notebooks(root: Path | None = None) -> dict[str, Path]:
    """{"01": notebooks/01_capture.py, ...} in order."""
    sources = sorted(((root or repo_root()) / "notebooks").glob("[0-9][0-9]_*.py"))
    return {source.name[:2]: source for source in sources}


def _numbers(text: str) -> list[str]:
    """``"01, 2,03"`` → ["01", "02", "03"]; refuses anything that is not a number."""
    items = [item.strip() for item in str(text).split(",") if item.strip()]
    bad = [item for item in items if not item.isdigit()]
    if bad:
        raise Refusal(f"notebook numbers must be like 01,02; got {bad}")
    return [f"{int(item):02d}" for item in items]


def select_notebooks(profile: dict, only: str = "", root: Path | None = None) -> list[Path]:
    """The profile's notebooks (its ``notebooks`` key, else all), narrowed by ``only``."""
    available = numbered_notebooks(root)
    listed = _numbers(profile["notebooks"]) if "notebooks" in profile else list(available)
    missing = [number for number in listed if number not in available]
    if missing:
        raise Refusal(f"the profile lists notebooks {missing}, which do not exist; "
                      f"notebooks/ has {', '.join(available)}")
    if not only:
        return [available[number] for number in listed]
    wanted = _numbers(only)
    outside = [number for number in wanted if number not in listed]
    if outside or not wanted:
        raise Refusal(f"--only {only!r}: no notebook {', '.join(outside) or 'named'} in this "
                      f"profile, which runs {', '.join(listed)}")
    return [available[number] for number in listed if number in wanted]


def check_model(name: str) -> None:
    """Refuse a model that cannot be opened offline, without loading any weights."""
    from actwave.capture import models

    if name in models.REGISTRY:
        return
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise Refusal(f"--model {name!r}: folder has no config.json (not a saved HF model)")
        return
    if name.startswith((".", "/", "~")) or path.exists() or name.count("/") != 1:
        raise Refusal(f"--model {name!r}: no such model folder, and not a bundled model "
                      f"({', '.join(sorted(models.REGISTRY))}) or an HF id like 'org/name'")
    from huggingface_hub import try_to_load_from_cache

    if not isinstance(try_to_load_from_cache(name, "config.json"), str):
        raise Refusal(f"--model {name!r}: no such folder, and not in the local Hugging Face "
                      f"cache (runs are offline: download it first, or pass a local folder)")


def notebook_parameters(source: Path) -> list[str]:
    """Names assigned in the notebook's ``parameters`` cell, in order."""
    text = source.read_text()
    if PARAMETERS_MARKER not in text:
        return []
    cell = text.split(PARAMETERS_MARKER, 1)[1].split("\n# %%", 1)[0]
    return [target.id for node in ast.parse(cell).body if isinstance(node, ast.Assign)
            for target in node.targets if isinstance(target, ast.Name)]


def notebook_values(source: Path, profile_name: str, profile_values: dict,
                    model: str = "") -> dict:
    """The parameters one notebook receives: the declared subset of the profile's
    parameters (``actwave.profile.parameters``), the profile name, and ``--model`` in place
    of the model lists."""
    declared = set(notebook_parameters(source))
    values = {**parameters(profile_values), "profile": profile_name}
    if model:
        values.update(models=model, train_models=model)
    return {key: value for key, value in values.items()
            if key in declared and key not in RUNNER_KEYS}


class EncryptedKernelManager(KernelManager):
    """A local kernel manager that provisions CurveZMQ keys (the python3 kernelspec
    declares support), so the kernel's sockets are not plain TCP."""

    def __init__(self, **kwargs):
        super().__init__(**{"transport_encryption": "required", **kwargs})


class _HideCellMarkers(logging.Filter):
    """Papermill logs two marker lines per cell; the log keeps only what cells print."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(("Executing Cell", "Ending Cell"))


def files_written(folders: list[Path], since: float) -> list[Path]:
    """Files under ``folders`` modified at or after ``since`` (a time.time() value), sorted."""
    return sorted(path for folder in folders if folder.is_dir() for path in folder.rglob("*")
                  if path.is_file() and path.stat().st_mtime >= since)


def run_notebook(source: Path, profile_name: str, profile: dict, model: str = "") -> Path:
    """Execute ``source`` (a jupytext .py) into the profile's results folder
    (:func:`actwave.config.results_dir`) as ``<stem>.ipynb``; print the
    tables and figures it wrote. Returns the executed notebook's path."""
    import jupytext
    import papermill

    from actwave.plots import default_figures_dir

    out_dir = results_dir(profile_name)
    executed, start = out_dir / f"{source.stem}.ipynb", time.time()
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        notebook = Path(tmp) / f"{source.stem}.ipynb"
        jupytext.write(jupytext.read(source), notebook)
        papermill.execute_notebook(
            str(notebook), str(executed), kernel_name="python3", cwd=str(source.parent),
            parameters=notebook_values(source, profile_name, profile, model),
            log_output=True, progress_bar=False, kernel_manager_class=EncryptedKernelManager)
    made = [p for p in files_written([out_dir, default_figures_dir()], start) if p != executed]
    print(f"{source.stem} wrote {len(made)} files: "
          + ", ".join(str(p.relative_to(repo_root())) if p.is_relative_to(repo_root()) else str(p)
                      for p in made), flush=True)
    return executed


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="actwave run",
                                     description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    plan = sub.add_parser("notebooks", help="print the notebooks to run, or refuse")
    plan.add_argument("--only", default="")
    run = sub.add_parser("run", help="execute one notebook with the profile's parameters")
    run.add_argument("notebook", type=Path)
    for command in (plan, run):
        command.add_argument("--profile", required=True)
        command.add_argument("--model", default="")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        profile = load_profile(args.profile)
        if args.command == "notebooks":
            chosen = select_notebooks(profile, args.only)
            if args.model:
                check_model(args.model)
            print("\n".join(str(path.relative_to(repo_root())) for path in chosen))
            return 0
    except Refusal as refusal:
        print(f"reproduce.sh: {refusal}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("papermill").addFilter(_HideCellMarkers())
    # Notebooks run in notebooks/: a model folder given relative to the caller is resolved.
    model = str(Path(args.model).resolve()) if args.model and Path(args.model).is_dir() \
        else args.model
    run_notebook(args.notebook.resolve(), args.profile, profile, model)
    return 0


if __name__ == "__main__":
    sys.exit(main())
