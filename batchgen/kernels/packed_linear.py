"""bfloat16 dense linear layers on CPU on a weight packed once for AMX (csrc/packed_linear.cpp).

``y = x @ W.T (+ bias)``: float32 accumulation, one rounding to bfloat16 after the bias add
(the numerics of oneDNN's inner product), on a weight packed at load into the layout of an AMX
B tile / ``vdpbf16ps`` operand (`pack_packed_linear_weight`). The micro-kernels are the fused
MoE kernel's (``csrc/amx_bf16.h``: 2 x 2 tiles of 16 x 16, ``tdpbf16ps``; ``vdpbf16ps`` where
the OS does not grant the AMX tile state), the design of SGLang's CPU
``weight_packed_linear`` that vLLM's CPU backend runs. At the bench model's sizes (hidden 512)
a call of oneDNN's prepacked path (`batchgen.kernels.onednn_linear`) costs about 15-20 us
whatever the rows, most of it fixed work; this kernel's fixed cost is a ctypes call and an
output allocation (see docs/performance.md for the measured ratios and where each path is
used: `batchgen.models.layers.linear`).

On: the library built (``BATCHGEN_CPU_KERNELS`` lists ``packed_linear`` or is ``1``), a CPU
with avx512_bf16 (and avx512bw/vl), and ``BATCHGEN_PACKED_LINEAR`` not ``0`` (A/B runs).
Cost: the packed weight is a second copy of the weight (N x K bfloat16, padded to whole
panels of 16 columns and K to a multiple of 32).
"""

from __future__ import annotations

import ctypes
import functools
import logging

import torch
from torch.profiler import record_function

from batchgen.kernels.cpu_build import kernels_enabled, load_library
from batchgen.kernels.switches import env_flag
from batchgen.kernels.fused_moe import amx_enabled

logger = logging.getLogger(__name__)

PACKED_LINEAR_ENV = "BATCHGEN_PACKED_LINEAR"  # "0" turns the kernel off (A/B runs)
PANEL = 16  # output columns per packed panel
K_ALIGN = 32  # K is padded to a multiple of this (one AMX tile step)
ISAS = {"auto": 0, "avx512_bf16": 1, "amx": 2}  # the kernel's `isa` codes
_i64, _ptr = ctypes.c_int64, ctypes.c_void_p


@functools.cache
def _function():
    """The typed kernel function and the best micro-kernel code (2 AMX, 1 vdpbf16ps), or None
    while unavailable (not built, ``BATCHGEN_CPU_KERNELS`` without it, no avx512_bf16)."""
    lib = load_library("packed_linear")
    if lib is None:
        return None
    best = lib.batchgen_packed_linear_bf16_supported()
    if best == 0:
        logger.info("packed_linear: no avx512_bf16 on this CPU; oneDNN / F.linear serve bf16")
        return None
    fn = lib.batchgen_packed_linear_bf16
    fn.restype = ctypes.c_int
    fn.argtypes = [_ptr, _i64, _ptr, _ptr, _ptr] + [_i64] * 6
    logger.info(
        "bf16 dense linear layers: packed_linear kernel (%s)",
        "AMX-BF16" if best == 2 else "vdpbf16ps",
    )
    return fn, best


def packed_linear_enabled() -> bool:
    """False when ``BATCHGEN_PACKED_LINEAR`` is ``0`` (also ``false``/``no``/``off``).

    Raises:
        ValueError: a value other than the on/off words (`switches.env_flag`)."""
    return env_flag(PACKED_LINEAR_ENV)


def packed_linear_supported() -> bool:
    """True when `packed_linear` runs here: ``BATCHGEN_PACKED_LINEAR`` not ``0``,
    ``BATCHGEN_CPU_KERNELS`` lets ``packed_linear`` run, the library built and the CPU has
    avx512_bf16. Read when a model is converted, not per call."""
    return packed_linear_enabled() and kernels_enabled("packed_linear") and _function() is not None


def kernel_isa() -> str | None:
    """The micro-kernel the engine's layers run: ``"amx"`` (the CPU has AMX-BF16, the OS
    grants the tile state, and ``BATCHGEN_CPU_AMX`` is not ``0``, the fused MoE kernel's
    switch), ``"avx512_bf16"`` (vdpbf16ps), or None (the kernel is unavailable)."""
    found = _function() if kernels_enabled("packed_linear") else None
    if found is None:
        return None
    return "amx" if found[1] == 2 and amx_enabled() else "avx512_bf16"


