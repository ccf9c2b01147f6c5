"""One door to the flags: every path launches its exchanging kernels through the group's ordering.

A call's flags carry its count, and a wait passes once the peer's count is at least its own (a
peer may legally be one call ahead). So two calls of a group that reach the device out of the
order the host counted them in pair a stale half with error word 0. What keeps them in order is
that every launch of a kernel that signals or waits on a group's flags is inside one of the doors
of ``runtime/paths/common.py``: ``exchange`` (the workspace: the call's epoch, after
``Workspace.order``) or ``lane_exchange`` (the graph lane, whose epochs live on the device: eager
calls after ``GraphLane.order``). This reads every module that runs a path (``runtime/running/``)
and fails on a launch outside them,
so the next path keeps the rule too.

What launches: the exchange launchers of ``kernels/exchange.py``, the launches the fused kernels'
``prepare`` returns (however they are held: a name, an attribute, a tuple's element, what
``ws.kept`` keeps), and the copy-engine graphs' replays (``runtime/ce_graphs.run``). A module-level
helper that launches outside a door (``ag_pull.pull``) counts as a launch where it is called. Every
function of the kernels (and of ``ce_graphs``) handed a workspace or a lane must be named below,
so a new launcher cannot slip past unclassified.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent / "commfuse"
#: The modules that run paths (``runtime/running/``): every launch is there.
RUNNING = ROOT / "runtime" / "running"

#: (module, function) that launch an exchanging kernel when called.
LAUNCHES = {("exchange", "all_reduce"), ("exchange", "gather"), ("exchange", "reduce_scatter"),
            ("exchange", "barrier"), ("exchange", "staged_all_reduce"), ("ce_graphs", "run"),
            ("norm_epilogue", "all_reduce_add_rms_norm"), ("norm_epilogue", "reduce_scatter_add_rms_norm"),
            ("norm_epilogue", "staged_add_rms_norm")}
#: (module, function) whose result is a launch (called later, or at once).
MAKES = {("fused_all_reduce", "prepare"), ("fused_all_gather", "prepare"), ("fused_split_k", "prepare")}
#: (module, function) handed a workspace or lane that launch nothing.
QUIET = {("fused_split_k", "misfit"), ("ce_graphs", "key"), ("ce_graphs", "keys"), ("ce_graphs", "drop_since")}
#: The doors, in ``paths/common.py``.
DOORS = {"exchange", "lane_exchange"}
#: Modules whose functions are classified above.
CLASSIFIED = sorted((ROOT / "kernels").glob("*.py")) + [ROOT / "runtime" / "ce_graphs.py"]


def test_every_function_handed_a_workspace_is_classified():
    """A public module-level function whose first parameter is a workspace (``ws``) or a graph lane
    (``lane``) either launches, makes a launch, or is named as launching nothing."""
    unknown = []
    for path in CLASSIFIED:
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.FunctionDef) and not node.name.startswith("_") and node.args.args:
                if node.args.args[0].arg in ("ws", "lane"):
                    key = (path.stem, node.name)
                    if key not in LAUNCHES | MAKES | QUIET:
                        unknown.append(f"{path.stem}.{node.name}")
    assert not unknown, f"classify these in {__name__}: do they launch an exchanging kernel? {unknown}"


class _Module:
    """What one path module's names stand for, and its functions."""

    def __init__(self, path: pathlib.Path):
        self.name = path.stem
        self.tree = ast.parse(path.read_text())
        self.modules: dict[str, str] = {}  # local name -> kernels / run-time module it names
        self.functions: dict[str, tuple[str, str]] = {}  # local name -> (that module, function)
        self.doors: set[str] = set()  # local names of the doors
        self.helpers: dict[str, tuple[str, str]] = {}  # local name -> (path module, function)
        for node in ast.walk(self.tree):
            if not isinstance(node, ast.ImportFrom):
                continue
            source = node.module or ""
            for alias in node.names:
                local = alias.asname or alias.name
                if (node.level, source) in ((1, "common"), (2, "paths.common")) and alias.name in DOORS:
                    self.doors.add(local)
                elif node.level == 1 and source:  # a function of a sibling path module
                    self.helpers[local] = (source, alias.name)
                elif source.endswith("kernels") or node.level == 2 and not source:
                    self.modules[local] = alias.name
                elif node.level >= 2:  # a function imported from a kernels or run-time module
                    self.functions[local] = (source.rsplit(".", 1)[-1], alias.name)
        self.parents = {child: parent for parent in ast.walk(self.tree) for child in ast.iter_child_nodes(parent)}
        for node in self.tree.body:
            if isinstance(node, ast.FunctionDef):
                self.helpers[node.name] = (self.name, node.name)

    def _function(self, node):
        """``node``'s outermost enclosing function: (name, whether it is a module-level function)."""
        owner = None
        while node in self.parents:
            node = self.parents[node]
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                owner = node
        if owner is None:
            return "<module>", False
        parent = self.parents.get(owner)
        if isinstance(parent, ast.ClassDef):
            return f"{parent.name}.{owner.name}", False
        return owner.name, True

    def _in_door(self, node) -> bool:
        while node in self.parents:
            node = self.parents[node]
            if isinstance(node, (ast.With, ast.AsyncWith)):
                for item in node.items:
                    call = item.context_expr
                    if isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id in self.doors:
                        return True
        return False

    def _named(self, func) -> tuple[str, str] | None:
        """(module, function) a call's callee names: a kernels / run-time module's function."""
        if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id in self.modules:
            return self.modules[func.value.id], func.attr
        if isinstance(func, ast.Name) and func.id in self.functions:
            return self.functions[func.id]
        return None

    def _makes(self, value) -> str | None:
        """What makes a launch in ``value``, if its result is one: a ``MAKES`` call, one kept by
        ``ws.kept(key, lambda: ...)`` (any call handed a lambda that makes one), or a name or
        attribute bound to one (``_bind``)."""
        if isinstance(value, ast.NamedExpr):
            return self._makes(value.value)
        if isinstance(value, ast.Name) and value.id in self.made:
            return f"{value.id} (a prepared launch)"
        if isinstance(value, ast.Attribute) and value.attr in self.made_attrs:
            return f".{value.attr} (a prepared launch)"
        if not isinstance(value, ast.Call):
            return None
        named = self._named(value.func)
        if named in MAKES:
            return ".".join(named) + "(...)"
        for arg in [*value.args, *(k.value for k in value.keywords)]:
            if isinstance(arg, ast.Lambda) and self._makes(arg.body):
                return f"{self._makes(arg.body)} (kept)"
        return None

    def _bind(self, target, value) -> bool:
        """Note the names and attributes ``target`` binds to a launch; whether any was new."""
        if isinstance(target, (ast.Tuple, ast.List)):
            if isinstance(value, (ast.Tuple, ast.List)) and len(value.elts) == len(target.elts):
                return any([self._bind(t, v) for t, v in zip(target.elts, value.elts)])
            return any([self._bind(t, value) for t in target.elts])  # (unpacked: each may be one)
        if isinstance(target, ast.Starred):
            return self._bind(target.value, value)
        if not self._makes(value):
            return False
        if isinstance(target, ast.Name) and target.id not in self.made:
            self.made.add(target.id)
            return True
        if isinstance(target, ast.Attribute) and target.attr not in self.made_attrs:
            self.made_attrs.add(target.attr)
            return True
        return False

    def launches(self, launching: set[tuple[str, str]]):
        """Each call that launches: (call node, what it calls)."""
        self.made: set[str] = set()  # names bound to a launch (``launch = fused_x.prepare(...)``)
        self.made_attrs: set[str] = set()  # attributes bound to one (``self.launch = ...``)
        new = True
        while new:  # (a name bound to another name bound to a launch)
            new = False
            for node in ast.walk(self.tree):
                if isinstance(node, ast.Assign):
                    new = any([self._bind(t, node.value) for t in node.targets]) or new
                elif isinstance(node, (ast.AnnAssign, ast.NamedExpr)) and node.value is not None:
                    new = self._bind(node.target, node.value) or new
        for node in ast.walk(self.tree):
            if not isinstance(node, ast.Call):
                continue
            func, what = node.func, None
            named = self._named(func)
            if named in LAUNCHES:
                what = ".".join(named)
            elif self._makes(func):
                what = self._makes(func)
            elif isinstance(func, ast.Name) and self.helpers.get(func.id) in launching:
                what = ".".join(self.helpers[func.id])
            if what:
                yield node, what

    def unguarded(self, launching: set[tuple[str, str]]):
        """(function, is it module-level, line, what) of each launch outside a door."""
        for node, what in self.launches(launching):
            if not self._in_door(node):
                name, helper = self._function(node)
                yield name, helper, node.lineno, what


