"""Paged prefill attention for CPU, float32 and bfloat16 (``csrc/prefill_attention.cpp``), on a
KV cache of q's dtype or a narrower ``kv_cache_dtype`` (`CACHE_DTYPES`).

The torch prefill path runs one SDPA call per prefill chunk; a chunk after a sequence's first
``index_select``s its sequence's whole cached context out of the paged cache and builds a
``[n, kv_len]`` mask. This kernel is flash attention (Dao et al. 2022; FlashAttention-2's loop
order, Dao 2023 Sec. 3.1): per block of 16 query tokens (32 on the AMX path) and the query
heads that share one KV head, it walks the visible keys in blocks of 32 straight from their
cache slots with an online softmax (causal, grouped-query, sliding window; no copy of the
context, no mask tensor). Paths (`prefill_kernel_isa`): bf16 on AMX-BF16 (``tdpbf16ps`` for
Q K^T and P V, float32 accumulation and softmax) where the CPU has it; else AVX-512 (float32
FMAs; bf16 ``vdpbf16ps`` where the CPU has avx512_bf16: AMD Zen 4, Intel Cooper Lake); else
loops the compiler vectorises. A narrower cache (float32 q on bf16 / fp8 e4m3fn / e5m2, bf16 q on
fp8; ``csrc/prefill_attention_kv.h``) is read exactly: the AVX-512 path converts each key
block's K/V rows to q's compute type once per task (bf16 q keeps ``vdpbf16ps``), the generic
loops per element; AMX serves a bf16 cache only. See the sources' headers for the layouts and
numerics.

``BATCHGEN_PREFILL_ATTENTION`` (`PREFILL_ATTENTION_ENV`): ``auto`` (default: the kernel where
`auto_runs_kernel` says it measured faster than SDPA, else SDPA), ``kernel`` (the kernel for
every dtype it serves, the generic loops included), ``sdpa`` (torch's SDPA per chunk, the
oracle).
"""

from __future__ import annotations

import ctypes
import functools
import logging
from dataclasses import dataclass

import torch

from batchgen.kernels.cpu_build import cpu_flags, kernels_enabled, load_library
from batchgen.kernels.paged_attention import rows_strided_ok
from batchgen.kernels.profiling import kernel_scope
from batchgen.kernels.switches import env_choice

_i64, _ptr = ctypes.c_int64, ctypes.c_void_p
_DTYPES = (torch.float32, torch.bfloat16)  # q's dtypes the kernel serves
# The caches' dtypes (kv_cache_dtype) it reads under each q dtype, and their codes in the C++
# source (KvCode, csrc/prefill_attention_kv.h).
_CACHE_CODES = {
    torch.float32: 0,
    torch.bfloat16: 1,
    torch.float8_e4m3fn: 2,
    torch.float8_e5m2: 3,
}
CACHE_DTYPES = {
    torch.float32: tuple(_CACHE_CODES),
    torch.bfloat16: (torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2),
}
# Paths (``isa``): auto = AMX (bf16) where usable, else AVX-512 (float32: AVX-512F; bf16:
# AVX512-BF16), else the generic loops; the others force one (refused where the CPU lacks it).
ISAS = {"auto": 0, "generic": 1, "avx512": 2, "amx": 3}
_PATHS = ("generic", "avx512", "amx")  # batchgen_prefill_attention_isa's answers
PREFILL_ATTENTION_ENV = "BATCHGEN_PREFILL_ATTENTION"
MODES = ("auto", "kernel", "sdpa")

logger = logging.getLogger(__name__)
_lib = None
_logged: set[tuple] = set()


def _library():
    """The kernel library, or None while it is unavailable or turned off."""
    global _lib
    if not kernels_enabled("prefill_attention"):
        return None
    if _lib is None:
        lib = load_library("prefill_attention")
        if lib is None:
            return None
        f32 = ctypes.c_float
        lib.batchgen_prefill_attention.argtypes = (
            [_ptr] * 6 + [_i64] * 4 + [f32] + [_i64] * 6 + [f32, f32]
        )  # ..., scale, window, threads, isa, q's row stride, q dtype, cache dtype, k/v scale
        lib.batchgen_prefill_attention_isa.argtypes = [_i64, _i64, _i64]
        for fn in (lib.batchgen_prefill_attention, lib.batchgen_prefill_attention_isa):
            fn.restype = ctypes.c_int
        _lib = lib
    return _lib


