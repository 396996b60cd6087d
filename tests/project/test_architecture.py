"""The package's layers: which module may import which, and no import cycles in any package.

``LAYERS`` is the one layer map; docs/architecture.md shows it as a table, checked here to
match. Every import counts, at module level or inside a function, except those under
``if TYPE_CHECKING:`` (they never run).
"""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGES = ("podsjax", "experiments", "benchmarks")

# Bottom to top: layer -> (its modules, the layers it may import). A subpackage's name covers
# every module in it; the root "podsjax" is its __init__ alone, which loads the rest lazily.
LAYERS = {
    "core": (("podsjax.core",), ("core",)),
    "base": (("podsjax", "podsjax.moved", "podsjax.devices", "podsjax.run", "podsjax.data.prompts",
              "podsjax.data.data_files"), ("base",)),
    "tasks": (("podsjax.rewards", "podsjax.data"), ("base", "tasks")),
    "models": (("podsjax.models",), ("base", "models")),
    "sampler": (("podsjax.sampler",), ("base", "models", "sampler")),
    "update": (("podsjax.update",), ("core", "base", "models", "update")),
    "plan": (("podsjax.devices.dry_run",), ("core", "base", "models", "sampler", "update")),
    "rl": (("podsjax.rl",), ("core", "base", "tasks", "models", "sampler", "update", "plan", "rl")),
    "presets": (("podsjax.tiny",), ("core", "base", "tasks", "models", "sampler", "update", "presets")),
    "experiments": (("experiments",),
                    ("core", "base", "tasks", "models", "sampler", "update", "plan", "rl", "presets", "experiments")),
    "benchmarks": (("benchmarks",), ("core", "base", "tasks", "models", "sampler", "update", "plan", "rl", "presets",
                                     "experiments", "benchmarks")),
}
ORDER = list(LAYERS)


def module_files() -> dict[str, pathlib.Path]:
    """Every module of the three packages, by dotted name (a package by its own name)."""
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


MODULES = module_files()


def layer_of(module: str) -> str | None:
    """The layer whose most specific entry names ``module`` or a package above it."""
    best, depth = None, -1
    for layer, (entries, _) in LAYERS.items():
        for entry in entries:
            covers = module == entry or (entry != "podsjax" and module.startswith(entry + "."))
            if covers and entry.count(".") > depth:
                best, depth = layer, entry.count(".")
    return best


class _Imports(ast.NodeVisitor):
    """``(line, text, module)`` of each import of our packages, resolved to a module file."""

    def __init__(self, module: str, is_package: bool):
        self.package = module if is_package else module.rpartition(".")[0]
        self.found: list[tuple[int, str, str]] = []

    def visit_If(self, node: ast.If):
        test = node.test
        if (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
                isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"):
            for child in node.orelse:
                self.visit(child)
            return
        self.generic_visit(node)

    def visit_Import(self, node: ast.Import):
        for alias in node.names:
            self._add(node, alias.name, f"import {alias.name}")

    def visit_ImportFrom(self, node: ast.ImportFrom):
        base = node.module or ""
        if node.level:
            parts = self.package.split(".")
            base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
        for alias in node.names:
            self._add(node, f"{base}.{alias.name}", f"from {'.' * node.level}{node.module or ''} import {alias.name}")

    def _add(self, node, name: str, text: str):
        if name.split(".")[0] not in PACKAGES:
            return
        while name not in MODULES and "." in name:  # a name inside a module: that module
            name = name.rpartition(".")[0]
        self.found.append((node.lineno, text, name))


def imports_of(module: str) -> list[tuple[int, str, str]]:
    path = MODULES[module]
    visitor = _Imports(module, path.name == "__init__.py")
    visitor.visit(ast.parse(path.read_text(), filename=str(path)))
    return visitor.found


def where(module: str, line: int | None = None) -> str:
    path = MODULES[module]
    shown = path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else str(path)
    return shown if line is None else f"{shown}:{line}"


def layer_violations(module: str) -> list[str]:
    """One line per import of ``module`` that its layer does not allow."""
    layer = layer_of(module)
    allowed = LAYERS[layer][1]
    problems = []
    for line, text, target in imports_of(module):
        target_layer = layer_of(target)
        if target == module or target_layer in allowed or target_layer is None:  # no layer: test_every_module...
            continue
        if ORDER.index(target_layer) > ORDER.index(layer):
            why = f"a higher layer ({target_layer})"
        else:
            why = f"layer {target_layer}, outside its allowed set"
        problems.append(f"{where(module, line)}: `{text}` imports {target}, {why}; "
                        f"layer {layer} may import {rule_text(layer, allowed)}")
    return problems


def import_graph(package: str = "podsjax") -> dict[str, set[str]]:
    """Module -> the modules of ``package`` importing it runs, the package ``__init__``s
    entered from outside included (importing ``a.b.c`` from outside ``a.b`` runs ``a.b``)."""
    graph = {}
    for module in MODULES:
        if module.split(".")[0] != package:
            continue
        edges = set()
        for _, _, target in imports_of(module):
            if target.split(".")[0] != package or target == module:
                continue
            edges.add(target)
            parts = target.split(".")
            for cut in range(1, len(parts)):
                parent = ".".join(parts[:cut])
                if not (module == parent or module.startswith(parent + ".")):
                    edges.add(parent)
        graph[module] = edges
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as ``[a, b, ..., a]``, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node):
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        state[node] = 2
        path.pop()
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def rule_text(layer: str, allowed: tuple[str, ...]) -> str:
    """What a layer may import, in words."""
    if list(allowed) == [layer]:
        return "itself, nothing else of podsjax"
    return "every layer below, itself" if list(allowed) == ORDER[:ORDER.index(layer) + 1] else ", ".join(allowed)


