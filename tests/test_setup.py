"""The install files agree: environment.yml mirrors requirements.txt; CI calls the README command."""
import ast
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


def _notebook_parameters() -> dict[str, object]:
    """{name: default} over every notebook's papermill parameters cell."""
    params = {}
    for source in sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.py")):
        cell = source.read_text().split('# %% tags=["parameters"]\n', 1)[1].split("\n# %%", 1)[0]
        for line in cell.splitlines():
            if line and not line.startswith("#"):
                name, value = line.split("#", 1)[0].split("=", 1)
                params[name.strip()] = ast.literal_eval(value.strip())
    return params


def test_profiles_set_only_known_flat_parameters():
    params = _notebook_parameters()
    assert "stats_matmul_dtype" in params and "train_steps" in params
    for profile in sorted((ROOT / "profiles").glob("*.yaml")):
        values = yaml.safe_load(profile.read_text())
        unknown = sorted(set(values) - set(params))
        assert not unknown, f"{profile.name}: {unknown} is not a parameter of any notebook"
        for name, value in values.items():
            assert isinstance(value, (str, int, float, bool)), f"{profile.name}: {name} not flat"
            default = params[name]
            assert isinstance(value, type(default)) or isinstance(default, float), \
                f"{profile.name}: {name}={value!r} but the notebooks' default is {default!r}"
