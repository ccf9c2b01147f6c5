"""The direct Triton launch (``kernels/launch.py``): a specialisation's first launch goes through
Triton, later ones through the compiled kernel with every argument in the kernel's order; a value
that Triton would specialise differently goes through Triton again. Fake kernels stand in for
Triton's objects (the real ones need a GPU: the GPU suite runs every kernel through this path)."""

from __future__ import annotations

import logging

import pytest
import torch

from commfuse.kernels import launch


class _Param:
    def __init__(self, name, default=None, has_default=False, is_constexpr=False, do_not_specialize=False):
        self.name, self.default, self.has_default = name, default, has_default
        self.is_constexpr, self.do_not_specialize = is_constexpr, do_not_specialize


class _Compiled:
    packed_metadata = object()

    def __init__(self, log):
        self.log = log

    def __getitem__(self, grid):
        def runner(*args, stream=None):
            self.log.append(("direct", grid, args, stream))
        return runner


class _Refuses(_Compiled):
    """A compiled kernel whose launcher refuses the arguments (before launching anything)."""

    def __getitem__(self, grid):
        def runner(*args, stream=None):
            raise TypeError("launcher takes 2 arguments")
        return runner


class _Kernel:
    """Parameters ``(x, n, FLAG: constexpr = 7)``; ``kernel[grid](...)`` records a Triton launch."""

    def __init__(self, returns=True, loose_n=False, names=("x", "n")):
        self.params = [_Param(names[0]), _Param(names[1], do_not_specialize=loose_n),
                       *[_Param(name) for name in names[2:]], _Param("FLAG", 7, True, True)]
        self.arg_names = [p.name for p in self.params]
        self.log = []
        self.compiled = _Compiled(self.log) if returns else None

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.log.append(("triton", grid, args, kwargs))
            return self.compiled
        return run


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    launch.clear()
    launch.configure(True)
    monkeypatch.setattr(launch, "_device", lambda: 0)
    monkeypatch.setattr(launch, "_raw_stream", lambda device: 1234)
    yield
    launch.clear()
    launch.configure(True)


def test_second_launch_goes_direct_with_all_arguments_in_order():
    k, x = _Kernel(), torch.zeros(4)
    launch.run(k, (3,), x, 32, num_warps=4)
    launch.run(k, (5,), x, 64, num_warps=4)
    assert k.log[0] == ("triton", (3,), (x, 32), {"num_warps": 4})
    kind, grid, args, stream = k.log[1]
    assert (kind, grid, stream) == ("direct", (5, 1, 1), 1234)
    assert args[0] is x and args[1:] == (64, 7)  # the constexpr's default filled in


@pytest.mark.parametrize("value", [1, 0, 33, 2 ** 40])
def test_a_new_specialisation_goes_through_triton(value):
    k, x = _Kernel(), torch.zeros(4)
    launch.run(k, (1,), x, 32)
    launch.run(k, (1,), x, value)
    assert [e[0] for e in k.log] == ["triton", "triton"]
    launch.run(k, (1,), x, value)
    assert k.log[-1][0] == "direct"


def test_constexprs_options_and_alignment_are_part_of_the_key():
    k, x = _Kernel(), torch.zeros(8)
    launch.run(k, (1,), x, 32, FLAG=7)
    launch.run(k, (1,), x, 32, FLAG=8)
    launch.run(k, (1,), x, 32, FLAG=7, num_warps=8)
    launch.run(k, (1,), x[1:], 32, FLAG=7)  # 4 bytes off 16-byte alignment
    assert [e[0] for e in k.log] == ["triton"] * 4
    launch.run(k, (1,), x, 32, FLAG=8)
    assert k.log[-1][0] == "direct" and k.log[-1][2][2] == 8


def test_turned_off_or_uncompiled_always_goes_through_triton():
    k = _Kernel(returns=False)  # the interpreter returns no compiled kernel
    for _ in range(3):
        launch.run(k, (1,), torch.zeros(4), 32)
    assert [e[0] for e in k.log] == ["triton"] * 3
    launch.configure(False)
    k = _Kernel()
    for _ in range(2):
        launch.run(k, (1,), torch.zeros(4), 32)
    assert [e[0] for e in k.log] == ["triton"] * 2


