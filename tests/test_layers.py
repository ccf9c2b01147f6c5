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
Compile time hands the run-time its workspace plans and site names through one registry
(``runtime/plans.py``), and writes no other run-time state.
"""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

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


#: What decides, at compile time and at a call: none of it may need Triton (or Iris).
DECIDING = ["commfuse", "commfuse.inductor_plugin", "commfuse.inductor_plugin.graph_pass", "commfuse.patterns",
            "commfuse.report", "commfuse.config", "commfuse.exclusion", "commfuse.ops", "commfuse.runtime.policy",
            "commfuse.runtime.rules", "commfuse.runtime.spec", "commfuse.runtime.rule_answers",
            "commfuse.runtime.paths", "commfuse.runtime.plans", "commfuse.runtime.capture",
            "commfuse.runtime.counters", "commfuse.kernels.sizes.fused_split_k",
            "commfuse.kernels.sizes.fused_all_reduce", "commfuse.kernels.sizes.fused_all_gather"]

_WITHOUT_TRITON = """
import importlib, sys

class NoTriton:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("triton", "iris"):
            raise ImportError(f"{name} is absent here")
        return None

sys.meta_path.insert(0, NoTriton())
for module in sys.argv[1:]:
    importlib.import_module(module)
from commfuse.runtime import policy
from commfuse.runtime.facts import GroupFacts
from commfuse.runtime.paths.base import Call
import torch
for op in ("mm_all_reduce", "all_gather_mm", "mm_reduce_scatter"):
    decision = policy.choose(Call(op, 4096, 4096, 4096, torch.bfloat16, 2), GroupFacts.simulated(2), quiet=True)
    assert decision.path.workspace_bytes(Call(op, 4096, 4096, 4096, torch.bfloat16, 2)) >= 0
    decision.path.config(Call(op, 4096, 4096, 4096, torch.bfloat16, 2), GroupFacts.simulated(2), decision.variant)
print(sorted(m for m in sys.modules if m.split(".")[0] in ("triton", "iris")))
"""


@pytest.mark.slow
def test_deciding_imports_no_triton():
    """The compile-time modules, the policy, the rules and every path's deciding side import, and
    decide a call, in a process where Triton and Iris cannot be imported."""
    proc = subprocess.run([sys.executable, "-c", _WITHOUT_TRITON, *DECIDING], capture_output=True, text=True,
                          cwd=ROOT.parent, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "[]"


def test_running_needs_what_deciding_does_not():
    """Running a path imports its kernels at import time, beside the path's deciding module."""
    graph = _graph()
    for module in (m for m in graph if m.startswith("commfuse.runtime.paths.")):
        assert not [t for t in graph[module] if t.startswith("commfuse.kernels.") and ".sizes" not in t
                    and t != "commfuse.kernels.codes"], f"{module} imports a kernel module: its running side does"
    # (each side's ``common``: what its paths share)
    running = {m.rsplit(".", 1)[-1] for m in graph if m.startswith("commfuse.runtime.running.")} - {"common"}
    deciding = {m.rsplit(".", 1)[-1] for m in graph if m.startswith("commfuse.runtime.paths.")} - {"base", "common"}
    assert running == deciding


#: The run-time modules that hold its state per group or per call (buffers, capture records, plans,
#: tuners, decisions): compile time may not import them, except the report, which reads the
#: decisions the groups keep.
_RUN_TIME_STATE = {"commfuse.runtime.groups", "commfuse.runtime.capture", "commfuse.runtime.entry",
                   "commfuse.runtime.tuning", "commfuse.runtime.workspace", "commfuse.runtime.shards"}
_READS_STATE = {"commfuse.report": {"commfuse.runtime.groups"}}


def test_compile_time_hands_the_run_time_only_the_plans_registry():
    """The graph pass's workspace plans and call-site names reach the run-time through
    ``runtime/plans.py`` only: no compile-time module imports a module that holds run-time state
    (the report reads the groups' decisions, nothing more); the registry imports no other commfuse
    module (what it holds cannot reach further); the graph pass registers there, and the run-time
    reads it."""
    graph = _graph()
    for module, imports in graph.items():
        if LAYERS[_part(module)] != LAYERS["inductor_plugin"]:
            continue
        wrong = (imports & _RUN_TIME_STATE) - _READS_STATE.get(module, set())
        assert not wrong, f"{module} imports run-time state: {sorted(wrong)}"
    assert graph["commfuse.runtime.plans"] == set()
    assert "commfuse.runtime.plans" in graph["commfuse.inductor_plugin.graph_pass"]
    assert "commfuse.runtime.plans" in graph["commfuse.runtime.groups"]
    text = (ROOT / "inductor_plugin" / "graph_pass.py").read_text()
    assert "plans.register(" in text and "plans.name_site(" in text
