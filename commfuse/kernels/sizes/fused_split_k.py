"""The split-K kernel's tilings and sizes, apart from its Triton code (``kernels/fused_split_k.py``):
what a path decides from imports no Triton."""

from __future__ import annotations

import dataclasses

import torch

from .tiles import TileConfig, cdiv


@dataclasses.dataclass(frozen=True)
class SplitConfig:
    """The tiling (``tile.bm`` rows, ``tile.bn`` columns, ``tile.bk`` per K step) and how many K
    slices each tile is split into."""

    tile: TileConfig
    split: int
    ll: bool | None = None  # the sums as LL words: True / False asked, None ``uses_ll``'s rule

    def __str__(self) -> str:
        return f"{self.tile}k{self.split}" + {True: "ll", False: "fl", None: ""}[self.ll]


#: LL words where each rank pushes at most this many values to its peers, all of them together:
#: beyond it the twice as many bytes on the link cost more than the fence and flag they replace
#: (counted over all peers: a limit on rows would push ever more extra bytes as the group grows).
LL_MAX_PUSHED = 1 << 17


def uses_ll(cfg: SplitConfig, m: int, n: int, world: int, dtype: torch.dtype, lane: bool = False) -> bool:
    """Whether a call pushes LL words: 16-bit outputs (two to a word), not in a graph lane (whose
    epochs live on the device and never restart), and as ``cfg.ll`` asks, or where it leaves
    that open, where the values pushed are at most ``LL_MAX_PUSHED``."""
    if dtype.itemsize != 2 or lane:
        return False
    return (world - 1) * m * n <= LL_MAX_PUSHED if cfg.ll is None else cfg.ll


def sums_elems(m: int, n: int, world: int, cfg: SplitConfig, dtype: torch.dtype, lane: bool = False) -> int:
    """Output-dtype elements of the ranks' sums: a block per tile and rank, twice as many
    elements as values in the LL form (a word per two values)."""
    values = world * num_tiles(m, n, cfg) * cfg.tile.bm * cfg.tile.bn
    return values * (2 if uses_ll(cfg, m, n, world, dtype, lane) else 1)


#: Rows up to which ``mm_all_reduce`` may take this kernel (one or two row blocks).
MAX_ROWS = 256


#: 65-128 rows from ``NARROW_MIN_K``: blocks of 128 x 64, 128 of which fill the SMs without K
#: slices, so no fp32 slice is stored and summed; from ``NARROW_MIN_N`` columns in 8 stages of
#: 64-deep K steps. Below ``NARROW_MIN_K`` the 64 x 64 blocks (with slices) stream faster.
NARROW_MIN_N, NARROW_MIN_K = 8192, 4096


def _narrow(m: int, n: int, programs: int) -> TileConfig | None:
    """Up to 32 rows: blocks of 16 rows by 32 or 64 columns (the narrower first), K steps of 256,
    where their count fills more than half the SMs and at most all, so one wave streams the
    weight without K slices (none stored, none summed)."""
    for bn in (32, 64):
        if programs // 2 < cdiv(m, 16) * cdiv(n, bn) <= programs:
            return TileConfig(bm=16, bn=bn, bk=256, stages=4, warps=4, group_m=1, reducers=0)
    return None


def one_row_block(m: int, k: int) -> bool:
    """65-128 rows from ``NARROW_MIN_K``: the 128 x 64 blocks of ``wide_tile``, which the
    split-K rules (``runtime/rules/*.json``) also let take larger outputs."""
    return 64 < m <= 128 and k >= NARROW_MIN_K