def test_the_fast_launch_setting_reaches_the_launcher():
    """``COMMFUSE_FAST_LAUNCH=0`` (read by the run-time, passed to ``launch.configure``) turns the
    direct path off, and back on when the setting goes."""
    from commfuse import env
    from commfuse.runtime import entry  # noqa: F401  (passes the setting on every change)

    with env.override(fast_launch="0"):
        assert not launch.enabled()
        k = _Kernel()
        for _ in range(2):
            launch.run(k, (1,), torch.zeros(4), 32)
        assert [e[0] for e in k.log] == ["triton"] * 2
    assert launch.enabled()


def test_a_launcher_that_rejects_the_arguments_turns_the_direct_path_off(caplog):
    k, x = _Kernel(), torch.zeros(4)

    k.compiled = _Refuses(k.log)
    launch.run(k, (1,), x, 32)
    with caplog.at_level(logging.WARNING, logger="commfuse.kernels.launch"):
        launch.run(k, (1,), x, 32)
    assert [e[0] for e in k.log] == ["triton", "triton"] and not launch.enabled()
    assert "directly failed" in caplog.text
    launch.run(k, (1,), x, 32)
    assert k.log[-1][0] == "triton"


def test_a_missing_argument_is_left_to_triton_to_report():
    k = _Kernel()
    launch.run(k, (1,), torch.zeros(4))  # n missing: Triton (here the fake) sees the call as is
    assert k.log == [("triton", (1,), (k.log[0][2][0],), {})]


@pytest.mark.parametrize("first, second", [
    (2 ** 63 - 16, 2 ** 63 + 16),  # i64 against u64, both divisible by 16
    (None, torch.zeros(4)),
    (True, False),  # bools by value
    (1.5, 3),
])
def test_argument_kinds_triton_tells_apart_are_told_apart(first, second):
    k, x = _Kernel(), torch.zeros(4)
    launch.run(k, (1,), x, first)
    launch.run(k, (1,), x, second)
    assert [e[0] for e in k.log] == ["triton", "triton"]
    launch.run(k, (1,), x, second)
    assert k.log[-1][0] == "direct"


def test_descriptors_keyed_by_shape_strides_block_and_alignment():
    from triton.tools.tensor_descriptor import TensorDescriptor

    k, x = _Kernel(), torch.zeros(64, 64)
    descs = [TensorDescriptor(x, [64, 64], [64, 1], [16, 16]),
             TensorDescriptor(x, [32, 64], [64, 1], [16, 16]),  # shape
             TensorDescriptor(x, [64, 64], [64, 1], [32, 16]),  # block
             TensorDescriptor(x[:, 4:], [64, 60], [64, 1], [16, 16])]  # base 16-byte aligned again
    for d in descs:
        launch.run(k, (1,), d, 32)
    assert [e[0] for e in k.log] == ["triton"] * 4
    launch.run(k, (1,), TensorDescriptor(torch.ones(64, 64), [64, 64], [64, 1], [16, 16]), 32)
    assert k.log[-1][0] == "direct"  # same key, another tensor


def test_launch_hooks_send_every_launch_through_triton(monkeypatch):
    """A hook runs after the launch: an error from it must not make ``run`` launch again."""
    hook = launch._KNOBS.runtime.launch_exit_hook
    k, x = _Kernel(), torch.zeros(4)
    launch.run(k, (1,), x, 32)
    if hasattr(hook, "calls"):
        monkeypatch.setattr(hook, "calls", [lambda *a: None])
    else:
        monkeypatch.setattr(launch._KNOBS.runtime, "launch_exit_hook", lambda *a: None)
    assert not launch.enabled()
    launch.run(k, (1,), x, 32)
    assert [e[0] for e in k.log] == ["triton", "triton"]


def test_a_changed_triton_debug_setting_compiles_anew(monkeypatch):
    k, x = _Kernel(), torch.zeros(4)
    launch.run(k, (1,), x, 32)
    launch.run(k, (1,), x, 32)
    assert k.log[-1][0] == "direct"
    monkeypatch.setattr(launch._KNOBS.runtime, "debug", True)
    launch.run(k, (1,), x, 32)
    assert k.log[-1][0] == "triton"


