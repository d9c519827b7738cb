"""The model side of the batch-invariant mode (`EngineConfig.batch_invariant`): every op whose
result for one token could depend on the other tokens of its call is made row-independent.

What varies with the batch by default on the CPU float32 path (measured, see
docs/batch-invariance.md): the dense GEMMs, since ``F.linear`` is MKL's SGEMM, whose blocking
of the reduction depends on the number of rows; and ``F.silu``, whose value for an element
depends on where a vectorized loop's remainder and the thread split fall. So a token's
projections, router logits and logits change in the last bits with its batch mates.

`enable_batch_invariant` turns every ``nn.Linear`` of the model into a `BatchInvariantLinear`
(same parameters, so weight loading, tying and updates are untouched) computed by
`batchgen.kernels.invariant_linear`, and marks the MoE blocks and dense MLPs: their torch
expert path (taken where the fused kernel does not serve a layer) uses the same GEMM, and all
of them `invariant_silu`. Already row-independent and left alone: RMSNorm, RoPE, softmax and
top-k routing (row-wise), the fused MoE kernel (one sequential sum per output,
``csrc/fused_moe.cpp``), paged decode attention (per sequence), prefill attention (one SDPA
call per prompt chunk; the engine fixes where a prompt is cut, `batchgen.engine.scheduler`).
Decode attention on the torch path, MLA's included, runs one sequence per call in this mode
(`batchgen.engine.model_runner.ModelRunner`).

Not covered: GELU activations. Expert parallelism is tested on 2 local ranks only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from batchgen.kernels.invariant_linear import invariant_linear, pack_linear_weight


def invariant_silu(x: torch.Tensor) -> torch.Tensor:
    """``x * sigmoid(x)`` as ``x / (1 + exp(-x))``: the same value for an element wherever it
    sits in the tensor.

    ``F.silu`` (and ``sigmoid``, ``gelu``) on CPU runs a vectorized loop with a scalar
    remainder, and splits large tensors over threads at arbitrary element offsets, so one
    element goes through the vector or the scalar formula depending on the tensor's size
    (measured: rows of ``F.silu`` over 1,001 x 96 elements on 2 threads differ in the last bit
    from the same rows alone). ``exp`` gives the same bits on both paths and the rest is
    correctly rounded arithmetic. Differs from ``F.silu`` by about an ulp."""
    return x / (1 + torch.exp(-x))


def invariant_activation(act):
    """The batch-invariant stand-in for an activation: `invariant_silu` for ``F.silu``; other
    activations (GELU) are returned unchanged and are not covered."""
    return invariant_silu if act is F.silu else act


class BatchInvariantLinear(nn.Linear):
    """``nn.Linear`` whose rows do not depend on each other (`invariant_linear`).

    The packed weight (a second copy, `pack_linear_weight`) is built on first use and again
    when the weight is replaced or changed in place through autograd-visible ops (keyed on its
    storage and version counter); other writes (``weight.data``, inference-mode tensors) need
    `invalidate_packed_weights`.
    """

    _packed: tuple | None = None

    def invalidate_packed_weights(self) -> None:
        """Drop the packed weight; the next forward packs again."""
        self._packed = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        try:
            version = w._version
        except RuntimeError:  # inference-mode tensor: no version counter
            version = None
        key = (w.data_ptr(), version, tuple(w.shape))
        if self._packed is None or self._packed[0] != key:
            with torch.no_grad():
                self._packed = (key, pack_linear_weight(w))
        return invariant_linear(x, w, self.bias, packed=self._packed[1])


def enable_batch_invariant(model: nn.Module) -> int:
    """Make ``model``'s per-token results independent of the batch (see the module docstring):
    every ``nn.Linear`` becomes a `BatchInvariantLinear` in place (its class changes, its
    parameters stay), every module with a ``batch_invariant`` attribute (the MoE blocks, the
    dense MLPs) gets it set. Returns the number of linear layers converted."""
    converted = 0
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = BatchInvariantLinear
            converted += 1
        if hasattr(module, "batch_invariant"):
            module.batch_invariant = True
    return converted



def check_batch_invariant_support(device: torch.device, dtype: torch.dtype) -> None:
    """ValueError unless the batch-invariant mode covers ``device`` and ``dtype``: CPU and
    float32 (what `batchgen.kernels.invariant_linear` and the fused MoE kernel compute; CUDA
    kernels and bfloat16 are not made or tested invariant)."""
    if device.type != "cpu" or dtype != torch.float32:
        raise ValueError(
            f"batch_invariant=True needs device='cpu' and dtype='float32', got device="
            f"{device.type!r}, dtype={str(dtype).removeprefix('torch.')!r}"
        )
