"""Imports point one way. Between packages, down a table of layers: models < config < metrics, exits, hardware <
quant, parallel, data < checkpoint < train < validate (the collector of every stage's rules) < estimate < the entry
points (titan/dry_run.py, titan/launch/), the table LAYERS below, which shared/tools/layers.py reads too.
Between modules, with no cycle anywhere in titan/ (titan/quant's order: formats <- kernels <- float8 casts and MX
numerics <- linears <- FSDP's float8 all-gather and the converter).
Imports inside functions count: deferring one hides a cycle from Python, not from a reader who must follow it."""

import ast
import graphlib
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TITAN = ROOT / "titan"

LAYERS = [{"models"}, {"config"}, {"metrics", "exits", "hardware"}, {"quant", "parallel", "data"}, {"checkpoint"},
          {"train"}, {"validate"}, {"estimate"}, {"dry_run", "launch"}]
"""Packages (a top-level module titan/<name>.py counts as package <name>), lowest first: a package imports from
its own layer and the ones below."""
LAYER_OF = {package: index for index, layer in enumerate(LAYERS) for package in layer}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_names(path: Path) -> Iterator[tuple[str, int]]:
    """Every name that the file at `path` imports anywhere in it, with its line: `import a.b` names a.b, and
    `from package import name` names the package and package.name (its submodule, where there is one)."""
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}:{node.lineno}: a relative import, which this check would not resolve"
            names = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
        else:
            continue
        for name in names:
            yield name, node.lineno


def imported_modules(path: Path, modules: set[str]) -> dict[str, int]:
    """The `modules` that the file at `path` imports anywhere in it, each with the line of its first import."""
    imported: dict[str, int] = {}
    for name, line in imported_names(path):
        if name in modules:
            imported.setdefault(name, line)
    return imported


def import_graph(package: Path) -> dict[str, dict[str, int]]:
    """Each module under `package` and the modules under it that it imports (with the line)."""
    paths = sorted(package.rglob("*.py"))
    modules = {module_name(path) for path in paths}
    return {module_name(path): imported_modules(path, modules) for path in paths}


def layer_package(module: str) -> str:
    """titan.quant.float8.linear -> quant; titan.launch -> launch."""
    return module.split(".")[1]


def test_every_package_has_a_layer() -> None:
    packages = {layer_package(module) for module in import_graph(TITAN) if module != "titan"}
    assert packages <= LAYER_OF.keys(), (f"titan packages without a layer: {sorted(packages - LAYER_OF.keys())}. "
                                         f"Place them in LAYERS.")


def test_imports_point_down_the_layers() -> None:
    upward = [f"{module} (line {line}) imports {target}: {layer_package(module)} -> {layer_package(target)}"
              for module, targets in import_graph(TITAN).items() if module != "titan"
              for target, line in targets.items() if target != "titan"
              and LAYER_OF[layer_package(target)] > LAYER_OF[layer_package(module)]]
    assert not upward, ("imports that run up the layers (lowest first: " + " < ".join(
        ", ".join(sorted(layer)) for layer in LAYERS) + "). Move what both sides need down:\n" + "\n".join(upward))


def test_imports_have_no_cycle() -> None:
    graph = import_graph(TITAN)
    # The check sees deferred imports (casts loads its Triton kernels on first use, the dry-run command the
    # simulation) and the shared format facts.
    assert "titan.quant.kernels.float8_cast" in graph["titan.quant.float8.casts"]
    assert "titan.estimate.simulate" in graph["titan.dry_run"]
    assert graph["titan.quant.formats"] == {}
    try:
        graphlib.TopologicalSorter(graph).prepare()
    except graphlib.CycleError as error:
        pytest.fail(f"import cycle in titan: {' -> '.join(error.args[1])}. Move what both sides need down "
                    f"(format facts to titan/quant/formats.py, say), so imports run one way.")


def test_models_import_nothing_from_parallel_or_other_stages() -> None:
    """Model code knows nothing about parallelism (the house style's section 2): nothing under titan/models imports
    torch.distributed or a Titan package other than titan.models."""
    files = sorted((TITAN / "models").rglob("*.py"))
    assert files
    for path in files:
        for name, _ in imported_names(path):
            assert not name.startswith("torch.distributed"), f"{path} imports {name}"
            assert not name.startswith("titan") or name.startswith("titan.models"), f"{path} imports {name}"


def family_packages() -> set[str]:
    """titan.models.llama, titan.models.qwen3, ...: every folder of titan/models but the shared one."""
    return {f"titan.models.{path.name}" for path in (TITAN / "models").iterdir()
            if (path / "__init__.py").is_file() and path.name != "common"}


def test_only_the_registry_imports_a_family() -> None:
    """A family is its folder plus one line in titan/models/families.py (docs/models.md): nothing else in titan/
    imports a family's own modules, and a family imports none of another's, only titan.models.common."""
    families = family_packages()
    assert {"titan.models.llama", "titan.models.qwen3"} <= families
    reaching = [f"{module} (line {line}) imports {target}"
                for module, targets in import_graph(TITAN).items() if module != "titan.models.families"
                for target, line in targets.items()
                for family in families if (target == family or target.startswith(family + "."))
                and not (module == family or module.startswith(family + "."))]
    assert not reaching, ("imports of a model family's own modules from outside it; go through the registry "
                          "(titan.models.families: FAMILIES, family_of) or move what is shared to "
                          "titan/models/common:\n" + "\n".join(reaching))
