"""Which implementation runs a MoE block's routed experts: decided here and nowhere else.

Paths (every one computes `batchgen.models.layers.moe.fused_experts_reference`'s result):

- ``cpu_kernel``: the fused C++ CPU kernel (`batchgen.kernels.fused_moe`), where it serves
  the block (float32; bf16 on CPUs with avx512_bf16) and no gradient is needed;
- ``per_expert``: the CPU torch path (`batchgen.models.layers.moe_cpu`), and the
  batch-invariant mode on any device;
- ``grouped_mm``: two grouped GEMMs (`batchgen.kernels.grouped_moe`);
- ``triton``: two Triton fused-MoE GEMM launches (`batchgen.kernels.triton_moe`);
- ``reference``: the per-expert Python loop.

``BATCHGEN_MOE_PATH`` (`MOE_PATH_ENV`): ``auto`` (default) picks ``cpu_kernel`` where it serves,
else ``per_expert`` on CPU; on CUDA ``grouped_mm`` where ``torch._grouped_mm`` runs its CUTLASS
kernel (bf16 on compute capability 9.0 or 10.x, see `grouped_mm_fast_on`), else ``triton``
where triton imports (`triton_unsupported_reason`), else ``reference``. Which of ``grouped_mm``
and ``triton`` is faster where both run is a device measurement, not settled here:
``benchmarks/gpu_kernels.py`` times both by rows per expert; until a GPU run says otherwise,
``auto`` keeps ``grouped_mm`` there. ``grouped_mm``, ``triton`` or ``reference`` force that
path on any device (tests force ``grouped_mm`` on CPU, and ``triton`` on CPU under
``TRITON_INTERPRET=1``), except in the batch-invariant mode, whose per-row GEMMs are a
correctness contract: it keeps ``cpu_kernel`` / ``per_expert`` whatever the variable says.
"""

from __future__ import annotations

import logging
import threading
from typing import Literal

import torch

from batchgen.kernels.grouped_moe import grouped_mm_fast_on, grouped_mm_unsupported_reason
from batchgen.kernels.switches import env_choice
from batchgen.kernels.triton_support import triton_unsupported_reason

logger = logging.getLogger(__name__)

ExpertPath = Literal["cpu_kernel", "grouped_mm", "per_expert", "reference", "triton"]
MOE_PATH_ENV = "BATCHGEN_MOE_PATH"
MOE_PATH_CHOICES = ("auto", "grouped_mm", "reference", "triton")
_logged: set[tuple] = set()
_logged_lock = threading.Lock()


def moe_path_override() -> str:
    """``BATCHGEN_MOE_PATH``, lower-cased (``auto`` when unset or empty).

    Raises:
        ValueError: a value outside `MOE_PATH_CHOICES`, naming the variable."""
    return env_choice(MOE_PATH_ENV, MOE_PATH_CHOICES)


def expert_path(
    device: torch.device,
    dtype: torch.dtype,
    *,
    batch_invariant: bool,
    cpu_kernel: bool,
    hidden_size: int,
    intermediate_size: int,
    num_experts: int,
) -> ExpertPath:
    """The routed-expert path for activations of ``dtype`` on ``device`` (rules in the module
    docstring). ``cpu_kernel``: whether the fused CPU kernel serves this block now
    (`SparseMoeBlock.uses_kernel`); the sizes are the block's H, I and held experts. Logs each
    distinct choice once (INFO).

    Raises:
        ValueError: a bad ``BATCHGEN_MOE_PATH``, ``grouped_mm`` forced for experts that
        ``torch._grouped_mm`` cannot run, or ``triton`` forced where the Triton kernels cannot
        run (the reason names the field)."""
    override = moe_path_override()
    if cpu_kernel and (override == "auto" or batch_invariant):
        path: ExpertPath = "cpu_kernel"
    elif batch_invariant:
        path = "per_expert"
    elif override == "grouped_mm":
        reason = grouped_mm_unsupported_reason(dtype, hidden_size, intermediate_size, num_experts)
        if reason is not None:
            raise ValueError(f"{MOE_PATH_ENV}=grouped_mm: {reason}")
        path = "grouped_mm"
    elif override == "triton":
        reason = triton_unsupported_reason(device, dtype)
        if reason is not None:
            raise ValueError(f"{MOE_PATH_ENV}=triton: {reason}")
        path = "triton"
    elif override == "reference":
        path = "reference"
    elif device.type == "cpu":
        path = "per_expert"
    elif grouped_mm_fast_on(device, dtype) and (
        grouped_mm_unsupported_reason(dtype, hidden_size, intermediate_size, num_experts) is None
    ):
        path = "grouped_mm"
    elif triton_unsupported_reason(device, dtype) is None:
        path = "triton"
    else:
        path = "reference"
    key = (device.type, dtype, override, batch_invariant, path)
    if key not in _logged:
        with _logged_lock:
            if key not in _logged:
                _logged.add(key)
                logger.info(
                    "MoE experts on %s in %s: %s path (%s=%s%s)",
                    device.type, dtype, path, MOE_PATH_ENV, override,
                    ", batch-invariant mode" if batch_invariant else "",
                )  # fmt: skip
    return path