def config(m: int, k: int, n: int, programs: int, split: int | None = None,
           tile: TileConfig | None = None, ll: bool | None = None) -> SplitConfig:
    """Blocks of 16 or 32 rows by 128 columns up to 32 rows (few rows waste little), 64 x 64 up
    to 128 rows, 128 x 128 beyond; up to 32 rows the ``_narrow`` blocks where they fill the SMs
    once, and 128 x 64 for 65-128 rows from ``NARROW_MIN_K`` (K steps of 64 in 8 stages from
    ``NARROW_MIN_N`` columns, else of 128 in 4; chosen at 16 and 128 rows, taken for the rows
    between alike); and enough K slices that the units fill ``programs`` once (one wave:
    with few rows the tail after the GEMM is latency, which more waves would not hide), each at
    least two K steps long. Shape and the group's SM count only, so the same on every rank.
    ``split``, ``tile`` and ``ll`` (``SplitConfig.ll``) override (path configurations)."""
    tile = tile or (_narrow(m, n, programs) if m <= 32 else None) or wide_tile(m, k, n)
    if split is None:
        count = cdiv(m, tile.bm) * cdiv(n, tile.bn)
        split = 1
        while split * 2 * count <= programs and split * 4 <= cdiv(k, tile.bk):
            split *= 2
    return SplitConfig(tile, max(1, split), ll)


def wide_tile(m: int, k: int, n: int) -> TileConfig:
    """``config``'s blocks where ``_narrow`` has none. Whatever the SM count, at least as tall
    and as wide as those, so with the most slices they bound the workspace of any tiling
    (``runtime.paths.split_k.plan_bytes``)."""
    if m <= 32:
        return TileConfig(bm=16 if m <= 16 else 32, bn=128, bk=128, stages=4, warps=4, group_m=1,
                                reducers=0)
    if one_row_block(m, k):  # the activation is read once per 64 columns; where 128 such blocks
        # fill the SMs without slices, 8 stages of 64-deep K steps stream a little faster
        deep = n >= NARROW_MIN_N
        return TileConfig(bm=128, bn=64, bk=64 if deep else 128, stages=8 if deep else 4, warps=4,
                                group_m=1, reducers=0)
    if m <= 128:  # 64 x 64 blocks: twice the units of 64 x 128 ones, and they stream faster
        return TileConfig(bm=64, bn=64, bk=128, stages=4, warps=4, group_m=1, reducers=0)
    return TileConfig(bm=128, bn=128, bk=64, stages=4, warps=8, group_m=1, reducers=0)


def num_tiles(m: int, n: int, cfg: SplitConfig) -> int:
    return cdiv(m, cfg.tile.bm) * cdiv(n, cfg.tile.bn)


def data_bytes(m: int, n: int, world: int, cfg: SplitConfig, dtype: torch.dtype, lane: bool = False) -> int:
    """Per parity: the ranks' sums (``sums_elems``), then the fp32 slices (256-byte aligned)."""
    sums = sums_elems(m, n, world, cfg, dtype, lane) * dtype.itemsize
    return cdiv(sums, 256) * 256 + num_tiles(m, n, cfg) * cfg.split * cfg.tile.bm * cfg.tile.bn * 4


def flag_slots(m: int, n: int, world: int, cfg: SplitConfig) -> int:
    return num_tiles(m, n, cfg) * world


def unsupported(m: int, k: int, n: int, dtype: torch.dtype, world: int, counters: int,
                flag_limit: int) -> str | None:
    """Why this kernel cannot take the call beyond what the fused all-reduce kernel needs
    (``runtime.paths.ar_fused.fused_support``, which ``runtime.paths.split_k`` checks
    first), or None."""
    if m > MAX_ROWS:
        return f"more than {MAX_ROWS} rows"
    # the wide blocks' tiles: a narrow tiling has at most one per SM, far below both limits
    cfg = SplitConfig(wide_tile(m, k, n), 1)
    if num_tiles(m, n, cfg) > counters:
        return "more tiles than the workspace has arrival counters"
    if flag_slots(m, n, world, cfg) > flag_limit:
        return "more tiles than the workspace has tile flags"
    return None


def misfit_sizes(m: int, n: int, world: int, cfg: SplitConfig, dtype: torch.dtype, lane: bool, slots: int,
                 counters: int, half_bytes: int) -> str | None:
    """``misfit`` for a buffer of ``slots`` flags, ``counters`` arrival counters and
    ``half_bytes`` per parity."""
    if flag_slots(m, n, world, cfg) > slots:
        return "too many tiles for the workspace's tile flags"
    if num_tiles(m, n, cfg) > counters:
        return "too many tiles for the workspace's arrival counters"
    need = data_bytes(m, n, world, cfg, dtype, lane)
    if need > half_bytes:
        return f"{need} bytes of split-K workspace do not fit the {half_bytes} bytes of a parity"
    return None
