"""Where the host time of launching a tile kernel goes, part by part (one GPU).

    python benchmarks/launch_cost.py [--out F] [--samples 500]

The tile GEMM (``kernels.tiles.matmul_kernel``, two TMA descriptor arguments) at 2048 x 2048 x
2048 bf16 is launched in several ways, each back to back behind a GPU sleep so that only the host
is timed: through Triton's JIT (``kernel[grid](...)``), through the compiled kernel as the
run-time's direct launches do, and through the compiled kernel's launcher with the descriptors
already encoded (what a launch prepared per call signature could do). The parts are timed alone
too: making the two ``TensorDescriptor`` objects, encoding them (Triton's ``make_tensordesc_arg``).
And the run-time's own ``launch.run`` (``kernels/launch.py``), with its kept encodings and without.

The already-encoded launch takes Triton's C launcher and the base arguments as the run-time reads
them (``kernels/launch.py``: Triton 3.6's layout); with another Triton those cases are left out,
and the output says so.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--samples", type=int, default=500)
    p.add_argument("--out", default="")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("launch_cost: needs a CUDA GPU", file=sys.stderr)
        return 2
    import triton

    from commfuse.kernels import tiles
    from commfuse.kernels.sizes.tiles import TileConfig

    cfg = TileConfig(reducers=0)
    m = k = n = 2048
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = (torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5).t()
    out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    grid = (min(sms, triton.cdiv(m, cfg.bm) * triton.cdiv(n, cfg.bn)), 1, 1)
    a_desc, b_desc, b_t = tiles.descriptor_operands(a, b, cfg)
    consts = dict(BM=cfg.bm, BN=cfg.bn, BK=cfg.bk, GROUP_M=cfg.group_m, B_TRANSPOSED=b_t, HAS_BIAS=False,
                  SCALED=False, ROWWISE=False, IMPRECISE=None)
    kernel = tiles.matmul_kernel
    positional = (a_desc, b_desc, out, out, m, n, k, 0, 0, out, out)
    compiled = kernel[grid](*positional, **consts, num_warps=cfg.warps, num_stages=cfg.stages)
    values = list(positional) + [consts[name] for name in kernel.arg_names[len(positional):]]
    ref = a.float() @ b.float()
    assert ((out.float() - ref).norm() / ref.norm()).item() < 1e-2
    stream = torch.cuda.current_stream().cuda_stream
    from commfuse.kernels import launch

    # the run-time's reading of Triton's launcher (``launch._Layout``): its C launcher, the base
    # arguments and the descriptors' encoding; None where it does not know the layout
    layout = launch._layout_of(compiled)
    if layout is not None:
        def encode(desc, i):
            return layout.encode(desc, layout.descs[i])

        expanded = [*encode(a_desc, 0), *encode(b_desc, 1), *values[2:]]

        def encoded():
            layout.raw(*grid, stream, layout.function, *layout.base_tail, *expanded)

        out.fill_(float("nan"))
        encoded()
        assert ((out.float() - ref).norm() / ref.norm()).item() < 1e-2, "the already-encoded launch is wrong"
    runner = compiled[grid]
    cases = {
        "Triton JIT: kernel[grid](...)": lambda: kernel[grid](*positional, **consts, num_warps=cfg.warps,
                                                              num_stages=cfg.stages),
        "compiled kernel: compiled[grid](*values)": lambda: runner(*values, stream=stream),
        "part: two TensorDescriptors (descriptor_operands)": lambda: tiles.descriptor_operands(a, b, cfg),
    }

    def through_run():
        launch.run(kernel, grid, *positional, **consts, num_warps=cfg.warps, num_stages=cfg.stages)

    cases["run-time: launch.run, descriptors encoded at each launch"] = through_run
    if layout is not None:
        cases["run-time: launch.run, encodings kept"] = through_run
        cases["part: encoding two descriptors (make_tensordesc_arg)"] = lambda: (encode(a_desc, 0), encode(b_desc, 1))
        cases["already encoded: the C launcher alone"] = encoded
    cycles = 40_000_000
    res = {}
    for name, fn in cases.items():
        launch.configure_encoded("encodings kept" in name)
        fn()
        t = []
        for i in range(args.samples):
            if i % 50 == 0:
                torch.cuda.synchronize()
                torch.cuda._sleep(cycles)
            start = time.perf_counter_ns()
            fn()
            t.append((time.perf_counter_ns() - start) / 1e3)
        torch.cuda.synchronize()
        res[name] = {"min": min(t), "median": statistics.median(t)}
        print(f"{name:55s} median {res[name]['median']:7.1f} µs  (min {res[name]['min']:.1f})", flush=True)
    print(f"encoded launch: {'yes' if layout is not None else 'no (a launcher layout it does not know)'}; Triton {triton.__version__}; {torch.cuda.get_device_name(0)}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"encoded": layout is not None, "triton": triton.__version__, "device": torch.cuda.get_device_name(0),
                       "us": res}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
