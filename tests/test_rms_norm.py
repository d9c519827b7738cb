"""The RMSNorm CPU kernel (batchgen/kernels/rms_norm.py) against the eager ops it replaces.

The kernel adds the squares in another order (16 lanes, fused multiply-adds) than torch's
``pow(2).mean()``, so the mean square may differ in its last bits and, through it, the
float32 outputs by a few units in the last place; bf16 outputs are rounded after that and
nearly always equal. Bounds asserted: float32, |kernel - eager| <= 4 ulp of the eager value
(the mean square's relative error is at most about H x 2^-24 either way; its square root halves
it); bf16, at most 1 bf16 ulp and on at most 0.1% of the elements."""

from __future__ import annotations

import pytest
import torch

from batchgen.kernels.rms_norm import rms_norm, rms_norm_available
from batchgen.models.layers.norm import RMSNorm

SHAPES = [(1, 64), (70, 512), (3, 7), (5, 2880), (33, 4096), (0, 512), (2, 3, 48)]


def eager(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_kernel_within_its_bound_of_the_eager_ops(dtype, shape):
    torch.manual_seed(hash(shape) % 1000)
    h = shape[-1]
    weight = (torch.randn(h) * 0.5 + 1).to(dtype)
    x = (torch.randn(*shape) * 3).to(dtype)
    assert rms_norm_available(x, weight)
    got, want = rms_norm(x, weight, 1e-5), eager(x, weight, 1e-5)
    assert got.shape == x.shape and got.dtype == dtype
    if x.numel() == 0:
        return
    if dtype == torch.float32:
        ulp = torch.finfo(torch.float32).eps * want.abs().clamp_min(torch.finfo(torch.float32).tiny)
        assert ((got - want).abs() <= 4 * ulp).all()
    else:
        diff = got != want
        assert diff.float().mean().item() <= 1e-3
        one_ulp = want.float().abs() * 2**-7  # bf16 keeps 8 significant bits
        assert ((got.float() - want.float()).abs() <= one_ulp + 1e-30).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rows_result_does_not_depend_on_the_other_rows(dtype):
    torch.manual_seed(0)
    weight = torch.randn(512).to(dtype)
    x = torch.randn(300, 512).to(dtype)  # threaded path
    full = rms_norm(x, weight, 1e-6)
    for rows in (slice(0, 1), slice(17, 18), slice(5, 40), slice(299, 300)):
        assert torch.equal(rms_norm(x[rows], weight, 1e-6), full[rows])


def test_module_uses_the_kernel_where_it_serves_and_the_eager_ops_elsewhere(monkeypatch):
    torch.manual_seed(0)
    norm = RMSNorm(64, 1e-6)
    x = torch.randn(4, 64)
    with torch.no_grad():
        assert torch.equal(norm(x), rms_norm(x, norm.weight, 1e-6))
    # A gradient is needed: the eager ops (autograd), exactly.
    y = norm(x)
    assert y.requires_grad and torch.equal(y.detach(), eager(x, norm.weight.detach(), 1e-6))
    # float16 and a weight of another dtype: eager.
    assert not rms_norm_available(x.half(), norm.weight.half())
    assert not rms_norm_available(x.bfloat16(), norm.weight)
    monkeypatch.setenv("BATCHGEN_CPU_KERNELS", "fused_moe")
    assert not rms_norm_available(x, norm.weight)
    monkeypatch.setenv("BATCHGEN_CPU_KERNELS", "rms_norm")
    assert rms_norm_available(x, norm.weight.detach())
