"""``kernels/``: what every kernel keeps off its specialisation key (epochs, slots, ranks), and
that ranks emulated on one GPU load every kernel with the context.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys

from commfuse.kernels import fused_all_gather, fused_all_reduce, fused_split_k, norm_epilogue

from choosing import (  # noqa: F401  (_quiet_policy, fresh_groups: fixtures, found by name)
    _quiet_policy)


def test_exchange_kernels_do_not_specialise_on_epochs_or_slots():
    """An epoch divisible by 16 would otherwise compile and load a new kernel variant mid-run."""
    from commfuse.kernels import exchange

    for kernel in (exchange.one_shot_kernel, exchange.two_shot_kernel, exchange.pull_gather_kernel,
                   exchange.reduce_scatter_kernel, exchange.barrier_kernel,
                   fused_all_reduce.gemm_all_reduce_kernel, fused_split_k.split_k_all_reduce_kernel,
                   norm_epilogue.one_shot_add_rms_norm_kernel):
        names = [kernel.arg_names[i] if isinstance(i, int) else i for i in kernel.do_not_specialize]
        assert "epoch" in names, kernel.fn.__name__
    names = norm_epilogue.one_shot_add_rms_norm_kernel.do_not_specialize
    assert "slot_base" in [norm_epilogue.one_shot_add_rms_norm_kernel.arg_names[i] if isinstance(i, int) else i
                           for i in names]
    assert "slot" in [exchange.barrier_kernel.arg_names[i] if isinstance(i, int) else i
                      for i in exchange.barrier_kernel.do_not_specialize]


def test_no_kernel_specialises_on_the_rank():
    """Every rank runs one binary: ranks emulated on one GPU never load a kernel while another
    rank's spins waiting for it (a module load waits for the running kernels)."""
    from commfuse.kernels import exchange

    for kernel in (exchange.one_shot_kernel, exchange.staged_one_shot_kernel, exchange.two_shot_kernel,
                   exchange.pull_gather_kernel, exchange.reduce_scatter_kernel, exchange.barrier_kernel,
                   fused_all_reduce.gemm_all_reduce_kernel, fused_split_k.split_k_all_reduce_kernel,
                   fused_all_gather.all_gather_gemm_kernel, norm_epilogue.one_shot_add_rms_norm_kernel,
                   norm_epilogue.staged_add_rms_norm_kernel):
        assert "rank" in kernel.arg_names
        assert "rank" in [kernel.arg_names[i] if isinstance(i, int) else i for i in kernel.do_not_specialize], \
            kernel.fn.__name__


def test_an_emulated_group_loads_its_kernels_with_the_context(monkeypatch, caplog):
    """One host thread launches every emulated rank, so a kernel loaded lazily at its first launch
    (which may wait for the device's running kernels, among them a rank spinning for one not yet
    launched) would stall the group until the bound: importing the emulation asks for eager
    loading unless the process set a mode, and making a group under another mode says so once."""
    env = {k: v for k, v in os.environ.items() if k != "CUDA_MODULE_LOADING"}
    probe = "import os, commfuse.tools.emulated; print(os.environ.get('CUDA_MODULE_LOADING'))"
    for preset, want in ((None, "EAGER"), ("LAZY", "LAZY")):
        run_env = dict(env, **({"CUDA_MODULE_LOADING": preset} if preset else {}))
        out = subprocess.run([sys.executable, "-c", probe], env=run_env, capture_output=True, text=True, check=True)
        assert out.stdout.split()[-1] == want, out.stderr
    from commfuse.tools import emulated

    monkeypatch.setattr(emulated, "_warned", [])
    monkeypatch.setenv("CUDA_MODULE_LOADING", "LAZY")
    with caplog.at_level(logging.WARNING, logger="commfuse"):
        emulated._check_loading()
        emulated._check_loading()
    said = [r for r in caplog.records if "CUDA_MODULE_LOADING=LAZY" in r.getMessage()]
    assert len(said) == 1
    monkeypatch.setattr(emulated, "_warned", [])
    monkeypatch.setenv("CUDA_MODULE_LOADING", "EAGER")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="commfuse"):
        emulated._check_loading()
    assert not caplog.records
