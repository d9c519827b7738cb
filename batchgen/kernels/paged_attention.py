"""Paged decode attention for CPU, float32 and bfloat16 (``csrc/paged_decode_attention.cpp``).

The pure-torch decode path gathers each sequence's whole context out of the paged cache into
a padded ``[b, L, Hkv, D]`` copy and then runs SDPA over it: the context crosses memory three
times (read, write, read again). This kernel reads each key and value once, straight through
the block table: on the bench model (512 sequences x 448 positions, 2 KV heads x 64, 2 cores)
one layer's decode attention took 90 ms on the torch path and about 20 ms here.

From memory the kernel is bandwidth-bound: this machine reads blocks of 8 KiB scattered over
gigabytes at about 4.5 GB/s per core with two readers (a plain summing loop). One layer of
2,048 sequences x 448 positions (1 KiB of K and V per position), medians of 8 alternating
rounds in one process: generic loops 120 ms (7.6 GB/s), the AVX2 path 114 ms, and with the
cache on transparent huge pages (`batchgen.engine.host_allocator.advise_huge_pages`) 104 ms
and 95 ms (9.7 GB/s).

float32 paths: AVX-512F (``csrc/paged_decode_attention_f32.h``: two query heads of a KV head
per zmm in the scores, a 16-lane softmax, each query head's P @ V accumulators in registers,
rows prefetched into L2 two blocks ahead) where the head size is 64 or 128 and Hq / Hkv is
even, else AVX2, else generic loops. The AVX-512F path's scores are the AVX2 path's bit for
bit; its softmax (Cephes' exp, explicit 16-lane sums) differs from the AVX2 path's by a few
ulps. At the bench's shapes (70 and 256 sequences, contexts 32-1,500, 4 caches cycled, one
thread, CPU time, loaded machine) it took 0.55-0.57x the AVX2 path's time (one process, A/B
alternated), about 0.8x vLLM 0.32's ``vec`` path where the AVX2 path took 1.5x
(``benchmarks/peers/decode_attention.py --dtype float32``).

bfloat16 (q, caches and output in bf16): each bf16 value is widened exactly to float32 in
registers, scores, softmax and the weighted sum of values run in float32; the unnormalised
softmax weights are rounded to bf16 before the sum and the output once, as torch's CPU SDPA does
in bf16 (so decode here and a bf16 prefill, which runs SDPA, agree up to summation order);
half the bytes of float32 to read. Paths (`decode_kernel_isa`, logged once per shape):
``amx``: the ``avx512_bf16`` path with its scores by AMX-BF16 (``tdpbf16ps`` on 16 key rows
loaded from the cache by stride) and its P @ V too (value rows interleaved in pairs into tiles
per 32 positions), where the CPU has AMX and Linux grants its tile state, blocks
are a multiple of 16, D <= 192 and Hq / Hkv <= 16; ``avx512_bf16`` (``vdpbf16ps`` on bf16 pairs
for Q @ K^T and P @ V, one KV head and its query heads at a time, accumulators in registers, a
vectorised exp) for head sizes that are a multiple of 32 where the CPU has avx512_bf16; else
AVX-512F (bf16 widened to float32, 16 lanes) for multiples of 16 where the library is built
for it, else AVX2 (multiples of 8), else generic loops. ``BATCHGEN_PAGED_ATTENTION_ISA`` (one
of `ISAS`, default ``auto``) forces a path for A/B runs. Measured at the bench's shapes (70
sequences, contexts log-uniform 32-1,500, Hq 8, Hkv 2, D 64, one thread, CPU time, loaded
machine): ``amx`` about 4x the ``avx512f`` path with the cache in L2/L3 and 2-2.4x from memory,
where both wait on the cache misses one core keeps in flight (see docs/performance.md).

A KV cache narrower than q (vLLM's ``kv_cache_dtype``, `MIXED_PAIRS`: q float32 over bfloat16,
float8_e4m3fn or float8_e5m2; q bfloat16 over fp8): a key is worth its stored value times
``k_scale``, a value times ``v_scale``; the arithmetic is q's dtype's path's (bf16: float32
sums, weights and output rounded to bf16). AVX-512F for head sizes 64 and 128 (the float32
path's structure, each row widened to float32 once: csrc/paged_decode_attention_mixed.h), else
generic loops. Measured (`benchmarks/paged_attention.py`, 512 sequences x contexts 32-1,500,
one thread, CPU time, loaded 2-core machine): q float32 over fp8 0.53-0.70x and over bf16
0.75-0.79x the float32 cache's time, where 4x and 2x fewer bytes would allow about 0.25x and
0.5x: the path turns compute-bound (with the cache in L2 it takes 1.0-1.1x the float32 path's
time, a quarter of it converting). q bf16 over fp8 takes about the bf16 kernel's time on a
bf16 cache (0.9-1.0x): the ``vdpbf16ps`` path does the same work in fewer instructions.
"""

