"""RMSNorm (Zhang & Sennrich 2019), computed in float32 as in Hugging Face `LlamaRMSNorm`."""

from __future__ import annotations

import torch
from torch import nn

from batchgen.kernels.rms_norm import fused_add_rms_norm, rms_norm, rms_norm_available

# The attribute of a residual tensor that carries its rows already normed for the next stage:
# ``(norm module, normed [T, H])`` (see `add_and_prenorm`).
PRENORMED_ATTR = "_batchgen_prenormed"


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
        self._kernel_pin = None  # (dtype, on CPU, H, kernel serves), see `pin_kernel`

    def pin_kernel(self, device: torch.device, dtype: torch.dtype) -> bool:
        """Decide once whether the CPU kernel serves this norm for activations of ``dtype`` on
        ``device`` without autograd (`rms_norm_available`), and keep the answer for those
        calls instead of asking on every one (the engine pins at start: a
        ``BATCHGEN_CPU_KERNELS`` changed later reaches this norm when pinned again or after
        `unpin_kernel`). Other calls, and any call whose size or weight dtype differs, ask
        per call. Returns the answer."""
        self._kernel_pin = None
        with torch.no_grad():
            probe = torch.empty((0, self.weight.shape[-1]), dtype=dtype, device=device)
            serves = rms_norm_available(probe, self.weight)
        self._kernel_pin = (dtype, probe.is_cpu, self.weight.shape[-1], serves)
        return serves

    def unpin_kernel(self) -> None:
        """Ask `rms_norm_available` on every call again (`pin_kernel` undone)."""
        self._kernel_pin = None

    def kernel_serves(self, x: torch.Tensor) -> bool:
        """`rms_norm_available` for ``x [..., H]`` and this weight, answered by the pin
        (`pin_kernel`) where it covers the call."""
        pin = self._kernel_pin
        if (
            pin is not None
            and x.dtype is pin[0]
            and self.weight.dtype is pin[0]
            and x.shape[-1] == pin[2]
            and x.is_cpu is pin[1]
            and not torch.is_grad_enabled()
        ):
            return pin[3]
        return rms_norm_available(x, self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel_serves(x):
            return rms_norm(x, self.weight, self.eps)
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


def add_and_prenorm(x: torch.Tensor, residual: torch.Tensor, norm: RMSNorm | None) -> torch.Tensor:
    """The residual add ``residual + x`` of a pre-norm block (HF's order: the sum in the model
    dtype), returned as the new residual stream ``[T, H]``.

    With ``norm`` and the CPU kernel available (`RMSNorm.kernel_serves`), one
    `fused_add_rms_norm` call also norms the sum for the next stage (vLLM's fused add + RMSNorm)
    and attaches it to the returned tensor; `prenormed` picks it up there. The attached rows are
    bit for bit ``norm(sum)``, so a stage that gets another tensor (no attachment) computes the
    same values. The residual stream must not be changed in place after this call (nothing in
    the engine does)."""
    if norm is None or x.shape != residual.shape or not norm.kernel_serves(x):
        return residual + x
    if residual.dtype != x.dtype or residual.device != x.device:
        return residual + x
    normed, summed = fused_add_rms_norm(x, residual, norm.weight, norm.eps)
    setattr(summed, PRENORMED_ATTR, (norm, normed))
    return summed


def prenormed(h: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
    """``norm(h)``: the rows `add_and_prenorm` attached to ``h`` for this very ``norm``, else
    computed now."""
    attached = getattr(h, PRENORMED_ATTR, None)
    if attached is not None and attached[0] is norm:
        return attached[1]
    return norm(h)


def cat_prenormed(hs: list[torch.Tensor]) -> torch.Tensor:
    """``torch.cat(hs)`` (``[sum T_i, H]``), keeping `add_and_prenorm`'s attachment: when every
    tensor carries rows normed by the same norm, their concatenation rides on the result. The
    kernel norms each row on its own, so these are bit for bit the norm of the concatenation
    (the executor's coalesced FFN input; without this the FFN stage norms the rows again)."""
    out = torch.cat(hs)
    attached = [getattr(h, PRENORMED_ATTR, None) for h in hs]
    first = attached[0]
    if first is not None and all(a is not None and a[0] is first[0] for a in attached):
        setattr(out, PRENORMED_ATTR, (first[0], torch.cat([a[1] for a in attached])))
    return out


def split_prenormed(h: torch.Tensor, sizes: list[int]) -> tuple[torch.Tensor, ...]:
    """``h.split(sizes)`` (views of ``h [T, H]``, ``sum(sizes) == T``), each part carrying its
    rows of ``h``'s attachment (`add_and_prenorm`) if ``h`` has one, so that the next stage of
    each part (the attention after a coalesced FFN) does not norm them again."""
    parts = h.split(sizes)
    attached = getattr(h, PRENORMED_ATTR, None)
    if attached is not None:
        for part, normed in zip(parts, attached[1].split(sizes), strict=True):
            setattr(part, PRENORMED_ATTR, (attached[0], normed))
    return parts
