"""docs/architecture.md §1 kept by a test: a layer may import any layer below it, never one above, and no module
takes part in an import circle, within a layer or across layers.

Every module's imports are read with `ast`, those inside functions included: a lazy import is an
edge like any other (it only hides a circle until the wrong module is imported first). Importing
`a.b.c` also runs the `__init__` of `a.b` and `a`, so those packages are edges too (unless they
contain the importer: a package's own __init__ runs before its modules anyway).
"""

from __future__ import annotations

import ast
import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Folders of the repository and the module names they are installed as (pyproject.toml's package-dir).
SOURCES = {"cxltrain": "cxltrain", "emulation": "cxltrain.emulation", "kernels": "cxltrain.kernels"}
# The modules that are files directly in cxltrain/, not folders: the leaves.
ROOT_LEAVES = {f"cxltrain.{p.stem}" for p in (ROOT / "cxltrain").glob("*.py")} - {"cxltrain.__init__",
                                                                                  "cxltrain.__main__"}

# docs/architecture.md §1, bottom to top: a layer is a folder. The modules directly in cxltrain/ (errors,
# knobs, faults, modes) are the leaves every layer reads, and read only each other; the package's own
# __init__ (lazy re-exports) and __main__ sit at the top with the command line.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("leaves", (ROOT_MODULES := "cxltrain.<module>",)),
    ("kernels", ("cxltrain.kernels",)),
    ("devices", ("cxltrain.devices", "cxltrain.emulation")),
    ("pool", ("cxltrain.pool",)),
    ("checkpoint", ("cxltrain.checkpoint",)),
    ("data", ("cxltrain.data",)),
    ("placement", ("cxltrain.placement",)),
    ("model", ("cxltrain.tables", "cxltrain.models")),
    ("runtime", ("cxltrain.runtime",)),
    ("jobs", ("cxltrain.jobs", "cxltrain.bench")),
    ("cli", ("cxltrain.cli", "cxltrain", "cxltrain.__main__")),
]
RANK = {prefix: rank for rank, (_, prefixes) in enumerate(LAYERS) for prefix in prefixes}


def layer_of(module: str) -> int | None:
    """Rank of the layer `module` belongs to: its folder (the longest matching prefix), or the leaves
    for a module directly in cxltrain/ that is not a folder of its own; None outside cxltrain."""
    parts = module.split(".")
    if len(parts) == 2 and parts[0] == "cxltrain" and module not in RANK and module in ROOT_LEAVES:
        return RANK[ROOT_MODULES]
    for n in range(len(parts), 0, -1):
        rank = RANK.get(".".join(parts[:n]))
        if rank is not None:
            return rank
    return None