def prefill_attention_mode() -> str:
    """``$BATCHGEN_PREFILL_ATTENTION`` (case and spaces ignored), ``"auto"`` when unset or empty.

    Raises:
        ValueError: a value not in `MODES`, naming the variable and the allowed values.
    """
    return env_choice(PREFILL_ATTENTION_ENV, MODES)


def _serves(dtype: torch.dtype, cache_dtype: torch.dtype) -> bool:
    return cache_dtype in CACHE_DTYPES.get(dtype, ())


def prefill_kernel_isa(
    dtype: torch.dtype, head_size: int, cache_dtype: torch.dtype | None = None
) -> str | None:
    """The path the kernel runs under ``isa="auto"`` for q's ``dtype``, ``head_size`` and the
    caches' ``cache_dtype`` (None: ``dtype``) on this CPU: ``"amx"`` (bf16 q and cache, head
    size a multiple of 32 up to 512, AMX-BF16 and avx512_bf16 usable), else ``"avx512"``
    (float32 q: head size a multiple of 16 and AVX-512F/BW/DQ; bf16 q: a multiple of 32 and
    avx512_bf16 too; any cache dtype it serves), else ``"generic"`` (loops the compiler
    vectorises), or None when the kernel is unavailable or does not serve the pair
    (`CACHE_DTYPES`)."""
    cache_dtype = dtype if cache_dtype is None else cache_dtype
    lib = _library()
    if lib is None or not _serves(dtype, cache_dtype):
        return None
    code = lib.batchgen_prefill_attention_isa(
        int(dtype == torch.bfloat16), _CACHE_CODES[cache_dtype], head_size
    )
    return _PATHS[code]


def use_prefill_kernel(
    device: torch.device,
    dtype: torch.dtype,
    head_size: int,
    cache_dtype: torch.dtype | None = None,
) -> bool:
    """Whether `paged_attention`'s prefill chunks run this kernel for q's ``dtype`` on a cache
    of ``cache_dtype`` (None: ``dtype``; a narrower kv_cache_dtype, `CACHE_DTYPES`): on CPU,
    per `prefill_attention_mode` (``auto``: where `auto_runs_kernel` says so; ``kernel``:
    every pair the kernel serves, any path; ``sdpa``: never) and the library built.

    Raises:
        ValueError: a bad ``BATCHGEN_PREFILL_ATTENTION``.
        RuntimeError: ``kernel`` forced on a CPU tensor where the library is unavailable.
    """
    cache_dtype = dtype if cache_dtype is None else cache_dtype
    mode = prefill_attention_mode()
    if mode == "sdpa" or device.type != "cpu" or not _serves(dtype, cache_dtype):
        return False
    if _library() is None:
        if mode == "kernel":
            raise RuntimeError(
                f"{PREFILL_ATTENTION_ENV}=kernel but the CPU prefill attention kernel is not "
                "available (BATCHGEN_CPU_KERNELS, or no C++ compiler: see the log)"
            )
        return False
    if mode == "auto":
        return auto_runs_kernel(dtype, head_size, cache_dtype)
    return True


