"""Dense projections on prepacked weights: `PrepackedLinear` and `enable_prepacked_linear`.

On a CPU with avx512_bf16, a bfloat16 model's ``nn.Linear`` layers (attention q/k/v/o, MLA
projections, dense MLPs, shared experts, the router gate, the LM head) run on oneDNN weights
packed once (`batchgen.kernels.onednn_linear`) instead of ``F.linear``, which repacks the
weight on every call. The class changes in place and the parameters stay, so weight loading,
tying (``lm_head.weight is embed_tokens.weight``) and `update_weights` are untouched: the packed
copy is keyed on the weight's storage and version counter, and is dropped by
`invalidate_packed_weights` (called by the loader and by `update_weights`, whose writes go
through ``.data`` or inference-mode tensors that the version counter does not see).

Float32 models and the batch-invariant mode (float32 only) keep their ``nn.Linear`` /
`BatchInvariantLinear` as they were.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from batchgen.kernels.onednn_linear import pack_onednn_weight, prepacked_linear_supported


def _version(t: torch.Tensor) -> int | None:
    """The version counter, None for an inference-mode tensor (which has none). Asked first:
    reading ``_version`` there raises, and a C++ exception costs about 20 us per call."""
    return None if t.is_inference() else t._version


class PrepackedLinear(nn.Linear):
    """``nn.Linear`` whose bfloat16 CPU forward runs on a oneDNN-packed copy of the weight
    (`batchgen.kernels.onednn_linear`); other inputs (float32, CUDA, autograd) take
    ``F.linear``. Made by `enable_prepacked_linear`, which converts only bfloat16 layers and
    only where `prepacked_linear_supported`.

    The packed weight (a second copy) is built at conversion and again when the weight is
    replaced or changed through autograd-visible ops (keyed on its storage and version
    counter); other writes need `invalidate_packed_weights`. The forward is kept to a few
    attribute reads: at the bench model's sizes (hidden 512) oneDNN takes about 20 us a call,
    and each microsecond of Python is 5% of it.
    """

    _packed: tuple | None = None  # ((data_ptr, version), packed weight)

    def invalidate_packed_weights(self) -> None:
        """Drop the packed weight; the next bfloat16 forward packs again."""
        self._packed = None

    def packed_weight(self) -> torch.Tensor:
        """`pack_onednn_weight` of ``self.weight``, cached (see the class docstring)."""
        w = self.weight
        key = (w.data_ptr(), _version(w))
        if self._packed is None or self._packed[0] != key:
            with torch.no_grad():
                self._packed = (key, pack_onednn_weight(w))
        return self._packed[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if (
            x.dtype is not torch.bfloat16
            or not x.is_cpu
            or (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad))
        ):
            return F.linear(x, w, self.bias)
        packed = self._packed
        if packed is None or packed[0] != (w.data_ptr(), _version(w)):
            self.packed_weight()
            packed = self._packed
        if x.shape[-1] != self.in_features:
            raise ValueError(f"x must be [..., {self.in_features}], got {tuple(x.shape)}")
        # Any leading dimensions and strides; float32 accumulation, rounded once to bf16.
        return torch.ops.mkldnn._linear_pointwise(x, packed[1], self.bias, "none", [], "")


def enable_prepacked_linear(model: nn.Module) -> int:
    """Where `prepacked_linear_supported` (oneDNN, avx512_bf16, ``BATCHGEN_ONEDNN_LINEAR`` not
    ``0``), turn every plain ``nn.Linear`` of ``model`` with a bfloat16 CPU weight into a
    `PrepackedLinear` in place (class changed, parameters kept) and pack its weight now, so the
    first step does not pay for it. Other layers (float32 ones such as DeepSeek's router gate,
    subclasses such as `BatchInvariantLinear`) are left alone. Returns the number converted
    (0 where unsupported: the model is unchanged)."""
    if not prepacked_linear_supported():
        return 0
    converted = 0
    for module in model.modules():
        w = getattr(module, "weight", None)
        if type(module) is nn.Linear and w.dtype == torch.bfloat16 and w.is_cpu:
            module.__class__ = PrepackedLinear
            module.packed_weight()
            converted += 1
    return converted
