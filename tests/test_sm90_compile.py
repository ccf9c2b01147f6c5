"""The fused all-reduce kernel compiled ahead of time for sm_90 (H200) on the CPU, through
Triton's bundled ptxas: the TMA-push form (``fused_all_reduce.Options(tma_push=True)``) has inline
assembly and device-made descriptors that the interpreter does not see, so only a real compile
checks them."""

from __future__ import annotations

import pytest

triton = pytest.importorskip("triton")


def _compile(tma: bool, scatter: bool, stagger: bool = False, fp8: tuple | None = None):
    from commfuse.kernels import fused_all_reduce

    bm, bn, bk = 128, 256, 64
    sig = {"a_desc": f"tensordesc<bf16[{bm}, {bk}]>", "b_desc": f"tensordesc<bf16[{bn}, {bk}]>",
           "bias": "*bf16", "data": "*bf16", "out": "*bf16", "M": "i32", "N": "i32", "K": "i32",
           "stride_bm": "i32", "stride_bn": "i32", "flags": "*i32", "heap_bases": "*i64", "epoch": "i32",
           "rank": "i32", "err": "*i32", "timeout": "i64", "ticket": "*i32", "ticket_base": "i32",
           "trace": "*i64", "compute": "i32", "lag": "i32", "positions": "i32", "stagger": "i32",
           "scale_a": "*fp32", "scale_b": "*fp32"}
    consts = dict(OP=5, WORLD=2, BM=bm, BN=bn, BK=bk, GROUP_M=8, SUB_M=64, B_TRANSPOSED=True,
                  HAS_BIAS=False, TICKETS=True, SCATTER=scatter, ABLATE=0, PULL=False, TRACE=False,
                  INLINE=not scatter, TMA_PUSH=tma, STAGGER=stagger, SCALED=False, ROWWISE=False, IMPRECISE=None)
    if fp8 is not None:  # FP8 operands: (row-wise scales, use_fast_accum)
        from commfuse.kernels import tiles

        bk = 128
        sig.update({"a_desc": f"tensordesc<fp8e4nv[{bm}, {bk}]>", "b_desc": f"tensordesc<fp8e4nv[{bn}, {bk}]>"})
        consts.update(BK=bk, SCALED=True, ROWWISE=fp8[0], IMPRECISE=tiles.fp8_accumulation(fp8[1], bk))
    return _compile_for_sm90(fused_all_reduce.gemm_all_reduce_kernel, sig, consts, num_warps=8, num_stages=3)


def _compile_for_sm90(fn, sig: dict, consts: dict, **options):
    """``fn`` compiled for sm_90 with ``sig``'s arguments (pointers 16-byte aligned) and
    ``consts``; skips where this Triton cannot."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = dict(sig, **{name: "constexpr" for name in consts})
    pointers = [i for i, (name, kind) in enumerate(sig.items()) if kind.startswith("*")]
    src = ASTSource(fn=fn, signature=sig,
                    constexprs={(list(sig).index(name),): value for name, value in consts.items()},
                    attrs={(i,): [["tt.divisibility", 16]] for i in pointers})
    try:
        return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    except (ImportError, FileNotFoundError) as exc:  # a Triton without the CUDA backend or ptxas
        pytest.skip(f"Triton cannot compile for sm_90 here: {exc}")


@pytest.mark.parametrize("scatter", [False, True])
def test_tma_push_compiles_for_sm90(scatter):
    """The TMA form compiles (ptxas accepts the wait and fence), stores through a TMA bulk copy
    instead of per-thread global stores, waits for those stores before a flag's release, and
    needs no more shared memory than the register-store form."""
    pytest.importorskip("iris")
    plain, tma = _compile(False, scatter), _compile(True, scatter)
    bulk_store = "cp.async.bulk.tensor.2d.global.shared"
    assert bulk_store not in plain.asm["ptx"]
    assert bulk_store in tma.asm["ptx"]
    assert "cp.async.bulk.wait_group 0" in tma.asm["ptx"]
    assert tma.asm["ptx"].count("st.global.v4") < plain.asm["ptx"].count("st.global.v4")
    assert tma.metadata.shared <= plain.metadata.shared <= 227 * 1024
    assert tma.metadata.global_scratch_size > 0  # the device-made descriptors


@pytest.mark.parametrize("scatter", [False, True])
@pytest.mark.parametrize("rowwise, fast", [(False, True), (True, True), (False, False)],
                         ids=["tensorwise", "rowwise", "fp32_accum"])
def test_fp8_form_compiles_for_sm90_on_fp8_tensor_cores(scatter, rowwise, fast):
    """The fused all-reduce (and its reduce-scatter form) on FP8 operands with ``_scaled_mm``'s
    scales (``tests/interpreted_fused.py`` checks the values): FP8 warpgroup MMAs, the
    partials exchanged in bf16 as the plain kernel's are, within the shared memory."""
    pytest.importorskip("iris")
    compiled = _compile(False, scatter, fp8=(rowwise, fast))
    ptx = compiled.asm["ptx"]
    assert "wgmma.mma_async.sync.aligned" in ptx and ".e4m3.e4m3" in ptx
    assert "sys.release" in ptx or "release.sys" in ptx
    assert compiled.metadata.shared <= 227 * 1024


