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
