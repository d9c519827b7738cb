"""Dense projections on prepacked weights: `PrepackedLinear` and `enable_prepacked_linear`.

On a CPU with avx512_bf16, a bfloat16 model's ``nn.Linear`` layers (attention q/k/v/o, MLA
projections, dense MLPs, shared experts, the router gate, the LM head) run on weights packed
once instead of ``F.linear``, which repacks the weight on every call: the `packed_linear`
kernel (AMX / vdpbf16ps, `batchgen.kernels.packed_linear`) for weights of at most 1 MiB at any
row count (with AMX) and for other calls of at most `packed_linear_max_macs` multiply-adds (by
threads, AMX or not and the CPU kind; decode steps:
a fixed cost of a few microseconds where oneDNN's is 15-20), oneDNN's inner product
(`batchgen.kernels.onednn_linear`) for larger ones, its rows rounded up to
`onednn_bucket_rows` so that oneDNN does not build a primitive for every new row count.
`use_packed_linear` is the one place that chooses; the thresholds are measured
(docs/performance.md, ``benchmarks/bf16_linear.py``, ``benchmarks/peers/dense_linear.py``).
The class changes in place and the parameters stay, so weight loading, tying
(``lm_head.weight is embed_tokens.weight``) and `update_weights` are untouched: the packed
copies are keyed on the weight's storage and version counter, and is dropped by
`invalidate_packed_weights` (called by the loader and by `update_weights`, whose writes go
through ``.data`` or inference-mode tensors that the version counter does not see).

Float32 layers become `PrepackedLinear` too where `onednn_f32_mode` is ``"onednn"`` (by
default a CPU with avx512f that is not Intel's: MKL's sgemm there lost to oneDNN by 1.2-1.5x
from 70 rows): oneDNN's prepacked inner product for calls above `ONEDNN_F32_MIN_MACS`,
``F.linear`` below (`use_onednn_f32`). Elsewhere, and in the batch-invariant mode (float32
only, `BatchInvariantLinear`), float32 layers stay as they were.
"""

from __future__ import annotations

import functools
import logging
import os

import torch
import torch.nn.functional as F
from torch import nn

from batchgen.kernels import packed_linear as pk
from batchgen.kernels.cpu_build import cpu_flags
from batchgen.kernels.onednn_linear import (
    ONEDNN_LINEAR_F32_ENV,
    onednn_f32_mode,
    pack_onednn_weight,
    prepacked_linear_supported,
)

logger = logging.getLogger(__name__)

# Largest M * N * K (multiply-adds per call) that `packed_linear` serves, by torch threads;
# above it oneDNN's prepacked inner product is as fast or faster. Measured with
# ``benchmarks/bf16_linear.py`` on a 2-core AMX-BF16 machine (docs/performance.md). Hidden-512
# shapes: one thread, the kernel won up to 128-256 rows (qkv 128 x 768 x 512 = 50 M: 1.05x;
# o and lm_head 256 x 512 x 512 = 67 M: 1.0x; 2,048 rows: 0.87-0.89x); two threads, up to
# 512 rows (qkv 512 x 768 x 512 = 201 M: 1.05x; 2,048 rows: 0.91-0.95x). Hidden-2048 shapes
# (N 2048-32000, K 2048-5632): it won up to about 70 rows (1.0-1.5x) and lost from 256
# (0.55-0.9x); the limits keep it to the smaller of those calls. More than two threads was not
# measured: the two-thread limit is used.
PACKED_LINEAR_MAX_MACS_ONE_THREAD = 2**26
PACKED_LINEAR_MAX_MACS = 3 * 2**26
# Where the CPU has AMX-BF16 but the OS grants no tile state (or ``BATCHGEN_CPU_AMX=0``) the
# kernel runs vdpbf16ps. Emulated on the AMX machine with oneDNN limited to AVX512-BF16
# (``ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16``, one thread, process CPU time): the kernel was
# 1.13-1.76x at one row, 1.0-1.3x at 16-70 rows of the router, 0.83-0.92x from 16 rows of qkv
# (768 x 512); so only calls up to 2^21 multiply-adds.
PACKED_LINEAR_MAX_MACS_VNNI = 2**21
# On a CPU without AMX-BF16 at all (AMD EPYC Zen 4: avx512_bf16, no AMX; 2 cores, load average
# 7-10, process CPU time, 2026-12-02) vdpbf16ps won against oneDNN's bucketed path further:
# with a new row count per call drawn from (M/2, M] as decode steps and prefill chunks have
# (``benchmarks/packed_linear_vary.py``, 1 and 2 threads, three runs) on the bench model's qkv
# 768 x 512 1.12-1.21x at M 70, 0.95-1.01x at 128, 0.88-0.92x from 256; o and lm_head
# 512 x 512 1.07-1.24x at 70, 0.99-1.16x at 128, 0.87-1.04x from 256; the router 64 x 512
# 1.2-3.6x up to M 1,024. Hidden
# 2048 (``benchmarks/bf16_linear.py --models 2048 --threads 2 --clock cpu``, fixed rows): 1.1-1.5x
# at 1-2 rows, 0.97-1.08x at 4-8, 0.82-0.95x at 16. So calls up to 2^25 multiply-adds there:
# a decode step's (~70 rows) qkv, o, router and bench lm_head, the router up to 1,024 rows.
PACKED_LINEAR_MAX_MACS_NO_AMX_CPU = 2**25
# Weights of at most this many elements (1 MiB of bf16; vLLM's CPU backend sends weights up to
# 1 MiB to SGLang's ``weight_packed_linear`` on the same grounds) run on the AMX kernel at any
# row count. The limits above were measured calling one row count again and again; an engine's
# prefill chunks have a new row count nearly every step, and oneDNN builds (JITs) a primitive
# for each new shape: about 3.5 ms for the bench model's qkv, so a first call at 1,000-2,000
# rows took 4-5 ms where the kernel took 1.1 (``benchmarks/peers/dense_linear.py --vary``, one
# thread, process CPU time, loaded machine). Against oneDNN with its rows bucketed
# (`onednn_bucket_rows`, primitives cached) the kernel was still 1.1-1.6x on the bench
# model's qkv (768 x 512) and o (512 x 512) at 257-4,096 rows of varying count.
PACKED_LINEAR_ANY_ROWS_MAX_WEIGHT = 2**19
# oneDNN calls round their rows up to one of this many sizes per power of two (padding at most
# 1/8 of the rows), so a run meets a few dozen row counts per weight shape instead of
# thousands, and oneDNN's primitive cache (1,024 entries by default) keeps them.
ONEDNN_ROW_BUCKETS_PER_OCTAVE = 8


