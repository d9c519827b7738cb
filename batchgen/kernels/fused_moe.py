"""Fused MoE experts for CPU, float32 and bfloat16 (``csrc/fused_moe.cpp``).

One call runs every expert of a layer: per expert, gather its rows, ``silu(x W1^T) * (x W3^T)``,
times ``W2^T``, weighted by the router; then each token's top-k outputs are summed in slot order.
The GEMMs use a register-blocked micro-kernel on weights packed once (`pack_expert_weights`).
Against the per-expert torch path (`fused_experts_per_expert`: MKL GEMMs plus about eight small
ops per expert), on the bench model (E 64, H 512, I 256, top-8, 2 cores, one process, two
rounds each) the AVX2 kernel ran 31.6 -> 10.5 ms per layer at 64 tokens, 68 -> 37 at 512,
88 -> 59 at 1,024, 150 -> 130 at 2,048, 290 -> 260 at 4,096 (`/tmp` scripts of session 5 on
issue 4). The GEMM alone matches MKL from 128 rows per expert and beats it below (one core: 29
vs 13-15 GFLOP/s at 8 rows, 57 vs 51 at 64), where MKL packs the weight on every call.

Micro-kernels (`kernel_isa`, logged once per dtype on first use):

- float32, chosen when the library is compiled (``-march=native``): AVX-512F, 12 rows x 32
  columns in 24 zmm accumulators, where the compiler defines ``__AVX512F__``; else AVX2/FMA,
  6 x 16. Both run the same FMA chain per output, so their results are bit-identical
  (``isa="avx2"`` forces the AVX2 one for A/B runs). Measured on one core of a 2-core AVX-512
  machine under load from other jobs (minimum of 40 alternated calls, E 4, top-1, H 512, I 256):
  AVX-512 vs AVX2 at 4 tokens 0.25 vs 0.24 ms (weight-bandwidth bound), 64 tokens 90 vs 67
  GFLOP/s, 256 tokens 96 vs 69, 1,024 tokens 65 vs 49. The AVX-512 one prefetches each
  panel pair 2 KiB ahead in its first row block (the hardware streamer stops at every 4 KiB
  page) and writes y_slots of a large call with non-temporal stores, as the bf16 kernels do:
  bench layer (E 64, top-8), one thread, process time, machine loaded, same-run A/B against
  the kernel without either: 70 tokens 8.9 -> 7.6 ms, 257 tokens 17.8 -> 15.1, 2,048 tokens
  107 -> 93 (the stores alone: 99); 16 tokens (about 2 rows per expert, at the weight
  stream's bandwidth already) unchanged.
- bfloat16, chosen at run time: AMX-BF16 (``tdpbf16ps`` on 2 x 2 tiles of 16 x 16 float32)
  where the CPU has amx_bf16 and the OS grants this process the tile state (Linux
  ``arch_prctl(ARCH_REQ_XCOMP_PERM)``, asked once), else ``vdpbf16ps`` (AVX512-BF16, two k per
  instruction, 12 x 32 like the float32 one). Both read weights packed with pairs of k
  interleaved (an AMX B tile is 16 such rows), accumulate in float32, round the SiLU-gated
  activation once to bf16 (round to nearest even) before the down GEMM, and weight and sum the
  slots in float32; the result is float32, or bf16 rounded in that last pass (``out_dtype``: the
  bits of ``.to(torch.bfloat16)``, without the cast). AMX pads an expert's rows to a multiple of 16
  with zero rows and needs H and I multiples of 32 (other layers take vdpbf16ps). Same measurement
  (E 4, top-1, H 512, I 256, one thread, minimum of 30 alternated calls, machine loaded):
  GFLOP/s float32 AVX-512 / vdpbf16ps / AMX at 4 tokens 12.5 / 15.1 / 18.8, 16 tokens 31 /
  37 / 44, 64 tokens 90 / 70 / 150, 256 tokens 101 / 72 / 345, 1,024 tokens 95 / 75 / 335; at
  1 and 8 tokens AMX is no slower than vdpbf16ps either (12.3 vs 5.5, 21 vs 20), so AMX runs
  every row count (no row-count-dependent choice, which would break batch invariance).
  ``vdpbf16ps`` alone gives no more arithmetic than two float32 FMAs per cycle on this CPU.
  ``BATCHGEN_CPU_AMX=0`` (or ``isa="avx512_bf16"``) turns AMX off for A/B runs. Without
  avx512_bf16 a bf16 model's experts take the per-expert torch path. The bf16 activation
  uses glibc's 16-lane AVX-512 ``expf`` (``_ZGVeN16v_expf``; measured within 2.6 ULP of
  float64 ``exp`` on every third float in [-88, 88], as is the 8-lane AVX2 variant the
  float32 path gets from GCC). AMX runs it in the gate/up GEMM's epilogue (no float32
  ``[rows, 2I]`` buffer), runs the gate/up GEMM's k in blocks of 256 that stay in L1, and
  both bf16 kernels write the per-slot rows with non-temporal stores: at 2,048 tokens of the
  bench layer one thread went from 33.7 to 20.8 ms against the previous AMX kernel
  (``benchmarks/fused_moe_ab.py``, ``docs/performance.md``).

In float32 the result equals `batchgen.models.layers.moe.fused_experts_reference` up to float32
rounding:
the same sums in the same top-k order, but each GEMM output is summed over k in one sequential
chain (relative error against float64 measured up to 2e-6 at K = 4,096 and 3e-6 at 7,168, 2-7x
MKL's blocked sums) and SiLU's ``exp`` is glibc's vector one (4.6 ULP worst case against
torch's 2.3). In bfloat16 it is within one bf16 rounding of the activation of the float32
reference on the same bf16 inputs (the bound is derived in ``tests/test_fused_moe_bf16.py``).
A token's output does not depend on the other tokens in the call, in either dtype.

Memory: the packed weights are a second copy of the expert weights (a tensor of 4 MiB or more
reserves 2 MiB more address space, to start on a huge page; the pages before that start are
never written, so not resident: 48 packed tensors of 4 MiB written through added 190 MiB of
RSS against 194 MiB for plain ``torch.empty`` ones, one run on a loaded machine; the CPU KV
cache budget is ``kv_cache_memory_gb`` or a fixed 1 GiB, not what is left after the weights,
so it does not move), and the per-(token, slot) scratch (`_workspace`) keeps the size of the
largest call (T x top-k x H floats) for the life of the process.
"""