from __future__ import annotations

import ctypes
import logging

import torch

from batchgen.kernels.cpu_build import cpu_flags, kernels_enabled, load_library
from batchgen.kernels.paged_attention_checks import (  # noqa: F401 (check_decode_context: API)
    MIXED_PAIRS,
    check_args,
    check_cache_dtype,
    check_decode_context,
    rows_strided_ok,
)
from batchgen.kernels.profiling import kernel_scope
from batchgen.kernels.switches import env_choice

_i64, _ptr = ctypes.c_int64, ctypes.c_void_p
_DTYPES = (torch.float32, torch.bfloat16)  # the dtypes the kernel serves
# KV cache dtypes narrower than q (vLLM's kv_cache_dtype), the mixed entry's codes.
_KV_CODES = {torch.bfloat16: 0, torch.float8_e4m3fn: 1, torch.float8_e5m2: 2}
# Forced paths of the bf16 entry (the ``isa`` argument): auto picks the fastest this CPU and
# build run; a forced path that does not apply (head size, block size, CPU) falls back down
# the list amx -> avx512_bf16 -> avx512f -> avx2 -> generic.
ISAS = {"auto": 0, "avx2": 1, "generic": 2, "avx512f": 3, "avx512_bf16": 4, "amx": 5}
ISA_ENV = "BATCHGEN_PAGED_ATTENTION_ISA"  # the default ``isa`` (A/B runs of the engine)
_LEVEL_NAMES = {4: "amx", 3: "avx512_bf16", 2: "avx512f", 1: "avx2", 0: "generic"}

logger = logging.getLogger(__name__)
_lib = None
_logged: set[tuple[torch.dtype, int, int, int, torch.dtype, str]] = set()


def _library():
    """The configured kernel library, or None while it is unavailable (not cached then, so
    turning ``BATCHGEN_CPU_KERNELS`` back on takes effect)."""
    global _lib
    if _lib is None:
        lib = load_library("paged_decode_attention")
        if lib is None:
            return None
        common = [_ptr] * 6 + [_i64] * 6 + [ctypes.c_float, _i64, _i64]
        # + isa, q's row stride
        lib.batchgen_paged_decode_attention_f32.argtypes = [*common, _i64, _i64]
        lib.batchgen_paged_decode_attention_bf16.argtypes = [*common, _i64, _i64]
        lib.batchgen_paged_decode_attention_bf16_isa.argtypes = [_i64] * 3
        lib.batchgen_paged_decode_attention_f32_isa.argtypes = [_i64] * 2
        # + isa, q's row stride, q's dtype, the cache's dtype, k_scale, v_scale
        lib.batchgen_paged_decode_attention_mixed.argtypes = [
            *common, *[_i64] * 4, ctypes.c_double, ctypes.c_double
        ]
        lib.batchgen_paged_decode_attention_mixed_isa.argtypes = [_i64]
        for fn in (
            lib.batchgen_paged_decode_attention_f32,
            lib.batchgen_paged_decode_attention_bf16,
            lib.batchgen_paged_decode_attention_bf16_isa,
            lib.batchgen_paged_decode_attention_f32_isa,
            lib.batchgen_paged_decode_attention_mixed,
            lib.batchgen_paged_decode_attention_mixed_isa,
        ):
            fn.restype = ctypes.c_int
        _lib = lib
    return _lib


def _function():
    """The library when ``BATCHGEN_CPU_KERNELS`` lets the kernel run and it is built, else None."""
    return _library() if kernels_enabled("paged_decode_attention") else None


def _served(dtype: torch.dtype, cache_dtype: torch.dtype | None) -> bool:
    cache_dtype = dtype if cache_dtype is None else cache_dtype
    return (dtype == cache_dtype and dtype in _DTYPES) or (dtype, cache_dtype) in MIXED_PAIRS


def decode_kernel_available(
    device: torch.device, dtype: torch.dtype, cache_dtype: torch.dtype | None = None
) -> bool:
    """True when `paged_decode_attention` serves queries of ``dtype`` over KV caches of
    ``cache_dtype`` (None: ``dtype``) on ``device``: CPU, the kernel built (see
    `batchgen.kernels.cpu_build`), and the pair float32/float32, bfloat16/bfloat16 or one of
    `MIXED_PAIRS` (a cache narrower than q: vLLM's ``kv_cache_dtype``; every head size, the
    generic loops where the AVX-512F path does not apply)."""
    return device.type == "cpu" and _served(dtype, cache_dtype) and _function() is not None