def pack_packed_linear_weight(weight: torch.Tensor) -> torch.Tensor:
    """``weight [N, K]`` bfloat16 -> ``[ceil(N / 16), Kp / 2, 16, 2]`` bfloat16, contiguous
    (Kp: K rounded up to a multiple of 32): 16-column panels, pairs of k interleaved per column
    (an AMX B tile, a ``vdpbf16ps`` operand), zero columns and zero k as padding. A copy.

    Raises:
        ValueError: ``weight`` is not a 2-D bfloat16 CPU tensor.
    """
    if weight.dim() != 2 or weight.dtype != torch.bfloat16 or weight.device.type != "cpu":
        raise ValueError(
            f"weight must be a 2-D bfloat16 CPU tensor, got {tuple(weight.shape)} "
            f"{weight.dtype} on {weight.device}"
        )
    n, k = weight.shape
    np_, kp = -(-n // PANEL) * PANEL, -(-k // K_ALIGN) * K_ALIGN
    with torch.no_grad():
        w = torch.zeros(np_, kp, dtype=torch.bfloat16)
        w[:n, :k] = weight.detach()
        # [Np, Kp] -> [Np / 16, 16, Kp / 2, 2] -> [Np / 16, Kp / 2, 16, 2]
        return w.view(np_ // PANEL, PANEL, kp // 2, 2).transpose(1, 2).contiguous()


def packed_linear(
    x: torch.Tensor,
    packed: torch.Tensor,
    n: int,
    k: int,
    bias: torch.Tensor | None = None,
    isa: str = "auto",
) -> torch.Tensor:
    """``x @ W.T + bias`` in bfloat16 on ``packed = pack_packed_linear_weight(W)``.

    Args:
        x: ``[..., K]`` bfloat16 on CPU (any leading dimensions; rows must have unit stride in
            the last dimension after flattening, else a contiguous copy is made).
        packed: `pack_packed_linear_weight` of ``W [N, K]``.
        n, k: W's shape (the packing pads both).
        bias: ``[N]`` bfloat16, or None.
        isa: ``"auto"`` (AMX where granted, else vdpbf16ps; ``BATCHGEN_CPU_AMX`` is not read
            here, the layer reads it through `kernel_isa`), ``"avx512_bf16"`` or ``"amx"``.
    Returns:
        ``[..., N]`` bfloat16: per output, the float32 sum of the exact bf16 x bf16 products
        (AMX: 32 per step, in k order across steps), plus the bias in float32, rounded once
        to nearest even. bf16 subnormal inputs count as zero.
    Raises:
        ValueError: x's last dimension is not ``k``, a dtype is not bfloat16, ``packed`` does
            not fit ``(n, k)`` or is not contiguous, a tensor is not on the CPU, or ``isa``
            is unknown.
        RuntimeError: the kernel is unavailable here or rejected the call (its code).
    """
    if x.shape[-1] != k:
        raise ValueError(f"x must be [..., {k}] for a weight of [{n}, {k}], got {tuple(x.shape)}")
    if x.dtype != torch.bfloat16 or (bias is not None and bias.dtype != torch.bfloat16):
        raise ValueError(
            f"x and bias must be bfloat16, got {x.dtype} and {None if bias is None else bias.dtype}"
        )
    kp = -(-k // K_ALIGN) * K_ALIGN
    if packed.shape != (-(-n // PANEL), kp // 2, PANEL, 2):
        raise ValueError(f"packed has shape {tuple(packed.shape)}, not the packing of [{n}, {k}]")
    if packed.dtype != torch.bfloat16 or not packed.is_contiguous():
        raise ValueError(
            f"packed must be the contiguous bfloat16 tensor of pack_packed_linear_weight, got "
            f"{packed.dtype}{'' if packed.is_contiguous() else ', not contiguous'}"
        )
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"bias must be [{n}], got {tuple(bias.shape)}")
    # the kernel reads raw CPU pointers: a meta or CUDA tensor would crash it
    for name, t in (("x", x), ("packed", packed), ("bias", bias)):
        if t is not None and t.device.type != "cpu":
            raise ValueError(f"{name} must be on the CPU, got {t.device}")
    if isa not in ISAS:
        raise ValueError(f"isa must be one of {sorted(ISAS)}, got {isa!r}")
    found = _function() if kernels_enabled("packed_linear") else None
    if found is None:
        raise RuntimeError("the packed_linear kernel is not available on this machine")
    bias = None if bias is None else bias.contiguous()
    return run_packed_linear(found[0], x, packed, n, k, bias, torch.get_num_threads(), ISAS[isa])


def run_packed_linear(fn, x, packed, n, k, bias, num_threads, isa=0) -> torch.Tensor:
    """`packed_linear` without the argument checks, for the layer's hot path (each microsecond
    is 5-20% of a decode call): ``fn`` from `kernel_function`, ``bias`` contiguous or None,
    ``num_threads`` the OpenMP threads, ``isa`` the kernel's code (`ISAS`). Shapes, dtypes
    and results as `packed_linear`.

    Raises:
        RuntimeError: the kernel rejected the call (its code).
    """
    rows = x if x.dim() == 2 else x.reshape(-1, k)  # [M, K]
    m = rows.shape[0]
    ldx = rows.stride(0) if m > 1 else k
    if rows.stride(1) != 1 or ldx < k:
        rows = rows.contiguous()
        ldx = k
    out = torch.empty((m, n), dtype=torch.bfloat16)  # [M, N]
    if m:
        args = (
            rows.data_ptr(),
            ldx,
            packed.data_ptr(),
            None if bias is None else bias.data_ptr(),
            out.data_ptr(),
            m,
            k,
            packed.shape[1] * 2,
            n,
            num_threads,
            isa,
        )
        # The ctypes call is no torch op: named for torch.profiler only while it records
        # (record_function costs about a microsecond a call).
        if torch.autograd._profiler_enabled():
            with record_function("batchgen::packed_linear"):
                rc = fn(*args)
        else:
            rc = fn(*args)
        if rc != 0:
            raise RuntimeError(f"packed_linear kernel rejected the call (code {rc})")
    return out if x.dim() == 2 else out.view(*x.shape[:-1], n)


def kernel_function():
    """The ctypes kernel function, or None where `packed_linear_supported` is False."""
    return _function()[0] if packed_linear_supported() else None