from __future__ import annotations

import array
import ctypes
import itertools
import logging
import threading

import torch
import torch.nn.functional as F

from batchgen.engine.host_allocator import empty_huge_pages
from batchgen.kernels.cpu_build import kernels_enabled, load_library
from batchgen.kernels.fused_moe_checks import PANEL, check_fused_moe_args
from batchgen.kernels.profiling import kernel_scope
from batchgen.kernels.switches import env_flag

logger = logging.getLogger(__name__)

_i64, _ptr = ctypes.c_int64, ctypes.c_void_p
_lib = None
_logged: set[str] = set()
# `fused_moe_silu`'s ``isa`` values per dtype (the kernel's codes).
ISAS = {
    torch.float32: {"auto": 0, "avx2": 1},
    torch.bfloat16: {"auto": 0, "avx512_bf16": 1, "amx": 2},
}
AMX_ENV = "BATCHGEN_CPU_AMX"  # "0" turns the AMX bf16 micro-kernel off (``isa="auto"`` only)


def _library():
    """The kernel library with its functions typed, or None while unavailable (not built,
    kernels off, or neither an AVX2/FMA float32 kernel nor a usable bf16 one)."""
    global _lib
    if _lib is None:
        lib = load_library("fused_moe")
        if lib is None:
            return None
        lib.batchgen_fused_moe_silu_f32.argtypes = [_ptr] * 8 + [_i64] * 7
        lib.batchgen_fused_moe_silu_bf16.argtypes = [_ptr] * 8 + [_i64] * 7
        lib.batchgen_fused_moe_silu_bf16_out.argtypes = [_ptr] * 8 + [_i64] * 8  # out_is_bf16
        for fn in (
            lib.batchgen_fused_moe_silu_f32,
            lib.batchgen_fused_moe_silu_bf16,
            lib.batchgen_fused_moe_silu_bf16_out,
        ):
            fn.restype = ctypes.c_int
        _lib = lib
    return _lib


def amx_enabled() -> bool:
    """False when ``BATCHGEN_CPU_AMX`` is ``0`` (also ``false``/``no``/``off``): ``isa="auto"``
    then runs bf16 on vdpbf16ps even where AMX is usable (for end-to-end A/B runs).

    Raises:
        ValueError: a value other than the on/off words (`switches.env_flag`)."""
    return env_flag(AMX_ENV)


