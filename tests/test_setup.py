"""The install files agree: environment.yml mirrors requirements.txt; CI calls the README command."""
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def _requirements(path):
    lines = (ROOT / path).read_text().splitlines()
    return sorted(line.strip() for line in lines if line.strip() and not line.startswith("#"))


def test_environment_yml_mirrors_requirements():
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    pip_section = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict))
    assert sorted(pip_section) == _requirements("requirements.txt")


def test_requirements_are_pinned():
    for path in ("requirements.txt", "requirements-assets.txt"):
        unpinned = [r for r in _requirements(path) if "==" not in r]
        assert not unpinned, f"{path}: unpinned {unpinned}"


def test_ci_calls_the_readme_test_command():
    assert "./reproduce.sh test" in (ROOT / ".ci" / "run").read_text()
    assert "./reproduce.sh test" in (ROOT / "README.md").read_text()
