"""A GEMM tiling and the arithmetic on it, apart from the Triton kernels that use it: what a path
decides from (``runtime/paths``) imports no Triton."""

from __future__ import annotations

import dataclasses
import re

import torch

#: FP8 element types the tile kernels multiply (Hopper's FP8 tensor cores; e5m2 x e5m2 is not a
#: ``_scaled_mm`` form).
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def cdiv(x: int, y: int) -> int:
    """Ceiling division for host code (``triton.cdiv`` is a constexpr function, slow to call)."""
    return -(-x // y)


@dataclasses.dataclass(frozen=True)
class TileConfig:
    """A GEMM tiling. ``reducers``: programs of the fused all-reduce kernel that copy pushed sums
    instead of multiplying (0: the multiplying programs copy them, in the ticket order, which
    ``runtime.paths.ar_fused.tile_config`` picks for every call; 16, this class's default,
    where a path configuration asks for reducer programs);
    ``per_sm``: programs per SM (2 lets one program's epilogue stores drain while the other
    multiplies; the launcher lowers it to what the compiled kernel fits)."""

    bm: int = 128
    bn: int = 256
    bk: int = 64
    stages: int = 3
    warps: int = 8
    group_m: int = 8
    reducers: int = 16
    per_sm: int = 1

    def __str__(self) -> str:
        return (f"{self.bm}x{self.bn}x{self.bk}s{self.stages}w{self.warps}g{self.group_m}"
                f"r{self.reducers}o{self.per_sm}")

    @classmethod
    def parse(cls, text: str) -> "TileConfig":
        """The inverse of ``str``: ``128x256x64s3w8g8r16o1`` (``o1`` may be left out)."""
        m = re.fullmatch(r"(\d+)x(\d+)x(\d+)s(\d+)w(\d+)g(\d+)r(\d+)(?:o(\d+))?", text.strip())
        if not m:
            raise ValueError(f"commfuse: tile config {text!r} is not like 128x256x64s3w8g8r16o1")
        return cls(*(int(x) for x in m.groups() if x is not None))