def test_staggered_start_compiles_for_sm90():
    """``Options.stagger_ns`` (set by the fused all-reduce path): the programs' held start (a
    loop on the GPU timer) compiles for sm_90 and adds only that loop: the same shared memory, the timer read in the stagger."""
    pytest.importorskip("iris")
    plain, staggered = _compile(False, False), _compile(False, False, stagger=True)
    assert staggered.metadata.shared == plain.metadata.shared
    assert staggered.asm["ptx"].count("%globaltimer") > plain.asm["ptx"].count("%globaltimer")


def _compile_split_k(ll: bool, world: int = 2, group: int = 2, lane: bool = False, fp8: bool = False):
    from commfuse.kernels import fused_split_k, tiles

    bm, bn, bk = 16, 64, 256
    el = "fp8e4nv" if fp8 else "bf16"
    sig = {"a_desc": f"tensordesc<{el}[{bm}, {bk}]>", "b_desc": f"tensordesc<{el}[{bn}, {bk}]>",
           "bias": "*bf16", "parts0": "*fp32", "sums0": "*bf16", "half_parts": "i32", "half_sums": "i32",
           "out": "*bf16", "M": "i32", "N": "i32", "K": "i32", "stride_bm": "i32", "stride_bn": "i32",
           "flags": "*i64" if lane else "*i32", "counters": "*i32", "heap_bases": "*i64", "epoch": "i32", "rank": "i32",
           "err": "*i32", "timeout": "i64", "ticket": "*i64", "ticket_base": "i64", "epochs": "*i64",
           "scale_a": "*fp32", "scale_b": "*fp32"}
    consts = dict(OP=4 if lane else 8, WORLD=world, SPLIT=1, BM=bm, BN=bn, BK=bk, B_TRANSPOSED=True, HAS_BIAS=False,
                  DEVICE_EPOCH=lane, EPOCH_SLOTS=128 if lane else 1, LL=ll, LL_GROUP=group, GROUP_M=1, SCALED=fp8,
                  ROWWISE=False, IMPRECISE=tiles.fp8_accumulation(True, bk) if fp8 else None)
    return _compile_for_sm90(fused_split_k.split_k_all_reduce_kernel, sig, consts, num_warps=4, num_stages=4)


def test_split_k_ll_form_compiles_for_sm90_without_the_flag_release():
    """The split-K kernel's LL form (``SplitConfig.ll``) compiles for sm_90, pushes 64-bit words
    and polls them with volatile loads, and has no system-scope release (the flag store and its
    fence) that the other form needs."""
    pytest.importorskip("iris")
    plain, ll = _compile_split_k(False).asm["ptx"], _compile_split_k(True).asm["ptx"]
    assert "atom.global.sys.release" in plain and ".release" not in ll and ".acquire" not in ll
    assert "st.global.v2.b64" in ll and "ld.volatile.global.b64" in ll


