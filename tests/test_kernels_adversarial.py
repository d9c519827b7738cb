"""Nasty inputs for the CPU kernels added this session (RMSNorm, packed_linear, the bf16 paged
decode attention paths): NaN/inf, odd sizes, strided and misaligned views, thread counts, the
environment switches. Each test states what a user or a real model could feed in and what the
kernel must do: the same as torch's eager ops (a NaN stays a NaN), or a clear error."""

from __future__ import annotations

import pytest
import torch

from batchgen.kernels.paged_attention import decode_kernel_available, paged_decode_attention
from tests.test_paged_attention_bf16 import ISA_NAMES, _paged_case, needs_compiler


@needs_compiler
@pytest.mark.parametrize("isa", ISA_NAMES)
@pytest.mark.parametrize("hq,hkv,d,block_size", [(8, 2, 64, 16), (16, 1, 32, 16), (4, 4, 64, 32)])
def test_bf16_decode_attention_a_nan_key_makes_the_output_nan(hq, hkv, d, block_size, isa):
    """A NaN in one cached key (a corrupted slot, an overflowed activation) gives torch's SDPA
    a NaN score and a NaN output row; every path must say so too, not drop the key (the
    AVX512-BF16 path clamped NaN to -104 inside its exp, which made its weight 0)."""
    if not decode_kernel_available(torch.device("cpu"), torch.bfloat16):
        pytest.skip("kernel not built")
    kv_lens = [1, 16, 17, 40]
    q, k_cache, v_cache, tables, slots = _paged_case(kv_lens, hq, hkv, d, block_size)
    k_cache[slots[3][5]] = float("nan")  # position 5 of sequence 3, every KV head
    out = torch.zeros(q.shape, dtype=torch.bfloat16)
    paged_decode_attention(
        q, k_cache, v_cache, tables, torch.tensor(kv_lens), block_size, d**-0.5, None, out, isa
    )
    assert out[3].isnan().all(), f"{int(out[3].isnan().sum())} of {out[3].numel()} are NaN"
    assert not out[:3].isnan().any()  # the other sequences are untouched


SWITCHES = [
    ("BATCHGEN_PACKED_LINEAR", "batchgen.kernels.packed_linear", "packed_linear_enabled"),
    ("BATCHGEN_CPU_AMX", "batchgen.kernels.fused_moe", "amx_enabled"),
    ("BATCHGEN_ONEDNN_LINEAR", "batchgen.kernels.onednn_linear", "prepacked_linear_enabled"),
]


@pytest.mark.parametrize("var,module,fn", SWITCHES)
@pytest.mark.parametrize("value", ["of", "2", "disable", "0,1"])
def test_on_off_switches_reject_values_they_do_not_know(var, module, fn, value, monkeypatch):
    """A typo such as ``BATCHGEN_PACKED_LINEAR=of`` used to mean "on" (anything but the four
    off words did), so an A/B run silently measured the same path twice."""
    import importlib

    enabled = getattr(importlib.import_module(module), fn)
    monkeypatch.setenv(var, value)
    allowed = "allowed values are 1/true/yes/on .* 0/false/no/off"
    with pytest.raises(ValueError, match=rf"{var}=.*{allowed}"):
        enabled()


@pytest.mark.parametrize("var,module,fn", SWITCHES)
def test_on_off_switches_accept_the_documented_words(var, module, fn, monkeypatch):
    import importlib

    enabled = getattr(importlib.import_module(module), fn)
    words = [("0", False), (" OFF ", False), ("no", False), ("false", False)]
    words += [("1", True), ("On", True), ("yes", True), ("true", True), ("", True)]
    for value, want in words:
        monkeypatch.setenv(var, value)
        assert enabled() is want, (var, value)
    monkeypatch.delenv(var)
    assert enabled() is True


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(3, 0), (0, 0), (0, 5), (2, 0, 4)])
def test_rms_norm_of_an_empty_tensor_is_the_eager_result(shape, dtype):
    """No rows, or a hidden size of 0: the eager ops return an empty tensor of x's shape; the
    kernel's wrapper raised reshape's "cannot reshape tensor of 0 elements" for H = 0."""
    from batchgen.models.layers.norm import RMSNorm

    x = torch.randn(shape).to(dtype)
    norm = RMSNorm(shape[-1]).to(dtype)
    with torch.no_grad():
        y = norm(x)
    assert y.shape == x.shape and y.dtype == dtype


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("h", [1, 7, 17, 2880, 5128])
def test_rms_norm_nan_inf_and_odd_hidden_sizes_follow_the_eager_ops(h, dtype):
    """A NaN or an inf in a row makes that row NaN as in the eager ops (inf / inf), never a
    number; the other rows are the eager result up to the kernel's summation order (one bf16
    rounding, tests/test_rms_norm.py's bound); hidden sizes not a multiple of 16 take the
    generic loops. Views at an odd element offset and transposed inputs give the same bits as
    their contiguous copies, and one thread the same bits as two."""
    from batchgen.kernels.rms_norm import rms_norm, rms_norm_available

    g = torch.Generator().manual_seed(h)
    x = torch.randn(40, h + 1, generator=g).to(dtype)[:, 1:]  # odd offset, strided rows
    w = torch.randn(h + 1, generator=g).to(dtype)[1:]
    if not rms_norm_available(x, w):
        pytest.skip("rms_norm kernel not built")
    x[1, 0], x[2, -1], x[3, h // 2] = float("nan"), float("inf"), float("-inf")
    y = rms_norm(x, w, 1e-6)
    x32 = x.float()
    want = w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)
    assert torch.equal(y.isnan(), want.isnan()) and y[1:4].isnan().any(dim=-1).all()
    finite = ~want.isnan()
    ulp = 2.0**-7 if dtype == torch.bfloat16 else 2.0**-20
    assert ((y - want).float().abs()[finite] <= ulp * want.float().abs()[finite] * 2 + 1e-30).all()
    same_bits = dict(rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(y, rms_norm(x.contiguous(), w.contiguous(), 1e-6), **same_bits)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = rms_norm(x, w, 1e-6)
    finally:
        torch.set_num_threads(threads)
    torch.testing.assert_close(one, y, **same_bits)