def _outside_the_doors(paths: list[pathlib.Path]) -> list[str]:
    modules = [_Module(p) for p in paths if p.name not in ("__init__.py", "common.py")]
    launching: set[tuple[str, str]] = set()  # module-level helpers that launch outside a door
    while True:  # until no more helpers are found to launch (through other helpers)
        found = {(m.name, name) for m in modules for name, helper, _, _ in m.unguarded(launching) if helper}
        if found <= launching:
            break
        launching |= found
    called = {m.helpers[n.func.id] for m in modules for n in ast.walk(m.tree)
              if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in m.helpers}
    wrong = []
    for m in modules:
        for name, helper, line, what in m.unguarded(launching):
            if not helper or (m.name, name) not in called:
                wrong.append(f"{m.name}.py:{line} {name} launches {what} outside paths.common's doors")
    return wrong


def test_every_path_launches_its_exchanging_kernels_through_a_door():
    wrong = _outside_the_doors(sorted(RUNNING.glob("*.py")))
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("body, found", [
    ("exchange.all_reduce(ws, p, out, epoch, 'one_shot', 1)", True),
    ("gather_now(ws, p, out, 1, 1, 1, 2)", True),  # a launcher imported by its name
    ("run_graph(ws, 1, (), None, 0)", True),
    ("launch = fused_split_k.prepare(ws, a, b, None, out, cfg)\n        launch(1, 0)", True),
    ("fused_split_k.prepare(lane, a, b, None, out, cfg, lane=True)(0)", True),
    ("helper(ws)", True),  # a module-level helper that launches outside a door
    ("with epoch_of(ctx, ws, 'op') as (epoch, parity):\n            helper(ws)", False),
    ("with lane_exchange(lane, False):\n            exchange.staged_all_reduce(lane, p, out, 4)", False),
    ("launch = fused_split_k.prepare(ws, a, b, None, out, cfg)\n"
     "        with epoch_of(ctx, ws, 'op') as (epoch, parity):\n            launch(epoch, parity)", False),
    ("fused_split_k.misfit(ws, 1, 1, cfg, None, False)", False),
    # a launch kept on an attribute, unpacked from a tuple, kept by the workspace, or named twice
    ("self.launch = fused_split_k.prepare(ws, a, b, None, out, cfg)\n        self.launch(1, 0)", True),
    ("launch, n = fused_split_k.prepare(ws, a, b, None, out, cfg), 1\n        launch(1, 0)", True),
    ("launch = ws.kept('k', lambda: fused_split_k.prepare(ws, a, b, None, out, cfg))\n        launch(1, 0)", True),
    ("ws.kept('k', make=lambda: fused_split_k.prepare(ws, a, b, None, out, cfg))(1, 0)", True),
    ("(go := fused_split_k.prepare(ws, a, b, None, out, cfg))\n        go(1, 0)", True),
    ("first = fused_split_k.prepare(ws, a, b, None, out, cfg)\n        again = first\n        again(1, 0)", True),
    ("self.launch = ws.kept('k', lambda: fused_split_k.prepare(ws, a, b, None, out, cfg))\n"
     "        with epoch_of(ctx, ws, 'op') as (epoch, parity):\n            self.launch(epoch, parity)", False),
    ("launch, n = fused_split_k.prepare(ws, a, b, None, out, cfg), 1\n        n(1, 0)", False),
])
def test_the_check_finds_launches_outside_the_doors(tmp_path, body, found):
    """The check itself, on a path module written for it."""
    (tmp_path / "made_up.py").write_text(f'''
from ...kernels import exchange, fused_split_k
from ...kernels.exchange import gather as gather_now
from ..ce_graphs import run as run_graph
from ..paths.common import exchange as epoch_of, lane_exchange


def helper(ws):
    exchange.barrier(ws, 1, 1)


class MadeUp:
    def step(self, ctx, ws):
        with epoch_of(ctx, ws, "op") as (epoch, parity):
            helper(ws)

    def run(self, ctx, ws, lane, a, b, p, out, cfg):
        {body}
''')
    wrong = _outside_the_doors([tmp_path / "made_up.py"])
    assert bool(wrong) == found, wrong
    if found:
        assert all("MadeUp.run launches" in w for w in wrong), wrong