@pytest.mark.parametrize("ll", [False, True], ids=["flags", "ll"])
def test_split_k_on_fp8_operands_compiles_for_sm90(ll):
    """The split-K kernel on FP8 operands (``tests/interpreted_split_k.py`` checks its values), in
    both its forms (LL words and flags), within the shared memory. Its 16-row blocks are below a
    warpgroup MMA's 64 rows, so Triton multiplies them with the older MMA on fp16 (every e4m3
    value is exact in fp16, the accumulator fp32): the operands still stream from memory at one
    byte an element, which is what few rows are bound by."""
    pytest.importorskip("iris")
    compiled = _compile_split_k(ll, fp8=True)
    ptx = compiled.asm["ptx"]
    assert "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32" in ptx
    assert "cvt.rn.f16x2.e4m3x2" in ptx  # the FP8 bytes converted in registers
    assert compiled.metadata.shared <= 227 * 1024


def test_split_k_in_the_graph_lane_compiles_for_sm90():
    """The split-K kernel with its call count on the device (the graph lane: int64 flags, the tag
    from the ``epoch`` argument) compiles for sm_90 with its flag release and acquire."""
    pytest.importorskip("iris")
    ptx = _compile_split_k(False, lane=True).asm["ptx"]
    assert "atom.global.sys.release" in ptx and "sys.acquire" in ptx


@pytest.mark.parametrize("world, group", [(3, 4), (8, 2)])
def test_split_k_ll_reads_in_groups_compile_for_sm90(world, group):
    """The LL reader over a padded group (3 ranks read as 4) and over several groups (8 ranks, 2
    at a time) compiles for sm_90; its volatile polls are predicated (the padding, or the words
    a thread does not hold, are not loaded)."""
    pytest.importorskip("iris")
    import re

    ptx = _compile_split_k(True, world, group).asm["ptx"]
    assert re.search(r"@%p\d+ ld\.volatile\.global\.b64", ptx), "no predicated volatile poll"


_EXCHANGE_COMMON = {"flags": "*i32", "heap_bases": "*i64", "epoch": "i32", "rank": "i32", "err": "*i32",
                    "timeout": "i64"}


@pytest.mark.parametrize("kernel, dtype", [
    ("one_shot_kernel", "bf16"), ("two_shot_kernel", "bf16"), ("pull_gather_kernel", "bf16"),
    ("reduce_scatter_kernel", "bf16"), ("staged_one_shot_kernel", "bf16"),
    # the FP8 ops' exchanges (decisions.md §20): fp32 products summed, FP8 shards gathered
    ("one_shot_kernel", "fp32"), ("two_shot_kernel", "fp32"), ("reduce_scatter_kernel", "fp32"),
    ("pull_gather_kernel", "fp8e4nv"), ("pull_gather_kernel", "fp8e5"),
    ("pull_gather_kernel", "u8")])  # the row-wise FP8 gather's bytes, poisoned as all ones