def auto_runs_kernel(
    dtype: torch.dtype, head_size: int, cache_dtype: torch.dtype | None = None
) -> bool:
    """Whether ``BATCHGEN_PREFILL_ATTENTION=auto`` runs the kernel for q's ``dtype``,
    ``head_size`` and ``cache_dtype`` (None: ``dtype``) on this CPU: where its path measured
    faster than torch's SDPA (benchmarks/prefill_attention.py, bench shapes, one thread;
    docs/performance.md):

    - ``amx`` (bf16): 1.2-2.2x SDPA on Intel AMX machines;
    - ``avx512`` on a CPU without AMX: 1.9-2.9x SDPA in bf16, 1.5-2.3x in float32 (AMD Zen 4).
      On an AMX CPU float32 stays on SDPA until measured there (bf16 runs AMX there);
    - ``avx512`` with a narrower cache (kv_cache_dtype) on a CPU without AMX, against SDPA on
      the dequantised context (AMD Zen 4, `paged_attention` with the cache write, bench
      spans, ``--kv-cache-dtypes``): float32 q on bf16 1.5-2.1x, on fp8 1.5-2.4x; bf16 q on
      fp8 2.2-3.3x (0.96-1.38x the time of the kernel on a cache of q's dtype: the fp8 write
      costs more). On an AMX CPU SDPA until measured there;
    - ``generic``: never (0.4-0.9x SDPA on both kinds of machine).
    """
    cache_dtype = dtype if cache_dtype is None else cache_dtype
    path = prefill_kernel_isa(dtype, head_size, cache_dtype)
    if path == "amx":
        return True
    if cache_dtype != dtype:
        return path == "avx512" and not _cpu_has_amx()
    return path == "avx512" and (dtype == torch.bfloat16 or not _cpu_has_amx())


@functools.cache
def _cpu_has_amx() -> bool:
    return "amx_bf16" in cpu_flags().split()


@dataclass(frozen=True)
class PrefillPlan:
    """The prefill spans of one step as the kernel reads them, built once per step and checked
    at construction (the kernel reads them as raw memory; frozen so a checked plan stays so).

    Attributes:
        spans: ``[S, 4]`` int64 rows ``(token_start, num_tokens, kv_len, slot_offset)``.
        slots: ``[sum kv_len]`` int64: span i's slots of positions ``0 .. kv_len-1`` start at
            ``slot_offset``.
        num_slots: the cache rows every slot was checked against.
        num_tokens: the flat batch's tokens every span was checked to lie in.
    Raises:
        ValueError: naming the field, for spans or slots that are not contiguous int64 CPU
            tensors of those shapes, a span whose tokens leave ``[0, num_tokens)``, with
            ``num_tokens`` outside ``[1, kv_len]`` or slots past ``slots``, or a slot outside
            ``[0, num_slots)``.
    """

    spans: torch.Tensor
    slots: torch.Tensor
    num_slots: int
    num_tokens: int

    def __post_init__(self) -> None:
        for name, x, dim in (("spans", self.spans, 2), ("slots", self.slots, 1)):
            if (
                not isinstance(x, torch.Tensor)
                or x.dtype != torch.int64
                or x.device.type != "cpu"
                or x.dim() != dim
                or not x.is_contiguous()
            ):
                raise ValueError(
                    f"PrefillPlan.{name} must be a contiguous {dim}-D int64 CPU tensor, got "
                    f"{getattr(x, 'dtype', type(x))} {tuple(getattr(x, 'shape', ()))} on "
                    f"{getattr(x, 'device', '-')}"
                )
        if self.spans.shape[1] != 4:
            raise ValueError(f"PrefillPlan.spans must be [S, 4], got {tuple(self.spans.shape)}")
        if self.slots.numel() and (
            int(self.slots.min()) < 0 or int(self.slots.max()) >= self.num_slots
        ):
            raise ValueError(f"prefills' kv_slots must be in [0, {self.num_slots})")
        total = self.slots.numel()
        for i, (start, n, kv_len, offset) in enumerate(self.spans.tolist()):
            if n < 1 or n > kv_len:
                raise ValueError(f"prefills[{i}]: num_tokens {n} not in [1, kv_len]")
            if start < 0 or start + n > self.num_tokens:
                raise ValueError(f"prefills[{i}]: tokens leave the batch of {self.num_tokens}")
            if offset < 0 or offset + kv_len > total:
                raise ValueError(
                    f"prefills[{i}]: slots {offset} + kv_len {kv_len} past the plan's {total} slots"
                )


