"""The tile kernels' GEMM, the fused all-reduce kernel's tile order, and every fused kernel (all-
reduce, reduce-scatter, all-gather, split-K) and the exchange kernels as one rank with its peers
simulated, in Triton's CPU interpreter (fp16: the interpreter mishandles bf16).
The cross-GPU parts run in tests/gpu."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


#: script -> what it checks: each runs in a fresh interpreter process with TRITON_INTERPRET=1
INTERPRETED = {
    "interpreted_tiles.py": "the tile GEMM (bf16, and FP8 with _scaled_mm's scales) and the fused all-reduce's tile order",
    "interpreted_split_k.py": "the split-K kernel's slices, sums, pushes, flags, counters, ticket "
                              "and (graph lane) device epochs",
    "interpreted_fused.py": "the fused all-reduce (both forms: slabs, slots, pushes, ready/done "
                            "flags, reducers, inline copies waiting for late peers, TMA pushes) and the fused "
                            "all-gather (chunk pushes and flags)",
    "interpreted_inline_order.py": "the fused all-reduce's inline-copy order (the kernel's own "
                                   "function) and an exhaustive model of its waits: never stuck, "
                                   "stuck without a copy's release before its wait",
    "interpreted_exchange.py": "one-shot, two-shot (both phases), the pull gather, the "
                               "reduce-scatter, the graph lane's staged one-shot, the one-shot "
                               "and barrier reading their epoch on the device, and NaN (not stale "
                               "bytes) where a late peer's data would go",
    "interpreted_norm_epilogue.py": "the all-reduce + add + RMSNorm kernels (one-shot, the graph lane's "
                                    "staged form): h and n against fp32 and the unfused chain's "
                                    "rounding (both forms), odd hidden sizes, NaN for a late peer",
}


#: Scripts that take more than ~20 s of CPU (the fused kernels' cases run every program of every
#: position one after another): marked slow
SLOW = {"interpreted_fused.py", "interpreted_norm_epilogue.py", "interpreted_inline_order.py", "interpreted_exchange.py",
        "interpreted_split_k.py"}


@pytest.mark.parametrize("script", [pytest.param(s, marks=pytest.mark.slow) if s in SLOW else s
                                    for s in sorted(INTERPRETED)])
def test_kernels_in_the_interpreter(script):
    """Each script checks its kernels on the CPU; all but the first as one rank of 2, 4 and 8
    with the other ranks' pushes and flags simulated (see each script's docstring)."""
    pytest.importorskip("triton.tools.tensor_descriptor")
    if script != "interpreted_tiles.py":
        pytest.importorskip("iris")
    root = os.path.dirname(HERE)
    # the script's own directory leads its sys.path, not the working directory: without the
    # checkout's root first, ``import commfuse`` finds whatever copy is installed
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=path)
    run = subprocess.run([sys.executable, os.path.join(HERE, script)], env=env,
                         capture_output=True, text=True, timeout=600, cwd=root)
    assert run.returncode == 0 and "ok" in run.stdout, run.stdout[-3000:] + run.stderr[-3000:]


@pytest.mark.parametrize("form", ["single_row_transposed", "odd_offset_view", "transposed", "expanded", "dense"])
def test_descriptors_accept_every_activation_layout(form):
    """TMA wants 16-byte aligned rows and base: a one-row transposed view (torch gives its row
    stride as 1), a view at an odd offset or an expanded row (stride 0) must be copied densely,
    never described as is."""
    pytest.importorskip("triton.tools.tensor_descriptor")
    import torch

    from commfuse.kernels import tiles

    k, n = 64, 32
    a = {"single_row_transposed": torch.randn(k, 1, dtype=torch.float16).t(),
         "odd_offset_view": torch.randn(5 * k + 3, dtype=torch.float16)[3:].view(5, k),
         "transposed": torch.randn(k, 7, dtype=torch.float16).t(),
         "expanded": torch.randn(1, k, dtype=torch.float16).expand(4, k),  # row stride 0
         "dense": torch.randn(6, k, dtype=torch.float16)}[form]
    w = torch.randn(n, k, dtype=torch.float16)
    cfg = tiles.TileConfig(bm=16, bn=16, bk=16)
    for b, transposed in ((w.t(), True), (w.t().contiguous(), False)):
        a_desc, b_desc, b_t = tiles.descriptor_operands(a, b, cfg)
        assert b_t is transposed
        assert a_desc.strides == [k, 1] and a_desc.base.data_ptr() % 16 == 0
        assert torch.equal(a_desc.base, a)  # the same values, wherever they now live
        assert b_desc.strides == ([k, 1] if transposed else [n, 1])


def _described(desc) -> tuple:
    """What a descriptor says to the kernel and to the launch's keys: its base (address, dtype,
    shape, strides), its own shape, strides, block and padding."""
    base = desc.base
    return (base.data_ptr(), base.dtype, tuple(base.shape), base.stride(), list(desc.shape), list(desc.strides),
            list(desc.block_shape), desc.padding)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_descriptors_from_kept_layouts_are_those_made_afresh(dtype):
    """``descriptor_operands`` keeps each operand layout it checked once: later operands of that
    layout, at other addresses, get descriptors made from the kept fields. They must say what a
    descriptor made afresh says (to the kernel, and to the launch's keys: ``launch._spec``,
    ``launch.descriptor_layout``), and an operand of a kept layout whose base is not 16-byte aligned must
    still be copied, as a layout that needs a copy is never kept."""
    pytest.importorskip("triton.tools.tensor_descriptor")
    import torch

    from commfuse.kernels import launch, tiles

    dt = getattr(torch, dtype)
    cfg = tiles.TileConfig(bm=16, bn=32, bk=16)
    k, n = 64, 96
    tiles._LAYOUTS.clear()

    def fresh(a, b):
        tiles._LAYOUTS.clear()
        made = tiles.descriptor_operands(a, b, cfg)
        tiles._LAYOUTS.clear()
        return made

    layouts = [lambda m: (torch.randn(m, k, dtype=dt), torch.randn(n, k, dtype=dt).t()),  # nn.Linear's weight
               lambda m: (torch.randn(m, k, dtype=dt), torch.randn(k, n, dtype=dt)),  # a dense weight
               lambda m: (torch.randn(m, 2 * k, dtype=dt)[:, :k], torch.randn(n, k, dtype=dt).t())]  # strided rows
    for make in layouts:
        for m in (1, 5):
            first = make(m)
            tiles.descriptor_operands(*first, cfg)  # the layout is kept from here
            assert tiles._LAYOUTS
            for _ in range(3):
                a, b = make(m)  # the same layout at other addresses
                got = tiles.descriptor_operands(a, b, cfg)
                want = fresh(a, b)
                tiles.descriptor_operands(*first, cfg)
                assert got[2] is want[2]
                for g, w in zip(got[:2], want[:2]):
                    assert _described(g) == _described(w)
                    assert launch._spec(g) == launch._spec(w) and launch.descriptor_layout(g) == launch.descriptor_layout(w)
                assert got[0].base is a  # no copy: the operand itself
            # the same layout, but at an address no TMA descriptor takes: copied, never described as is
            storage = torch.randn(m * k + 1, dtype=dt)
            odd = storage[1:].view(m, k)
            if make is layouts[2]:
                continue
            got = tiles.descriptor_operands(odd, first[1], cfg)
            assert got[0].base.data_ptr() % 16 == 0 and got[0].base.data_ptr() != odd.data_ptr()
            assert torch.equal(got[0].base, odd)
    # a layout that needs a copy (an expanded row) is copied at every call, and not kept
    tiles._LAYOUTS.clear()
    row = torch.randn(1, k, dtype=dt).expand(4, k)
    w = torch.randn(n, k, dtype=dt).t()
    bases = {tiles.descriptor_operands(row, w, cfg)[0].base.data_ptr() for _ in range(2)}
    assert row.data_ptr() not in bases
    assert all(key[0] != "a" for key in tiles._LAYOUTS)


class _Fits(dict):
    """Every configuration fits once per SM (no GPU to ask): ``fused_all_gather._resident``."""

    def __contains__(self, key):
        return True

    def __getitem__(self, key):
        return 1


def test_the_fused_all_gather_keeps_its_plan_and_its_workspace_descriptors(monkeypatch):
    """``fused_all_gather.prepare``: what depends only on the shapes, layout and options is made
    once per workspace (``_Plan``): one kept launch for every call, the descriptors of each
    parity's gathered rows made once (the workspace does not move); a call passes its own
    operands and outputs, this parity's rows and their descriptor, and copies its shard into its
    own rows of them."""
    pytest.importorskip("triton.tools.tensor_descriptor")
    pytest.importorskip("iris")
    import torch

    from commfuse.kernels import fused_all_gather, launch, tiles
    from commfuse.runtime import workspace as wsmod

    monkeypatch.setattr(fused_all_gather, "_resident", _Fits())
    launched = []
    monkeypatch.setattr(launch.Bound, "__call__", lambda self, **kw: launched.append((self, kw)))
    world, rank, rows, k, n = 2, 1, 32, 64, 32
    data = 1 << 16
    ws = wsmod.Workspace("0", rank, world, torch.zeros(wsmod.HEADER_BYTES + 2 * data, dtype=torch.uint8),
                         torch.zeros(world, dtype=torch.int64), data)
    cfg = tiles.TileConfig(bm=32, bn=32, bk=16)
    w = torch.randn(n, k, dtype=torch.float16)
    for call in range(4):
        ticket = ws.ticket_base
        shard = torch.randn(rows, k, dtype=torch.float16)
        gathered = torch.empty(world * rows, k, dtype=torch.float16)
        out = torch.empty(world * rows, n, dtype=torch.float16)
        go = fused_all_gather.prepare(ws, shard, w.t(), None, gathered, out, cfg)
        parity = (call + 1) % 2
        go(call + 1, parity)
        bound, args = launched[-1]
        rows_of_parity = ws.data(parity, (world * rows, k), torch.float16)
        assert args["data"].data_ptr() == rows_of_parity.data_ptr()
        assert args["g_desc"].base is args["data"] and args["g_desc"].block_shape == [32, 16]
        assert torch.equal(rows_of_parity[rank * rows:(rank + 1) * rows], shard)  # its own rows
        assert args["out"] is out and args["gathered"] is gathered and args["bias"] is out
        assert args["b_desc"].base.data_ptr() == w.data_ptr() and bound.fixed["B_TRANSPOSED"]
        assert args["trace"].data_ptr() == ws.ticket.data_ptr() and args["scale_a"] is ws.err and args["scale_b"] is ws.err
        assert (args["epoch"], args["ticket_base"]) == (call + 1, ticket)
        assert ws.ticket_base == ticket + world * 1 * 1 + bound.grid[0]  # every tile, one failed claim each
    assert len({id(b) for b, _ in launched}) == 1 and len(ws.launches) == 1
    for parity in (0, 1):  # each parity's descriptor made once
        assert len({id(kw["g_desc"]) for _, kw in launched if kw["data"].data_ptr() == ws.data(
            parity, (1,), torch.float16).data_ptr()}) == 1


class _Peers:
    """The torch provider's per-peer views over one process's simulated ranks."""

    def __init__(self, bufs):
        self.bufs = bufs

    def get_buffer(self, peer, sizes, dtype, offset):
        return self.bufs[peer][offset:offset + sizes[0]]


class _Side:
    """A stream on the CPU: the waits asked of it, logged."""

    log: list = []

    def __init__(self, name: str = "side"):
        self.name = name

    def wait_stream(self, other):
        self.log.append((self.name, "waits for", other.name))


def _ag_setup(monkeypatch):
    """A workspace of rank 1 of 2 with peer views, the kept launch recorded, every configuration
    fitting: what ``fused_all_gather.prepare`` needs on the CPU."""
    import contextlib

    import torch

    from commfuse.kernels import fused_all_gather, launch
    from commfuse.runtime import workspace as wsmod

    monkeypatch.setattr(fused_all_gather, "_resident", _Fits())
    launched = []
    monkeypatch.setattr(launch.Bound, "__call__", lambda self, **kw: launched.append((self, kw)))
    monkeypatch.setattr(fused_all_gather, "copy_engine_flags", lambda: lambda flags, at, value: flags.__setitem__(at, value))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: _Side("main"))
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(_Side, "log", [])
    data = 1 << 16
    bufs = [torch.zeros(wsmod.HEADER_BYTES + 2 * data, dtype=torch.uint8) for _ in range(2)]
    ws = wsmod.Workspace("0", 1, 2, bufs[1], torch.zeros(2, dtype=torch.int64), data, _keepalive=_Peers(bufs))
    return ws, launched


def test_a_copy_engine_all_gather_planned_in_inference_mode_runs_outside_it(monkeypatch):
    """A plan keeps the peers' views it pushes into: one made under ``torch.inference_mode`` (a
    prefill) must take a later call's pushes outside it (training), which write them in place; and
    with the copy engines pushing, the kernel gathers nothing: it takes the output in the gathered
    tensor's place, while the call's gathered tensor is copied from the workspace."""
    pytest.importorskip("triton.tools.tensor_descriptor")
    pytest.importorskip("iris")
    import torch

    from commfuse.kernels import fused_all_gather, tiles

    ws, launched = _ag_setup(monkeypatch)
    cfg = tiles.TileConfig(bm=32, bn=32, bk=16)
    w = torch.randn(32, 64, dtype=torch.float16)
    for call, mode in enumerate((torch.inference_mode, torch.no_grad)):
        shard = torch.randn(32, 64, dtype=torch.float16)
        gathered = torch.empty(64, 64, dtype=torch.float16)
        out = torch.empty(64, 32, dtype=torch.float16)
        with mode():  # the first call's plan made in inference mode
            go = fused_all_gather.prepare(ws, shard, w.t(), None, gathered, out, cfg, side=_Side())
        assert go.variants == ("ce_push",)
        with torch.no_grad():
            go(call + 1, (call + 1) % 2)  # the second call's pushes outside inference mode
        args = launched[-1][1]
        assert args["gathered"] is out and not launched[-1][0].fixed["GATHER"]
        peer = ws.peer_data(0, (call + 1) % 2, (64, 64), torch.float16)
        assert torch.equal(peer[32:], shard)  # this rank's rows, pushed into rank 0's
    assert len(ws.launches) == 1
    # each call: the side stream after the caller's before the pushes, the caller's stream after
    # the side stream's once the kernel is queued
    assert _Side.log == [("side", "waits for", "main"), ("main", "waits for", "side")] * 2


def test_the_all_gathers_pushes_rejoin_the_callers_stream_when_a_launch_fails(monkeypatch):
    """A copy-engine call whose kernel launch raises still has the caller's stream wait for the
    side stream (its copies read the shard, which the caller may free)."""
    pytest.importorskip("triton.tools.tensor_descriptor")
    pytest.importorskip("iris")
    import torch

    from commfuse.kernels import fused_all_gather, launch, tiles

    ws, launched = _ag_setup(monkeypatch)

    def refuse(self, **kw):
        raise RuntimeError("launch refused")

    monkeypatch.setattr(launch.Bound, "__call__", refuse)
    go = fused_all_gather.prepare(ws, torch.randn(32, 64, dtype=torch.float16),
                                  torch.randn(32, 64, dtype=torch.float16).t(), None, None,
                                  torch.empty(64, 32, dtype=torch.float16), tiles.TileConfig(bm=32, bn=32, bk=16),
                                  side=_Side())
    with pytest.raises(RuntimeError, match="launch refused"):
        go(1, 1)
    assert _Side.log == [("side", "waits for", "main"), ("main", "waits for", "side")]


def test_each_input_of_the_all_gathers_plan_makes_a_plan_of_its_own(monkeypatch):
    """Calls that differ in one of what the kernel's plan depends on (the weight's layout, a
    gathered tensor, a bias, FP8 operands) on one workspace get plans and kept launches of their
    own; alike calls share one."""
    pytest.importorskip("triton.tools.tensor_descriptor")
    pytest.importorskip("iris")
    import torch

    from commfuse.kernels import fused_all_gather, tiles

    ws, launched = _ag_setup(monkeypatch)
    cfg = tiles.TileConfig(bm=32, bn=32, bk=16)
    f16 = torch.float16
    w = torch.randn(32, 64, dtype=f16)

    def call(weight=None, gathered=True, bias=None, fp8=False):
        shard = torch.randn(32, 64, dtype=f16)
        b = w.t() if weight is None else weight
        scales = None
        if fp8:
            shard, b = shard.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn)
            scales = (torch.ones(()), torch.ones(()))
        g = torch.empty(64, 64, dtype=shard.dtype) if gathered else None
        out = torch.empty(64, 32, dtype=f16)
        fused_all_gather.prepare(ws, shard, b, bias, g, out, cfg, scales=scales)(1, 1)
        return launched[-1]

    first = call()
    assert call()[0] is first[0]  # alike: one kept launch
    variants = [call(weight=w.t().contiguous()), call(gathered=False), call(bias=torch.randn(32, dtype=f16)),
                call(fp8=True)]
    assert len({id(b) for b, _ in [first, *variants]}) == 5 and len(ws.launches) == 5
    assert not variants[0][0].fixed["B_TRANSPOSED"] and first[0].fixed["B_TRANSPOSED"]
    assert not variants[1][0].fixed["GATHER"] and variants[2][0].fixed["HAS_BIAS"] and variants[3][0].fixed["SCALED"]


@pytest.mark.parametrize("transposed", [True, False], ids=["linear_weight", "dense_weight"])
def test_a_misaligned_weight_of_a_kept_layout_is_copied(transposed):
    """The weight's layout is kept as the activation's is: a weight of that layout at an address
    no TMA descriptor takes is copied, never described as is."""
    pytest.importorskip("triton.tools.tensor_descriptor")
    import torch

    from commfuse.kernels import tiles

    cfg = tiles.TileConfig(bm=16, bn=32, bk=16)
    k, n = 64, 96
    tiles._LAYOUTS.clear()

    def weight(offset):
        if transposed:
            flat = torch.randn(n * k + offset, dtype=torch.float16)
            return flat[offset:].view(n, k).t()
        flat = torch.randn(k * n + offset, dtype=torch.float16)
        return flat[offset:].view(k, n)

    aligned = weight(0)
    desc, b_t = tiles.weight_descriptor(aligned, cfg)
    assert b_t is transposed and desc.base.data_ptr() == aligned.data_ptr()
    odd = weight(1)  # the same shape and strides, 2 bytes off
    desc, _ = tiles.weight_descriptor(odd, cfg)
    assert desc.base.data_ptr() % 16 == 0 and desc.base.data_ptr() != odd.data_ptr()
    assert torch.equal(desc.base, odd)  # (a dense copy of its values: described untransposed)


def test_the_pull_kernels_keep_a_launch_per_kernel_and_alignment(monkeypatch):
    """``exchange.gather`` and ``exchange.reduce_scatter`` keep their launches on the workspace:
    alike calls share one, while the other kernel, or a source whose rows the kernel may not read
    as 16-byte vectors, gets its own; each call passes its own tensors, sizes and epoch."""
    pytest.importorskip("iris")
    import torch

    from commfuse.kernels import exchange, launch
    from commfuse.runtime import workspace as wsmod

    launched = []
    monkeypatch.setattr(launch.Bound, "__call__", lambda self, **kw: launched.append((self, kw)))
    data = 1 << 16
    ws = wsmod.Workspace("0", 0, 2, torch.zeros(wsmod.HEADER_BYTES + 2 * data, dtype=torch.uint8),
                         torch.zeros(2, dtype=torch.int64), data)
    src = ws.data(0, (4, 64), torch.float16)
    out = torch.empty(4, 128, dtype=torch.float16)
    exchange.gather(ws, src, out, 4, 64, 1, 3)
    exchange.gather(ws, src, out, 4, 64, 2, 3)
    exchange.reduce_scatter(ws, src, out[:, :32], 4, 32, 3, 3)
    odd = ws.data(0, (4, 60), torch.float16, 8)  # rows of 120 bytes: no 16-byte vectors
    exchange.gather(ws, odd, out, 4, 60, 4, 3)
    bounds = [b for b, _ in launched]
    assert bounds[0] is bounds[1] and len({id(b) for b in bounds}) == 3
    assert bounds[0].kernel is exchange.pull_gather_kernel and bounds[2].kernel is exchange.reduce_scatter_kernel
    assert bounds[0].fixed["VEC"] == 1 and bounds[3].fixed["VEC"] == 0
    assert launched[1][1] == {"shard": src, "out": out, "outer": 4, "inner": 64, "epoch": 2}
    assert launched[2][1]["partial"] is src
