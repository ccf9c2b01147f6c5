"""Run by test_tiles.py under TRITON_INTERPRET=1: the split-K kernel of ``fused_split_k.py`` as
rank 0 of two, in one process. Rank 1 is simulated: its sums and flags are written into rank 0's
workspace before the launch, as its pushes would have left them, and rank 0's pushes are checked
in rank 1's buffer after. Both epoch modes: host epochs (a workspace) and device epochs (a graph
lane, two calls in a row). Exits non-zero on a mismatch.

What the interpreter cannot show: it runs programs one after another, so the first program
claims every unit (no concurrent claims, no arrival races, the deferred tile output always
follows the next unit of the same program), and rank 1's flags are set before the launch, so no
wait ever spins. Those run on GPUs (``tests/gpu/test_gpu_split_k.py``)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from commfuse.kernels import fused_split_k, symm, sync, tiles
from commfuse.kernels.sync import ErrorWord


@triton.jit
def _now():
    """The interpreter has no inline assembly: a clock that never advances (no wait times out;
    the test's subprocess timeout bounds a wait that never ends)."""
    return tl.full((), 0, tl.int64)


sync.now = _now
fused_split_k.now = _now
ErrorWord._word = torch.zeros(4, dtype=torch.int32)  # no pinned memory without CUDA
ErrorWord._host = ErrorWord._word.numpy()

DT = torch.float16  # the interpreter mishandles bf16


def blocks(full: torch.Tensor, bm: int, bn: int) -> torch.Tensor:
    """``full`` [M, N] as the kernel's dense [tiles, bm, bn] blocks, tile t = (t // num_n, t % num_n)."""
    m, n = full.shape
    num_m, num_n = -(-m // bm), -(-n // bn)
    pad = torch.zeros(num_m * bm, num_n * bn, dtype=full.dtype)
    pad[:m, :n] = full
    return pad.view(num_m, bm, num_n, bn).permute(0, 2, 1, 3).reshape(num_m * num_n, bm, bn)


def case(m: int, k: int, n: int, split: int, bias: bool, lane: bool, calls: int = 1) -> None:
    torch.manual_seed(m * 1000 + k + n + split)
    tile = tiles.TileConfig(bm=16, bn=16, bk=16, stages=2, warps=4, group_m=1, reducers=0)
    cfg = fused_split_k.config(m, k, n, 3, split, tile)
    count = fused_split_k.num_tiles(m, n, cfg)
    data_bytes = 1 << 16
    header = symm.GRAPH_FLAG_BYTES if lane else symm.HEADER_BYTES
    bufs = [torch.zeros(header + 2 * data_bytes, dtype=torch.uint8) for _ in range(2)]
    bases = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.int64)
    if lane:
        ws = [symm.GraphLane("0", r, 2, bufs[r], bases, data_bytes, 3) for r in range(2)]
    else:
        ws = [symm.Workspace("0", r, 2, bufs[r], bases, data_bytes, max_programs=3) for r in range(2)]
    sums_elems = 2 * count * 16 * 16
    for call in range(calls):
        a = [torch.randn(m, k, dtype=DT) for _ in range(2)]
        w = [(torch.randn(n, k, dtype=DT) / k ** 0.5) for _ in range(2)]
        c = [torch.randn(n, dtype=DT) if bias else None for _ in range(2)]
        partial = [(a[r].float() @ w[r].float().t() + (c[r].float() if bias else 0)).to(DT) for r in range(2)]
        if lane:
            epoch = int(ws[0].counter[0]) + 1
            sums0, flags0, flags1 = ws[0].data(DT), ws[0].flags, ws[1].flags
            sums1 = ws[1].data(DT)
            half = ws[0].half_elems(DT)
        else:
            epoch = ws[0].epoch + 1
            half = data_bytes // 2
            sums0 = bufs[0][symm.HEADER_BYTES:].view(DT)
            sums1 = bufs[1][symm.HEADER_BYTES:].view(DT)
            flags0, flags1 = ws[0].tile_flags, ws[1].tile_flags
        at = (epoch % 2) * half
        # rank 1's pushes, as they would have landed in rank 0's workspace: its sums, its flags
        sums0[at + count * 256:at + sums_elems].copy_(blocks(partial[1], 16, 16).flatten())
        for t in range(count):
            flags0[t * 2 + 1] = epoch
        out = torch.full((m, n), float("nan"), dtype=DT)
        launch = fused_split_k.prepare(ws[0], a[0], w[0].t(), c[0], out, cfg, lane=lane)
        if lane:
            launch()
        else:
            launch(*ws[0].next_epoch())
        want = partial[0].float() + partial[1].float()  # the rank-order sum of rounded partials
        err = ((out.float() - want).norm() / want.norm()).item()
        assert err < 2e-3, (m, k, n, split, bias, lane, call, err)
        # what rank 0 pushed into rank 1: its rounded sum in slot [0, tile], and its flags
        got = sums1[at:at + count * 256].view(count, 16, 16)
        mine = blocks(partial[0], 16, 16)
        assert ((got.float() - mine.float()).norm() / mine.float().norm()).item() < 2e-3
        assert all(int(flags1[t * 2]) == epoch for t in range(count)), "rank 0's flags"
        assert ws[0].tile_counters.eq(0).all(), "arrival counters back at zero"
        if lane:
            assert ws[0].counter.eq(epoch).all(), "the lane's epoch advanced in every slot"
            assert ws[0].ticket.eq(0).all(), "ticket and exits back at zero"
        else:
            assert int(ws[0].ticket.item()) == ws[0].ticket_base, "each unit claimed once"
        assert int(ErrorWord._word[0]) == 0


def main() -> None:
    for m, k, n, split, bias in [(5, 96, 40, 2, True), (16, 64, 32, 1, False), (20, 80, 48, 3, False),
                                 (33, 128, 16, 4, True)]:
        case(m, k, n, split, bias, lane=False)
        case(m, k, n, split, bias, lane=True, calls=2)
    print("ok")


if __name__ == "__main__":
    main()
