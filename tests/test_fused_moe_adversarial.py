"""Nasty inputs for the CPU fused MoE kernel (`batchgen.kernels.fused_moe`) after the round of
prefetch, non-temporal y_slots stores, AMX k blocks of 128 and huge-page packed weights:
skewed routing, empty experts, odd sizes, the streaming threshold exactly, thread counts,
non-contiguous / wrongly placed arguments, and a bad ``order`` (the kernel indexes x and
y_slots with it)."""

from __future__ import annotations

import pytest
import torch
from fused_moe_helpers import (
    STREAM_MIN_BYTES,
    needs_amx,
    needs_bf16,
    needs_kernel,
)
from fused_moe_helpers import reference as _reference
from fused_moe_helpers import routing as _routing
from fused_moe_helpers import run as _run
from fused_moe_helpers import weights as _weights
from test_fused_moe_bf16 import assert_within_bf16_bound

from batchgen.kernels import fused_moe as fm
from batchgen.models.layers.moe import sort_by_expert


@needs_kernel
@pytest.mark.parametrize(
    "num_tokens,num_experts,top_k,hidden,inter,skew",
    [
        (1, 8, 8, 16, 8, None),  # top_k = num_experts, one token
        (1, 8, 1, 16, 8, None),  # top-1, one token: 7 experts with 0 rows
        (97, 8, 2, 48, 24, 3),  # every token's first slot on expert 3 (97 rows: 9 row blocks)
        (513, 4, 4, 16, 8, 0),  # top_k = E and far more rows than one row chunk per expert
        (5, 64, 8, 80, 40, None),  # most experts empty; H, I not multiples of 32 / 64
        (33, 4, 2, 144, 72, 1),  # H 144, I 72: odd multiples of 16 / 8
        (1000, 64, 1, 48, 24, 0),  # top-1, every row on expert 0, 63 experts empty
    ],
)
def test_float32_skewed_and_sparse_routing_matches_float64(
    num_tokens, num_experts, top_k, hidden, inter, skew
):
    w13, w2 = _weights(num_experts, hidden, inter, seed=1)
    x = torch.randn(num_tokens, hidden, generator=torch.Generator().manual_seed(2))
    weights, ids = _routing(num_tokens, num_experts, top_k, seed=3, skew=skew)
    got = _run(x, w13, w2, weights, ids)
    want = _reference(x, w13, w2, weights, ids)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def _stream_tokens(top_k, hidden, extra):
    """num_tokens with y_slots = T x top_k x H x 4 bytes exactly at kStreamMinBytes (extra 0)
    or one token above it (the smallest step a call can take)."""
    tokens, rem = divmod(STREAM_MIN_BYTES, top_k * hidden * 4)
    assert rem == 0
    return tokens + extra


