"""Which path a call takes by default: ordered rules per GPU and world size, read from data files.

The rules live in ``rules/<arch>.json`` beside this module, one file per GPU architecture
(``sm_90``), each holding tables keyed by world size and, where one architecture spans parts that
differ (an H100 PCIe and an H200 SXM), by GPU name or SM count; a table without a finer key serves
every part of its architecture. A GPU whose architecture has no file uses ``rules/default.json``.
Every table says where its rules were measured (``measured``), and every rule carries its evidence
as ``path@commit`` entries, so the data, not code comments, says why a rule is there.

A table maps each op (``mm_all_reduce``, ``all_gather_mm``, ``mm_reduce_scatter``, and
``mm_all_reduce@capture`` for calls inside a CUDA-graph capture) to rules in order::

    {"path": "fused", "when": {"m": [4096, null], "k_le_m": true}, "evidence": ["...@..."]}

The first rule whose conditions all hold and whose path supports the call wins; a table's ops end
with a rule without conditions. Conditions (bounds inclusive, ``null`` open):

========== =========================================================================
``m``      the product's rows (all-gather: the gathered rows)
``k``      its inner size
``n``      its outer size
``elems``  M x N, the product's elements
``bytes``  the bytes one rank exchanges (``Call.exchanged_bytes``)
``shard_mnk`` GEMM work of one rank's block of rows, (M / world) x K x N
``k_le_m`` K at most M
``rows_dim`` 0 where each rank's block is one block of the product's rows
========== =========================================================================

A rule may carry a ``variant`` (a dict) that the path's ``config`` reads: the graph lane runs its
split-K kernel where the rule asks for ``{"split_k": true}``.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import pathlib

from ..env import ALGO_ALIASES
from .paths.base import Call
from .spec import SPECS

RULES_DIR = pathlib.Path(__file__).resolve().parent / "rules"
#: The table of architectures without a file of their own.
DEFAULT = "default"

_RANGES = ("m", "k", "n", "elems", "bytes", "shard_mnk")
_FLAGS = ("k_le_m",)
_EQUALS = ("rows_dim",)


def _value(call: Call, name: str) -> int:
    if name == "elems":
        return call.m * call.n
    if name == "bytes":
        return call.exchanged_bytes
    if name == "shard_mnk":
        return call.shard_mnk
    return getattr(call, name)


@dataclasses.dataclass(frozen=True)
class Rule:
    path: str
    when: tuple = ()  # ((name, value), ...), as in the data
    variant: tuple = ()  # ((name, value), ...)
    evidence: tuple[str, ...] = ()
    note: str = ""

    def matches(self, call: Call) -> bool:
        for name, bound in self.when:
            if name in _RANGES:
                lo, hi = bound
                x = _value(call, name)
                if (lo is not None and x < lo) or (hi is not None and x > hi):
                    return False
            elif name in _FLAGS:
                if (call.k <= call.m) != bool(bound):
                    return False
            elif _value(call, name) != bound:
                return False
        return True

    @property
    def variant_dict(self) -> dict | None:
        return dict(self.variant) if self.variant else None

    def describe(self) -> str:
        conds = ", ".join(f"{n} {_show(v)}" for n, v in self.when) or "otherwise"
        extra = f" {dict(self.variant)}" if self.variant else ""
        why = f": {self.note}" if self.note and self.path == "nccl" else ""  # why a rule keeps the unfused ops
        return f"{self.path}{extra} when {conds}{why}"


def _show(bound) -> str:
    if isinstance(bound, (list, tuple)) and len(bound) == 2:
        lo, hi = bound
        if lo is None:
            return f"<= {hi}"
        if hi is None:
            return f">= {lo}"
        return f"in [{lo}, {hi}]"
    return f"= {bound}"


@dataclasses.dataclass(frozen=True)
class Table:
    """The rules of one (architecture, world sizes, parts) key."""

    arch: str
    worlds: str  # as in the data: "2", "4,8" or ">2"
    parts: tuple[str, ...]  # GPU names or "sms=N"; empty: every part of the architecture
    measured: str | None  # where the rules were measured, None where they are carried over
    note: str
    ops: dict  # op -> tuple[Rule, ...]

    def covers_world(self, world: int) -> bool:
        if self.worlds.startswith(">"):
            return world > int(self.worlds[1:])
        return world in {int(w) for w in self.worlds.split(",")}

    def covers_part(self, name: str, sms: int) -> bool:
        return not self.parts or name in self.parts or f"sms={sms}" in self.parts

    def rules(self, op: str) -> tuple[Rule, ...]:
        return self.ops.get(op, ())

    def label(self) -> str:
        parts = f" {'/'.join(self.parts)}" if self.parts else ""
        return f"{self.arch}{parts} world {self.worlds}"


def _rule(data: dict, where: str) -> Rule:
    unknown = set(data) - {"path", "when", "variant", "evidence", "note"}
    if unknown or "path" not in data:
        raise ValueError(f"commfuse rules: {where}: a rule needs 'path' and takes when/variant/evidence/note, "
                         f"got {sorted(data)}")
    when = data.get("when", {})
    for name, bound in when.items():
        if name in _RANGES:
            if not (isinstance(bound, list) and len(bound) == 2):
                raise ValueError(f"commfuse rules: {where}: {name} needs [low, high], got {bound!r}")
        elif name not in _FLAGS + _EQUALS:
            raise ValueError(f"commfuse rules: {where}: unknown condition {name!r}")
    return Rule(ALGO_ALIASES.get(data["path"], data["path"]), tuple((n, tuple(b) if isinstance(b, list) else b) for n, b in when.items()),
                tuple(sorted(data.get("variant", {}).items())), tuple(data.get("evidence", ())),
                data.get("note", ""))


def parse(data: dict, source: str = "<data>") -> list[Table]:
    """The tables of one rules file (raises ``ValueError`` naming what is malformed)."""
    arch = data.get("arch")
    if not isinstance(arch, str) or not isinstance(data.get("tables"), list):
        raise ValueError(f"commfuse rules: {source} needs 'arch' and 'tables'")
    tables = []
    for i, t in enumerate(data["tables"]):
        worlds = t.get("world")
        worlds = ",".join(str(w) for w in worlds) if isinstance(worlds, list) else str(worlds)
        ops = {}
        for op, rules in t.get("ops", {}).items():
            ops[op] = tuple(_rule(r, f"{source} table {i} {op} rule {j}") for j, r in enumerate(rules))
            if not ops[op] or ops[op][-1].when:
                raise ValueError(f"commfuse rules: {source} table {i}: {op} must end with a rule without 'when'")
        tables.append(Table(arch, worlds, tuple(t.get("parts", ())), t.get("measured"), t.get("note", ""), ops))
    return tables


@functools.lru_cache(None)
def load(arch: str) -> tuple[Table, ...]:
    """The tables for ``arch`` (``default``'s where it has no file)."""
    path = RULES_DIR / f"{arch}.json"
    if not path.exists():
        path = RULES_DIR / f"{DEFAULT}.json"
    return tuple(parse(json.loads(path.read_text()), path.name))


@functools.lru_cache(None)
def may_ask_for(pattern: str) -> bool:
    """Whether any rules file has rows for an op that ``pattern`` (a module of ``patterns/``) makes:
    an opt-in pattern the settings do not name runs only then, fusing where such a row matches."""
    ops = {spec.name for spec in SPECS.values() if spec.pattern == pattern}
    return any(op in t.ops for path in sorted(RULES_DIR.glob("*.json")) for t in load(path.stem) for op in ops)


def table(arch: str, world: int, name: str = "", sms: int = 0) -> Table | None:
    """The table for a group: a part-specific one first, then the architecture's, then None."""
    tables = [t for t in load(arch) if t.covers_world(world)]
    for t in tables:
        if t.parts and t.covers_part(name, sms):
            return t
    for t in tables:
        if not t.parts:
            return t
    return None


def data_hash() -> str:
    """A hash of every rules file: part of the graph pass's cache key."""
    digest = hashlib.sha256()
    for path in sorted(RULES_DIR.glob("*.json")):
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()