def decode_kernel_isa(
    dtype: torch.dtype,
    head_size: int,
    num_queries_per_kv: int = 1,
    block_size: int = 16,
    cache_dtype: torch.dtype | None = None,
) -> str | None:
    """The path `paged_decode_attention` runs under ``isa="auto"`` for ``dtype``, ``head_size``,
    ``num_queries_per_kv`` (Hq / Hkv) and ``block_size`` on this CPU and build: ``"amx"``
    (bfloat16, the ``"avx512_bf16"`` path with its scores and P @ V by AMX-BF16: head size a
    multiple of 32 up to 192, at most 16 query heads per KV head, blocks of a multiple of 16,
    the CPU has AMX and Linux grants its tile state), ``"avx512_bf16"`` (bfloat16, head size a
    multiple of 32, the CPU has avx512_bf16), ``"avx512f"`` (library built for AVX-512F;
    bfloat16: head size a multiple of 16; float32: head size 64 or 128 and an even number of
    query heads per KV head), ``"avx2"`` (head size a multiple of 8, AVX2/FMA build),
    ``"generic"`` (plain loops), or None when the kernel does not serve ``dtype`` or is
    unavailable. A ``cache_dtype`` other than ``dtype`` (one of `MIXED_PAIRS`): ``"avx512f"``
    for head size 64 or 128 where the library is built for AVX-512F, else ``"generic"``."""
    lib = _function()
    if lib is None or not _served(dtype, cache_dtype):
        return None
    if cache_dtype is not None and cache_dtype != dtype:
        return _LEVEL_NAMES[lib.batchgen_paged_decode_attention_mixed_isa(head_size)]
    if dtype == torch.float32:
        level = lib.batchgen_paged_decode_attention_f32_isa(head_size, num_queries_per_kv)
        return _LEVEL_NAMES[level]
    level = lib.batchgen_paged_decode_attention_bf16_isa(head_size, num_queries_per_kv, block_size)
    return _LEVEL_NAMES[level]


def default_isa() -> str:
    """The ``isa`` `paged_decode_attention` uses when none is given (bfloat16):
    ``$BATCHGEN_PAGED_ATTENTION_ISA`` (case and spaces ignored), ``"auto"`` when unset or empty.

    Raises:
        ValueError: a value not in `ISAS`, naming the variable and the allowed values.
    """
    return env_choice(ISA_ENV, sorted(ISAS))


def _log_once(
    dtype: torch.dtype,
    head_size: int,
    group: int,
    block_size: int,
    isa: str,
    cache_dtype: torch.dtype | None = None,
) -> None:
    cache_dtype = dtype if cache_dtype is None else cache_dtype
    key = (dtype, head_size, group, block_size, cache_dtype, isa)
    if key not in _logged:
        _logged.add(key)
        chosen = decode_kernel_isa(*key[:5]) if isa == "auto" else f"forced {isa}"
        cache = "" if cache_dtype == dtype else f", {cache_dtype} KV cache"
        logger.info(
            "paged decode attention, %s, head size %d, %d query heads per KV head, blocks of "
            "%d%s: %s path%s",
            *key[:4],
            cache,
            chosen,
            _why_not_avx512(dtype, chosen) if not cache else _why_generic_mixed(chosen),
        )


def _why_generic_mixed(chosen: str | None) -> str:
    """Why a narrower cache (kv_cache_dtype) takes the generic loops on an AVX-512 CPU."""
    if chosen != "generic" or "avx512f" not in cpu_flags().split():
        return ""
    return " (the AVX-512F path for a narrower KV cache needs head size 64 or 128)"


