"""The README and docs/: results tables hold only numbers that a committed results table
holds; the README stays short and its links into docs/ resolve."""
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted((ROOT / "docs").glob("*.md"))
DECIMAL = re.compile(r"(?<![\w.])-?\d+\.\d+(?!\d*e-?\d)")  # not a mantissa: 7.5e-14
MAX_README_LINES = 350
# a block marked <!-- NAME:start --> … <!-- NAME:end --> holds numbers of this results folder
BLOCK_FOLDERS = {"results": "results/cpu", "study": "results/study",
                 "benchmarks": "results/benchmarks", "select": "results/select"}
# the tables of a folder: CSV, except select's (the --json files of real `select` runs)
TABLE_GLOB = {"select": "*.json"}
LINK = re.compile(r"\]\(([^)\s]+)\)")


def results_block(readme: str, name: str = "results") -> str:
    return readme.split(f"<!-- {name}:start -->", 1)[1].split(f"<!-- {name}:end -->", 1)[0]


def marked_blocks(text: str) -> list[tuple[str, str]]:
    """(name, text) of every marked block, in order."""
    names = "|".join(BLOCK_FOLDERS)
    return re.findall(rf"<!-- ({names}):start -->(.*?)<!-- \1:end -->", text, re.S)


def table_decimals(block: str) -> list[str]:
    """Every decimal number printed in a Markdown table row of the block."""
    rows = [line for line in block.splitlines() if line.lstrip().startswith("|")]
    return [number for row in rows for number in DECIMAL.findall(row)]


def committed_values(folder: Path, pattern: str = "*.csv") -> list[float]:
    """Every number in the folder's tables (cells and CI strings alike); the "-" of a range
    such as "1.2-1.3" is not a minus sign."""
    return [float(x) for path in sorted(folder.glob(pattern))
            for x in re.findall(r"(?<![\d.])-?\d+(?:\.\d+)?(?:e-?\d+)?", path.read_text())]


def unbacked(printed: list[str], values: list[float]) -> list[str]:
    """Printed decimals that no value rounds to at the printed precision."""
    def backed(text: str) -> bool:
        places = len(text.split(".")[1])
        return any(abs(value - float(text)) <= 0.5 * 10 ** -places + 1e-12 for value in values)
    return [text for text in printed if not backed(text)]


def test_readme_result_tables_come_from_the_cpu_tables():
    printed = table_decimals(results_block((ROOT / "README.md").read_text()))
    assert len(printed) >= 4  # the block has its table (the rest: docs/PROFILES.md)
    missing = unbacked(printed, committed_values(ROOT / "results" / "cpu"))
    assert not missing, f"README numbers in no results/cpu table: {missing}"


def test_readme_select_numbers_come_from_the_committed_select_runs():
    """Every decimal in the select block is in the JSON of a committed `select --validate` run."""
    block = results_block((ROOT / "README.md").read_text(), "select")
    printed = DECIMAL.findall(block)
    assert len(printed) >= 8
    missing = unbacked(printed, committed_values(ROOT / "results" / "select", "*.json"))
    assert not missing, f"README select numbers in no results/select run: {missing}"


def test_readme_study_numbers_come_from_the_study_tables():
    """Every decimal in the study block, prose included, is in a results/study table."""
    block = results_block((ROOT / "README.md").read_text(), "study")
    printed = DECIMAL.findall(block)
    assert len(printed) > 20
    missing = unbacked(printed, committed_values(ROOT / "results" / "study"))
    assert not missing, f"README study numbers in no results/study table: {missing}"


def test_a_number_no_table_holds_is_caught():
    assert unbacked(["0.153", "1.29"], [0.15312, 1.2857]) == []
    assert unbacked(["0.154"], [0.15312]) == ["0.154"]


def heading_anchors(text: str) -> set[str]:
    """GitHub's anchors of the Markdown headings outside code blocks: lower case, spaces to
    hyphens, punctuation other than hyphens and underscores dropped."""
    anchors, fence = set(), False
    for line in text.splitlines():
        if line.startswith("```"):
            fence = not fence
        elif not fence and re.match(r"#{1,6} ", line):
            title = line.lstrip("#").strip().lower()
            anchors.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return anchors


def broken_links(path: Path) -> list[str]:
    """The relative links of a Markdown file whose file or #anchor does not exist."""
    text, broken = path.read_text(), []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target):
            continue  # http(s), mailto: not checked offline
        file, _, anchor = target.partition("#")
        linked = (path.parent / file).resolve() if file else path
        if not linked.exists() or (anchor and linked.suffix == ".md"
                                   and anchor not in heading_anchors(linked.read_text())):
            broken.append(target)
    return broken


def test_readme_is_short():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= MAX_README_LINES, f"README has {len(lines)} lines (at most {MAX_README_LINES})"


def test_readme_links_into_docs_resolve():
    readme = (ROOT / "README.md").read_text()
    assert {"docs/METHODS.md", "docs/PROFILES.md", "docs/STUDY.md", "docs/BENCHMARKS.md",
            "docs/OWN_MODEL.md", "docs/FAULTS.md"} <= {t.partition("#")[0] for t in LINK.findall(readme)}
    assert broken_links(ROOT / "README.md") == []


@pytest.mark.parametrize("path", DOCS, ids=[p.name for p in DOCS])
def test_docs_links_resolve(path):
    assert broken_links(path) == []


def test_anchors_follow_github():
    assert heading_anchors("## 16. Offline acceptance (`actwave.decoding.acceptance`)\n```\n# x\n```") \
        == {"16-offline-acceptance-actwavedecodingacceptance"}


@pytest.mark.parametrize("path", DOCS, ids=[p.name for p in DOCS])
def test_docs_results_tables_come_from_committed_tables(path):
    for name, block in marked_blocks(path.read_text()):
        printed = table_decimals(block) if name != "study" else DECIMAL.findall(block)
        missing = unbacked(printed, committed_values(ROOT / BLOCK_FOLDERS[name],
                                                     TABLE_GLOB.get(name, "*.csv")))
        assert not missing, f"{path.name} {name} block: numbers in no {BLOCK_FOLDERS[name]} table: {missing}"


def test_docs_mark_their_results_tables():
    marked = {(path.name, name) for path in DOCS for name, _ in marked_blocks(path.read_text())}
    assert {("STUDY.md", "study"), ("BENCHMARKS.md", "benchmarks"), ("PROFILES.md", "results")} <= marked


def test_readme_layout_names_every_notebook_and_no_test_count():
    readme = (ROOT / "README.md").read_text()
    layout = readme.split("## Layout", 1)[1].split("\n## ", 1)[0]
    last = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.py"))[-1].stem
    assert last in layout, f"the Layout's notebooks stop before {last}"
    assert not re.search(r"\b\d+ passed\b", readme), "the README states a test count"
