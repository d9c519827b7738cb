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
