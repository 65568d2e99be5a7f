"""The package's import graph: no circle, and every import points down the layers of docs/architecture.md.

Every import counts, also one inside a function or under ``TYPE_CHECKING``: a lazy import is still a
dependency. Run alone with ``python -m pytest tests/test_layers.py -q``; a failure names the modules.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

from support import REPO

PACKAGE = REPO / "fabric"

# top to bottom: a module may import its own layer and the layers below it, never one above
LAYERS: list[tuple[str, ...]] = [
    ("fabric.__main__", "fabric.cli", "fabric.run_options", "fabric.consolidate"),
    ("fabric", "fabric.fabric", "fabric.launching", "fabric.setup_inputs"),
    ("fabric.connector", "fabric.input_types"),
    ("fabric.wrappers", "fabric.forward_methods"),
    ("fabric.strategies",),
    ("fabric.strategies.launchers",),
    # the plugin families a strategy is made of (the CheckpointIO plugin implements what the checkpoint wing declares),
    # and the exception classes Lightning users import by name, gathered from their homes (the wing's among them)
    ("fabric.accelerators", "fabric.plugins", "fabric.loggers", "fabric.callbacks", "fabric.utilities.exceptions"),
    # the checkpoint wing, top to bottom: save and load; the formats and their table; the walks and the protocols a
    # strategy and a plugin implement; storage; the checks of a torch archive's bytes; the errors
    ("fabric.checkpoint", "fabric.checkpoint.pipeline"),
    ("fabric.checkpoint.formats",),
    (
        "fabric.checkpoint.agreement",
        "fabric.checkpoint.async_save",
        "fabric.checkpoint.fit",
        "fabric.checkpoint.host",
        "fabric.checkpoint.layout",
        "fabric.checkpoint.per_rank",
        "fabric.checkpoint.plugin",
        "fabric.checkpoint.restore",
        "fabric.checkpoint.resume",
        "fabric.checkpoint.state",
        "fabric.checkpoint.stateful",
    ),
    ("fabric.checkpoint.storage",),
    ("fabric.checkpoint.integrity",),
    ("fabric.checkpoint.errors",),
    ("fabric.plugins.environments",),  # a plugin family, so above the utilities; standard library and _core only
    ("fabric.utilities",),
    ("fabric.supervision",),
    ("fabric._core",),
]


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(REPO).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def _imports(modules: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the fabric modules it imports (a name imported from a package counts as its module if it is one)."""
    edges: dict[str, set[str]] = defaultdict(set)
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*parts, base] if base else parts)
                targets = [f"{base}.{alias.name}" for alias in node.names] + [base]
            else:
                continue
            for target in targets:
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    edges[name].add(target)
    return edges


def _layer(module: str) -> int:
    best, best_length = None, -1
    for index, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best_length:
                best, best_length = index, len(prefix)
    assert best is not None, f"{module} belongs to no layer of LAYERS: add it"
    return best


def _circles(edges: dict[str, set[str]]) -> list[list[str]]:
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def visit(node: str) -> None:  # Tarjan's strongly connected components
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in edges.get(node, ()):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for node in list(edges):
        if node not in index:
            visit(node)
    return circles


def test_no_import_circle() -> None:
    assert _circles(_imports(_modules())) == []


def _packages(edges: dict[str, set[str]]) -> dict[str, set[str]]:
    """package -> the packages its modules import, where neither holds the other (a package uses its subpackages, and
    they the modules beside them: the layers order those)."""
    modules = _modules()

    def package(module: str) -> str:
        return module if modules[module].name == "__init__.py" else module.rpartition(".")[0]

    def nested(a: str, b: str) -> bool:
        return a == b or a.startswith(b + ".") or b.startswith(a + ".")

    between: dict[str, set[str]] = defaultdict(set)
    for importer, targets in edges.items():
        for imported in targets:
            if not nested(package(importer), package(imported)):
                between[package(importer)].add(package(imported))
    return between


def test_no_circle_between_packages() -> None:
    assert _circles(_packages(_imports(_modules()))) == []


def test_every_import_points_down_the_layers() -> None:
    upward = sorted(
        f"{importer} -> {imported}"
        for importer, targets in _imports(_modules()).items()
        for imported in targets
        if _layer(imported) < _layer(importer)
    )
    assert upward == []


def test_the_checker_sees_a_circle_and_an_upward_import() -> None:
    edges = {"fabric.checkpoint.a": {"fabric.strategies.b"}, "fabric.strategies.b": {"fabric.checkpoint.a"}}
    assert _circles(edges) == [["fabric.checkpoint.a", "fabric.strategies.b"]]
    assert _layer("fabric.checkpoint.a") > _layer("fabric.strategies.b")
