"""The fused all-reduce (and reduce-scatter) kernel's sizes and options, apart from its Triton code
(``kernels/fused_all_reduce.py``): what a path decides from imports no Triton."""

from __future__ import annotations

from typing import NamedTuple

from .tiles import TileConfig, cdiv


def num_tiles(m: int, n: int, world: int, cfg: TileConfig, scatter: bool = False) -> int:
    """Tiles of a call (the reduce-scatter tiles each rank's share of the rows separately)."""
    rows = world * cdiv(m // world, cfg.bm) if scatter else cdiv(m, cfg.bm)
    return rows * cdiv(n, cfg.bn)


def tile_flag_slots(m: int, n: int, world: int, cfg: TileConfig, scatter: bool = False) -> int:
    return num_tiles(m, n, world, cfg, scatter) * (world + 1)


def data_elems(m: int, n: int, world: int, cfg: TileConfig, scatter: bool = False) -> int:
    """Elements per parity: ``world`` slabs of the owned tiles, and (all-reduce) the result area."""
    count = num_tiles(m, n, world, cfg, scatter)
    slabs = world * cdiv(count, world)
    return (slabs if scatter else slabs + count) * cfg.bm * cfg.bn


class Options(NamedTuple):
    """How a call runs the kernel beyond its tiling (the path decides; benchmarks vary them).

    ``tickets``: programs claim tile positions in order from the workspace's ticket (else a
    static stride, which needs every program resident and ``reducers`` to copy the pushed sums).
    ``stagger_ns``: the spread over which the programs start their first tiles, for calls of more
    than one wave of tiles and for one wave (0: together; ticket order only). ``copy_lag_waves``:
    how far the inline copies trail this rank's own tiles, in waves of its programs.
    ``tma_push``: push through the TMA unit. ``pull`` (reduce-scatter): the owners pull the peers'
    partials. ``ablate``: ``ABLATIONS`` bits, for timing only (results are wrong)."""
    tickets: bool = True
    stagger_ns: tuple[int, int] = (0, 0)
    copy_lag_waves: float = 4.0
    tma_push: bool = False
    pull: bool = False
    ablate: int = 0