# float32 calls of at most this many multiply-adds (M * N * K) run ``F.linear`` (MKL): below
# it oneDNN's fixed cost per call through torch's op (15-30 us) loses. Measured on AMD Zen 4
# (``benchmarks/f32_linear.py --threads 1``, process CPU time, loaded machine,
# docs/performance.md): on qkv (768 x 512), o and lm_head (512 x 512) oneDNN was 0.55-0.8x at
# one row, 1.0-1.3x at 8-32 rows, 1.05-1.25x at 70-257 rows (with `onednn_bucket_rows`'
# padding 1.0-1.2x) and 1.35-1.5x at 1,024-2,048; 2^23 is 22 rows of qkv, 32 of o.
ONEDNN_F32_MIN_MACS = 2**23
# Narrower weights (N below this, the router's 64 experts) need more rows: on the router
# (64 x 512) oneDNN was 0.3-0.8x up to 257 rows and 1.1-1.4x from 1,024 (2^25 = 1,024 rows).
ONEDNN_F32_NARROW_N = 256
ONEDNN_F32_NARROW_MIN_MACS = 2**25


def use_onednn_f32(m: int, n: int, k: int) -> bool:
    """Whether a float32 call of ``[m, k] @ [n, k].T`` on a layer with a oneDNN-packed weight
    runs there (True) or on ``F.linear`` (False): above `ONEDNN_F32_MIN_MACS` multiply-adds,
    `ONEDNN_F32_NARROW_MIN_MACS` for fewer than `ONEDNN_F32_NARROW_N` outputs."""
    macs = m * n * k
    return macs > (ONEDNN_F32_MIN_MACS if n >= ONEDNN_F32_NARROW_N else ONEDNN_F32_NARROW_MIN_MACS)