def layers_table() -> str:
    """``LAYERS`` as the markdown table docs/architecture.md shows."""
    def short(name):
        return name if name == "podsjax" else name.removeprefix("podsjax.")

    rows = ["| layer | modules | may import |", "|---|---|---|"]
    for layer, (entries, allowed) in reversed(LAYERS.items()):
        rows.append(f"| {layer} | {', '.join(f'`{short(e)}`' for e in entries)} | {rule_text(layer, allowed)} |")
    return "\n".join(rows)


def test_every_module_is_in_one_layer():
    missing = [where(module) for module in MODULES if layer_of(module) is None]
    assert not missing, (f"in no layer: {', '.join(missing)}; add each to LAYERS in tests/project/test_architecture.py "
                         "and the table in docs/architecture.md")


def test_every_layer_entry_names_a_module():
    unknown = [entry for entries, _ in LAYERS.values() for entry in entries if entry not in MODULES]
    assert not unknown, f"LAYERS names modules that do not exist: {', '.join(unknown)}"


def test_layers_import_only_themselves_and_layers_below():
    for layer, (_, allowed) in LAYERS.items():
        above = [name for name in allowed if ORDER.index(name) > ORDER.index(layer)]
        assert not above, f"layer {layer} may import {above}, above it in LAYERS"


@pytest.mark.parametrize("package", PACKAGES)
def test_every_import_stays_within_its_layers_rule(package):
    problems = [p for module in MODULES if module.split(".")[0] == package and layer_of(module)
                for p in layer_violations(module)]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("package", PACKAGES)
def test_no_import_cycle(package):
    cycle = find_cycle(import_graph(package))
    assert cycle is None, f"{package} import cycle: " + " -> ".join(cycle)


def test_the_docs_show_the_layer_map():
    doc = (ROOT / "docs" / "architecture.md").read_text()
    assert layers_table() in doc, f"docs/architecture.md's layer table differs from LAYERS; it should read:\n" \
                                  f"{layers_table()}"


def test_the_checks_catch_a_forbidden_import_and_a_cycle(tmp_path, monkeypatch):
    # The core importing the loop breaks both rules; the check names the file, the import and the rule.
    source = tmp_path / "selection.py"
    source.write_text(MODULES["podsjax.core.selection"].read_text() + "\nfrom podsjax.rl import trainer\n")
    monkeypatch.setitem(MODULES, "podsjax.core.selection", source)
    [problem] = layer_violations("podsjax.core.selection")
    assert problem.startswith(f"{source}:") and problem.endswith("layer core may import itself, nothing else of podsjax")
    assert "`from podsjax.rl import trainer` imports podsjax.rl.trainer, a higher layer (rl)" in problem
    cycle = find_cycle(import_graph("podsjax"))  # selection -> loop -> ... -> train -> selection
    assert cycle is not None and "podsjax.core.selection" in cycle


# A module or class past these sizes does several jobs: split it along a seam (see docs/architecture.md).
MAX_MODULE_LINES = 450
MAX_CLASS_LINES = 200


def test_no_module_or_class_outgrows_its_size():
    too_big = []
    for module, path in MODULES.items():
        source = path.read_text()
        if (lines := source.count("\n")) > MAX_MODULE_LINES:
            too_big.append(f"{where(module)}: {lines} lines, over {MAX_MODULE_LINES}")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ClassDef) and (size := node.end_lineno - node.lineno + 1) > MAX_CLASS_LINES:
                too_big.append(f"{where(module, node.lineno)}: class {node.name} is {size} lines, over {MAX_CLASS_LINES}")
    assert not too_big, "\n".join(too_big)
