"""``kernels/``: what every kernel keeps off its specialisation key (epochs, slots, ranks), and
that ranks emulated on one GPU load every kernel with the context.
"""

from __future__ import annotations

import logging
import pathlib
import re

import pytest

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


def test_an_emulated_group_asks_for_its_kernels_loaded_when_cuda_starts(monkeypatch, caplog):
    """One host thread launches every emulated rank, so a kernel loaded lazily at its first launch
    (which may wait for the device's running kernels, among them a rank spinning for one not yet
    launched) would stall the group until the bound. Every one-GPU benchmark that makes emulated
    groups asks for eager loading before it imports torch or anything that does (later, CUDA has
    read the setting), and making a group where the driver loads lazily says so once."""
    root = pathlib.Path(__file__).resolve().parents[1]
    scripts = [f for f in sorted((root / "benchmarks").glob("*.py"))
               if re.search(r"emulated\.(group|lanes)\(", f.read_text())]
    assert len(scripts) >= 3
    first_import = re.compile(r"^\s*(import|from)\s+(torch|triton|iris|commfuse)\b")
    for script in scripts:
        lines = script.read_text().splitlines()
        asked = [i for i, line in enumerate(lines) if 'os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")' in line]
        imports = [i for i, line in enumerate(lines) if first_import.match(line)]
        assert asked and imports and asked[0] < imports[0], script.name
    from commfuse.tools import emulated

    # the driver's own word (``cuModuleGetLoadingMode``), through a stand-in of the driver library
    class Driver:
        def __init__(self, mode, init=0):
            self.mode, self.init = mode, init

        def cuInit(self, flags):
            return self.init

        def cuModuleGetLoadingMode(self, ref):
            ref._obj.value = self.mode
            return 0

    for driver, want in ((Driver(2), "LAZY"), (Driver(1), "EAGER"), (Driver(1, init=100), None)):
        monkeypatch.setattr(emulated.ctypes, "CDLL", lambda name, driver=driver: driver)
        assert emulated.loading_mode() == want
    monkeypatch.undo()

    def warnings(mode, env):
        monkeypatch.setattr(emulated, "_warned", [])
        monkeypatch.setattr(emulated, "loading_mode", lambda: mode)
        if env is None:
            monkeypatch.delenv("CUDA_MODULE_LOADING", raising=False)
        else:
            monkeypatch.setenv("CUDA_MODULE_LOADING", env)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="commfuse"):
            emulated._check_loading()
            emulated._check_loading()
        return [r.getMessage() for r in caplog.records if "emulated group" in r.getMessage()]

    # the driver's word wins over the environment's (set too late, it says EAGER to no effect)
    assert len(warnings("LAZY", "EAGER")) == 1 and "lazy" in warnings("LAZY", "EAGER")[0]
    assert warnings("EAGER", None) == []
    # no driver to ask: the environment's word
    assert warnings(None, "EAGER") == []
    assert len(warnings(None, None)) == 1

    # making a group (or a lane) asks, before anything touches the device
    class Asked(Exception):
        pass

    def ask():
        raise Asked

    monkeypatch.setattr(emulated, "_check_loading", ask)
    for make in (emulated.group, emulated.lanes):
        with pytest.raises(Asked):
            make(2, 1024, device="cpu")
