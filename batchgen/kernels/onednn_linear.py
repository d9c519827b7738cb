"""bfloat16 dense linear layers for CPU on oneDNN's prepacked weights.

``F.linear`` on a bfloat16 CPU tensor runs oneDNN's matmul on the plain ``[N, K]`` weight, which
oneDNN reorders into its blocked (AMX / AVX512-BF16) layout on every call. Inductor's freezing
pass avoids that by reordering once (``torch.ops.mkldnn._reorder_linear_weight``) and calling
``torch.ops.mkldnn._linear_pointwise`` on the opaque packed tensor; `onednn_linear` does the
same for the engine. Measured on a 2-core AMX-BF16 machine shared with other jobs, torch 2.13,
one thread, process CPU time, fastest of 30 alternated calls, as module calls
(``benchmarks/bf16_linear.py --threads 1 --clock cpu``, docs/performance.md): on a hidden-2048
model's projections 1.0-1.56x ``F.linear`` (qkv, o and the LM head 1.1-1.56x, the down
projection about 1.0x); on the bench model's (hidden 512) 0.8-1.3x, about 1.1x below 64 rows
and even from 256 rows, where the call's fixed cost of about 15-20 us dominates. At one row
neither bf16 path reaches float32 ``F.linear`` (MKL) on the hidden-512 shapes (9-10 against
12-14 GFLOP/s). The result is oneDNN's inner product: float32 accumulation, one rounding to
bfloat16; it was bit-identical to ``F.linear`` in bfloat16 on every shape measured, and the
tests bound it against the exact product of the same bfloat16 inputs.

Used by `batchgen.models.layers.linear.PrepackedLinear` (every dense projection of a bfloat16
model on CPU; since issue 19's second round only the calls too large for the AMX
`batchgen.kernels.packed_linear` kernel, see `use_packed_linear`) where
`prepacked_linear_supported`: oneDNN built into torch, a CPU with
avx512_bf16 (without it oneDNN emulates bfloat16 and nothing was measured), and
``BATCHGEN_ONEDNN_LINEAR`` not ``0`` (off: the engine runs ``F.linear`` as before, for A/B
runs). The fused-MoE micro-kernels as a one-expert dense MLP (candidate (b) of issue 19) were
0.9-1.35x ``F.linear`` below 64 rows and 0.65-0.98x from 256 rows, so a library path it is.

Float32 (issue 19's dense round, on a CPU that is not Intel's): ``F.linear`` runs MKL's sgemm,
which on AMD Zen 4 (avx512f, 2 cores) reached 65-78 GFLOP/s at one thread on the bench
model's projections against oneDNN's 83-107 from 70 rows (``benchmarks/f32_linear.py``,
docs/performance.md); vLLM's ``onednn_mm`` is the same oneDNN inner product. `onednn_f32_mode`
says where float32 layers take the prepacked path (`use_onednn_f32` then picks per call);
on Intel CPUs, where MKL has its own AVX-512 code and nothing was measured, ``F.linear`` stays.
The result there is not bit-identical to ``F.linear`` (another summation order), within a
few float32 ulps of the exact product.

Cost: the packed weight is a second copy of the weight (N x K per layer).
"""

from __future__ import annotations

import functools
import logging

import torch

from batchgen.kernels.cpu_build import cpu_flags
from batchgen.kernels.switches import env_choice, env_flag

logger = logging.getLogger(__name__)

ONEDNN_LINEAR_ENV = "BATCHGEN_ONEDNN_LINEAR"  # "0" turns the prepacked path off (A/B runs)
# float32 layers: "auto" (oneDNN where the CPU is not Intel's), "onednn", "linear" (F.linear)
ONEDNN_LINEAR_F32_ENV = "BATCHGEN_ONEDNN_LINEAR_F32"
ONEDNN_LINEAR_F32_CHOICES = ("auto", "onednn", "linear")


@functools.cache
def _onednn_bf16_fast() -> bool:
    """oneDNN is in this torch and the CPU has native bfloat16 dot products (logged once)."""
    flags = cpu_flags().split()
    ok = (
        torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
        and "avx512_bf16" in flags
    )
    if ok:
        logger.info(
            "bf16 dense linear layers: oneDNN prepacked weights (%s)",
            "AMX-BF16" if "amx_bf16" in flags else "AVX512-BF16",
        )
    else:
        logger.info(
            "bf16 dense linear layers: F.linear (oneDNN prepacking needs torch with mkldnn "
            "and a CPU with avx512_bf16)"
        )
    return ok