def test_each_direct_launch_goes_on_the_stream_current_then(monkeypatch):
    streams = iter([11, 22, 33])
    monkeypatch.setattr(launch, "_raw_stream", lambda device: next(streams))
    k, x = _Kernel(), torch.zeros(4)
    launch.run(k, (1,), x, 32)  # through Triton: no stream asked
    launch.run(k, (1,), x, 32)
    launch.run(k, (1,), x, 32)
    assert [e[3] for e in k.log[1:]] == [11, 22]


def test_a_bound_launch_goes_direct_with_its_changing_arguments_in_place():
    k, x, y = _Kernel(), torch.zeros(4), torch.ones(4)
    bound = launch.Bound(k, (2,), ("x", "n"), FLAG=9, num_warps=1)
    bound(x=x, n=32)
    before = launch.BOUND_DIRECT
    bound(x=y, n=64)
    assert launch.BOUND_DIRECT == before + 1
    assert k.log[0] == ("triton", (2,), (), {"FLAG": 9, "num_warps": 1, "x": x, "n": 32})
    kind, grid, args, stream = k.log[1]
    assert (kind, grid, stream) == ("direct", (2, 1, 1), 1234)
    assert args[0] is y and args[1:] == (64, 9)
    assert all(v is None for v in bound._direct[1][:2])  # no call's tensor is kept


@pytest.mark.parametrize("n, kind", [(1, "triton"), (33, "triton"), (2 ** 40, "triton"), (48, "direct")])
def test_a_bound_argument_that_specialises_otherwise_goes_through_run(n, kind):
    k, x = _Kernel(), torch.zeros(4)
    bound = launch.Bound(k, (1,), ("n",), x=x)
    bound(n=32)
    bound(n=n)
    assert k.log[-1][0] == kind and k.log[-1][2 if kind == "direct" else 3] == (
        (x, n, 7) if kind == "direct" else {"x": x, "n": n})


def test_a_bound_integer_triton_does_not_specialise_changes_only_with_its_width():
    k, x = _Kernel(loose_n=True), torch.zeros(4)
    bound = launch.Bound(k, (1,), ("n",), x=x)
    for n in (32, 1, 33, 0):  # Triton keeps only the width of a do_not_specialize integer
        bound(n=n)
    assert [e[0] for e in k.log] == ["triton", "direct", "direct", "direct"]
    bound(n=2 ** 40)  # i64: another signature
    assert k.log[-1][0] == "triton"


def test_a_bound_launch_takes_exactly_its_changing_arguments():
    k = _Kernel()
    bound = launch.Bound(k, (1,), ("x", "n"))
    with pytest.raises(TypeError, match="exactly"):
        bound(x=torch.zeros(4))
    assert k.log == []


def test_a_bound_launch_off_or_hooked_goes_through_triton(monkeypatch):
    k, x = _Kernel(), torch.zeros(4)
    bound = launch.Bound(k, (1,), ("n",), x=x)
    bound(n=32)
    launch.configure(False)
    bound(n=32)
    launch.configure(True)
    monkeypatch.setattr(launch, "_device", lambda: 1)  # another device: through run
    bound(n=32)
    assert [e[0] for e in k.log] == ["triton"] * 3
    bound(n=32)
    assert k.log[-1][0] == "direct"


@pytest.mark.parametrize("name", ["FLAG", "num_warps", "nothing"])
def test_only_runtime_arguments_of_the_kernel_may_change_between_bound_launches(name):
    """A constexpr or a launch option compiles another kernel: the kept one must never launch."""
    with pytest.raises(TypeError, match="cannot change"):
        launch.Bound(_Kernel(), (1,), ("n", name))


def test_a_bound_launch_whose_launcher_refuses_launches_once_through_triton(caplog):
    """The launcher refuses before launching anything: one launch through Triton, logged, and the
    direct path off."""
    k, x = _Kernel(), torch.zeros(4)

    k.compiled = _Refuses(k.log)
    bound = launch.Bound(k, (1,), ("n",), x=x)
    bound(n=32)
    with caplog.at_level(logging.WARNING, logger="commfuse.kernels.launch"):
        bound(n=32)
    assert [e[0] for e in k.log] == ["triton", "triton"] and not launch.enabled()
    assert "directly failed" in caplog.text


