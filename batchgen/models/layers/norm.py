"""RMSNorm (Zhang & Sennrich 2019), computed in float32 as in Hugging Face `LlamaRMSNorm`."""

from __future__ import annotations

import torch
from torch import nn

from batchgen.kernels.rms_norm import rms_norm, rms_norm_available


class RMSNorm(nn.Module):
    """``y = x / sqrt(mean(x^2) + eps) * weight``.

    Input ``[..., hidden]`` of any float dtype; the normalisation runs in float32 and the result
    is cast back to the input dtype before the weight multiply (HF's order, so bf16 matches).
    On CPU in float32 or bfloat16 one kernel call computes the same
    (`batchgen.kernels.rms_norm`: the sum of squares in another order), else eight torch ops.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if rms_norm_available(x, self.weight):
            return rms_norm(x, self.weight, self.eps)
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)