def kernel_isa(dtype: torch.dtype) -> str | None:
    """The micro-kernel `fused_moe_silu` runs for ``dtype`` with ``isa="auto"`` on this CPU:
    ``"avx512f"`` or ``"avx2"`` (float32, chosen when the library is compiled for this CPU);
    for bfloat16, chosen at run time, ``"amx_bf16"`` (the CPU has amx_bf16, the OS grants the
    tile state, `amx_enabled`; layers whose H or I is not a multiple of 32 still take
    vdpbf16ps) or ``"avx512_bf16"`` (vdpbf16ps); or None (the torch path serves ``dtype``:
    also where ``BATCHGEN_CPU_KERNELS`` leaves ``fused_moe`` out, read on every call, since
    the library stays loaded once a call has loaded it)."""
    lib = _library() if kernels_enabled("fused_moe") else None
    if lib is None:
        return None
    if dtype == torch.float32:
        return {2: "avx512f", 1: "avx2"}.get(lib.batchgen_fused_moe_supported())
    if dtype == torch.bfloat16:
        best = lib.batchgen_fused_moe_bf16_supported()
        if best == 2 and amx_enabled():
            return "amx_bf16"
        return "avx512_bf16" if best else None
    return None


def _log_once(dtype: torch.dtype) -> None:
    """Log, once per process and dtype, which expert path serves ``dtype``."""
    key = str(dtype)
    if key in _logged:
        return
    _logged.add(key)
    isa = kernel_isa(dtype)
    if isa == "avx512_bf16":
        lib = _library()
        why = (
            f"AMX off by {AMX_ENV}"
            if lib.batchgen_fused_moe_bf16_supported() == 2
            else "no AMX-BF16 on this CPU, or the OS did not grant the tile state"
        )
        logger.info(
            "fused MoE CPU kernel for %s experts: avx512_bf16 micro-kernel (%s)", dtype, why
        )
    elif isa is not None:
        logger.info("fused MoE CPU kernel for %s experts: %s micro-kernel", dtype, isa)
    else:
        logger.info(
            "fused MoE CPU kernel does not serve %s experts on this CPU (bf16 needs "
            "avx512_bf16); the per-expert torch path runs them",
            dtype,
        )


_workspace_buffer: torch.Tensor | None = None
_workspace_lock = threading.Lock()


def _workspace(num_floats: int) -> torch.Tensor:
    """A float32 scratch buffer of ``num_floats`` reused across calls (grown when too small).

    The per-(token, slot) outputs of a coalesced step are large (16,384 tokens x top-8 x
    hidden 512 = 256 MiB), above glibc's largest mmap threshold (32 MiB), so a fresh tensor
    per call is fresh pages, faulted and zeroed every time (about 7% of the call at 4,096
    tokens). Callers hold `_workspace_lock` while they use it.
    """
    global _workspace_buffer
    if _workspace_buffer is None or _workspace_buffer.numel() < num_floats:
        _workspace_buffer = None  # free the old buffer before allocating the new one
        _workspace_buffer = torch.empty(num_floats, dtype=torch.float32)
    return _workspace_buffer[:num_floats]


def fused_moe_available(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, act) -> bool:
    """True when `fused_moe_silu` serves this layer: CPU, SiLU, ``2I`` and ``H`` multiples of
    `PANEL`, activations and weights all float32 (with an AVX2/FMA or AVX-512F build) or all
    bfloat16 (on a CPU with avx512_bf16; AMX where usable). Logs once per dtype which
    micro-kernel runs."""
    if not (
        x.device.type == "cpu"
        and x.dtype in (torch.float32, torch.bfloat16)
        and w13.dtype == x.dtype
        and w2.dtype == x.dtype
        and act is F.silu
        and w13.shape[1] % PANEL == 0
        and w2.shape[1] % PANEL == 0
        and kernels_enabled("fused_moe")
    ):
        return False
    _log_once(x.dtype)
    return kernel_isa(x.dtype) is not None