def source_modules(root: Path = ROOT) -> dict[str, Path]:
    """Module name -> file, for every .py file of the installed packages."""
    modules = {}
    for folder, package in SOURCES.items():
        for path in sorted((root / folder).rglob("*.py")):
            parts = list(path.relative_to(root / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join([package, *parts])] = path
    return modules


def _is_package(path: Path) -> bool:
    return path.name == "__init__.py"


def imports_of(module: str, path: Path, known: set[str]) -> list[tuple[str, int]]:
    """(imported module of ours, line) for every import statement in the file, at any depth."""
    package = module if _is_package(path) else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(base_parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            found.append((base, node.lineno))
            # `from pkg import name`: name may be a module of pkg
            found += [(f"{base}.{alias.name}", node.lineno) for alias in node.names
                      if f"{base}.{alias.name}" in known]
    return [(name, line) for name, line in found if name in known]


def import_graph(modules: dict[str, Path]) -> dict[str, dict[str, int]]:
    """module -> {module it imports (with the packages that import runs): line of the import}."""
    known = set(modules)
    graph: dict[str, dict[str, int]] = {}
    for module, path in modules.items():
        own = set(_ancestors(module)) | {module}
        edges: dict[str, int] = {}
        for target, line in imports_of(module, path, known):
            for name in [target, *_ancestors(target)]:
                if name in known and name not in own:
                    edges.setdefault(name, line)
        graph[module] = edges
    return graph


def _ancestors(module: str) -> list[str]:
    parts = module.split(".")
    return [".".join(parts[:n]) for n in range(len(parts) - 1, 0, -1)]


def upward_imports(graph: dict[str, dict[str, int]], files: dict[str, Path] | None = None) -> list[str]:
    """One line per import of a layer above the importer's, naming the edge and both layers."""
    problems = []
    for module, edges in sorted(graph.items()):
        low = layer_of(module)
        for target, line in sorted(edges.items()):
            high = layer_of(target)
            if low is not None and high is not None and high > low:
                where = f" ({files[module].relative_to(ROOT)}:{line})" if files else ""
                problems.append(f"{module} -> {target}{where}: {LAYERS[low][0]} may not import "
                                f"{target.removeprefix('cxltrain.')} (layer '{LAYERS[high][0]}' is above "
                                f"'{LAYERS[low][0]}')")
    return problems


def import_circles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """One circle, [a, b, ..., a], through each group of modules that import each other."""
    return [_circle_through(graph, set(component)) for component in tangles(graph)]


def tangles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Every strongly connected component of more than one module (or a module importing itself),
    sorted: each is a set of modules every one of which imports every other, through the others.
    Tarjan's algorithm, iterative (no recursion limit on long chains)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, {})))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1 or node in graph.get(node, {}):
                    components.append(sorted(component))
    return components


def _circle_through(graph: dict[str, dict[str, int]], component: set[str]) -> list[str]:
    """A shortest circle from the component's first module back to itself, inside the component."""
    start = min(component)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for child in sorted(graph[node]):
                if child == start:
                    return paths[node] + [start]
                if child in component and child not in paths:
                    paths[child] = paths[node] + [child]
                    following.append(child)
        frontier = following
    raise AssertionError(f"no circle through {start}")  # cannot happen in a strongly connected component


# ---------------------------------------------------------------------------------------------
# the rule, on the code
# ---------------------------------------------------------------------------------------------
MODULES = source_modules()
GRAPH = import_graph(MODULES)


def test_every_module_has_a_layer():
    missing = sorted(m for m in MODULES if layer_of(m) is None)
    assert not missing, f"modules in no layer (add them to LAYERS in {Path(__file__).name}): {missing}"


def test_no_layer_imports_one_above_it():
    problems = upward_imports(GRAPH, MODULES)
    assert not problems, "upward imports (docs/architecture.md §1):\n" + "\n".join(problems)


def test_no_import_circles():
    found = [f"{' -> '.join(_circle_through(GRAPH, set(group)))} (tangled: {', '.join(group)})"
             for group in tangles(GRAPH)]
    assert not found, "import circles (docs/architecture.md §1):\n" + "\n".join(found)


def test_every_folder_of_the_package_is_a_layer():
    """A new folder must be placed in LAYERS: a folder is never left to fall into the leaves."""
    folders = {f"cxltrain.{p.parent.name}" for p in (ROOT / "cxltrain").glob("*/__init__.py")}
    assert folders <= set(RANK), f"folders in no layer: {sorted(folders - set(RANK))}"


def test_a_planted_upward_import_in_the_real_tree_is_caught(tmp_path):
    """The rule on a copy of the tree with one planted upward import: the pool's format reaching up
    into the runtime is named, with its file and line."""
    for folder in SOURCES:
        shutil.copytree(ROOT / folder, tmp_path / folder, ignore=shutil.ignore_patterns("__pycache__"))
    planted = tmp_path / "cxltrain" / "pool" / "format.py"
    planted.write_text(planted.read_text() + "\n\ndef _planted():\n    from ..runtime import runtime  # noqa\n")
    modules = source_modules(tmp_path)
    graph = import_graph(modules)
    assert not upward_imports(import_graph(source_modules()))
    problems = upward_imports(graph)
    assert problems == ["cxltrain.pool.format -> cxltrain.runtime: pool may not import runtime "
                        "(layer 'runtime' is above 'pool')",
                        "cxltrain.pool.format -> cxltrain.runtime.runtime: pool may not import runtime.runtime "
                        "(layer 'runtime' is above 'pool')"]


def test_leaves_import_nothing_below_them():
    """errors, knobs and faults are read by every layer: they may import only each other."""
    leaves = {m: edges for m, edges in GRAPH.items() if layer_of(m) == 0}
    assert leaves.keys() >= {"cxltrain.errors", "cxltrain.knobs", "cxltrain.faults"}
    assert all(layer_of(target) == 0 for edges in leaves.values() for target in edges), leaves


# ---------------------------------------------------------------------------------------------
# the checker, on planted graphs: it must name what it finds
# ---------------------------------------------------------------------------------------------
def test_an_upward_import_is_named_with_both_layers():
    graph = {"cxltrain.kernels.ops": {"cxltrain.tables": 3}, "cxltrain.tables": {"cxltrain.kernels.ops": 9}}
    assert upward_imports(graph) == ["cxltrain.kernels.ops -> cxltrain.tables: kernels may not import tables "
                                     "(layer 'model' is above 'kernels')"]


def test_circles_are_found_within_one_layer_and_across_layers():
    graph = {"cxltrain.devices": {"cxltrain.devices.registry": 1},
             "cxltrain.devices.registry": {"cxltrain.emulation.cxl": 1},
             "cxltrain.emulation.cxl": {"cxltrain.devices": 1},
             "cxltrain.knobs": {"cxltrain.knobs": 1},
             "cxltrain.pool.handle": {"cxltrain.knobs": 1}}
    assert import_circles(graph) == [
        ["cxltrain.devices", "cxltrain.devices.registry", "cxltrain.emulation.cxl", "cxltrain.devices"],
        ["cxltrain.knobs", "cxltrain.knobs"]]
    assert import_circles({"a": {"b": 1}, "b": {"c": 1}, "c": {}}) == []


def test_lazy_imports_and_the_packages_they_run_are_edges(tmp_path):
    package = tmp_path / "cxltrain" / "devices"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "base.py").write_text("def f():\n    from ..emulation import cxl\n")
    modules = {"cxltrain.devices": package / "__init__.py", "cxltrain.devices.base": package / "base.py",
               "cxltrain.emulation": tmp_path / "e.py", "cxltrain.emulation.cxl": tmp_path / "c.py"}
    (tmp_path / "e.py").write_text("")
    (tmp_path / "c.py").write_text("from cxltrain.devices.base import f\n")
    graph = import_graph(modules)
    assert graph["cxltrain.devices.base"] == {"cxltrain.emulation.cxl": 2, "cxltrain.emulation": 2}
    assert graph["cxltrain.emulation.cxl"] == {"cxltrain.devices.base": 1, "cxltrain.devices": 1}