@needs_kernel
@pytest.mark.parametrize("extra", [0, 1])
def test_y_slots_at_and_just_above_the_streaming_threshold_are_exact(extra):
    """At kStreamMinBytes the rows are stored normally, one token above non-temporally: the
    same bits for every token as the token alone, and float32-close to float64."""
    top_k, hidden, inter, num_experts = 8, 128, 32, 8
    num_tokens = _stream_tokens(top_k, hidden, extra)
    w13, w2 = _weights(num_experts, hidden, inter, seed=4)
    x = torch.randn(num_tokens, hidden, generator=torch.Generator().manual_seed(5))
    weights, ids = _routing(num_tokens, num_experts, top_k, seed=6)
    got = _run(x, w13, w2, weights, ids)
    torch.testing.assert_close(
        got.double(), _reference(x, w13, w2, weights, ids), rtol=1e-5, atol=1e-5
    )
    for t in (0, num_tokens // 2, num_tokens - 1):
        alone = _run(x[t : t + 1], w13, w2, weights[t : t + 1], ids[t : t + 1])
        assert torch.equal(alone[0], got[t])


@needs_kernel
@pytest.mark.parametrize(
    "dtype", [torch.float32, pytest.param(torch.bfloat16, marks=needs_bf16)]
)
@pytest.mark.parametrize("num_tokens,top_k", [(300, 4), (1700, 8)])  # y_slots 0.8 / 8.7 MB
def test_one_and_two_threads_give_the_same_bits(dtype, num_tokens, top_k):
    """Experts spread over threads dynamically, the slot sum statically, regular and (above
    kStreamMinBytes) non-temporal stores: the same bits on 1 and 2 threads."""
    w13, w2 = _weights(16, 160, 96, seed=7, dtype=dtype)  # K = 160: one k block of 128 + 32
    x = torch.randn(num_tokens, 160, generator=torch.Generator().manual_seed(8)).to(dtype)
    weights, ids = _routing(num_tokens, 16, top_k, seed=9, skew=5)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _run(x, w13, w2, weights, ids)
        torch.set_num_threads(2)
        two = _run(x, w13, w2, weights, ids)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


@needs_amx
@pytest.mark.parametrize(
    "hidden,inter,num_tokens",  # 70 / 600 tokens: ~17 / ~150 rows per expert
    [(32, 32, 70), (160, 96, 70), (288, 160, 70), (416, 288, 70), (160, 96, 600)],
)
def test_amx_k_not_a_multiple_of_the_k_block_within_the_bf16_bound(hidden, inter, num_tokens):
    """AMX runs K in blocks of 128 (kKc): K = 32 (less than one block), 160, 288, 416 (a
    partial last block), in one and in two row chunks per expert. AMX and vdpbf16ps both
    within `bf16_error_bound` of float64 math on the same bf16 inputs (so within twice it of
    each other), and a token alone gives AMX's bits."""
    w13, w2 = _weights(8, hidden, inter, seed=10, dtype=torch.bfloat16)
    x = torch.randn(num_tokens, hidden, generator=torch.Generator().manual_seed(11)).bfloat16()
    weights, ids = _routing(num_tokens, 8, 2, seed=12, skew=2)
    amx = _run(x, w13, w2, weights, ids, isa="amx")
    vec = _run(x, w13, w2, weights, ids, isa="avx512_bf16")
    assert_within_bf16_bound(amx, x, w13, w2, weights, ids)
    assert_within_bf16_bound(vec, x, w13, w2, weights, ids)
    for t in (0, num_tokens - 1):
        alone = _run(x[t : t + 1], w13, w2, weights[t : t + 1], ids[t : t + 1], isa="amx")
        assert torch.equal(alone[0], amx[t])


@needs_kernel
def test_zero_tokens_and_zero_experts_with_rows():
    w13, w2 = _weights(4, 16, 8, seed=13)
    x = torch.empty(0, 16)
    out = _run(x, w13, w2, torch.empty(0, 2), torch.empty(0, 2, dtype=torch.int64))
    assert out.shape == (0, 16)


@needs_kernel
def test_non_contiguous_packed_weights_are_refused():
    """A strided view of packed weights (every other expert) has consistent shapes but the
    kernel reads ``data_ptr`` as one dense block: garbage, and past the end of the storage for
    the last experts. It must be refused, naming the argument."""
    w13, w2 = _weights(8, 16, 8, seed=14)
    p13, p2 = fm.pack_expert_weights(w13), fm.pack_expert_weights(w2)
    x = torch.randn(3, 16)
    weights, ids = _routing(3, 4, 2, seed=15)
    order, counts = sort_by_expert(ids, 4)
    with pytest.raises(ValueError, match="w13_packed"):
        fm.fused_moe_silu(x, p13[::2], p2[:4], weights, order, counts)
    with pytest.raises(ValueError, match="w2_packed"):
        fm.fused_moe_silu(x, p13[:4], p2[::2], weights, order, counts)


@needs_kernel
def test_tensors_off_the_cpu_are_refused():
    w13, w2 = _weights(4, 16, 8, seed=16)
    p13, p2 = fm.pack_expert_weights(w13), fm.pack_expert_weights(w2)
    weights, ids = _routing(3, 4, 2, seed=17)
    order, counts = sort_by_expert(ids, 4)
    with pytest.raises(ValueError, match="x"):
        fm.fused_moe_silu(torch.empty(3, 16, device="meta"), p13, p2, weights, order, counts)
    with pytest.raises(ValueError, match="w13_packed"):
        fm.fused_moe_silu(torch.randn(3, 16), p13.to("meta"), p2, weights, order, counts)


@needs_kernel
@pytest.mark.parametrize("bad", ["too_large", "negative", "duplicate"])
def test_an_order_that_is_not_a_permutation_is_refused(bad):
    """``order`` indexes x (by token) and y_slots (by slot): an index past T x top-k read and
    wrote out of bounds; a duplicate left a slot of the reused workspace unwritten (a previous
    call's values summed into the output)."""
    w13, w2 = _weights(4, 16, 8, seed=18)
    x = torch.randn(3, 16)
    weights, ids = _routing(3, 4, 2, seed=19)
    order, counts = sort_by_expert(ids, 4)
    order = order.clone()
    if bad == "too_large":
        order[0] = 1 << 40
    elif bad == "negative":
        order[-1] = -7
    else:
        order[1] = order[0]
    with pytest.raises(ValueError, match="order"):
        fm.fused_moe_silu(x, fm.pack_expert_weights(w13), fm.pack_expert_weights(w2),
                          weights, order, counts)


@needs_kernel
def test_top_k_zero_is_refused_by_name():
    w13, w2 = _weights(4, 16, 8, seed=20)
    with pytest.raises(ValueError, match="top_k"):
        fm.fused_moe_silu(torch.randn(2, 16), fm.pack_expert_weights(w13),
                          fm.pack_expert_weights(w2), torch.empty(2, 0),
                          torch.empty(0, dtype=torch.int64), [0, 0, 0, 0])


def test_pack_expert_weights_of_a_non_contiguous_weight_is_the_same_layout():
    """A transposed checkpoint tensor (``w.t()`` views are common after conversions)."""
    w13, _ = _weights(4, 32, 16, seed=21)
    strided = w13.transpose(1, 2).contiguous().transpose(1, 2)
    assert not strided.is_contiguous()
    assert torch.equal(fm.pack_expert_weights(strided), fm.pack_expert_weights(w13))


def test_pack_expert_weights_rejects_a_weight_that_is_not_3d_by_name():
    with pytest.raises(ValueError, match=r"\[E, N, K\]"):
        fm.pack_expert_weights(torch.zeros(32, 16))


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float64, torch.float16, torch.int32])
def test_an_unsupported_activation_dtype_is_named(dtype):
    """It said ``isa must be one of [] for torch.float64, got 'auto'`` (blaming isa)."""
    w13, w2 = _weights(4, 16, 8, seed=28)
    weights, ids = _routing(3, 4, 2, seed=29)
    order, counts = sort_by_expert(ids, 4)
    with pytest.raises(ValueError, match=r"x must be float32 or bfloat16"):
        fm.fused_moe_silu(torch.zeros(3, 16, dtype=dtype), fm.pack_expert_weights(w13),
                          fm.pack_expert_weights(w2), weights, order, counts)


