"""Package structure: the imports between actwave's own modules form no cycle, and the math
modules (stats: metrics, layerstats, blockstats, selection, selection_report) are pure.

Every ``import`` statement of every module under lib/actwave counts, at module level and
inside functions (a lazy import still ties the two modules together)."""
from __future__ import annotations

import ast
from pathlib import Path

LIB = Path(__file__).resolve().parents[1] / "lib"
PACKAGE = "actwave"


def module_names() -> dict[str, Path]:
    """{dotted module name: file} for every module of the package (``__init__`` = the package)."""
    names = {}
    for path in sorted((LIB / PACKAGE).rglob("*.py")):
        parts = path.relative_to(LIB).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def _absolute(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    """The absolute module an ``from … import`` names (relative imports resolved)."""
    if not node.level:
        return node.module or ""
    base = module.split(".")
    base = base[: len(base) - node.level + (1 if is_package else 0)]
    return ".".join(base + ([node.module] if node.module else []))


def imported_modules(module: str, path: Path, known: set[str]) -> set[str]:
    """The package's modules that ``module`` imports anywhere in its file. ``from a import b``
    counts as importing ``a.b`` when that is a module, else ``a``."""
    targets = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            source = _absolute(node, module, path.name == "__init__.py")
            targets.update(f"{source}.{alias.name}" if f"{source}.{alias.name}" in known
                           else source for alias in node.names)
    return {name for name in targets if name in known and name != module}


def import_graph() -> dict[str, set[str]]:
    names = module_names()
    return {module: imported_modules(module, path, set(names)) for module, path in names.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as [a, b, …, a], or None (iterative depth-first search)."""
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    for start in sorted(graph):
        if start in state:
            continue
        path, stack = [start], [iter(sorted(graph[start]))]
        state[start] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            elif nxt not in state:
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(graph.get(nxt, ()))))
    return None


def test_find_cycle_reports_the_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_graph_sees_function_level_and_relative_imports(tmp_path):
    source = tmp_path / "m.py"
    source.write_text("from . import b\ndef f():\n    from actwave.c import d\n")
    known = {"actwave.a.b", "actwave.c", "actwave.a.m"}
    assert imported_modules("actwave.a.m", source, known) == {"actwave.a.b", "actwave.c"}


def test_import_graph_is_acyclic():
    graph = import_graph()
    assert len(graph) > 20 and any(graph.values())
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle in lib/actwave: " + " -> ".join(cycle)


# The math modules take tensors and return tensors or floats: no I/O, no printing, so they
# run anywhere torch does (CUDA included). Validators of plain values may come from integrity.
PURE = ("actwave.stats.metrics", "actwave.stats.layerstats", "actwave.stats.blockstats",
        "actwave.stats.selection", "actwave.stats.selection_report")
PURE_IMPORTS = ("__future__", "math", "itertools", "typing", "collections.abc", "dataclasses",
                "torch")
VALIDATORS = {"actwave.integrity": {"int_ids", "Between", "check_fields"}}


def _allowed(name: str) -> bool:
    """A stdlib/torch module of ``PURE_IMPORTS`` or one of its submodules, or a pure module."""
    return name in PURE or any(name == root or name.startswith(root + ".") for root in PURE_IMPORTS)


def impurities(module: str, path: Path) -> list[str]:
    """What in ``module``'s file breaks purity: imports outside the allowed ones, calls of
    print/open/input."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [f"import {a.name}" for a in node.names if not _allowed(a.name)]
        elif isinstance(node, ast.ImportFrom):
            source = _absolute(node, module, path.name == "__init__.py")
            names = {a.name for a in node.names}
            pure = _allowed(source) or (
                source == "actwave.stats" and {f"{source}.{n}" for n in names} <= set(PURE))
            if not pure and not names <= VALIDATORS.get(source, set()):
                found.append(f"from {source} import {', '.join(sorted(names))}")
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("print", "open", "input")):
            found.append(f"{node.func.id}() at line {node.lineno}")
    return found


def test_math_modules_are_pure():
    names = module_names()
    found = {module: impurities(module, names[module]) for module in PURE}
    assert not any(found.values()), found


def test_impurities_are_found(tmp_path):
    source = tmp_path / "m.py"
    source.write_text("import json\nimport torch\nfrom actwave.integrity import write_record, int_ids\n"
                      "from actwave.stats import metrics\ndef f():\n    print(1)\n")
    assert impurities("actwave.stats.m", source) == [
        "import json", "from actwave.integrity import int_ids, write_record", "print() at line 6"]