def test_exchange_kernels_compile_for_sm90_with_their_late_peer_poison(kernel, dtype):
    """The exchange kernels, with a late peer's NaN (``tests/interpreted_exchange.py`` checks the
    values), compile for sm_90: signals released and waits acquired at system scope."""
    pytest.importorskip("iris")
    from commfuse.kernels import exchange

    t = f"*{dtype}"
    if kernel == "one_shot_kernel":
        sig = {"partial": t, "out": t, "n": "i32", "slot_base": "i32", **_EXCHANGE_COMMON,
               "epoch_at": "*i32"}
        consts = dict(OP=1, WORLD=2, BLOCK=8192, VEC=1, DEVICE_EPOCH=False)
    elif kernel == "two_shot_kernel":
        sig = {"partial": t, "out": t, "n": "i32", "share": "i32", **_EXCHANGE_COMMON}
        consts = dict(OP=1, WORLD=4, BLOCK=8192)
    elif kernel == "staged_one_shot_kernel":  # the graph lane's: int64 flags and counters
        sig = {"src": t, "out": t, "data": t, "n": "i32", "half_elems": "i32",
               **_EXCHANGE_COMMON, "flags": "*i64", "counter": "*i64"}
        consts = dict(OP=4, WORLD=2, BLOCK=8192, SLOTS=128)
    else:
        sig = {"shard" if kernel == "pull_gather_kernel" else "partial": t, "out": t,
               "outer": "i32", "inner": "i32", **_EXCHANGE_COMMON}
        consts = dict(OP=2, WORLD=2, BLOCK=8192, VEC=1)
    # the argument order is the kernel's own
    names = list(getattr(exchange, kernel).arg_names)
    sig = {name: sig[name] for name in names if name in sig}
    ptx = _compile_for_sm90(getattr(exchange, kernel), sig, consts, num_warps=16).asm["ptx"]
    assert "sys.release" in ptx and "sys.acquire" in ptx, "the signal's release, the wait's acquire"


@pytest.mark.parametrize("kernel,scatter", [("one_shot_add_rms_norm_kernel", False),
                                            ("one_shot_add_rms_norm_kernel", True),
                                            ("staged_add_rms_norm_kernel", False)],
                         ids=["one_shot", "one_shot_scatter", "staged"])
def test_norm_epilogue_compiles_for_sm90_with_a_row_in_registers(kernel, scatter):
    """The all-reduce + add + RMSNorm kernels (``tests/interpreted_norm_epilogue.py`` checks the
    values) at their largest row, 8192 bf16 elements at 16 warps, the one-shot in both its forms
    (all-reduce, sequence parallelism's reduce-scatter): they compile for sm_90 with the signal's
    release and the wait's acquire."""
    pytest.importorskip("iris")
    from commfuse.kernels import norm_epilogue

    rows = {name: "*bf16" for name in ("partial", "src", "x", "weight", "h", "n", "data")}
    sig = {**rows, "rows": "i32", "cols": "i32", "half_elems": "i32", "eps": "fp32", "slot_base": "i32",
           "chunk": "i32", **_EXCHANGE_COMMON}
    consts = dict(OP=1, WORLD=2, BLOCK=8192, VEC=1, WEIGHT_LAST=True)
    if kernel == "one_shot_add_rms_norm_kernel":
        consts.update(SCATTER=scatter)
    if kernel == "staged_add_rms_norm_kernel":  # the graph lane's: int64 flags and counters
        sig.update(flags="*i64", counter="*i64")
        consts.update(OP=4, SLOTS=128)
    fn = getattr(norm_epilogue, kernel)
    sig = {name: sig[name] for name in fn.arg_names if name in sig}
    ptx = _compile_for_sm90(fn, sig, consts, num_warps=16).asm["ptx"]
    assert "sys.release" in ptx and "sys.acquire" in ptx, "the signal's release, the wait's acquire"


