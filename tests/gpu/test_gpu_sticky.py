"""A dead peer costs one wait bound, not one per call: on one GPU, two emulated ranks
(``commfuse.tools.emulated``), rank 1 never launching.

Rank 0 queues many exchange calls on its stream. The first call's waits time out after the bound
and record the failure in the group's error word; every later wait of the group sees the word once
it has waited a little (``kernels/sync.py``, ``failed``) and ends at once, its output NaN. Without
that, each call would wait out the bound in turn (here 8 x 2 s). The same holds inside a CUDA graph
of the graph lane's calls, whose replays the host cannot stop.

    pytest -m one_gpu tests/gpu/test_gpu_sticky.py
"""

from __future__ import annotations

import os
import time

import pytest
import torch

from commfuse.kernels import exchange
from commfuse.kernels.sync import GRAPH_LANE_OP, OP_MM_ALL_REDUCE
from commfuse.runtime import workspace as ws_mod
from commfuse.tools import emulated

pytestmark = [pytest.mark.gpu, pytest.mark.one_gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.skipif(int(os.environ.get("WORLD_SIZE", "1")) > 1, reason="runs in one process")]

BOUND_S = 2.0
CALLS = 8


def test_a_dead_peer_costs_one_bound_not_one_per_call():
    group = emulated.group(2, 1 << 20, timeout_s=BOUND_S)
    ws = group[0]  # rank 1 never launches anything
    n = 4096
    outs = []
    stream = torch.cuda.Stream()
    torch.cuda.synchronize()
    began = time.perf_counter()
    with torch.cuda.stream(stream):
        for _ in range(CALLS):
            epoch, parity = ws.next_epoch()
            partial = ws.data(parity, (n,), torch.bfloat16)
            partial.fill_(1.0)
            out = torch.full((n,), 7.0, device="cuda", dtype=torch.bfloat16)
            exchange.all_reduce(ws, partial, out, epoch, "one_shot", OP_MM_ALL_REDUCE)
            outs.append(out)
    stream.synchronize()
    spent = time.perf_counter() - began
    assert spent < 2 * BOUND_S, f"{CALLS} calls with a dead peer took {spent:.1f} s (bound {BOUND_S} s)"
    word = [int(x) for x in ws.err[:5]]
    assert word[:4] == [1, OP_MM_ALL_REDUCE, 0, 1], word  # the first timeout: the op, this rank, the peer
    assert word[4] == 1  # in call 1 (the count)
    for out in outs:  # every call's output shows the missing peer: no stale sums
        assert torch.isnan(out.float()).any()


def _lanes(world: int, data_bytes: int, timeout_s: float) -> list:
    """``world`` graph lanes on one device sharing one heap-bases table and one error word."""
    device = torch.device("cuda")
    bufs = [torch.zeros(ws_mod.GRAPH_FLAG_BYTES + 2 * data_bytes, dtype=torch.uint8, device=device)
            for _ in range(world)]
    err = ws_mod.error_word()
    programs = torch.cuda.get_device_properties(device).multi_processor_count // world
    lanes = []
    for r in range(world):
        bases = ws_mod.header(bufs[r], ws_mod.GRAPH_FLAG_BYTES, [b.data_ptr() for b in bufs], ws_mod.GRAPH_FLAG_BYTES)
        lanes.append(ws_mod.GraphLane("one-device-lane", r, world, bufs[r], bases, data_bytes, programs, err=err,
                                      timeout_ns=int(timeout_s * 1e9)))
    return lanes


def test_a_graph_of_lane_calls_with_a_dead_peer_ends_after_one_bound():
    lane = _lanes(2, 1 << 20, BOUND_S)[0]
    n = 4096
    src = torch.ones(n, device="cuda", dtype=torch.bfloat16)
    outs = [torch.empty(n, device="cuda", dtype=torch.bfloat16) for _ in range(CALLS)]
    stream = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        exchange.staged_all_reduce(lane, src, outs[0], GRAPH_LANE_OP)  # compiled and loaded before capture
        stream.synchronize()
        lane.err.zero_()
        lane.counter.zero_()
        graph.capture_begin()
        for out in outs:
            exchange.staged_all_reduce(lane, src, out, GRAPH_LANE_OP)
        graph.capture_end()
    for out in outs:
        out.fill_(7.0)
    torch.cuda.synchronize()
    began = time.perf_counter()
    with torch.cuda.stream(stream):
        graph.replay()
    stream.synchronize()
    spent = time.perf_counter() - began
    assert spent < 2 * BOUND_S, f"a graph of {CALLS} lane calls with a dead peer took {spent:.1f} s"
    assert int(lane.err[0]) == 1 and int(lane.err[1]) == GRAPH_LANE_OP
    for out in outs:
        assert torch.isnan(out.float()).any()