@functools.cache
def cpu_vendor() -> str:
    """The ``vendor_id`` of ``/proc/cpuinfo`` (``"GenuineIntel"``, ``"AuthenticAMD"``), ``""``
    where it cannot be read (not Linux, not x86)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def onednn_f32_mode() -> str:
    """``BATCHGEN_ONEDNN_LINEAR_F32``: ``"onednn"`` or ``"linear"``, ``"auto"`` resolved to
    ``"onednn"`` on an x86 CPU with avx512f that is not Intel's (MKL's sgemm there measured
    0.65-0.8x oneDNN's, module docstring) and ``"linear"`` elsewhere; ``"linear"`` also where
    torch lacks oneDNN's prepacked ops. Read when a model is converted, not per call.

    Raises:
        ValueError: a value other than ``auto``/``onednn``/``linear`` (`switches.env_choice`).
    """
    mode = env_choice(ONEDNN_LINEAR_F32_ENV, ONEDNN_LINEAR_F32_CHOICES)
    ops_ok = (
        torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )
    if mode == "auto":
        vendor = cpu_vendor()
        fast = "avx512f" in cpu_flags().split() and vendor not in ("", "GenuineIntel")
        mode = "onednn" if fast else "linear"
    return mode if ops_ok else "linear"


def prepacked_linear_enabled() -> bool:
    """False when ``BATCHGEN_ONEDNN_LINEAR`` is ``0`` (also ``false``/``no``/``off``).

    Raises:
        ValueError: a value other than the on/off words (`switches.env_flag`)."""
    return env_flag(ONEDNN_LINEAR_ENV)


def prepacked_linear_supported() -> bool:
    """True when `onednn_linear` runs bfloat16 here: oneDNN in torch, a CPU with avx512_bf16
    (`_onednn_bf16_fast`, logged once) and ``BATCHGEN_ONEDNN_LINEAR`` not ``0``. Read when a
    model is converted (`batchgen.models.layers.linear.enable_prepacked_linear`), not per call."""
    return prepacked_linear_enabled() and _onednn_bf16_fast()


def prepacked_linear_available(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """True when `onednn_linear` serves ``x @ weight.T`` here: both on CPU and bfloat16, no
    autograd through them (the op has no backward) and `prepacked_linear_supported`."""
    needs_grad = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    return (
        x.is_cpu
        and weight.is_cpu
        and x.dtype == torch.bfloat16
        and weight.dtype == torch.bfloat16
        and not needs_grad
        and prepacked_linear_supported()
    )


def pack_onednn_weight(weight: torch.Tensor) -> torch.Tensor:
    """``weight [N, K]`` bfloat16 or float32 -> oneDNN's packed copy (an opaque MKLDNN tensor
    of the same logical shape and dtype), laid out for any number of rows (no batch-size hint).

    Raises:
        ValueError: ``weight`` is not a 2-D bfloat16 or float32 CPU tensor.
    """
    if (
        weight.dim() != 2
        or weight.dtype not in (torch.bfloat16, torch.float32)
        or weight.device.type != "cpu"
    ):
        raise ValueError(
            f"weight must be a 2-D bfloat16 or float32 CPU tensor, got {tuple(weight.shape)} "
            f"{weight.dtype} on {weight.device}"
        )
    with torch.no_grad():
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), None)


def onednn_linear(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``x @ W.T + bias`` in bfloat16 on a weight packed by `pack_onednn_weight`.

    Args:
        x: ``[..., K]`` bfloat16 activations (any strides).
        packed: `pack_onednn_weight` of ``W [N, K]``.
        bias: ``[N]`` bfloat16, or None.
    Returns:
        ``[..., N]`` bfloat16: float32 accumulation, rounded once (oneDNN inner product).
    Raises:
        ValueError: ``x``'s last dimension is not K, or a dtype is not bfloat16.
    """
    n, k = packed.shape
    if x.shape[-1] != k:
        raise ValueError(
            f"x must be [..., {k}] for a packed weight of [{n}, {k}], got {tuple(x.shape)}"
        )
    if x.dtype != torch.bfloat16 or (bias is not None and bias.dtype != torch.bfloat16):
        raise ValueError(
            f"x and bias must be bfloat16, got {x.dtype} and "
            f"{None if bias is None else bias.dtype}"
        )
    # The op takes any leading dimensions and strides (tested), and rounds once to bf16.
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")  # [..., N]