def build_prefill_plan(prefills: list, num_tokens: int, num_slots: int) -> PrefillPlan:
    """Pack `PrefillSpan`s (``token_start``, ``num_tokens``, ``kv_len``, ``kv_slots``) into a
    `PrefillPlan`, checking what the kernel reads as raw memory.

    Raises:
        ValueError: a span whose tokens leave ``[0, num_tokens)``, with ``num_tokens`` outside
            ``[1, kv_len]``, ``kv_slots`` not an integer CPU tensor ``kv_len`` long, or a slot
            outside ``[0, num_slots)`` (see `PrefillPlan`).
    """
    rows, slots, offset = [], [], 0
    for i, sp in enumerate(prefills):
        kv_slots = sp.kv_slots
        if not isinstance(kv_slots, torch.Tensor):
            raise ValueError(f"prefills[{i}]: kv_slots must be a tensor, got {type(kv_slots)}")
        if kv_slots.dtype.is_floating_point or kv_slots.dtype.is_complex or (
            kv_slots.dtype == torch.bool
        ):
            raise ValueError(
                f"prefills[{i}]: kv_slots must be an integer tensor, got {kv_slots.dtype}"
            )
        if kv_slots.device.type == "meta":
            raise ValueError(f"prefills[{i}]: kv_slots must be on the CPU or a GPU, not meta")
        if kv_slots.shape != (sp.kv_len,):
            raise ValueError(
                f"prefills[{i}]: kv_slots shape {tuple(kv_slots.shape)} != ({sp.kv_len},)"
            )
        rows.append((sp.token_start, sp.num_tokens, sp.kv_len, offset))
        slots.append(kv_slots)
        offset += sp.kv_len
    flat = torch.cat(slots).to("cpu", torch.int64) if slots else torch.zeros(0, dtype=torch.int64)
    spans = torch.tensor(rows, dtype=torch.int64).reshape(-1, 4)
    return PrefillPlan(spans, flat.contiguous(), num_slots, num_tokens)


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: PrefillPlan,
    scale: float,
    sliding_window: int | None,
    out: torch.Tensor,
    isa: str = "auto",
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Causal attention of every prefill span's queries to its context in the paged cache;
    writes the spans' rows of ``out`` (other rows untouched).

    Args:
        q: ``[T, Hq, D]`` float32 or bfloat16, RoPE applied; read in place when only its
            rows are strided (a view of the fused QKV output,
            `batchgen.kernels.paged_attention.rows_strided_ok`), else copied contiguous.
        k_cache, v_cache: ``[num_slots, Hkv, D]``, contiguous, one dtype: q's, or a narrower
            kv_cache_dtype (`CACHE_DTYPES`: float32 q reads bfloat16, float8_e4m3fn or
            float8_e5m2; bf16 q reads the two fp8 formats); the spans' new K/V already
            written (Hq a multiple of Hkv; query head h reads KV head h // (Hq / Hkv)).
        plan: `build_prefill_plan` for these spans and this cache's ``num_slots``.
        scale: softmax scale; sliding_window: HF's rule (key j visible to the query at
            position i iff ``j <= i`` and ``i - j < window``) or None.
        out: ``[T, Hq, D]``, q's dtype, contiguous.
        isa: ``"auto"`` (the path `prefill_kernel_isa` names), or one of `ISAS` to force a
            path (``"amx"``: bf16 q and cache only).
        k_scale, v_scale: the stored K and V are multiplied by these (vLLM's per-tensor
            scales; 1.0 for the engine's caches, `batchgen.models.layers.kv_cache_dtype`).
    Result: SDPA in q's dtype on the dequantised context (``cache.to(q.dtype) * scale``) up to
    summation order and where the scales are applied (folded into the score scale and the
    output). Numerics: every cache value is read exactly; scores, softmax and sums in float32;
    bf16 q rounds the unnormalised softmax weights and the output to bf16 (round to nearest
    even), as torch's CPU SDPA does in bf16.
    Raises:
        RuntimeError: the kernel is unavailable, rejects the head counts, or a forced ``isa``
            is not usable on this CPU for the dtypes and head size.
        ValueError: naming the argument, for a wrong dtype (pair), device, shape or layout, or
            a plan built for another cache size.
    """
    lib = _library()
    if lib is None:
        raise RuntimeError("the CPU prefill attention kernel is not available")
    _check(q, k_cache, v_cache, plan, sliding_window, out, isa)
    t, hq, d = q.shape
    hkv = k_cache.shape[1]
    key = (q.dtype, k_cache.dtype, d, hq // max(1, hkv), isa)
    if key not in _logged:
        _logged.add(key)
        path = prefill_kernel_isa(q.dtype, d, k_cache.dtype) if isa == "auto" else f"forced {isa}"
        logger.info(
            "prefill attention kernel, %s on a %s cache, head size %d, G %d: %s path",
            *key[:4],
            path,
        )
    if not rows_strided_ok(q):
        q = q.contiguous()
    q_stride = q.stride(0) if t > 1 else hq * d  # one row: its stride is never used
    with kernel_scope("batchgen::prefill_attention"):  # named for torch.profiler
        rc = lib.batchgen_prefill_attention(
            q.data_ptr(),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            out.data_ptr(),
            plan.spans.data_ptr(),
            plan.slots.data_ptr(),
            plan.spans.shape[0],
            hq,
            hkv,
            d,
            scale,
            sliding_window or 0,
            torch.get_num_threads(),
            ISAS[isa],
            q_stride,
            int(q.dtype == torch.bfloat16),
            _CACHE_CODES[k_cache.dtype],
            k_scale,
            v_scale,
        )
    if rc == 4:
        raise RuntimeError(
            f"prefill attention: isa {isa!r} is not usable on this CPU for {q.dtype} on a "
            f"{k_cache.dtype} cache, head size {d} (prefill_kernel_isa gives "
            f"{prefill_kernel_isa(q.dtype, d, k_cache.dtype)!r})"
        )
    if rc == 3:
        raise ValueError("prefill attention: a span's kv_len is above 2^31 - 1 positions")
    if rc != 0:
        raise RuntimeError(f"prefill attention rejected Hq={hq}, Hkv={hkv}, D={d} (code {rc})")


def _check(q, k_cache, v_cache, plan, sliding_window, out, isa) -> None:
    for name, x in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("out", out)):
        if x.dim() != 3:
            raise ValueError(f"{name} must have 3 dimensions, got shape {tuple(x.shape)}")
        if x.device.type != "cpu":
            raise ValueError(f"{name} must be a CPU tensor, got one on {x.device}")
    for name, x in (("q", q), ("out", out)):
        if x.dtype != q.dtype or x.dtype not in _DTYPES:
            raise ValueError(
                f"{name} must be a float32 or bfloat16 CPU tensor like q, got {x.dtype}"
            )
    if v_cache.dtype != k_cache.dtype or not _serves(q.dtype, k_cache.dtype):
        raise ValueError(
            f"k_cache and v_cache must share a dtype the kernel reads under {q.dtype} q "
            f"({', '.join(map(str, CACHE_DTYPES[q.dtype]))}), got {k_cache.dtype} and "
            f"{v_cache.dtype}"
        )
    for name, x in (("k_cache", k_cache), ("v_cache", v_cache), ("out", out)):
        if not x.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    if out.shape != q.shape or v_cache.shape != k_cache.shape or k_cache.shape[2] != q.shape[2]:
        raise ValueError(
            f"shapes: q {tuple(q.shape)}, out {tuple(out.shape)}, k_cache "
            f"{tuple(k_cache.shape)}, v_cache {tuple(v_cache.shape)}"
        )
    if plan.num_slots != k_cache.shape[0]:
        raise ValueError(f"plan built for {plan.num_slots} slots, the cache has {k_cache.shape[0]}")
    if plan.num_tokens != q.shape[0]:
        raise ValueError(f"plan built for {plan.num_tokens} tokens, q has {q.shape[0]}")
    if sliding_window is not None and (
        not isinstance(sliding_window, int)
        or isinstance(sliding_window, bool)
        or sliding_window < 1
    ):
        raise ValueError(f"sliding_window must be None or a positive int, got {sliding_window!r}")
    if isa not in ISAS or (isa == "amx" and q.dtype != torch.bfloat16):
        raise ValueError(f"isa must be one of {sorted(ISAS)} ('amx' bf16 only), got {isa!r}")
