"""Launch a Triton kernel with less host work once Triton has launched the same specialisation.

``kernel[grid](...)`` binds every argument, builds a cache key from their specialisation, checks
the kernel's globals and only then launches: tens of µs of host per launch, paid several times
per collective call (the copy-engine overlap launches a barrier per chunk). A training step
measured host-bound on these calls (``benchmarks/results/h200x2/explore/diag_skew_ea260fa.log``).
After the first launch through Triton, this keeps the compiled kernel under a key at least as fine
as Triton's specialisation (integers equal to 0 or 1 or divisible by 16, their width, pointer
alignment, descriptor shapes) and launches it directly. ``COMMFUSE_FAST_LAUNCH=0`` turns it off.

Host-bound loops of one call could not see the saving (it was dropped once for that); inside the
DTensor model, where the host's caches are cold, the fused call's host time fell from ~490 to
~300 us in prefill and the steps got 0.04-0.26 ms faster than with it off in the same rounds
(``model/model_calls*_353b127``, ``NOTES.md`` §30).
"""

from __future__ import annotations

import logging
import os

import torch

try:
    from triton import knobs as _KNOBS
except ImportError:  # a Triton without knobs: no hooks or global options to honour
    _KNOBS = None

log = logging.getLogger(__name__)

#: Bound on remembered specialisations (shapes enter the key through descriptors); cleared when full.
MAX_ENTRIES = 4096

_compiled: dict[tuple, object] = {}
_signatures: dict[object, tuple] = {}
_disabled: list[str] = []  # the reason, once the direct launch failed to bind


def enabled() -> bool:
    return not _disabled and os.environ.get("COMMFUSE_FAST_LAUNCH", "1") != "0" and not _hooked()


def _hooked() -> bool:
    """Launch hooks are set (a profiler such as proton): such a hook runs after the kernel is
    launched, so an error it raises must not be taken for a launcher refusing the arguments
    (``run`` would launch the collective kernel a second time on this rank alone); every launch
    then goes through Triton."""
    runtime = getattr(_KNOBS, "runtime", None)
    for name in ("launch_enter_hook", "launch_exit_hook"):
        hook = getattr(runtime, name, None)
        if hook is not None and (not hasattr(hook, "calls") or hook.calls):
            return True
    return False


def _global_options() -> tuple:
    """Triton options read from its global settings at each launch (not from the call): part of
    the key, so a changed setting compiles anew instead of reusing a stale kernel."""
    runtime, compilation = getattr(_KNOBS, "runtime", None), getattr(_KNOBS, "compilation", None)
    return (getattr(runtime, "debug", None), getattr(compilation, "instrumentation_mode", None),
            getattr(compilation, "fpsan_homomorphic_casts", None))


def _spec(v):
    """What of a runtime argument ``v`` Triton may specialise on, or more."""
    t = type(v)
    if t is int:
        kind = "one" if v == 1 else "zero" if v == 0 else "d16" if v % 16 == 0 else "int"
        return (kind, -(2 ** 31) <= v < 2 ** 31, v >= 2 ** 63)  # i32, i64, u64
    if isinstance(v, torch.Tensor):
        return (v.dtype, v.data_ptr() % 16 == 0)
    if t.__name__ == "TensorDescriptor":
        base = v.base
        return (base.dtype, base.data_ptr() % 16 == 0, tuple(v.shape), tuple(v.strides),
                tuple(v.block_shape), getattr(v, "padding", None))
    if t is float:
        return t
    return (t, v)  # bool, None, str: by value


def _signature(kernel) -> tuple | None:
    """(parameter names, their defaults, the names' set, which are constexpr: keyed by value) in
    the kernel's order; None under Triton's CPU interpreter (nothing compiled) or a Triton that
    does not say which parameters are constexpr."""
    if kernel not in _signatures:
        params = getattr(kernel, "params", None)
        names = getattr(kernel, "arg_names", None)
        if (params is None or names is None or type(kernel).__name__ == "InterpretedFunction"
                or not all(hasattr(p, "is_constexpr") for p in params)):
            _signatures[kernel] = None
        else:
            defaults = tuple(p.default if p.has_default else _MISSING for p in params)
            constexpr = tuple(bool(p.is_constexpr) for p in params)
            _signatures[kernel] = (tuple(names), defaults, frozenset(names), constexpr)
    return _signatures[kernel]


_MISSING = object()


def _bind(signature, args, kwargs) -> list | None:
    names, defaults = signature[0], signature[1]
    values = list(args) + [kwargs.get(name, default) for name, default in
                           zip(names[len(args):], defaults[len(args):])]
    return None if any(v is _MISSING for v in values) else values


def run(kernel, grid: tuple, *args, **kwargs) -> None:
    """``kernel[grid](*args, **kwargs)``; from the second launch of a specialisation on, through
    the compiled kernel directly."""
    signature = _signature(kernel) if enabled() else None
    if signature is None:
        kernel[grid](*args, **kwargs)
        return
    values = _bind(signature, args, kwargs)
    if values is None:
        kernel[grid](*args, **kwargs)
        return
    device = _device()
    options = tuple(sorted((k, v) for k, v in kwargs.items() if k not in signature[2]))
    key = (kernel, device, options, _global_options(),
           tuple((type(v), v) if c else _spec(v) for v, c in zip(values, signature[3])))
    compiled = _compiled.get(key)
    if compiled is None:
        compiled = kernel[grid](*args, **kwargs)
        if len(_compiled) >= MAX_ENTRIES:
            _compiled.clear()
        # the interpreter returns no compiled kernel: keep launching through Triton then
        _compiled[key] = compiled if hasattr(compiled, "packed_metadata") else False
        return
    if compiled is False:
        kernel[grid](*args, **kwargs)
        return
    grid3 = (grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1)
    try:  # argument parsing fails before anything launches
        compiled[grid3](*values, stream=_raw_stream(device))
    except TypeError as exc:  # a Triton whose compiled kernels cannot launch this way
        _give_up(exc)
        kernel[grid](*args, **kwargs)


def _device() -> int:
    return torch.cuda.current_device()


def _raw_stream(device: int) -> int:
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    return raw(device) if raw is not None else torch.cuda.current_stream(device).cuda_stream


def _give_up(exc: BaseException) -> None:
    _disabled.append(f"{type(exc).__name__}: {exc}")
    log.warning("commfuse: launching Triton kernels directly failed (%s); using Triton's launch "
                "path from now on", _disabled[0])


def clear() -> None:
    """Forget the compiled kernels (tests)."""
    _compiled.clear()
    _disabled.clear()
