"""titan/quant imports one way: formats <- kernels <- float8 casts and MX numerics <- linears <- FSDP's float8
all-gather and the converter. Imports inside functions count: deferring one hides a cycle from Python, not from
a reader who must follow it."""

import ast
import graphlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
QUANT = ROOT / "titan" / "quant"


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path, modules: set[str]) -> set[str]:
    """The `modules` that the file at `path` imports anywhere in it; `from package import name` imports the
    package and, when there is one, its submodule package.name."""
    imported = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            imported.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}:{node.lineno}: a relative import, which this check would not resolve"
            imported.update({node.module, *(f"{node.module}.{alias.name}" for alias in node.names)})
    return imported & modules


def quant_import_graph() -> dict[str, set[str]]:
    """Each titan.quant module and the titan.quant modules it imports."""
    paths = sorted(QUANT.rglob("*.py"))
    modules = {module_name(path) for path in paths}
    return {module_name(path): imported_modules(path, modules) for path in paths}


def test_quant_imports_have_no_cycle() -> None:
    graph = quant_import_graph()
    # The check sees deferred imports (casts loads its Triton kernels on first use) and the shared format facts.
    assert "titan.quant.kernels.float8_cast" in graph["titan.quant.float8.casts"]
    assert graph["titan.quant.formats"] == set()
    try:
        graphlib.TopologicalSorter(graph).prepare()
    except graphlib.CycleError as error:
        pytest.fail(f"import cycle in titan/quant: {' -> '.join(error.args[1])}. Move what both sides need down "
                    f"(format facts to titan/quant/formats.py), so imports run one way.")
