"""Launch a Triton kernel with less host work once Triton has launched the same specialisation.

``kernel[grid](...)`` binds every argument, builds a cache key from their specialisation, checks
the kernel's globals and only then launches: host work per launch comparable to a small
exchange's whole GPU time, paid several times per collective call (the copy-engine overlap
launches a barrier per chunk), and a model step whose host is the limit waits for it.
After the first launch through Triton, this keeps the compiled kernel under a key at least as fine
as Triton's specialisation (integers equal to 0 or 1 or divisible by 16, their width, pointer
alignment, descriptor shapes) and launches it directly (``configure(False)`` turns it off; the
run-time passes ``COMMFUSE_FAST_LAUNCH``).

The saving shows inside a model, where the host's caches are cold between calls; a loop of one
call, whose caches stay warm, hides it. ``Bound`` goes further for launches repeated from one call
site (a barrier per copy-engine chunk, the fused kernels once per call): only the arguments that
change are checked and put in place.
"""

from __future__ import annotations

import logging

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
_switched_on = True  # ``configure``: the run-time's setting (``COMMFUSE_FAST_LAUNCH``)


def configure(fast: bool) -> None:
    """Whether launches may go direct (the run-time passes its setting)."""
    global _switched_on
    _switched_on = bool(fast)


def enabled() -> bool:
    return _switched_on and not _disabled and not _hooked()


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


#: The attribute a descriptor made from a kept layout carries (``tiles.descriptor_operands``): its
#: (shape, strides, block, padding) as tuples, what a descriptor's key holds besides its base.
LAYOUT_ATTR = "_commfuse_layout"


def descriptor_layout(desc) -> tuple:
    """A descriptor's (shape, strides, block, padding) as tuples: its kept ones, or made now."""
    kept = getattr(desc, LAYOUT_ATTR, None)
    if kept is not None:
        return kept
    return tuple(desc.shape), tuple(desc.strides), tuple(desc.block_shape), getattr(desc, "padding", None)


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
        return (base.dtype, base.data_ptr() % 16 == 0, *descriptor_layout(v))
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
    _launch(kernel, grid, args, kwargs)


def _launch(kernel, grid: tuple, args: tuple, kwargs: dict):
    """``run``; returns (the compiled kernel, every argument in the kernel's order, the key, the
    device) where later launches of it may go direct, else None."""
    signature = _signature(kernel) if enabled() else None
    if signature is None:
        kernel[grid](*args, **kwargs)
        return None
    values = _bind(signature, args, kwargs)
    if values is None:
        kernel[grid](*args, **kwargs)
        return None
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
        return (compiled, values, key, device) if _compiled[key] is not False else None
    if compiled is False:
        kernel[grid](*args, **kwargs)
        return None
    try:  # argument parsing fails before anything launches
        launcher_of(compiled, _grid3(grid))(*values, stream=_raw_stream(device))
    except TypeError as exc:  # a Triton whose compiled kernels cannot launch this way
        _give_up(exc)
        kernel[grid](*args, **kwargs)
        return None
    return compiled, values, key, device


def _width(v):
    """What Triton keeps of an integer it does not specialise on (``do_not_specialize``): its
    width (``_spec`` without the value's kind); anything else as ``_spec``."""
    spec = _spec(v)
    return ("int",) + spec[1:] if type(v) is int else spec


def _unspecialised(kernel) -> list[bool]:
    """Per parameter: Triton does not specialise its value (``do_not_specialize``)."""
    return [bool(getattr(p, "do_not_specialize", False)) for p in kernel.params]


def _grid3(grid: tuple) -> tuple:
    return (grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1)


#: Launches ``Bound`` sent straight to a compiled kernel since import (tests check it did).
BOUND_DIRECT = 0


