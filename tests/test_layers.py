"""The package's import graph: layers import downwards only, and nothing forms a cycle.

    tools (and the command line)        benchmarks, diagnostics, explain
      -> the public package                 commfuse/__init__.py
      -> compile time                       inductor_plugin/, patterns/, config, exclusion, report
      -> ops                                ops/ (schemas, fakes, argument checks)
      -> run-time                           runtime/ (groups, workspaces, policy, rules, paths)
      -> kernels                            kernels/ (Triton device code and launchers)
      -> base                               env (settings), log

A module may import its own layer or any layer below it. An import inside a function is an edge
too (it is how an optional or heavy dependency is kept out of ``import commfuse``), so the graph
is read from every import statement of every module. The kernels read no environment variable.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent / "commfuse"

#: Layer of each top-level part of the package: a lower number may import a higher one.
LAYERS = {
    "tools": 0, "__main__": 0, "demo": 0,
    "__init__": 1,
    "inductor_plugin": 2, "patterns": 2, "config": 2, "exclusion": 2, "report": 2,
    "ops": 3,
    "runtime": 4,
    "kernels": 5,
    "env": 6, "log": 6,
}


def _module(path: pathlib.Path) -> str:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _part(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _imports(path: pathlib.Path) -> set[str]:
    """Every commfuse module ``path`` imports, resolved to module names."""
    tree = ast.parse(path.read_text())
    me = _module(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("commfuse"))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if not mod.startswith("commfuse"):
                continue
            for alias in node.names:  # ``from . import x`` names a module when there is one
                sub = f"{mod}.{alias.name}"
                found.add(sub if _exists(sub) else mod)
    return found


def _exists(module: str) -> bool:
    rel = pathlib.Path(*module.split(".")[1:])
    return (ROOT / rel).with_suffix(".py").exists() or (ROOT / rel / "__init__.py").exists()


def _graph() -> dict[str, set[str]]:
    return {_module(p): _imports(p) for p in sorted(ROOT.rglob("*.py"))}


def test_every_part_has_a_layer():
    parts = {_part(m) for m in _graph()}
    assert parts <= set(LAYERS), f"parts without a layer: {sorted(parts - set(LAYERS))}"


def test_imports_go_down_the_layers():
    wrong = []
    for module, imports in _graph().items():
        for target in imports:
            if target == "commfuse":
                target = "commfuse.__init__"
            if LAYERS[_part(target)] < LAYERS[_part(module)]:
                wrong.append(f"{module} -> {target}")
    assert not wrong, "imports against the layer order:\n" + "\n".join(sorted(wrong))


def test_no_import_cycles():
    graph = _graph()
    # a package's modules import their package (its __init__) implicitly; only explicit edges count
    state: dict[str, int] = {}
    cycles = []

    def visit(node, stack):
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if nxt not in graph or nxt == node:
                continue
            if state.get(nxt) == 1:
                cycles.append(" -> ".join(stack[stack.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = 2

    for node in graph:
        if node not in state:
            visit(node, [node])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


@pytest.mark.parametrize("path", sorted((ROOT / "kernels").rglob("*.py")), ids=lambda p: p.name)
def test_kernels_read_no_environment(path):
    text = path.read_text()
    for word in ("os.environ", "getenv", "from .. import env", "from ..env"):
        assert word not in text, f"{path.name} reads the environment ({word}); the run-time passes settings"


def test_tools_are_imported_by_nothing_else():
    for module, imports in _graph().items():
        if _part(module) in ("tools", "__main__"):
            continue
        assert not [t for t in imports if _part(t) == "tools"], module
