"""Can a tile's epilogue traffic hide under the next tile's K loop? One GPU, no group.

The fused all-reduce kernel (``fused_all_reduce.py``) spends ~50 µs of a 450 µs call at
4096x4096x8192 on its tiles' local epilogue traffic (``NOTES.md`` §29): an owned tile reads the
peer's partial, adds it, writes the output and the sum it pushes. In Triton's language those
loads and stores run after the tile's K loop and before the next one. Gluon
(``triton.experimental.gluon``, Hopper TMA, mbarriers and wgmma) can issue them asynchronously:
the partial's TMA load before the K loop, the stores as TMA stores that drain during the next
tile's K loop. This times, per shape, checked against fp32 first:

- ``cublas``: ``torch.mm``;
- ``triton``: the tile GEMM (``tiles.matmul``), and ``triton+epi``: the same with the owned tile's
  epilogue written as the fused kernel does (load a partial, add, store the output and a second
  copy);
- ``gluon``: a persistent Gluon GEMM whose output leaves by an asynchronous TMA store, and
  ``gluon+epi1`` / ``gluon+epi2``: the same epilogue as ``triton+epi`` through TMA (the partial
  loaded during the K loop, both stores asynchronous), the partial staged in the output's
  shared-memory buffer (whose stores must then leave before the next K loop) or in one of its own
  (they leave during it; 64 KiB more, so fewer operand stages fit).

If ``gluon+epi2`` costs about what ``gluon`` does while ``triton+epi`` costs ~10% more than
``triton``, the fused kernel's epilogue can hide this way.

    python benchmarks/gluon_epilogue_probe.py [--shapes MxKxN,...] [--stages 3] [--bk 64] [--epi 0,1,2]
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from commfuse.bench import time_us
from commfuse.kernels import tiles
from commfuse.kernels.launch import run as run_kernel
from commfuse.kernels.fused_all_reduce import _stagger
from commfuse.kernels.tiles import claim, mma_tile, tile_coords

BM, BN = 128, 256
#: A barrier of the CTA's threads (``gl.barrier`` in Triton 3.9, ``thread_barrier`` or
#: ``debug_barrier`` in older Gluon).
_cta_barrier = next(getattr(gl, n) for n in ("barrier", "thread_barrier", "debug_barrier") if hasattr(gl, n))


@gluon.jit
def _coords(t, num_m, num_n, GROUP_M: gl.constexpr):
    """``tiles.tile_coords`` written in Gluon, for the Gluon kernel."""
    per_group = GROUP_M * num_n
    first_m = (t // per_group) * GROUP_M
    size_m = gl.minimum(num_m - first_m, GROUP_M)
    return first_m + (t % per_group) % size_m, (t % per_group) // size_m


@gluon.jit
def _load_step(a_desc, b_desc, a_bufs, b_bufs, ready, g, off_m, off_n, k, STAGES: gl.constexpr):
    s = g % STAGES
    mbarrier.expect(ready.index(s), a_desc.block_type.nbytes + b_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(a_desc, [off_m, k], ready.index(s), a_bufs.index(s))
    tma.async_copy_global_to_shared(b_desc, [off_n, k], ready.index(s), b_bufs.index(s))


@gluon.jit
def gluon_gemm_kernel(a_desc, b_desc, c_desc, p_desc, s_desc, M, N, K, GROUP_M: gl.constexpr,
                      STAGES: gl.constexpr, EPI: gl.constexpr, num_warps: gl.constexpr):
    """Persistent ``c = a @ w.t()``; ``EPI`` 1 or 2: ``c = a @ w.t() + p`` and ``s = c`` too, the
    partial loaded into the output's buffer once its last stores have left (1: they must drain
    before the K loop) or into a buffer of its own (2: they drain during the K loop). Timing
    only: 3 as 2 without reading the loaded partial, 4 as 2 without the second store."""
    BLOCK_M: gl.constexpr = c_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = c_desc.block_type.shape[1]
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    dtype: gl.constexpr = a_desc.dtype
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                         instr_shape=[16, BLOCK_N, 16])
    a_bufs = gl.allocate_shared_memory(dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
    b_bufs = gl.allocate_shared_memory(dtype, [STAGES] + b_desc.block_type.shape, b_desc.layout)
    c_smem = gl.allocate_shared_memory(dtype, c_desc.block_type.shape, c_desc.layout)
    if EPI >= 2:
        p_smem = gl.allocate_shared_memory(dtype, c_desc.block_type.shape, c_desc.layout)
    else:
        p_smem = c_smem
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    pbar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
    mbarrier.init(pbar, count=1)
    num_m = gl.cdiv(M, BLOCK_M)
    num_n = gl.cdiv(N, BLOCK_N)
    steps = gl.cdiv(K, BLOCK_K)
    g = 0  # K steps loaded and consumed so far (the stages' phases follow it)
    done = 0  # tiles finished by this program (the partial barrier's phase)
    for t in range(gl.program_id(0), num_m * num_n, gl.num_programs(0)):
        pid_m, pid_n = _coords(t, num_m, num_n, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        if EPI:  # the partial into p_smem while the K loop runs
            if EPI == 1:
                tma.store_wait(pendings=0)  # (p_smem is c_smem: its last stores must have left)
            mbarrier.expect(pbar, p_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(p_desc, [off_m, off_n], pbar, p_smem)
        for j in gl.static_range(STAGES - 1):
            if j < steps:
                _load_step(a_desc, b_desc, a_bufs, b_bufs, ready, g + j, off_m, off_n, j * BLOCK_K, STAGES)
        acc = gl.zeros((BLOCK_M, BLOCK_N), gl.float32, acc_layout)
        for k in range(steps):
            s = (g + k) % STAGES
            mbarrier.wait(ready.index(s), ((g + k) // STAGES) & 1)
            acc = warpgroup_mma(a_bufs.index(s), b_bufs.index(s).permute((1, 0)), acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
            nxt = k + STAGES - 1  # into the stage step k - 1 used, whose MMA has finished
            if nxt < steps:
                _load_step(a_desc, b_desc, a_bufs, b_bufs, ready, g + nxt, off_m, off_n, nxt * BLOCK_K, STAGES)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        g += steps
        if EPI:
            mbarrier.wait(pbar, done & 1)
            if EPI != 3:
                acc += p_smem.load(acc_layout).to(gl.float32)
                _cta_barrier()  # every warp read the partial before p_smem is overwritten
        if EPI != 1:
            tma.store_wait(pendings=0)  # the last tile's output has left c_smem
        c_smem.store(acc.to(dtype))
        fence_async_shared()
        tma.async_copy_shared_to_global(c_desc, [off_m, off_n], c_smem)
        if EPI != 0 and EPI != 4:
            tma.async_copy_shared_to_global(s_desc, [off_m, off_n], c_smem)
        done += 1
    tma.store_wait(pendings=0)


@triton.jit
def _tile_at(pid_m, pid_n, N, BM: tl.constexpr, BN: tl.constexpr):
    """Offsets of tile (pid_m, pid_n) in a row-major [M, N] tensor."""
    rows = pid_m * BM + tl.arange(0, BM)
    cols = pid_n * BN + tl.arange(0, BN)
    return rows[:, None].to(tl.int64) * N + cols[None, :]


@triton.jit
def _epilogue(acc, p, c, s, at, PARTS: tl.constexpr, EVICT: tl.constexpr):
    """``c = acc (+ p)`` at ``at`` (bit 1 of ``PARTS``), and ``s = c`` (bit 2)."""
    if PARTS & 1:
        acc += tl.load(p + at, eviction_policy=EVICT).to(tl.float32)
    val = acc.to(c.dtype.element_ty)
    tl.store(c + at, val, eviction_policy=EVICT)
    if PARTS & 2:
        tl.store(s + at, val, eviction_policy=EVICT)


@triton.jit
def triton_epi_kernel(a_desc, b_desc, p, c, s, M, N, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                      GROUP_M: tl.constexpr, EVICT: tl.constexpr = "", ALIAS: tl.constexpr = False,
                      PARTS: tl.constexpr = 3):
    """``tiles.matmul_kernel`` with an owned tile's epilogue: ``c = a @ w.t() + p``, ``s = c``;
    ``EVICT``: the epilogue's loads and stores with that L2 eviction policy (``evict_first``: they
    stream through L2 without pushing the K loop's operands out). ``ALIAS`` (timing only, the
    result is wrong): every tile's epilogue reads and writes the same four tiles, which stay in
    L2, so the epilogue's instructions and waits remain and its HBM traffic goes. ``PARTS``
    (timing only unless 3): bit 1 the partial loaded and added, bit 2 the second store."""
    num_m = tl.cdiv(M, BM)
    num_n = tl.cdiv(N, BN)
    for tile in range(tl.program_id(0), num_m * num_n, tl.num_programs(0)):
        pid_m, pid_n = tile_coords(tile, num_m, num_n, GROUP_M)
        acc = mma_tile(a_desc, b_desc, pid_m * BM, pid_n * BN, K, BM, BN, BK, True)
        at = _tile_at(pid_m % 2, pid_n % 2, N, BM, BN) if ALIAS else _tile_at(pid_m, pid_n, N, BM, BN)
        _epilogue(acc, p, c, s, at, PARTS, EVICT)


@triton.jit
def triton_epi_tma_kernel(a_desc, b_desc, p_desc, c_desc, s_desc, c, s, M, N, K, BM: tl.constexpr, BN: tl.constexpr,
                          BK: tl.constexpr, GROUP_M: tl.constexpr, STORES: tl.constexpr):
    """``triton_epi_kernel`` with the partial loaded through a TMA descriptor and, with
    ``STORES``, both stores through TMA descriptors too (what the fused kernel's epilogue could
    use for its local traffic)."""
    num_m = tl.cdiv(M, BM)
    num_n = tl.cdiv(N, BN)
    for tile in range(tl.program_id(0), num_m * num_n, tl.num_programs(0)):
        pid_m, pid_n = tile_coords(tile, num_m, num_n, GROUP_M)
        acc = mma_tile(a_desc, b_desc, pid_m * BM, pid_n * BN, K, BM, BN, BK, True)
        val = (acc + p_desc.load([pid_m * BM, pid_n * BN]).to(tl.float32)).to(c_desc.dtype)
        if STORES:
            c_desc.store([pid_m * BM, pid_n * BN], val)
            s_desc.store([pid_m * BM, pid_n * BN], val)
        else:
            at = _tile_at(pid_m, pid_n, N, BM, BN)
            tl.store(c + at, val)
            tl.store(s + at, val)


@triton.jit
def triton_epi_spread_kernel(a_desc, b_desc, p, c, s, ticket, base, spread, M, N, K, BM: tl.constexpr,
                             BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr, EPI: tl.constexpr):
    """``triton_epi_kernel`` (``EPI``) or the plain GEMM, its tiles claimed from a ticket as the
    fused kernel's are and program p started ``p / programs`` of ``spread`` ns late
    (``fused_all_reduce._stagger``): the tiles' ends spread over time instead of every
    program's at once (it did not make the epilogue any cheaper: ``gluon_epilogue_probe_f``)."""
    num_m = tl.cdiv(M, BM)
    num_n = tl.cdiv(N, BN)
    _stagger(tl.program_id(0), tl.num_programs(0), spread)
    tile = claim(ticket, base)
    while tile < num_m * num_n:
        pid_m, pid_n = tile_coords(tile, num_m, num_n, GROUP_M)
        acc = mma_tile(a_desc, b_desc, pid_m * BM, pid_n * BN, K, BM, BN, BK, True)
        _epilogue(acc, p, c, s, _tile_at(pid_m, pid_n, N, BM, BN), 3 if EPI else 0, "")
        tile = claim(ticket, base)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="4096x4096x8192,8192x2048x4096,1024x7168x4096")
    ap.add_argument("--stages", type=int, default=3)
    ap.add_argument("--bk", type=int, default=64)
    ap.add_argument("--epi", default="0,1,2", help="Gluon epilogues to time (gluon_gemm_kernel's EPI)")
    ap.add_argument("--spreads", default="", help="µs over which the ticket-order kernels' programs start "
                    "(triton_epi_spread_kernel), each timed with and without the epilogue")
    args = ap.parse_args()
    tiles.ensure_allocator()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    BK = args.bk
    cfg = tiles.TileConfig(bm=BM, bn=BN, bk=BK, stages=args.stages, warps=8, group_m=8, reducers=0)
    for shape in args.shapes.split(","):
        m, k, n = (int(x) for x in shape.split("x"))
        assert m % BM == 0 and n % BN == 0, "the probe's kernels have no masks"
        torch.manual_seed(0)
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
        p = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
        c, s = torch.empty_like(p), torch.empty_like(p)
        ref = a.float() @ w.float().t()
        grid = (min(sms, (m // BM) * (n // BN)),)
        lay = {name: gl.NVMMASharedLayout.get_default_for(block, gl.bfloat16)
               for name, block in (("a", [BM, BK]), ("b", [BN, BK]), ("c", [BM, BN]))}
        ga = TensorDescriptor.from_tensor(a, [BM, BK], lay["a"])
        gb = TensorDescriptor.from_tensor(w, [BN, BK], lay["b"])
        gc, gp, gs = (TensorDescriptor.from_tensor(x, [BM, BN], lay["c"]) for x in (c, p, s))
        ta, tb, _ = tiles.descriptor_operands(a, w.t(), cfg)
        tp, tc, ts = (tiles.TensorDescriptor(x, [m, n], [n, 1], [BM, BN]) for x in (p, c, s))
        def triton_run(kernel, *operands, **consts):
            """A launch of one of the probe's Triton kernels on these operands."""
            return lambda: run_kernel(kernel, grid, *operands, m, n, k, BM=BM, BN=BN, BK=BK, GROUP_M=8, num_warps=8,
                                      num_stages=args.stages, **consts)

        # name -> (launch, what its result holds: True the epilogue's, False the product, None
        # nothing checkable: timing only)
        runs = {
            "cublas": (lambda: torch.mm(a, w.t(), out=c), False),
            "triton": (lambda: tiles.matmul(a, w.t(), None, cfg, out=c), False),
            "triton+epi": (triton_run(triton_epi_kernel, ta, tb, p, c, s), True),
            "triton+epi tma load": (triton_run(triton_epi_tma_kernel, ta, tb, tp, tc, ts, c, s, STORES=False), True),
            "triton+epi tma load+stores": (triton_run(triton_epi_tma_kernel, ta, tb, tp, tc, ts, c, s, STORES=True),
                                           True),
            "triton+epi in L2 (wrong result)": (triton_run(triton_epi_kernel, ta, tb, p, c, s, ALIAS=True), None),
            "triton+partial only (one store)": (triton_run(triton_epi_kernel, ta, tb, p, c, s, PARTS=1), None),
            "triton+second store only": (triton_run(triton_epi_kernel, ta, tb, p, c, s, PARTS=2), None),
            "triton+epi evict_first": (triton_run(triton_epi_kernel, ta, tb, p, c, s, EVICT="evict_first"), True),
        }
        ticket = torch.zeros(1, device="cuda", dtype=torch.int32)
        claims = [0]  # the ticket's value at the next launch: each launch claims every tile and fails once a program

        def spread_run(epi: bool, us: int):
            triton_run(triton_epi_spread_kernel, ta, tb, p, c, s, ticket, claims[0], us * 1000, EPI=epi)()
            claims[0] += (m // BM) * (n // BN) + grid[0]

        for us in (int(x) for x in args.spreads.split(",") if x):
            runs[f"tickets spread {us}"] = (lambda us=us: spread_run(False, us), False)
            runs[f"tickets spread {us} +epi"] = (lambda us=us: spread_run(True, us), True)
        for epi in (int(e) for e in args.epi.split(",")):
            runs[f"gluon+epi{epi}" if epi else "gluon"] = (
                lambda epi=epi: gluon_gemm_kernel[grid](ga, gb, gc, gp, gs, m, n, k, 8, args.stages, epi, num_warps=8),
                epi > 0 if epi < 3 else None)
        line = []
        for name, (run, epi) in runs.items():
            try:
                c.fill_(float("nan"))
                s.fill_(float("nan"))
                run()
                torch.cuda.synchronize()
                if epi is not None:
                    want = ref + p.float() if epi else ref
                    err = ((c.float() - want).norm() / want.norm()).item()
                    if epi:
                        assert torch.equal(c, s), "the second copy differs"
                    assert err < 1e-2, f"relative error {err:.1e}"
                line.append(f"{name} {time_us(run):.1f}")
            except Exception as exc:  # noqa: BLE001 - a variant that fails is reported, not fatal
                line.append(f"{name} failed ({type(exc).__name__}: {' '.join(str(exc).split())[-700:]})")
        print(f"{shape} BK {BK}, {args.stages} stages (us): " + ", ".join(line), flush=True)


if __name__ == "__main__":
    main()
