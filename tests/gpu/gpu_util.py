"""Helpers of the GPU tests: poisoning, gathering from every rank, relative error."""

from __future__ import annotations

import torch
import torch.distributed as dist


def poison():
    """Fill freed allocator blocks with NaN so an output element nobody writes shows up."""
    blocks = [torch.full((1 << 26,), float("nan"), device="cuda", dtype=torch.float32) for _ in range(4)]
    del blocks


def gather_all(t: torch.Tensor) -> list[torch.Tensor]:
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t.contiguous())
    return out


def relerr(got, want):
    assert torch.isfinite(got).all(), "unwritten (NaN-poisoned) or non-finite output"
    return ((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-30)).item()