@needs_kernel
def test_strided_x_weights_and_order_and_tensor_counts_give_the_same_bits():
    """x a column slice of a wider tensor, topk_weights transposed twice, order a strided view,
    counts a tensor instead of a list: the same result as the dense arguments."""
    w13, w2 = _weights(8, 48, 24, seed=30)
    p13, p2 = fm.pack_expert_weights(w13), fm.pack_expert_weights(w2)
    wide = torch.randn(21, 96, generator=torch.Generator().manual_seed(31))
    x = wide[:, 48:]
    weights, ids = _routing(21, 8, 3, seed=32)
    order, counts = sort_by_expert(ids, 8)
    want = fm.fused_moe_silu(x.contiguous(), p13, p2, weights, order, counts)
    strided_weights = weights.t().contiguous().t()
    strided_order = torch.stack([order, order], 1)[:, 0]
    assert not (x.is_contiguous() or strided_weights.is_contiguous()
                or strided_order.is_contiguous())
    got = fm.fused_moe_silu(x, p13, p2, strided_weights, strided_order, torch.tensor(counts))
    assert torch.equal(got, want)


@needs_kernel
@pytest.mark.parametrize("extra", [0, 1])
def test_avx2_and_avx512_agree_bit_for_bit_at_the_streaming_threshold(extra):
    """The AVX2 kernel ignores ``stream`` (regular stores), the AVX-512 one streams above
    kStreamMinBytes: both run the same FMA chain per output, so the same bits either way."""
    if fm.kernel_isa(torch.float32) != "avx512f":
        pytest.skip("no AVX-512F build here")
    top_k, hidden, inter, num_experts = 8, 128, 32, 8
    num_tokens = _stream_tokens(top_k, hidden, extra)
    w13, w2 = _weights(num_experts, hidden, inter, seed=33)
    x = torch.randn(num_tokens, hidden, generator=torch.Generator().manual_seed(34))
    weights, ids = _routing(num_tokens, num_experts, top_k, seed=35)
    assert torch.equal(_run(x, w13, w2, weights, ids), _run(x, w13, w2, weights, ids, "avx2"))


@needs_bf16
@pytest.mark.parametrize("isa", ["avx512_bf16", pytest.param("amx", marks=needs_amx)])
@pytest.mark.parametrize("extra", [0, 1])
def test_bf16_at_and_just_above_the_streaming_threshold_is_batch_invariant(isa, extra):
    top_k, hidden, inter, num_experts = 8, 128, 64, 8
    num_tokens = _stream_tokens(top_k, hidden, extra)
    w13, w2 = _weights(num_experts, hidden, inter, seed=36, dtype=torch.bfloat16)
    x = torch.randn(num_tokens, hidden, generator=torch.Generator().manual_seed(37)).bfloat16()
    weights, ids = _routing(num_tokens, num_experts, top_k, seed=38, skew=extra)
    got = _run(x, w13, w2, weights, ids, isa)
    assert_within_bf16_bound(got, x, w13, w2, weights, ids)
    for t in (0, num_tokens - 1):
        alone = _run(x[t : t + 1], w13, w2, weights[t : t + 1], ids[t : t + 1], isa)
        assert torch.equal(alone[0], got[t])
