"""Where does commfuse lose time inside the model? (torchrun --nproc_per_node=2 benchmarks/diag_model.py)

1. The bundled Llama-style stack (8B-class sizes, DTensor TP) compiled once with commfuse; each
   step timed with every forced exchange path (``COMMFUSE_ALGO`` is read per call), next to Inductor.
2. The host cost of one fused call against mm + NCCL all-reduce (GPU kept busy, so only the host is
   timed), and a cProfile of the fused call's Python.
3. A CUDA profile of one prefill step per backend: the largest kernels by GPU time.
"""

from __future__ import annotations

import cProfile
import io
import os
import pstats
import statistics
import sys

import torch
import torch.distributed as dist

from commfuse.bench import host_us


def _p(*args):
    if dist.get_rank() == 0:
        print(*args, file=sys.stderr, flush=True)


def main() -> None:
    from commfuse import bench_model
    from commfuse.demo import init_distributed
    from commfuse.demo import transformer as demo
    import torch.distributed._functional_collectives as funcol

    torch._inductor.config.fx_graph_cache = False
    device, dtype = init_distributed()
    if device.type != "cuda":
        raise SystemExit("diag_model.py measures GPU paths: run it on GPUs")
    cfg = demo.sized_config(False, 2, dist.get_world_size())
    group = dist.group.WORLD.group_name

    # 2. host cost of one call (decode-sized and prefill-sized)
    for m in (4, 8192):
        a = torch.randn(m, 7168, device=device, dtype=dtype)
        b = torch.randn(4096, 7168, device=device, dtype=dtype).t()
        for algo in ("one_shot", "ce_overlap", "nccl"):
            if algo == "ce_overlap" and m < 4096:
                continue
            os.environ["COMMFUSE_ALGO"] = algo
            us = host_us(lambda: torch.ops.commfuse.mm_all_reduce(a, b, None, group))
            _p(f"host M={m}: commfuse {algo}: {us:.1f} us/call")
        os.environ["COMMFUSE_ALGO"] = ""
        us = host_us(lambda: funcol.wait_tensor(funcol.all_reduce(a @ b, "sum", group)))
        _p(f"host M={m}: mm + funcol all_reduce + wait: {us:.1f} us/call")
        us = host_us(lambda: a @ b)
        _p(f"host M={m}: mm alone: {us:.1f} us/call")
        if m == 4 and dist.get_rank() == 0:
            os.environ["COMMFUSE_ALGO"] = "one_shot"
            prof = cProfile.Profile()
            torch.cuda._sleep(int(2e9))
            prof.enable()
            for _ in range(200):
                torch.ops.commfuse.mm_all_reduce(a, b, None, group)
            prof.disable()
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(18)
            _p(s.getvalue()[-6000:])
        else:
            os.environ["COMMFUSE_ALGO"] = "one_shot"
            for _ in range(200):
                torch.ops.commfuse.mm_all_reduce(a, b, None, group)
        torch.cuda.synchronize()
        os.environ["COMMFUSE_ALGO"] = ""

    # 1. in-model step time per forced path
    for mode, batch, algos in (("prefill", 4, ("", "nccl", "one_shot", "ce_overlap")),
                               ("decode", 4, ("", "nccl", "one_shot"))):
        x_seq = 1 if mode == "decode" else 2048
        torch.manual_seed(100)
        x = torch.randn(batch, x_seq, cfg.dim, device=device, dtype=dtype)
        for backend in ("inductor", "commfuse"):
            torch._dynamo.reset()
            model = bench_model._build("dtensor", cfg, device, dtype)
            pos = None
            if mode == "decode":
                model.setup_cache(batch, 2048 + 200, device, dtype)
                pos = torch.tensor([2048], device=device)
            compiled = bench_model._compile(backend, model)

            def step():
                with torch.no_grad():
                    return compiled(x) if pos is None else compiled(x, pos)

            step(); step()
            for algo in (algos if backend == "commfuse" else ("",)):
                os.environ["COMMFUSE_ALGO"] = algo
                step()
                ms = statistics.median(bench_model._step_times(step, device, 20))
                _p(f"{mode} b{batch} {backend} algo={algo or 'default'}: {ms:.3f} ms")
            os.environ["COMMFUSE_ALGO"] = ""
            if mode == "prefill":
                from torch.profiler import ProfilerActivity, profile

                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                    step()
                    torch.cuda.synchronize()
                _p(f"--- {mode} {backend}: top CUDA kernels")
                _p(prof.key_averages().table(sort_by="device_time_total", row_limit=14, max_name_column_width=60))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