def _why_not_avx512(dtype: torch.dtype, chosen: str | None) -> str:
    """Why a float32 shape takes the AVX2 path on an AVX-512 CPU (other kernels, e.g. the fused
    MoE, log avx512f there): the float32 AVX-512F path exists for some shapes only."""
    if dtype != torch.float32 or chosen != "avx2" or "avx512f" not in cpu_flags().split():
        return ""
    return (
        " (the float32 AVX-512F path needs head size 64 or 128 and an even number of query "
        "heads per KV head)"
    )


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    kv_lens: torch.Tensor,
    block_size: int,
    scale: float,
    sliding_window: int | None,
    out: torch.Tensor,
    isa: str | None = None,
    context_checked: bool = False,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """One decode token per sequence attends to its cached context; writes ``out``.

    Args:
        q: ``[B, Hq, D]`` float32 or bfloat16 (the new tokens' queries, RoPE applied). Each
            sequence's ``[Hq, D]`` must be contiguous, the rows may be strided (q a view of
            the fused QKV projection's ``[B, (Hq + 2 Hkv) * D]`` output is read in place, no
            copy); another layout is copied first.
        k_cache, v_cache: ``[num_blocks * block_size, Hkv, D]``, contiguous, the new tokens'
            K/V already written; q's dtype, or both of a narrower dtype (vLLM's
            ``kv_cache_dtype``, `MIXED_PAIRS`): q float32 over bfloat16, float8_e4m3fn or
            float8_e5m2, q bfloat16 over float8_e4m3fn or float8_e5m2. In bfloat16 the
            scores, softmax and weighted sum are float32, the unnormalised softmax weights are
            rounded to bf16 before the weighted sum, and the output is rounded to bf16 (round
            to nearest even), as torch's CPU SDPA in bf16 does.
        block_tables: ``[B, n]`` int64 block ids (entries past a context are not read).
        kv_lens: ``[B]`` int64 context lengths including the new token (>= 1).
        block_size: tokens per KV block.
        scale: softmax scale; sliding_window: HF's rule (key j visible iff ``pos - j <
            window``) or None.
        out: ``[B, Hq, D]``, q's dtype, contiguous: receives the result.
        isa: ``"auto"`` (the fastest path, `decode_kernel_isa`), or one of `ISAS` to force a
            path (tests, A/B measurements; one that does not apply to the dtype, head size or
            CPU falls back to the next narrower: float32 has ``avx512f``, ``avx2`` and
            ``generic``, a narrower cache ``avx512f`` and ``generic``, ``avx2`` running the
            generic loops there). None: `default_isa` (the ``BATCHGEN_PAGED_ATTENTION_ISA`` variable,
            ``"auto"`` when unset).
        context_checked: the caller has run `check_decode_context` on these very
            ``block_tables`` and ``kv_lens`` against this cache's blocks (the layers of one
            step share them: `batchgen.models.layers.attention.paged_attention` checks once per
            step); the shape, dtype and layout checks run on every call regardless.
        k_scale, v_scale: a narrower cache's dequantisation scales (finite, > 0): a cached
            key is worth its stored value (exact in float32) times ``k_scale``, a value times
            ``v_scale`` (folded into the score scale and the output's normalisation in
            float64, rounded once to float32). Must be 1.0 for a cache of q's dtype.
    Raises:
        RuntimeError if the kernel is unavailable or rejects the shapes (Hq not a multiple of
        Hkv); ValueError (naming the argument) for a wrong dtype or dtype pairing (the
        message lists the served pairs), a tensor off the CPU, a non-contiguous cache or
        output, a bad scale, or a context or block id outside the cache: the kernel reads raw
        memory, so these are checked first.
    """
    lib = _function()
    if lib is None:
        raise RuntimeError("the CPU paged decode attention kernel is not available")
    if isa is None:
        isa = default_isa()
    if isa not in ISAS:
        raise ValueError(f"isa must be one of {sorted(ISAS)}, got {isa!r}")
    args = (q, k_cache, v_cache, block_tables, kv_lens, block_size, out, sliding_window)
    check_args(*args, context_checked)
    mixed = check_cache_dtype(q, k_cache, v_cache, k_scale, v_scale)
    extra: tuple = ()
    if mixed:
        fn = lib.batchgen_paged_decode_attention_mixed
        q_code = 0 if q.dtype == torch.float32 else 1
        extra = (q_code, _KV_CODES[k_cache.dtype], float(k_scale), float(v_scale))
    elif q.dtype == torch.bfloat16:
        fn = lib.batchgen_paged_decode_attention_bf16
    else:
        fn = lib.batchgen_paged_decode_attention_f32
    b, hq, d = q.shape
    hkv = k_cache.shape[1]
    _log_once(q.dtype, d, max(1, hq // max(1, hkv)), block_size, isa, k_cache.dtype)
    if not rows_strided_ok(q):
        q = q.contiguous()
    block_tables = block_tables.contiguous()
    kv_lens = kv_lens.contiguous()
    with kernel_scope("batchgen::paged_decode_attention"):  # named for torch.profiler
        rc = fn(
            q.data_ptr(),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            block_tables.data_ptr(),
            kv_lens.data_ptr(),
            out.data_ptr(),
            b,
            hq,
            hkv,
            d,
            block_size,
            block_tables.shape[1],
            scale,
            sliding_window or 0,
            torch.get_num_threads(),
            ISAS[isa],
            q.stride(0) if b > 1 else hq * d,  # one row: its stride is never used
            *extra,
        )
    if rc != 0:
        raise RuntimeError(f"paged decode attention rejected Hq={hq}, Hkv={hkv}, D={d}")
