"""The README's results tables hold only numbers that a committed results table holds."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DECIMAL = re.compile(r"(?<![\w.])-?\d+\.\d+")


def results_block(readme: str, name: str = "results") -> str:
    return readme.split(f"<!-- {name}:start -->", 1)[1].split(f"<!-- {name}:end -->", 1)[0]


def table_decimals(block: str) -> list[str]:
    """Every decimal number printed in a Markdown table row of the block."""
    rows = [line for line in block.splitlines() if line.lstrip().startswith("|")]
    return [number for row in rows for number in DECIMAL.findall(row)]


def committed_values(folder: Path) -> list[float]:
    """Every number in the folder's CSV tables (cells and CI strings alike)."""
    return [float(x) for path in sorted(folder.glob("*.csv"))
            for x in re.findall(r"-?\d+(?:\.\d+)?(?:e-?\d+)?", path.read_text())]


def unbacked(printed: list[str], values: list[float]) -> list[str]:
    """Printed decimals that no value rounds to at the printed precision."""
    def backed(text: str) -> bool:
        places = len(text.split(".")[1])
        return any(abs(value - float(text)) <= 0.5 * 10 ** -places + 1e-12 for value in values)
    return [text for text in printed if not backed(text)]


def test_readme_result_tables_come_from_the_cpu_tables():
    printed = table_decimals(results_block((ROOT / "README.md").read_text()))
    assert len(printed) > 20  # the block has its tables
    missing = unbacked(printed, committed_values(ROOT / "results" / "cpu"))
    assert not missing, f"README numbers in no results/cpu table: {missing}"


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
