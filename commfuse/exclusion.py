"""Opting modules out of fusion.

Three ways, all resolved against the ``nn_module_stack`` that Dynamo records on every graph node
(Inductor carries it to the backward graph as ``fwd_nn_module_stack``):

* an instance: ``commfuse.exclude(module)`` gives that one object a marker subclass of its own class
  (same name, same behaviour, ``isinstance`` unchanged), so graphs traced from it carry the marker;
* a class: ``commfuse.backend(exclude=[MyAttention])`` skips matmuls inside any instance of it;
* a qualified-name pattern: ``commfuse.backend(exclude=["layers.0.*"])`` (``fnmatch`` syntax) skips
  matmuls inside modules whose name, relative to the compiled module, matches. Dynamo's path starts
  at a local or global of the compiled frame (``L['self']``, ``L['args'][0]`` where a decorator
  wraps ``forward``, as transformers does, ``G['model']`` in a compiled function): that root is
  dropped (``L['args']`` with its index), so names are relative to the module the frame reaches;
  a list of modules keeps its index (``L['mods'][1].mlp`` is ``1.mlp``). Names are the tree as the
  user wrote it: where a framework wraps a forward in a closure (torchtitan's redistributing
  wrapper), Dynamo reaches the inner modules through the closure
  (``attention.forward.__closure__.0.cell_contents.__self__.wo``), and where a wrapper module sits
  in the tree (``torch.compile``'s ``_orig_mod``, activation checkpointing's
  ``_checkpoint_wrapped_module``, FSDP1's ``_fsdp_wrapped_module``) its attribute is a segment of
  its own: both are dropped (``attention.wo``). A pattern written against the full spelling still
  matches.

A match is excluded when any module on its matmul's stack is, so excluding a block excludes
everything inside it. An excluded instance stays excluded when a library later swaps its class for
a subclass (FSDP2's ``fully_shard``, a parametrization): the marker is inherited.
"""

from __future__ import annotations

import difflib
import fnmatch
import re

import torch.nn as nn

_MARKER_ATTR = "_commfuse_excluded"
_markers: dict[type, type] = {}


def _rebuild(base: type) -> nn.Module:
    """Unpickling/deepcopy target: a fresh instance of ``base``'s marker class (state set later)."""
    marker = _marker_class(base)
    return marker.__new__(marker)


def _marker_reduce_ex(self: nn.Module, protocol: int):
    # Pickle and deepcopy through the real class (the marker is not importable by name).
    return (_rebuild, (type(self)._commfuse_base,), self.__getstate__())


def _marker_class(cls: type) -> type:
    marker = _markers.get(cls)
    if marker is None:
        marker = type(
            cls.__name__,
            (cls,),
            {
                _MARKER_ATTR: True,
                "_commfuse_base": cls,
                "__module__": cls.__module__,
                "__qualname__": cls.__qualname__,
                "__reduce_ex__": _marker_reduce_ex,
            },
        )
        _markers[cls] = marker
    return marker


