"""The package's import graph: imports flow one way, from the leaves up, with no cycles.

Every ``import`` in ``jaxlp`` counts, function-level ones included; only imports under
``if TYPE_CHECKING:`` (annotations, never executed) are left out. Importing ``jaxlp.a.b``
executes ``jaxlp/a/__init__.py`` too, so a module also depends on the packages above the
modules it imports. The layers are in ``docs/architecture.md``; :data:`LAYERS` is the same
table (a module takes the layer of its longest listed prefix).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "jaxlp"

LAYERS = {
    # 0: leaves -- errors, shared numeric conventions, the array formats, the references kernels test against
    "jaxlp.errors": 0,
    "jaxlp.temperature": 0,
    "jaxlp.formats": 0,
    "jaxlp.attention": 0,  # the package itself imports nothing
    "jaxlp.attention.reference": 0,
    "jaxlp.data": 0,
    "jaxlp.testbed": 0,
    # 1: kernels
    "jaxlp.ffi": 1,
    "jaxlp.pallas": 1,
    # 2: ops with their pure-JAX reference and the dispatch to the kernels
    "jaxlp.attention.decode": 2,
    "jaxlp.attention.prefill": 2,
    "jaxlp.kvcache": 2,
    "jaxlp.sampling": 2,
    "jaxlp.checkpoint": 2,
    # 3: models, then quantization (which rewrites models)
    "jaxlp.models": 3,
    "jaxlp.quantization": 4,
    # 5: what users run
    "jaxlp": 5,
    "jaxlp.generation": 5,
    "jaxlp.pretrained": 5,
    "jaxlp.demo": 5,
    "jaxlp.cli": 5,
    "jaxlp.evals": 5,
    "jaxlp.serving": 5,
    "jaxlp.testbed.training": 5,
}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def all_modules() -> dict[str, Path]:
    return {module_name(p): p for p in ROOT.rglob("*.py")}


def layer(module: str) -> int:
    name = module
    while name not in LAYERS:
        if "." not in name:
            raise KeyError(f"{module} is in no layer of LAYERS (add it, and to docs/architecture.md)")
        name = name.rsplit(".", 1)[0]
    return LAYERS[name]


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def imports(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The jaxlp modules ``module`` imports explicitly (resolved to modules where they exist)."""
    is_package = path.name == "__init__.py"
    found: set[str] = set()

    def visit(node):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                for sub in child.orelse:
                    visit_node(sub)
                continue
            visit_node(child)

    def visit_node(node):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("jaxlp"):
                    found.add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                base = base if is_package else base[:-1]
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.startswith("jaxlp"):
                for alias in node.names:
                    sub = f"{target}.{alias.name}"
                    found.add(sub if sub in modules else target)
        visit(node)

    visit(ast.parse(path.read_text(), str(path)))
    found.discard(module)
    return found


def with_parents(target: str) -> set[str]:
    """``target`` and the packages above it that importing it executes (the root excepted)."""
    parts = target.split(".")
    return {".".join(parts[:i]) for i in range(2, len(parts) + 1)}


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    modules = all_modules()
    return {m: imports(m, p, modules) for m, p in modules.items()}


def test_every_module_has_a_layer(graph):
    for module in graph:
        layer(module)


def test_imports_flow_from_the_leaves_up(graph):
    against = []
    for module, targets in sorted(graph.items()):
        for target in sorted(set().union(*(with_parents(t) for t in targets)) if targets else ()):
            if target != module and not module.startswith(target + ".") and layer(target) > layer(module):
                against.append(f"{module} (layer {layer(module)}) imports {target} (layer {layer(target)})")
    assert not against, "imports against the flow:\n" + "\n".join(against)


def test_no_import_cycles(graph):
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def strongconnect(v):  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in graph:
                continue
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            strongconnect(v)
    assert not cycles, f"import cycles: {cycles}"


def test_the_graph_walker_sees_function_level_imports(tmp_path):
    """The checker itself: a function-level import is an edge; a TYPE_CHECKING import is not."""
    src = tmp_path / "jaxlp" / "kvcache" / "x.py"
    src.parent.mkdir(parents=True)
    src.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from jaxlp.models import config\n"
                   "def f():\n    from jaxlp.generation import generate\n    from . import base\n")
    found = imports("jaxlp.kvcache.x", src, {"jaxlp.kvcache.base": src})
    assert found == {"jaxlp.generation", "jaxlp.kvcache.base"}
    assert layer("jaxlp.kvcache.x") < layer("jaxlp.generation")