def test_a_bound_launch_with_a_launch_hook_goes_through_triton(monkeypatch):
    k, x = _Kernel(), torch.zeros(4)
    bound = launch.Bound(k, (1,), ("n",), x=x)
    bound(n=32)
    bound(n=32)
    hook = launch._KNOBS.runtime.launch_exit_hook
    if hasattr(hook, "calls"):
        monkeypatch.setattr(hook, "calls", [lambda *a: None])
    else:
        monkeypatch.setattr(launch._KNOBS.runtime, "launch_exit_hook", lambda *a: None)
    bound(n=32)
    assert [e[0] for e in k.log] == ["triton", "direct", "triton"]


# --- Launches with their descriptors already encoded (Triton 3.6's launcher layout) ----------------

class _Compiled36(_Compiled):
    """A compiled kernel laid out as Triton 3.6's: ``run.launch`` wraps the C launcher and encodes
    the descriptor arguments at every call (``encode``), as ``wrap_handle_tensordesc`` does."""

    function = 777

    def __init__(self, log, encode, indices=(0,), scratch=0, metas=True):
        super().__init__(log)
        launcher = lambda *args: log.append(("raw", args))  # noqa: E731 - the C launcher
        tensordesc_indices = set(indices)
        # (Triton's wrapper holds a None per descriptor that has no encoding metadata)
        tensordesc_meta = [{"swizzle": 3, "block_size": [16, 16]} if metas else None for _ in indices]

        def inner(*args):  # Triton's own wrapper: what the encoded launch must reproduce
            final = list(args[:launch.BASE_ARGS_36])
            n = 0
            for i, arg in enumerate(args[launch.BASE_ARGS_36:]):
                if i in tensordesc_indices:
                    final.extend(encode(arg, tensordesc_meta[n]))
                    n += 1
                else:
                    final.append(arg)
            return launcher(*final)

        self.run = type("CudaLauncher", (), {})()
        self.run.launch = inner
        self.metadata = type("Meta", (), dict(global_scratch_size=scratch, profile_scratch_size=0,
                                               launch_cooperative_grid=False, launch_pdl=True))()

    def triton_args(self, grid, values, stream):
        """What Triton 3.6's ``CudaLauncher.__call__`` hands its C launcher for this launch."""
        before = len(self.log)
        self.run.launch(*grid, stream, self.function, False, True, None, None, self.packed_metadata, None, None,
                        None, *values)
        return list(self.log.pop(before)[1])


class _Encoder:
    def __init__(self):
        self.calls = 0

    def __call__(self, desc, meta):
        self.calls += 1
        return [("tensormap", desc.base.data_ptr(), tuple(desc.shape), meta["swizzle"]), *desc.shape, *desc.strides]


def _kernel36(monkeypatch, version="3.6.0", base_args=launch.BASE_ARGS_36, names=("x", "n"), **kw):
    k, enc = _Kernel(names=names), _Encoder()
    k.compiled = _Compiled36(k.log, enc, **kw)
    monkeypatch.setattr(launch, "_triton_version", lambda: version)
    monkeypatch.setattr(launch, "_base_args_len", lambda: base_args)
    monkeypatch.setattr(launch, "_encoder", lambda: enc)
    return k, enc


def _desc(x, shape=(64, 64)):
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor(x, list(shape), [64, 1], [16, 16])


def test_an_encoded_launch_hands_the_c_launcher_what_tritons_wrapper_would(monkeypatch):
    k, enc = _kernel36(monkeypatch)
    x = torch.zeros(64, 64)
    launch.run(k, (3,), _desc(x), 32)
    before = launch.ENCODED_LAUNCHES
    launch.run(k, (3,), _desc(x), 48)
    assert launch.ENCODED_LAUNCHES == before + 1
    kind, args = k.log[-1]
    assert kind == "raw"
    assert list(args) == k.compiled.triton_args((3, 1, 1), (_desc(x), 48, 7), 1234)