@pytest.mark.parametrize("fast", [True, False], ids=["fast_accum", "fp32_accum"])
@pytest.mark.parametrize("rowwise", [False, True], ids=["tensorwise", "rowwise"])
def test_scaled_matmul_compiles_for_sm90_on_fp8_tensor_cores(fast, rowwise):
    """The GEMM alone on FP8 operands (``tiles.scaled_matmul``; ``tests/interpreted_tiles.py``
    checks its values against ``torch._scaled_mm``) compiles for sm_90 to Hopper's FP8
    warpgroup MMA in both accumulations (not the fp16 MMA Triton falls back to for
    ``max_num_imprecise_acc=0``); with ``use_fast_accum=False`` the partials are added into fp32
    registers (adds the fast form has none of), and the tile fits the shared memory."""
    from commfuse.kernels import tiles

    bm, bn, bk = 128, 256, 128
    sig = {"a_desc": f"tensordesc<fp8e4nv[{bm}, {bk}]>", "b_desc": f"tensordesc<fp8e4nv[{bn}, {bk}]>",
           "bias": "*bf16", "c": "*bf16", "M": "i32", "N": "i32", "K": "i32", "stride_bm": "i32", "stride_bn": "i32",
           "scale_a": "*fp32", "scale_b": "*fp32"}
    consts = dict(BM=bm, BN=bn, BK=bk, GROUP_M=8, B_TRANSPOSED=True, HAS_BIAS=False, SCALED=True, ROWWISE=rowwise,
                  IMPRECISE=tiles.fp8_accumulation(fast, bk))
    kernel = _compile_for_sm90(tiles.matmul_kernel, sig, consts, num_warps=8, num_stages=3)
    ptx = kernel.asm["ptx"]
    assert "wgmma.mma_async.sync.aligned" in ptx and ".e4m3.e4m3" in ptx
    assert kernel.metadata.shared <= 227 * 1024
    if not fast:
        fast_ptx = _compile_for_sm90(tiles.matmul_kernel, sig, dict(consts, IMPRECISE=tiles.fp8_accumulation(True, bk)),
                                     num_warps=8, num_stages=3).asm["ptx"]
        assert ptx.count("add.f32") > fast_ptx.count("add.f32") == 0


@pytest.mark.parametrize("fp8, rowwise", [(False, False), (True, False), (True, True)],
                         ids=["bf16", "fp8", "fp8_rowwise"])
def test_fused_all_gather_compiles_for_sm90(fp8, rowwise):
    """The fused all-gather kernel (``tests/interpreted_fused.py`` checks its values) with its
    pushers: bf16 and FP8 shards with tensor-wise scales (FP8 warpgroup MMAs over the gathered
    bytes) with the gathered copy, and the row-wise form, whose pushers push each chunk's row
    scales beside its rows (no gathered copy), within the shared memory."""
    pytest.importorskip("iris")
    from commfuse.kernels import fused_all_gather, tiles

    bm, bn, bk, el = 128, 256, 128 if fp8 else 64, "fp8e4nv" if fp8 else "bf16"
    sig = {"g_desc": f"tensordesc<{el}[{bm}, {bk}]>", "b_desc": f"tensordesc<{el}[{bn}, {bk}]>",
           "gathered": f"*{el}", "bias": "*bf16", "out": "*bf16", "data": f"*{el}", "rows": "i32", "N": "i32",
           "K": "i32", "stride_bm": "i32", "stride_bn": "i32", "flags": "*i32", "heap_bases": "*i64",
           "epoch": "i32", "rank": "i32", "err": "*i32", "timeout": "i64", "ticket": "*i32", "ticket_base": "i32",
           "trace": "*i64", "pushers": "i32", "flag_rows": "i32", "scale_a": "*fp32", "scale_b": "*fp32"}
    consts = dict(OP=7, WORLD=2, BM=bm, BN=bn, BK=bk, GROUP_M=8, CH=32, PUSH_K=256, B_TRANSPOSED=True,
                  HAS_BIAS=False, GATHER=not rowwise, TRACE=False, SCALED=fp8,
                  IMPRECISE=tiles.fp8_accumulation(True, bk) if fp8 else None, ROWWISE=rowwise)
    fn = fused_all_gather.all_gather_gemm_kernel
    assert list(sig) == [n for n in fn.arg_names if n not in consts]
    compiled = _compile_for_sm90(fn, sig, consts, num_warps=8, num_stages=3)
    ptx = compiled.asm["ptx"]
    assert "wgmma.mma_async.sync.aligned" in ptx and ((".e4m3.e4m3" in ptx) == fp8)
    assert compiled.metadata.shared <= 227 * 1024
