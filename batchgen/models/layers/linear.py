"""Dense projections on prepacked weights: `PrepackedLinear` and `enable_prepacked_linear`.

On a CPU with avx512_bf16, a bfloat16 model's ``nn.Linear`` layers (attention q/k/v/o, MLA
projections, dense MLPs, shared experts, the router gate, the LM head) run on oneDNN weights
packed once (`batchgen.kernels.onednn_linear`) instead of ``F.linear``, which repacks the
weight on every call. The class changes in place and the parameters stay, so weight loading,
tying (``lm_head.weight is embed_tokens.weight``) and `update_weights` are untouched: the packed
copy is keyed on the weight's storage, version counter and shape, and is dropped by
`invalidate_packed_weights` (called by the loader and by `update_weights`, whose writes go
through ``.data`` or inference-mode tensors that the version counter does not see).

Float32 models and the batch-invariant mode (float32 only) keep their ``nn.Linear`` /
`BatchInvariantLinear` as they were.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from batchgen.kernels.onednn_linear import (
    onednn_linear,
    pack_onednn_weight,
    prepacked_linear_available,
)


def _version(t: torch.Tensor) -> int | None:
    try:
        return t._version
    except RuntimeError:  # inference-mode tensor: no version counter
        return None


class PrepackedLinear(nn.Linear):
    """``nn.Linear`` whose bfloat16 CPU forward runs on a oneDNN-packed copy of the weight
    (`onednn_linear`); every other case (float32, CUDA, autograd, no avx512_bf16,
    ``BATCHGEN_ONEDNN_LINEAR=0``) is ``F.linear``.

    The packed weight (a second copy) is built on first use and again when the weight is
    replaced or changed through autograd-visible ops; other writes need
    `invalidate_packed_weights`.
    """

    _packed: tuple | None = None

    def invalidate_packed_weights(self) -> None:
        """Drop the packed weight; the next forward packs again."""
        self._packed = None

    def packed_weight(self) -> torch.Tensor:
        """`pack_onednn_weight` of ``self.weight``, cached (see the class docstring)."""
        w = self.weight
        key = (w.data_ptr(), _version(w), tuple(w.shape), w.dtype)
        if self._packed is None or self._packed[0] != key:
            self._packed = (key, pack_onednn_weight(w))
        return self._packed[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if prepacked_linear_available(x, self.weight):
            return onednn_linear(x, self.packed_weight(), self.bias)
        return F.linear(x, self.weight, self.bias)


def enable_prepacked_linear(model: nn.Module) -> int:
    """Turn every plain ``nn.Linear`` of ``model`` into a `PrepackedLinear` in place (class
    changed, parameters kept) and pack the weights that `onednn_linear` will serve now, so the
    first step does not pay for it; subclasses (`BatchInvariantLinear`) are left alone. Returns
    the number converted."""
    converted = 0
    with torch.no_grad():
        for module in model.modules():
            if type(module) is nn.Linear:
                module.__class__ = PrepackedLinear
                converted += 1
                if prepacked_linear_available(module.weight, module.weight):
                    module.packed_weight()
    return converted