def exclude(module: nn.Module) -> nn.Module:
    """Keep every matmul inside ``module`` (this instance only) unfused. Returns ``module``.

    Call it before the model is compiled; a compiled model recompiles on its next call.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"commfuse.exclude expects an nn.Module instance, got {type(module).__name__}")
    if not is_excluded_instance(module):
        module.__class__ = _marker_class(type(module))
    return module


def include(module: nn.Module) -> nn.Module:
    """Undo :func:`exclude` on ``module``. Returns ``module``."""
    if type(module).__dict__.get(_MARKER_ATTR, False):
        module.__class__ = type(module)._commfuse_base
    elif is_excluded_instance(module):
        raise TypeError(
            f"commfuse.include: this {type(module).__name__} was excluded before its class was swapped "
            "for a subclass (FSDP2's fully_shard, a parametrization): call include before that change")
    return module


def is_excluded_instance(module: nn.Module) -> bool:
    return _marked(type(module))


def _marked(cls: type) -> bool:
    """The marker class, or a class made from it later (FSDP2, parametrizations subclass it)."""
    return any(c.__dict__.get(_MARKER_ATTR, False) for c in cls.__mro__)


def any_instance_excluded() -> bool:
    """Whether ``exclude`` was ever used in this process (it changes what the pass does)."""
    return bool(_markers)


_ROOT = re.compile(r"^(?:L\[['\"]args['\"]\]\[\d+\]|[LG]\[['\"][^'\"]+['\"]\]|[LG]\.[A-Za-z_]\w*)\.?")
_INDEX = re.compile(r"\[['\"]?([^'\"\]]+)['\"]?\]")


#: Attributes that lead from a module to itself or to the module it wraps, not to a child: a bound
#: method's object, a decorated function's original, and the wrapper modules' inner attribute.
_WRAPPER_SEGMENTS = frozenset({"__self__", "__func__", "__wrapped__", "_orig_mod", "_checkpoint_wrapped_module",
                               "_fsdp_wrapped_module"})


def full_name(dynamo_path: str) -> str:
    """The path with its root and indexing syntax removed, every segment kept:
    ``"L['self'].layers[0]._modules['mlp']"`` -> ``"layers.0.mlp"``."""
    path = _ROOT.sub("", dynamo_path)
    path = _INDEX.sub(r".\1", path)
    path = path.replace("._modules.", ".").replace("_modules.", "")
    return path.strip(".")


def plain_name(name: str) -> str:
    """``full_name``'s result without closure and wrapper segments:
    ``"attention.forward.__closure__.0.cell_contents.__self__.wo"`` -> ``"attention.wo"``."""
    parts, out, i = name.split(".") if name else [], [], 0
    while i < len(parts):
        part = parts[i]
        if part == "__closure__":  # fn.__closure__[i].cell_contents: drop fn and the cell too
            if out and i > 0 and out[-1] == parts[i - 1]:
                out.pop()
            i += 2 + (i + 2 < len(parts) and parts[i + 2] == "cell_contents")
            continue
        if part not in _WRAPPER_SEGMENTS:
            out.append(part)
        i += 1
    return ".".join(out)


def qualified_name(dynamo_path: str) -> str:
    """``"L['self'].layers[0]._modules['mlp']"`` -> ``"layers.0.mlp"``; ``"L['args'][0].layers.1"``
    -> ``"layers.1"``; ``"G['model'].layers[1]"`` -> ``"layers.1"``;
    ``"L['self'].attention.forward.__closure__[0].cell_contents.__self__.wo"`` -> ``"attention.wo"``."""
    return plain_name(full_name(dynamo_path))


def module_stack(node) -> list[tuple[str, object]]:
    """``[(qualified name, module class), ...]`` outermost first, for a forward or backward node."""
    return [(plain_name(name), cls) for name, cls in _full_stack(node)]


def _full_stack(node) -> list[tuple[str, object]]:
    stack = node.meta.get("nn_module_stack") or node.meta.get("fwd_nn_module_stack") or {}
    return [(full_name(path), cls) for path, cls in stack.values()]


def _spellings(name: str) -> tuple[str, ...]:
    """The plain name first, then the full one where it differs (patterns may use either)."""
    plain = plain_name(name)
    return (plain,) if plain == name else (plain, name)


def _class_matches(cls: object, excluded: tuple[type, ...]) -> bool:
    if isinstance(cls, type):
        return issubclass(cls, excluded)
    # Some torch versions store the class as "module.QualName" text.
    return isinstance(cls, str) and cls in {f"{c.__module__}.{c.__qualname__}" for c in excluded}


def excluded_by(node, settings) -> str | None:
    """Why ``node`` is excluded (a sentence), or None if it may fuse."""
    for full, cls in _full_stack(node):
        name = plain_name(full)
        if isinstance(cls, type) and _marked(cls):
            return f"module {name or '<root>'} was opted out with commfuse.exclude()"
        if settings.exclude_classes and _class_matches(cls, settings.exclude_classes):
            shown = cls.__name__ if isinstance(cls, type) else cls
            return f"module {name or '<root>'} is a {shown}, an excluded class"
        for pattern in settings.exclude_names:
            if name and any(fnmatch.fnmatchcase(n, pattern) for n in _spellings(full)):
                return f"module {name} matches excluded name pattern {pattern!r}"
    return None


def unmatched_names(nodes, settings) -> list[tuple[str, list[str]]]:
    """The ``exclude`` name patterns of ``settings`` that match no module of any of ``nodes`` (a
    misspelt pattern, or one relative to another root, excludes nothing without a word), each
    with the module names closest to it."""
    if not settings.exclude_names:
        return []
    fulls = {full for node in nodes for full, _ in _full_stack(node) if full}
    names = sorted({plain_name(full) for full in fulls} - {""})
    spellings = {s for full in fulls for s in _spellings(full)}
    return [(pattern, difflib.get_close_matches(pattern, names, n=3, cutoff=0.5))
            for pattern in settings.exclude_names
            if not any(fnmatch.fnmatchcase(name, pattern) for name in spellings)]