def packed_expert_shape(n: int, k: int, dtype: torch.dtype) -> tuple[int, ...]:
    """The packed shape of one expert's ``[N, K]`` weight: ``(N / 16, K, 16)`` for float32
    (16-column panels, k-major), ``(N / 16, K / 2, 16, 2)`` for bfloat16 (pairs of k
    interleaved per column: vdpbf16ps's operand layout)."""
    if dtype == torch.bfloat16:
        return (n // PANEL, k // 2, PANEL, 2)
    return (n // PANEL, k, PANEL)


def pack_expert_weight_into(dst: torch.Tensor, w: torch.Tensor) -> None:
    """Copy one expert's ``w [N, K]`` into ``dst`` of `packed_expert_shape` (``dst``'s dtype
    picks the layout; N a multiple of 16, K even for bfloat16). Raises ValueError when w is
    not 2-D or ``dst`` is not `packed_expert_shape` of w's ``[N, K]``."""
    if w.dim() != 2:
        raise ValueError(f"w must be one expert's [N, K] weight, got shape {tuple(w.shape)}")
    n, k = w.shape
    want = packed_expert_shape(n, k, dst.dtype)
    if n % PANEL or (dst.dtype == torch.bfloat16 and k % 2) or tuple(dst.shape) != want:
        raise ValueError(
            f"dst {tuple(dst.shape)} ({dst.dtype}) is not the packed shape of w {tuple(w.shape)}"
            f" (N a multiple of {PANEL}, K even for bfloat16: {want})"
        )
    if dst.dtype == torch.bfloat16:
        dst.copy_(w.reshape(n // PANEL, PANEL, k // 2, 2).transpose(1, 2))
    else:
        dst.copy_(w.reshape(n // PANEL, PANEL, k).transpose(1, 2))


def pack_expert_weights(w: torch.Tensor) -> torch.Tensor:
    """``w [E, N, K]`` -> the kernel's packed layout, contiguous, a copy (N * K per expert):
    bfloat16 stays bfloat16, ``[E, N / 16, K / 2, 16, 2]``; any other dtype becomes float32,
    ``[E, N / 16, K, 16]`` (see `packed_expert_shape`), on w's device. A CPU weight's copy
    is on transparent huge pages where the OS gives them (`empty_huge_pages`: every decode
    step streams it; 16-18% faster float32 decode calls, 11% bfloat16, on the bench layer).
    Raises ValueError when w is not 3-D, N is not a multiple of 16 (or K odd for bfloat16)."""
    if w.dim() != 3:
        raise ValueError(f"expert weights must be [E, N, K], got shape {tuple(w.shape)}")
    num_experts, n, k = w.shape
    if n % PANEL:
        raise ValueError(f"expert weight rows must be a multiple of {PANEL}, got {n}")
    w = w.detach()  # reshape, not view: a strided checkpoint tensor is copied, not refused
    if w.dtype == torch.bfloat16:
        if k % 2:
            raise ValueError(f"bf16 expert weight columns must be even, got {k}")
        src = w.reshape(num_experts, n // PANEL, PANEL, k // 2, 2).transpose(2, 3)
    else:
        src = w.float().reshape(num_experts, n // PANEL, PANEL, k).transpose(2, 3)
    if w.device.type != "cpu":  # huge pages are host memory; the copy stays on w's device
        return src.contiguous()
    packed = empty_huge_pages(tuple(src.shape), src.dtype)
    packed.copy_(src)
    return packed


def fused_moe_silu(
    x: torch.Tensor,
    w13_packed: torch.Tensor,
    w2_packed: torch.Tensor,
    topk_weights: torch.Tensor,
    order: torch.Tensor,
    counts: list[int],
    isa: str = "auto",
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Every expert of a SiLU-gated MoE layer in one kernel call.

    Args:
        x: ``[T, H]`` activations, float32 or bfloat16 (the packed weights' dtype).
        w13_packed: `pack_expert_weights` of ``w13 [E, 2I, H]`` (gate rows, then up rows).
        w2_packed: `pack_expert_weights` of ``w2 [E, H, I]``.
        topk_weights: ``[T, A]`` router weights (used in float32).
        order: ``[T * A]`` int64, the flat (token, slot) indices grouped by expert
            (`batchgen.models.layers.moe.sort_by_expert`).
        counts: rows per expert (length E, summing to T * A).
        isa: ``"auto"`` (the best micro-kernel here, `kernel_isa`); for A/B measurements,
            float32: ``"avx2"`` (the AVX2 one); bfloat16: ``"avx512_bf16"`` (vdpbf16ps) or
            ``"amx"`` (AMX, even when ``BATCHGEN_CPU_AMX=0``).
        out_dtype: the result's dtype: float32, or (bfloat16 x only) bfloat16, the float32
            slot sum rounded to nearest even in the kernel's last pass: the same bits as
            ``.to(torch.bfloat16)`` of the float32 result, without that extra pass over [T, H].
    Returns:
        ``[T, H]`` of ``out_dtype``: ``sum_a topk_weights[t, a] * expert(x[t])``, summed over the
        top-k in slot order in float32. In bfloat16 the GEMMs accumulate in float32 and the
        SiLU-gated activation is rounded to bfloat16 once, before the down projection.
    Raises:
        ValueError: x neither float32 nor bfloat16; the arguments' shapes, dtypes or
            devices disagree; a packed weight is not contiguous; top_k is 0; ``order`` is
            not a permutation of the (token, slot) rows (each named in the message);
            ``isa`` is not one of `ISAS` for x's dtype; or ``out_dtype`` is neither float32
            nor (for bfloat16 x) bfloat16.
        RuntimeError: when the kernel is unavailable for this dtype or ``isa`` (``"amx"`` on a
            CPU without AMX), or rejects the shapes (``"amx"`` needs H and I multiples of 32).
    """
    if x.dtype not in ISAS:
        raise ValueError(f"x must be float32 or bfloat16, got {x.dtype}")
    isas = ISAS[x.dtype]
    if isa not in isas:
        raise ValueError(f"isa must be one of {sorted(isas)} for {x.dtype}, got {isa!r}")
    lib = _library()
    best = kernel_isa(x.dtype)
    if lib is None or best is None:
        raise RuntimeError(f"the fused MoE CPU kernel is not available for {x.dtype}")
    num_experts, hidden, inter = check_fused_moe_args(
        x, w13_packed, w2_packed, topk_weights, order, counts
    )
    if out_dtype != torch.float32 and not (out_dtype == x.dtype == torch.bfloat16):
        raise ValueError(
            f"out_dtype must be torch.float32 (or torch.bfloat16 for bfloat16 x), got "
            f"{out_dtype} for x {x.dtype}"
        )
    num_tokens, top_k = x.shape[0], topk_weights.shape[1]
    out = torch.empty(num_tokens, hidden, dtype=out_dtype)
    if num_tokens == 0:
        return out
    x = x.contiguous()
    weights = topk_weights.to(torch.float32).contiguous()
    order = order.to(torch.int64).contiguous()
    # [E + 1] int64: expert e's rows are order[starts[e] : starts[e + 1]]. A Python array,
    # not a tensor: torch.tensor(counts) + cumsum cost ~20 us a call, a decode step's MoE
    # layers pay it once each.
    starts = array.array("q", itertools.accumulate(counts, initial=0))
    bf16 = x.dtype == torch.bfloat16
    fn = lib.batchgen_fused_moe_silu_bf16_out if bf16 else lib.batchgen_fused_moe_silu_f32
    code = isas[isa]
    if bf16 and isa == "auto" and best != "amx_bf16":
        code = isas["avx512_bf16"]  # BATCHGEN_CPU_AMX=0
    # The ctypes call is no torch op: name it, so torch.profiler (`batchgen bench --profile`)
    # shows its time instead of losing it.
    with _workspace_lock, kernel_scope("batchgen::fused_moe_silu"):
        y_slots = _workspace(num_tokens * top_k * hidden)
        rc = fn(
            x.data_ptr(),
            w13_packed.data_ptr(),
            w2_packed.data_ptr(),
            weights.data_ptr(),
            order.data_ptr(),
            starts.buffer_info()[0],
            y_slots.data_ptr(),
            out.data_ptr(),
            num_tokens,
            hidden,
            inter,
            top_k,
            num_experts,
            torch.get_num_threads(),
            code,
            *((int(out_dtype == torch.bfloat16),) if bf16 else ()),
        )
    if rc == 3:
        raise ValueError(
            f"order must be a permutation of range({num_tokens * top_k}) (each (token, slot) "
            "row once, as sort_by_expert returns it)"
        )
    if rc == 2:
        raise RuntimeError(f"the fused MoE CPU kernel has no {isa!r} micro-kernel on this CPU")
    if rc != 0:
        raise RuntimeError(f"fused MoE kernel rejected the shapes (code {rc}, isa {isa!r})")
    return out