def onednn_bucket_rows(m: int) -> int:
    """``m`` rounded up to a multiple of ``2^(floor(log2 m) - 3)`` (`ONEDNN_ROW_BUCKETS_PER_OCTAVE`
    sizes per power of two; exact up to 16 rows): the row count a oneDNN call runs at.
    Example: 1,899 -> 1,920 (multiples of 128 between 1,024 and 2,048), 300 -> 320."""
    step = 1 << max(m.bit_length() - 1 - ONEDNN_ROW_BUCKETS_PER_OCTAVE.bit_length() + 1, 0)
    return -(-m // step) * step


@functools.cache
def cpu_has_amx_bf16() -> bool:
    """Whether ``/proc/cpuinfo`` lists ``amx_bf16`` (whether or not the OS grants the tiles)."""
    return "amx_bf16" in cpu_flags().split()


def packed_linear_max_macs(num_threads: int, amx: bool = True) -> int:
    """`PACKED_LINEAR_MAX_MACS_ONE_THREAD` for one thread, else `PACKED_LINEAR_MAX_MACS`. When
    the kernel runs without AMX (vdpbf16ps), whatever the threads:
    `PACKED_LINEAR_MAX_MACS_VNNI` on a CPU that has AMX-BF16 (tiles not granted or switched
    off), `PACKED_LINEAR_MAX_MACS_NO_AMX_CPU` on one without (measured on AMD Zen 4)."""
    if not amx:
        if cpu_has_amx_bf16():
            return PACKED_LINEAR_MAX_MACS_VNNI
        return PACKED_LINEAR_MAX_MACS_NO_AMX_CPU
    return PACKED_LINEAR_MAX_MACS_ONE_THREAD if num_threads <= 1 else PACKED_LINEAR_MAX_MACS


def use_packed_linear(m: int, n: int, k: int, num_threads: int, amx: bool = True) -> bool:
    """Whether a bf16 call of ``[m, k] @ [n, k].T`` on ``num_threads`` threads runs on the
    `packed_linear` kernel (True) or on oneDNN's prepacked path (False): the measured
    crossover, `packed_linear_max_macs` (``amx``: the kernel runs AMX tiles, not
    vdpbf16ps), and, with AMX, any row count for a weight of at most
    `PACKED_LINEAR_ANY_ROWS_MAX_WEIGHT` elements."""
    if amx and n * k <= PACKED_LINEAR_ANY_ROWS_MAX_WEIGHT:
        return True
    return m * n * k <= packed_linear_max_macs(num_threads, amx)


def _version(t: torch.Tensor) -> int | None:
    """The version counter, None for an inference-mode tensor (which has none). Asked first:
    reading ``_version`` there raises, and a C++ exception costs about 20 us per call."""
    return None if t.is_inference() else t._version


class PrepackedLinear(nn.Linear):
    """``nn.Linear`` whose bfloat16 CPU forward runs on packed copies of the weight: the
    `packed_linear` kernel for calls `use_packed_linear` picks, oneDNN's prepacked path for
    the rest (each where supported; ``F.linear`` where neither is). A float32 layer runs
    oneDNN's prepacked path for the calls `use_onednn_f32` picks, ``F.linear`` for the rest.
    Other inputs (a dtype other than the weight's, CUDA, autograd) take ``F.linear``. Made by
    `enable_prepacked_linear`, which converts bfloat16 layers where one of the two bf16 paths
    is supported and float32 layers where `onednn_f32_mode` is ``"onednn"``.

    The packed weights (a second and a third copy) are built at conversion and again when the
    weight is replaced or changed through autograd-visible ops (keyed on its storage and
    version counter); other writes need `invalidate_packed_weights`. The forward is kept to a
    few attribute reads: at the bench model's sizes (hidden 512) a decode call takes 5-20 us,
    and each microsecond of Python is 5-20% of it.
    """

    # ((data_ptr, version), oneDNN packed weight or None, packed_linear weight or None,
    #  the packed_linear ctypes function or None, whether it runs AMX)
    _packed: tuple | None = None

    def invalidate_packed_weights(self) -> None:
        """Drop the packed weights; the next bfloat16 forward packs again."""
        self._packed = None

    def packed_weight(self) -> torch.Tensor | None:
        """`pack_onednn_weight` of ``self.weight`` (None where oneDNN's path is off), cached
        (see the class docstring) with the `packed_linear` packing beside it."""
        w = self.weight
        key = (w.data_ptr(), _version(w))
        if self._packed is None or self._packed[0] != key:
            with torch.no_grad():
                if w.dtype == torch.float32:
                    onednn = pack_onednn_weight(w) if onednn_f32_mode() == "onednn" else None
                    amx = None
                else:
                    onednn = pack_onednn_weight(w) if prepacked_linear_supported() else None
                    amx = pk.pack_packed_linear_weight(w) if pk.packed_linear_supported() else None
                fn = pk.kernel_function() if amx is not None else None
                # float32 never runs packed_linear: no probe (its build and log line) for it
                runs_amx = amx is not None and pk.kernel_isa() == "amx"
                self._packed = (key, onednn, amx, fn, runs_amx)
        return self._packed[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The parameters read from `_parameters` directly: ``self.weight`` goes through
        # nn.Module.__getattr__, about 0.45 us each, 5-10% of a one-row call of the kernel.
        params = self._parameters
        w, bias = params["weight"], params["bias"]
        dtype = x.dtype
        if (
            dtype is not w.dtype
            or (dtype is not torch.bfloat16 and dtype is not torch.float32)
            or not x.is_cpu
            or (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad))
        ):
            return F.linear(x, w, bias)
        packed = self._packed
        if packed is None or packed[0] != (w.data_ptr(), _version(w)):
            self.packed_weight()
            packed = self._packed
        k = self.in_features
        if x.shape[-1] != k:
            raise ValueError(f"x must be [..., {k}], got {tuple(x.shape)}")
        if dtype is torch.float32:
            if packed[1] is None or not use_onednn_f32(x.numel() // k, self.out_features, k):
                return F.linear(x, w, bias)
            return _onednn_bucketed(x, packed[1], bias, k)
        if packed[2] is not None:
            n = self.out_features
            threads = torch.get_num_threads()
            if packed[1] is None or use_packed_linear(x.numel() // k, n, k, threads, packed[4]):
                # the kernel reads N contiguous bf16 (the dtype is checked at conversion)
                if bias is not None and not bias.is_contiguous():
                    bias = bias.contiguous()
                isa = 0 if packed[4] else 1  # the kernel's codes: auto (AMX), vdpbf16ps
                return pk.run_packed_linear(packed[3], x, packed[2], n, k, bias, threads, isa)
        if packed[1] is None:
            return F.linear(x, w, bias)
        return _onednn_bucketed(x, packed[1], bias, k)


def _onednn_bucketed(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, k: int
) -> torch.Tensor:
    """oneDNN's prepacked inner product of ``x [..., K]`` (any strides) at
    `onednn_bucket_rows` rows: the rows copied into a zero-padded ``[Mp, K]`` buffer when M is
    not a bucket size, the result ``[..., N]`` a view of the first M rows. Float32
    accumulation, rounded once to bf16 (a float32 ``x``: float32 out). The rows are those of
    oneDNN's call at Mp rows: bit for bit the unpadded call's only where oneDNN keeps its K
    blocking between M and Mp (it picks it by row count: at K = 2,048 a few elements of 511
    rows differ by one bf16 ulp from the 512-row call); within one bf16 rounding of the exact
    product either way (float32: within float32 summation error)."""
    rows = x.reshape(-1, k)  # [M, K]
    m = rows.shape[0]
    mp = onednn_bucket_rows(m)
    if mp != m:
        padded = rows.new_empty((mp, k))  # [Mp, K]
        padded[:m] = rows
        padded[m:].zero_()
        rows = padded
    out = torch.ops.mkldnn._linear_pointwise(rows, packed, bias, "none", [], "")  # [Mp, N]
    if mp != m:
        out = out[:m]
    return out if x.dim() == 2 else out.view(*x.shape[:-1], out.shape[-1])


def enable_prepacked_linear(model: nn.Module) -> int:
    """Turn plain ``nn.Linear`` layers of ``model`` on the CPU into `PrepackedLinear` in place
    (class changed, parameters kept) and pack their weights now, so the first step does not
    pay for it: those with a bfloat16 weight (and bias) where `prepacked_linear_supported`
    (oneDNN, avx512_bf16, ``BATCHGEN_ONEDNN_LINEAR`` not ``0``) or
    `batchgen.kernels.packed_linear.packed_linear_supported` (the kernel built, avx512_bf16,
    ``BATCHGEN_PACKED_LINEAR`` not ``0``); those with a float32 weight (and bias) where
    `onednn_f32_mode` is ``"onednn"``. Other layers (a weight and bias of two dtypes,
    subclasses such as `BatchInvariantLinear`) are left alone. Returns the number converted
    (0 where no path is supported: the model is unchanged). A dtype's paths are probed (and
    logged) only when the model has such layers: a float32 model logs no bf16 kernel.

    Raises:
        ValueError: a bad ``BATCHGEN_ONEDNN_LINEAR_F32`` (`onednn_f32_mode`)."""
    layers = [
        m
        for m in model.modules()
        if type(m) is nn.Linear
        and m.weight.is_cpu
        and (m.bias is None or m.bias.dtype == m.weight.dtype)
    ]
    present = {m.weight.dtype for m in layers}
    dtypes = []
    if torch.bfloat16 in present and (
        prepacked_linear_supported() or pk.packed_linear_supported()
    ):
        dtypes.append(torch.bfloat16)
    if torch.float32 in present and onednn_f32_mode() == "onednn":
        dtypes.append(torch.float32)
        _log_f32_path()
    converted = 0
    for module in layers:
        if module.weight.dtype in dtypes:
            module.__class__ = PrepackedLinear
            module.packed_weight()
            converted += 1
    return converted


@functools.cache
def _log_f32_path() -> None:
    mode = os.environ.get(ONEDNN_LINEAR_F32_ENV, "auto")
    logger.info(
        "float32 dense linear layers: oneDNN prepacked weights (%s=%s)", ONEDNN_LINEAR_F32_ENV, mode
    )
