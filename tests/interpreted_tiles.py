"""Run by test_tiles.py under TRITON_INTERPRET=1 (Triton's CPU interpreter): the tile kernels'
GEMM and the fused kernel's tile order, checked on the CPU. Exits non-zero on a mismatch.

The order and place functions take a program's position ``i`` as a scalar in the kernel; they are
element-wise, so the probes here evaluate them at every position of a call at once (one program,
``i`` a block of positions): the same arithmetic, at a launch per rank instead of a program per
position (which the interpreter runs one after another)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from commfuse.kernels import fused_all_reduce, tiles


#: Positions a probe evaluates at once (at least the most tiles of a case below)
NT = 256


@triton.jit
def _orders(out, num_tiles, rank, num_m, num_n, WORLD: tl.constexpr, GROUP_M: tl.constexpr, NT: tl.constexpr):
    i = tl.arange(0, NT)
    tile = fused_all_reduce._schedule(i, rank, num_tiles, WORLD)
    pid_m, pid_n = tiles.tile_coords(tile, num_m, num_n, GROUP_M)
    mask = i < num_tiles
    tl.store(out + 3 * i, tile, mask=mask)
    tl.store(out + 3 * i + 1, pid_m, mask=mask)
    tl.store(out + 3 * i + 2, pid_n, mask=mask)


def check_orders() -> None:
    for world in (2, 3, 4, 8):
        for num_m, num_n in ((1, 1), (3, 5), (8, 4), (9, 7)):
            num_tiles = num_m * num_n
            assert num_tiles <= NT
            coords = set()
            for rank in range(world):
                got = torch.full((num_tiles, 3), -1, dtype=torch.int32)
                _orders[(1,)](got, num_tiles, rank, num_m, num_n, WORLD=world, GROUP_M=2, NT=NT)
                order = got[:, 0].tolist()
                assert sorted(order) == list(range(num_tiles)), (world, rank, order)
                owners = [t % world for t in order]
                expect = [o for k in range(1, world + 1) for o in [(rank + k) % world]
                          for _ in range(sum(1 for t in range(num_tiles) if t % world == o))]
                assert owners == expect, ("peers' tiles first, own last", world, rank, owners)
                coords = {tuple(x) for x in got[:, 1:].tolist()}
                assert coords == {(m, n) for m in range(num_m) for n in range(num_n)}, (num_m, num_n)


@triton.jit
def _places(out, rank, M, num_m, num_n, num_tiles, WORLD: tl.constexpr, GROUP_M: tl.constexpr,
            BM: tl.constexpr, NT: tl.constexpr):
    i = tl.arange(0, NT)
    tile, off_m, pid_n, row_end = fused_all_reduce._place(i, rank, M, num_m, num_n, num_tiles,
                                                          GROUP_M, WORLD, BM, True)
    slab_tiles = num_tiles // WORLD
    mask = i < num_tiles
    tl.store(out + 6 * i, tile, mask=mask)
    tl.store(out + 6 * i + 1, fused_all_reduce._owner(tile, slab_tiles, WORLD, True), mask=mask)
    tl.store(out + 6 * i + 2, fused_all_reduce._slot(tile, slab_tiles, WORLD, True), mask=mask)
    tl.store(out + 6 * i + 3, off_m, mask=mask)
    tl.store(out + 6 * i + 4, pid_n, mask=mask)
    tl.store(out + 6 * i + 5, row_end, mask=mask)


def check_scatter_places() -> None:
    """The reduce-scatter form: each owner's tiles cover exactly its share of the rows (a
    ragged last row block included), peers' shares first, own last, slots 0..per-1."""
    bm = 4
    for world in (2, 4, 8):
        for share, num_n in ((4, 1), (8, 3), (6, 2), (13, 5)):
            m = share * world
            share_m = -(-share // bm)
            per = share_m * num_n
            count = fused_all_reduce.num_tiles(m, num_n * 8, world, tiles.TileConfig(bm=bm, bn=8), True)
            assert count == world * per <= NT
            for rank in range(world):
                got = torch.full((count, 6), -1, dtype=torch.int32)
                _places[(1,)](got, rank, m, -(-m // bm), num_n, count, WORLD=world, GROUP_M=2, BM=bm, NT=NT)
                rows = got.tolist()
                assert sorted(r[0] for r in rows) == list(range(count))
                owners = [r[1] for r in rows]
                assert owners == [(rank + k) % world for k in range(1, world + 1) for _ in range(per)]
                for tile, owner, slot, off_m, pid_n, row_end in rows:
                    assert tile == owner * per + slot and 0 <= slot < per
                    assert owner * share <= off_m < (owner + 1) * share == row_end
                    assert (off_m - owner * share) % bm == 0 and 0 <= pid_n < num_n
                for owner in range(world):
                    blocks = {(r[3], r[4]) for r in rows if r[1] == owner}
                    assert blocks == {(owner * share + j * bm, n) for j in range(share_m) for n in range(num_n)}


def check_matmul() -> None:
    torch.manual_seed(0)
    cfg = tiles.TileConfig(bm=32, bn=32, bk=16, stages=2, warps=4, group_m=2)
    for m, k, n, transposed, bias in [(70, 48, 96, True, "1d"), (64, 64, 40, False, None),
                                      (5, 32, 24, True, "rows"), (33, 16, 8, False, "1d")]:
        a = torch.randn(m, k, dtype=torch.float16)
        b = torch.randn(n, k, dtype=torch.float16).t() if transposed else torch.randn(k, n, dtype=torch.float16)
        c = {None: None, "1d": torch.randn(n, dtype=torch.float16),
             "rows": torch.randn(m, 1, dtype=torch.float16)}[bias]
        out = torch.full((m, n), float("nan"), dtype=torch.float16)
        tiles.matmul(a, b, c, cfg, out=out, programs=3)
        ref = a.float() @ b.float() + (c.float() if c is not None else 0)
        err = ((out.float() - ref).norm() / ref.norm()).item()
        assert err < 2e-3, (m, k, n, transposed, bias, err)
    at = torch.randn(48, 70, dtype=torch.float16).t()  # a transposed (non-contiguous) activation
    b = torch.randn(48, 96, dtype=torch.float16)
    ref = at.float() @ b.float()
    out = tiles.matmul(at, b, None, cfg, programs=2)
    assert ((out.float() - ref).norm() / ref.norm()).item() < 2e-3


def check_scaled_matmul() -> None:
    """The GEMM on FP8 operands with ``_scaled_mm``'s scales: against ``torch._scaled_mm`` itself
    (the CPU runs it) with the same operands, tensor-wise and row-wise scales, with and without a
    bias, bf16 and fp32 outputs, both FP8 element types; outputs poisoned first."""
    torch.manual_seed(1)
    cfg = tiles.TileConfig(bm=32, bn=32, bk=32, stages=2, warps=4, group_m=2)
    e4m3, e5m2 = torch.float8_e4m3fn, torch.float8_e5m2
    for m, k, n, rowwise, bias, out_dtype, (ta, tb) in [
            (70, 64, 96, False, True, torch.bfloat16, (e4m3, e4m3)),
            (33, 32, 48, True, False, torch.bfloat16, (e4m3, e4m3)),
            (64, 96, 40, True, True, torch.bfloat16, (e5m2, e4m3)),
            (5, 64, 24, False, False, torch.float32, (e4m3, e5m2))]:
        a = (torch.randn(m, k) * 4).to(ta)
        b = (torch.randn(n, k) * 4).to(tb).t()  # nn.Linear's weight, column-major as _scaled_mm wants it
        sa = torch.rand(m, 1) + 0.5 if rowwise else torch.tensor(0.37)
        sb = torch.rand(1, n) + 0.5 if rowwise else torch.tensor(1.9)
        c = torch.randn(n, dtype=torch.bfloat16) if bias else None
        for fast in (True, False):
            out = torch.full((m, n), float("nan"), dtype=out_dtype)
            tiles.scaled_matmul(a, b, sa, sb, c, out_dtype, fast, cfg, out=out, programs=3)
            ref = torch._scaled_mm(a, b, sa, sb, c, out_dtype=out_dtype, use_fast_accum=fast).float()
            err = ((out.float() - ref).norm() / ref.norm()).item()
            # bf16: each side rounds its output once (the interpreter's cast may truncate: 2**-8 relative)
            assert err < (8e-3 if out_dtype == torch.bfloat16 else 1e-5), (m, k, n, rowwise, bias, out_dtype, err)
    try:
        tiles.scaled_matmul(a.float(), b, sa, sb, None, torch.float32, True, cfg)
    except ValueError as exc:
        assert "multiplies FP8 operands" in str(exc)
    else:
        raise AssertionError("a float32 operand was taken")


if __name__ == "__main__":
    check_orders()
    check_scatter_places()
    check_matmul()
    check_scaled_matmul()
    print("ok")