class Bound:
    """Repeated launches of one kernel on one grid where only the arguments named ``changing``
    change between launches (a new epoch, a chunk's flag slot, the call's operands): each call
    passes exactly those, by keyword; the others are fixed here. Once a launch went direct, a
    later one whose changing arguments each specialise as before (and whose device and Triton
    settings are unchanged) puts them into the kept argument list and calls the compiled
    kernel's launcher itself, without ``run``'s binding and key (the copy-engine overlaps launch
    a barrier per chunk, the fused kernels one per call); any other goes through ``run``. The
    changing arguments are not kept (no tensor of a call outlives it here)."""

    def __init__(self, kernel, grid: tuple, changing: tuple[str, ...], **fixed):
        signature = _signature(kernel)
        if signature is not None:  # a compile-time value or a launch option changes the kernel itself
            wrong = [n for n in changing if n not in signature[2] or signature[3][signature[0].index(n)]]
            if wrong:
                raise TypeError(f"commfuse: {wrong} of {getattr(kernel, '__name__', kernel)} cannot change "
                                "between bound launches (constexprs and launch options are fixed)")
        self.kernel, self.grid, self.changing, self.fixed = kernel, grid, frozenset(changing), fixed
        # (runner, every argument with the changing ones left None, [(name, index, specialisation,
        # whether Triton leaves it unspecialised)], device, Triton settings)
        self._direct = None

    def __call__(self, **changes) -> None:
        if changes.keys() != self.changing:
            raise TypeError(f"commfuse: a bound launch of {getattr(self.kernel, '__name__', self.kernel)} takes "
                            f"exactly {sorted(self.changing)}, got {sorted(changes)}")
        direct = self._direct
        if direct is not None and enabled():
            runner, template, slots, device, settings = direct
            values = list(template)
            for name, i, spec, loose in slots:
                value = changes[name]
                if (_width(value) if loose else _spec(value)) != spec:
                    break
                values[i] = value
            else:
                if _device() == device and _global_options() == settings:
                    try:
                        runner(*values, stream=_raw_stream(device))
                    except TypeError as exc:  # as in ``run``: nothing launched
                        _give_up(exc)
                    else:
                        global BOUND_DIRECT
                        BOUND_DIRECT += 1
                        return
        self._direct = None
        done = _launch(self.kernel, self.grid, (), {**self.fixed, **changes})
        if done is not None:
            try:  # the kernel is in flight: nothing here may raise into the caller's exchange
                compiled, values, key, device = done
                names = _signatures[self.kernel][0]
                loose = _unspecialised(self.kernel)
                slots = [(name, i, _width(values[i]) if loose[i] else _spec(values[i]), loose[i])
                         for i, name in enumerate(names) if name in self.changing]
                template = [None if name in self.changing else v for name, v in zip(names, values)]
                self._direct = (launcher_of(compiled, _grid3(self.grid)), template, slots, device, key[3])
            except Exception as exc:  # noqa: BLE001 - the next call binds again through ``run``
                log.debug("commfuse: could not keep a launch of %s (%s)", self.kernel, exc)


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
    """Forget the compiled kernels (tests); a ``Bound`` keeps its own until it next binds."""
    _compiled.clear()
    _disabled.clear()
    _encoded.clear()
    _layouts.clear()
    _launchers.clear()


# --- Launches with their TMA descriptors already encoded -------------------------------------------
#
# Triton's launcher encodes every TMA descriptor argument again at each launch (``make_tensordesc_arg``:
# a ``cuTensorMapEncodeTiled`` through Python) before calling its C launcher. A descriptor depends only
# on its tensor's address, shape, strides, block and dtype, and the symmetric buffers' and weights'
# addresses do not move, so ``launcher_of`` keeps each encoding under those and calls the C launcher with
# the expanded arguments itself. This reaches into Triton's launcher, whose layout differs between
# versions: only a layout checked on a GPU is used (``ENCODED_LAYOUTS``); any other kernel, or one that
# needs scratch memory, launch hooks or the descriptors' other form, launches through the compiled
# kernel as before.

#: Triton versions whose launcher layout the encoded launch was checked against on a GPU.
ENCODED_LAYOUTS = ("3.6.",)
#: Encodings kept (activations come at many addresses); all dropped when full.
MAX_ENCODED = 4096
#: The arguments that come before a kernel's own in Triton 3.6's C launcher (``_BASE_ARGS_FORMAT``).
BASE_ARGS_36 = 13

_encoded: dict[tuple, list] = {}
_layouts: dict[object, object] = {}  # compiled kernel -> its _Layout, or False
_launchers: dict[tuple, object] = {}  # (compiled kernel, grid) -> its encoded launch
_switched_encoded = True  # ``configure``'s second setting
#: Launches that went through the C launcher with kept encodings since import (tests check it did).
ENCODED_LAUNCHES = 0


def configure_encoded(on: bool) -> None:
    """Whether direct launches may use kept descriptor encodings (on by default; benchmarks time
    both in one process; ``configure(False)`` turns direct launches off altogether)."""
    global _switched_encoded
    _switched_encoded = bool(on)
    _encoded.clear()


def _triton_version() -> str:
    import triton

    return triton.__version__


