"""Nasty inputs for the float32 paged decode attention kernel (its AVX-512F path,
``csrc/paged_decode_attention_f32.h``, and the paths it falls back to) through
`paged_decode_attention`: correct results against a float64 reference, or a clear error
naming the argument, never a raw read past a tensor.

Found by this file (failed before its fix): ``sliding_window=True`` ran as a window of 1 and
``block_size=True`` as blocks of 1 (``bool`` is an ``int``; the prefill kernel already refused
a bool window). Passing from the start (kept as regression tests): GQA groups 1, 3, 4, 8 and
head sizes 32-256 on every path, one thread = two threads bit for bit, contexts 1-17 and past
8k, windows at a block edge, NaN / inf in q, huge scores, an unknown isa.
"""

import pytest
import torch

from batchgen.kernels.paged_attention import decode_kernel_available, paged_decode_attention
from test_paged_attention_f32 import _case as _f32_case

pytestmark = pytest.mark.skipif(
    not decode_kernel_available(torch.device("cpu"), torch.float32), reason="kernel not built"
)


def _case(kv_lens, hq, hkv, d, block_size=16, seed=0):
    """q ``[B, Hq, D]``, caches ``[rows, Hkv, D]``, scattered block tables, kv_lens: the f32
    kernel tests' case builder, blocks of 16 by default."""
    return _f32_case(kv_lens, hq, hkv, d, block_size, seed)


def _reference(q, k, v, tables, kv_lens, block_size, scale, window):
    """float64 softmax(scale q K^T) V over each sequence's window (HF's rule)."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    g = q.shape[1] // k.shape[1]
    for b, n in enumerate(kv_lens.tolist()):
        pos = torch.arange(max(0, n - window) if window else 0, n)
        slots = tables[b, pos // block_size] * block_size + pos % block_size
        keys, values = k[slots].double(), v[slots].double()  # [n, Hkv, D]
        for h in range(q.shape[1]):
            p = torch.softmax(keys[:, h // g] @ q[b, h].double() * scale, 0)
            out[b, h] = p @ values[:, h // g]
    return out


@pytest.mark.parametrize("hq,hkv", [(1, 1), (3, 1), (4, 1), (8, 1), (6, 2), (16, 2)])
@pytest.mark.parametrize("d", [32, 64, 80, 128, 256])
def test_groups_and_head_sizes_on_every_path_match_float64(hq, hkv, d):
    q, k, v, tables, lens = _case([1, 15, 16, 17, 48], hq, hkv, d)
    scale = d**-0.5
    for window in (None, 16, 17):
        ref = _reference(q, k, v, tables, lens, 16, scale, window)
        for isa in ("auto", "avx512f", "amx", "avx2", "generic"):  # bf16-only names fall back
            outs = []
            for threads in (1, 2):
                torch.set_num_threads(threads)
                out = torch.empty_like(q)
                paged_decode_attention(q, k, v, tables, lens, 16, scale, window, out, isa=isa)
                outs.append(out)
            assert torch.equal(outs[0], outs[1]), (isa, window)  # threads never change bits
            assert (outs[0].double() - ref).abs().max() < 2e-6, (isa, window)


def test_contexts_past_8k_match_float64():
    q, k, v, tables, lens = _case([8200, 1, 9000], 8, 2, 128)
    ref = _reference(q, k, v, tables, lens, 16, 128**-0.5, None)
    out = torch.empty_like(q)
    paged_decode_attention(q, k, v, tables, lens, 16, 128**-0.5, None, out)
    assert (out.double() - ref).abs().max() < 2e-6


def test_non_finite_query_stays_in_its_sequence_and_huge_scores_do_not_overflow():
    q, k, v, tables, lens = _case([20, 20], 8, 2, 64)
    q[0, 0, 0] = float("inf")
    out = torch.empty_like(q)
    paged_decode_attention(q, k, v, tables, lens, 16, 0.125, None, out)
    ref = _reference(q, k, v, tables, lens, 16, 0.125, None)  # head 0 of sequence 0: NaN
    assert out[0, 0].isnan().all() and ref[0, 0].isnan().all()
    assert (out.double() - ref)[:, 1:].abs().max() < 2e-6 and out[1].isfinite().all()
    q, k, v, tables, lens = _case([20], 8, 2, 64)
    q *= 1e4  # scores ~1e5: the softmax subtracts the max first
    out = torch.empty_like(q)
    paged_decode_attention(q, k, v, tables, lens, 16, 0.125, None, out)
    assert (out.double() - _reference(q, k, v, tables, lens, 16, 0.125, None)).abs().max() < 1e-5


def test_bool_window_or_block_size_and_bad_isa_are_refused_by_name():
    q, k, v, tables, lens = _case([5], 4, 2, 64)
    out = torch.empty_like(q)
    with pytest.raises(ValueError, match="sliding_window"):
        paged_decode_attention(q, k, v, tables, lens, 16, 0.1, True, out)
    with pytest.raises(ValueError, match="block_size"):
        paged_decode_attention(q, k, v, tables, torch.tensor([1]), True, 0.1, None, out)
    with pytest.raises(ValueError, match="isa"):
        paged_decode_attention(q, k, v, tables, lens, 16, 0.1, None, out, isa="AVX512")