def test_an_encoding_is_kept_per_address_shape_and_made_again_when_they_change(monkeypatch):
    k, enc = _kernel36(monkeypatch)
    x, y = torch.zeros(64, 64), torch.ones(64, 64)
    launch.run(k, (1,), _desc(x), 32)  # through Triton
    for _ in range(3):
        launch.run(k, (1,), _desc(x), 32)
    assert enc.calls == 1
    launch.run(k, (1,), _desc(y), 32)  # another address: encoded anew, and the launch says so
    assert enc.calls == 2 and k.log[-1][1][13][1] == y.data_ptr()
    launch.run(k, (1,), _desc(x, (32, 64)), 32)  # a new shape specialises anew (Triton), then encodes
    launch.run(k, (1,), _desc(x, (32, 64)), 32)
    assert enc.calls == 3 and k.log[-1][1][13][2] == (32, 64)


def test_a_bound_launch_goes_through_the_encoded_launch(monkeypatch):
    k, enc = _kernel36(monkeypatch)
    x = torch.zeros(64, 64)
    bound = launch.Bound(k, (2,), ("x", "n"), FLAG=9)
    bound(x=_desc(x), n=32)
    bound(x=_desc(x), n=64)
    bound(x=_desc(x), n=80)
    assert [e[0] for e in k.log] == ["triton", "raw", "raw"] and enc.calls == 1
    assert list(k.log[-1][1]) == k.compiled.triton_args((2, 1, 1), (_desc(x), 80, 9), 1234)


@pytest.mark.parametrize("why", ["another Triton", "another launcher format", "scratch memory",
                                 "no encoding metadata", "switched off", "unreadable metadata"])
def test_a_launch_the_encoded_form_does_not_know_goes_through_the_compiled_kernel(monkeypatch, why):
    kw = {"scratch memory": {"scratch": 128}, "no encoding metadata": {"metas": False},
          "another launcher format": {"base_args": 14}}.get(why, {})
    k, enc = _kernel36(monkeypatch, version="3.9.0" if why == "another Triton" else "3.6.0", **kw)
    if why == "unreadable metadata":  # an error reading Triton's objects is no error of the launch
        del type(k.compiled.metadata).launch_pdl
    if why == "switched off":
        launch.configure_encoded(False)
    try:
        x = torch.zeros(64, 64)
        launch.run(k, (1,), _desc(x), 32)
        launch.run(k, (1,), _desc(x), 32)
        assert [e[0] for e in k.log] == ["triton", "direct"] and enc.calls == 0
    finally:
        launch.configure_encoded(True)


def test_a_bound_launch_kept_before_encoding_was_switched_off_launches_plainly(monkeypatch):
    k, enc = _kernel36(monkeypatch)
    x = torch.zeros(64, 64)
    bound = launch.Bound(k, (2,), ("x", "n"), FLAG=9)
    bound(x=_desc(x), n=32)
    bound(x=_desc(x), n=48)
    launch.configure_encoded(False)
    try:
        bound(x=_desc(x), n=64)
    finally:
        launch.configure_encoded(True)
    assert [e[0] for e in k.log] == ["triton", "raw", "direct"]
    bound(x=_desc(x), n=80)
    assert k.log[-1][0] == "raw"


def test_launch_hooks_take_the_launch_back_from_the_encoded_form(monkeypatch):
    k, enc = _kernel36(monkeypatch)
    x = torch.zeros(64, 64)
    launch.run(k, (1,), _desc(x), 32)
    monkeypatch.setattr(launch, "_hooked", lambda: True)
    launch.run(k, (1,), _desc(x), 32)
    assert [e[0] for e in k.log] == ["triton", "triton"]


def test_an_encoded_launch_of_several_descriptors_keeps_every_argument_in_place(monkeypatch):
    """Descriptors first, between and last among the kernel's arguments (the fused kernels take
    two or three): each is expanded into its encoding where it stands, the others pass in order,
    as Triton's own wrapper hands them to its C launcher."""
    k, enc = _kernel36(monkeypatch, indices=(0, 2, 4), names=("a", "m", "b", "n", "c"))
    x, y, z = torch.zeros(64, 64), torch.ones(64, 64), torch.full((64, 64), 2.0)
    launch.run(k, (3,), _desc(x), 5, _desc(y), 6, _desc(z))  # through Triton
    launch.run(k, (3,), _desc(x), 5, _desc(y), 6, _desc(z))
    assert k.log[-1][0] == "raw" and enc.calls == 3  # each descriptor encoded once
    assert list(k.log[-1][1]) == k.compiled.triton_args((3, 1, 1), (_desc(x), 5, _desc(y), 6, _desc(z), 7), 1234)
