"""The setup every notebook starts with, in one call:
``NOTEBOOK, model_names, results_dir, log = notebook_setup(NAME, profile, models)``."""
from __future__ import annotations

import logging
from pathlib import Path
from typing import NamedTuple

from actwave import index, plots
from actwave.config import results_dir


class Setup(NamedTuple):
    """What a notebook's first cell used to compute for itself (unpacked in one line)."""

    notebook: str       # the name its tables, figures and manifest entries carry
    models: list[str]   # the models it runs on
    results_dir: Path   # the profile's results folder (actwave.config.results_dir)
    log: logging.Logger


def notebook_setup(notebook: str, profile: str, models: str) -> Setup:
    """Log actwave's progress (INFO) with times, fix the plot style, and name the profile's
    results folder and the models of the comma-separated ``models`` parameter."""
    logging.basicConfig(format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("actwave").setLevel(logging.INFO)
    plots.setup_style()
    return Setup(notebook, index.names(models), results_dir(profile),
                 logging.getLogger(f"actwave.notebooks.{notebook}"))
