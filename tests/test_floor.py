"""The compute-only floor backend removes every collective and keeps shapes."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch._inductor.utils import run_and_get_code

from commfuse.tools.floor import floor_backend


def test_floor_has_no_collectives_and_same_shapes(world):
    g = dist.group.WORLD

    def f(x, w):
        h = funcol.all_gather_tensor(x, 0, g) @ w
        return funcol.all_reduce(h, "sum", g), funcol.reduce_scatter_tensor(h, "sum", 0, g)

    x, w = torch.randn(8, 16), torch.randn(16, 16)
    (ar, rs), codes = run_and_get_code(torch.compile(f, backend=floor_backend), x, w)
    code = "\n".join(codes)
    assert "_c10d_functional" not in code
    assert ar.shape == (8 * world, 16) and rs.shape == (8, 16)
    torch.testing.assert_close(ar, torch.cat([x] * world) @ w)  # the stand-ins' values
