"""Long and faulty runs on the 2 GPUs: 10,000 mixed calls without corruption or memory growth,
and a clean teardown of a process group whose fused call timed out."""

from __future__ import annotations

import os
import tempfile
import time

import pytest
import torch
import torch.distributed as dist

import commfuse
from commfuse import check_errors, env
from commfuse.runtime import groups
from gpu_util import gather_all, relerr

pytestmark = pytest.mark.gpu

SHAPES = [(16, 1024, 1024), (300, 1000, 2000), (4096, 1024, 1024), (1024, 512, 4096)]


def _call(op: str, algo: str, m: int, k: int, n: int, group_name: str):
    """One call (``algo``: the path forced, "" for the rules' choice) and a function computing its
    fp32 reference (from every rank's inputs)."""
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16) / k ** 0.5
    with env.override(algo=algo or None):
        if op == "mm_all_reduce":
            out = torch.ops.commfuse.mm_all_reduce(a, b, None, group_name)
            return out, lambda: sum(x.float() @ y.float() for x, y in zip(gather_all(a), gather_all(b)))
        if op == "all_gather_mm":
            out, _ = torch.ops.commfuse.all_gather_mm(a, b, None, 0, 2, group_name, False)
            return out, lambda: torch.cat(gather_all(a)).float() @ b.float()
        out = torch.ops.commfuse.mm_reduce_scatter(a, b, None, [m, n], 0, 2, group_name)
    return out, lambda: sum(x.float() @ y.float() for x, y in zip(gather_all(a), gather_all(b))
                            ).chunk(2)[dist.get_rank()]


def _data_bytes() -> dict:
    return {(g.name, g.provider): g.workspace.data_bytes for g in groups.all_groups() if g.workspace is not None}


def test_ten_thousand_mixed_calls_no_corruption_no_memory_growth(nccl):
    calls = [("mm_all_reduce", "fused"), ("mm_all_reduce", "one_shot"), ("mm_all_reduce", ""),
             ("mm_all_reduce", "split_k"),
             ("all_gather_mm", ""), ("mm_reduce_scatter", "")]
    gen = torch.Generator().manual_seed(17)  # the same sequence on every rank
    torch.manual_seed(40 + dist.get_rank())
    baseline = None
    start = time.time()
    for i in range(10_000):
        op, algo = calls[int(torch.randint(len(calls), (1,), generator=gen))]
        m, k, n = SHAPES[int(torch.randint(len(SHAPES), (1,), generator=gen))]
        out, reference = _call(op, algo, m, k, n, nccl.group_name)
        if i == 500:  # every shape and path has run: workspaces and caches are at full size
            torch.cuda.synchronize()
            baseline = (torch.cuda.memory_allocated(), _data_bytes())
        if i % 500 == 499:
            check_errors()
            assert relerr(out, reference()) < 1e-2, f"call {i}: {op} {algo or 'default'} {m}x{k}x{n}"
        if i % 2000 == 1999 and dist.get_rank() == 0:
            print(f"  soak: {i + 1} calls, {time.time() - start:.0f} s", flush=True)
    torch.cuda.synchronize()
    check_errors()
    grown = torch.cuda.memory_allocated() - baseline[0]
    assert grown < 16 << 20, f"allocated memory grew by {grown} bytes over 9,500 calls"
    assert _data_bytes() == baseline[1]  # no regrowth


def _timeout_then_teardown(rank: int, init_file: str, result_file: str) -> None:
    os.environ["COMMFUSE_TIMEOUT_S"] = "1"
    os.environ["COMMFUSE_ALGO"] = "fused"
    env.reload()  # (importing this module may have read the settings already)
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=2,
                            device_id=torch.device("cuda", rank))
    group = dist.group.WORLD.group_name
    a = torch.randn(512, 1024, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16)
    torch.ops.commfuse.mm_all_reduce(a, b, None, group)
    check_errors()
    dist.barrier()
    failed = False
    if rank == 0:  # rank 1 skips the call
        torch.ops.commfuse.mm_all_reduce(a, b, None, group)
        try:
            check_errors()
        except RuntimeError:
            failed = True
    dist.barrier()
    start = time.time()
    commfuse.release_all()
    dist.destroy_process_group()
    with open(f"{result_file}.{rank}", "w") as f:
        f.write(f"{int(failed)} {time.time() - start:.1f}")


def test_a_process_tears_down_cleanly_after_a_timeout(nccl):
    """Two fresh processes (one per GPU, beside the test's own): rank 1 skips a fused call, rank 0
    times out with an error, then both free their workspaces, destroy the group and exit 0."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        if dist.get_rank() == 0:
            result = os.path.join(tmp, "result")
            mp.spawn(_timeout_then_teardown, args=(os.path.join(tmp, "rendezvous"), result),
                     nprocs=2, join=True)  # raises if a child fails or exits non-zero
            failed0, secs0 = open(f"{result}.0").read().split()
            failed1, _ = open(f"{result}.1").read().split()
            assert (failed0, failed1) == ("1", "0")
            assert float(secs0) < 30
        dist.barrier()