class _Layout:
    """What a compiled kernel's encoded launch needs: its C launcher, which parameters are
    descriptors (and their encoding metadata), and the launch's fixed base arguments."""

    __slots__ = ("raw", "descs", "meta_keys", "base_tail", "function", "encode")

    def __init__(self, raw, descs: dict, compiled, encode):
        md = compiled.metadata
        self.raw, self.descs, self.encode = raw, descs, encode
        # an encoding depends on the metadata's values (swizzle, element type, block), not on which
        # kernel asked: kernels alike there share it
        self.meta_keys = {i: repr(sorted(m.items())) for i, m in descs.items()}
        self.function = compiled.function
        # cooperative grid, programmatic dependent launch, global and profile scratch (none), the
        # packed metadata, launch metadata and enter / exit hooks (none)
        self.base_tail = (md.launch_cooperative_grid, md.launch_pdl, None, None, compiled.packed_metadata,
                          None, None, None)


def _layout_of(compiled):
    """The compiled kernel's ``_Layout``, or None where its launch must go through Triton."""
    layout = _layouts.get(compiled)
    if layout is None:
        if len(_layouts) >= MAX_ENTRIES:
            _layouts.clear()
        layout = _layouts[compiled] = _make_layout(compiled) or False
    return layout or None


def _base_args_len() -> int | None:
    """How many arguments Triton's C launcher takes before the kernel's own (3.6's
    ``_BASE_ARGS_FORMAT``), or None where the driver does not say."""
    try:
        from triton.backends.nvidia import driver
    except ImportError:
        return None
    return getattr(driver, "_BASE_ARGS_FORMAT_LEN", None)


def _encoder():
    """Triton's encoding of a descriptor argument: ``(descriptor, metadata) -> its arguments``."""
    from triton.backends.nvidia.driver import make_tensordesc_arg

    return make_tensordesc_arg


def _make_layout(compiled):
    """The kernel's ``_Layout``, or None; anything unexpected in Triton's objects means None (a
    launch through the compiled kernel), never an error on the launch's way."""
    try:
        return _read_layout(compiled)
    except Exception as exc:  # noqa: BLE001 - an unknown layout launches as before
        log.debug("commfuse: no encoded launch for %s (%s)", compiled, exc)
        return None


def _read_layout(compiled):
    if not _triton_version().startswith(ENCODED_LAYOUTS) or _base_args_len() != BASE_ARGS_36:
        return None
    run = getattr(compiled, "run", None)
    inner = getattr(run, "launch", None)
    md = getattr(compiled, "metadata", None)
    if (type(run).__name__ != "CudaLauncher" or inner is None or md is None
            or getattr(inner, "__closure__", None) is None):
        return None  # another backend, no descriptor argument (the C launcher itself) or an unknown layout
    if getattr(md, "global_scratch_size", 1) or getattr(md, "profile_scratch_size", 1):
        return None
    try:
        cells = {name: cell.cell_contents for name, cell in zip(inner.__code__.co_freevars, inner.__closure__)}
    except ValueError:  # a variable not yet bound: not the wrapper this knows
        return None
    raw = cells.get("launcher")
    indices = cells.get("tensordesc_indices")
    meta = cells.get("tensordesc_meta")
    if raw is None or indices is None or meta is None or any(m is None for m in meta):
        return None  # descriptors without encoding metadata pass their tensor: nothing to keep
    descs = {i: meta[n] for n, i in enumerate(sorted(indices))}
    return _Layout(raw, descs, compiled, _encoder())


def _encode(layout: _Layout, index: int, desc) -> list:
    base = desc.base
    key = (base.data_ptr(), base.dtype, descriptor_layout(desc), layout.meta_keys[index])
    got = _encoded.get(key)
    if got is None:
        if len(_encoded) >= MAX_ENCODED:
            _encoded.clear()
        got = _encoded[key] = layout.encode(desc, layout.descs[index])
    return got


def launcher_of(compiled, grid3: tuple):
    """``compiled[grid3]``: a launch of the compiled kernel, ``fn(*values, stream=raw)``; through
    the C launcher with kept descriptor encodings where the layout allows (``_Layout``)."""
    key = (compiled, grid3)
    kept = _launchers.get(key)
    if kept is not None:
        return kept
    layout = _layout_of(compiled) if _switched_encoded else None
    if layout is None:
        return compiled[grid3]
    raw, tail, function = layout.raw, layout.base_tail, layout.function
    at = sorted(layout.descs)  # the descriptors' positions: the arguments between them pass as they are
    plain = compiled[grid3]

    def launch(*values, stream):
        global ENCODED_LAUNCHES
        if not _switched_encoded:  # switched off since this was made (a ``Bound`` keeps it)
            plain(*values, stream=stream)
            return
        args = [*grid3, stream, function, *tail]
        start = 0
        for i in at:
            args += values[start:i]
            args += _encode(layout, i, values[i])
            start = i + 1
        args += values[start:]
        raw(*args)
        ENCODED_LAUNCHES += 1

    if len(_launchers) >= MAX_ENTRIES:
        _launchers.clear()
    _launchers[key] = launch
    return launch
