"""The fused small-op CPU kernels against the torch ops they replace (issue 19):

- `topk_softmax` (batchgen/kernels/moe_routing.py) against HF's routing ops
  (``softmax(logits.float())``, ``torch.topk``, ``w / w.sum()``): bit for bit, the same experts
  in the same order, ties included (torch.topk's CPU algorithm, reproduced for rows with ties).
  Non-finite logits give torch's ids and NaN weights, as torch.
- `moe_sort`: exactly ``argsort(stable=True)`` and ``bincount``.
- `rotary_embedding_` (batchgen/kernels/rotary_embedding.py): bit for bit the eager
  ``q * cos + rotate_half(q) * sin``, float32 and bf16; `rotary_embedding_and_cache_` the same
  rotation and the two ``index_copy_`` of k and v into the paged cache, bit for bit.
- `fused_add_rms_norm` (batchgen/kernels/rms_norm.py): the new residual bit for bit
  ``residual + x`` and the normed rows bit for bit `rms_norm` of it; and the decoder layers
  that fuse it (`add_and_prenorm` / `prenormed`) give the unfused stages' bits.
"""

from __future__ import annotations

import pytest
import torch

from batchgen.kernels.moe_routing import (
    moe_sort,
    moe_sort_available,
    topk_softmax,
    topk_softmax_available,
)
from batchgen.kernels.rms_norm import fused_add_rms_norm, rms_norm
from batchgen.kernels.rotary_embedding import (
    rotary_embedding_and_cache_,
    rotary_embedding_and_cache_available,
    rotary_embedding_available,
)
from batchgen.models.layers.norm import (
    PRENORMED_ATTR,
    RMSNorm,
    add_and_prenorm,
    cat_prenormed,
    prenormed,
    split_prenormed,
)
from batchgen.models.layers.rotary import RotaryEmbedding

DTYPES = [torch.float32, torch.bfloat16]


def eager_routing(logits: torch.Tensor, k: int, renormalize: bool):
    """HF `MixtralTopKRouter` / `Qwen2MoeTopKRouter`'s ops."""
    probs = torch.softmax(logits.float(), dim=-1)
    w, ids = torch.topk(probs, k, dim=-1)
    if renormalize:
        w = w / w.sum(dim=-1, keepdim=True)
    return w, ids


# (E, k): partial_sort (k * 64 <= E) and nth_element paths, k = 1 and k = E.
ROUTES = [(64, 8), (8, 2), (60, 4), (128, 1), (512, 8), (16, 16)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("experts, k", ROUTES)
@pytest.mark.parametrize("renormalize", [True, False])
def test_topk_softmax_is_hfs_routing_bit_for_bit(
    dtype, experts, k, renormalize
):
    torch.manual_seed(experts * 10 + k)
    logits = (torch.randn(2000, experts) * 2).to(dtype)
    assert topk_softmax_available(logits)
    w, ids = topk_softmax(logits, k, renormalize)
    w0, ids0 = eager_routing(logits, k, renormalize)
    assert w.dtype == torch.float32 and ids.dtype == torch.int64 and w.shape == (2000, k)
    assert torch.equal(ids, ids0) and torch.equal(w, w0)


@pytest.mark.parametrize("k", range(1, 17))
def test_topk_softmax_renormalises_as_torch_for_every_k(k):
    """The kernel renormalises in slot order where torch.sum adds that way (k = 1-4, 8), torch
    renormalises elsewhere: bit for bit either way."""
    torch.manual_seed(k)
    logits = torch.randn(3000, 64)
    for scale in (1.0, 2.5):
        w, ids = topk_softmax(logits, k, True, scale)
        w0, ids0 = eager_routing(logits, k, True)
        assert torch.equal(ids, ids0) and torch.equal(w, w0 * scale if scale != 1.0 else w0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("experts, k", ROUTES)
def test_topk_softmax_breaks_ties_as_torch_topk(dtype, experts, k):
    """Logits from {0, 1, 2, 3}: most chosen experts tie with others; the ids must be torch's,
    which are neither ascending nor descending expert order in general (introselect)."""
    torch.manual_seed(experts + k)
    logits = torch.randint(0, 4, (3000, experts)).to(dtype)
    w, ids = topk_softmax(logits, k, True)
    w0, ids0 = eager_routing(logits, k, True)
    assert torch.equal(ids, ids0) and torch.equal(w, w0)
    if k >= 4:  # the test has teeth: chosen experts tie, in an order not the index order
        tied = w[:, :-1] == w[:, 1:]
        assert tied.float().mean() > 0.2
        assert (ids[:, :-1][tied] > ids[:, 1:][tied]).any()


def test_topk_softmax_non_finite_logits_follow_torch():
    torch.manual_seed(0)
    logits = torch.randn(4, 64)
    logits[1, 5], logits[2, 7], logits[3] = float("nan"), float("inf"), float("-inf")
    w, ids = topk_softmax(logits, 8, True)
    w0, ids0 = eager_routing(logits, 8, True)
    assert torch.equal(ids, ids0)
    assert torch.isnan(w[1:]).all() and torch.isnan(w0[1:]).all()
    assert torch.equal(w[:1], w0[:1])


def test_topk_softmax_scale_rows_and_bad_k():
    torch.manual_seed(0)
    logits = torch.randn(300, 64)
    w, ids = topk_softmax(logits, 6, True, scale=2.5)
    w1, ids1 = topk_softmax(logits, 6, True)
    assert torch.equal(ids, ids1) and torch.equal(w, w1 * 2.5)
    for rows in (slice(0, 1), slice(100, 101), slice(7, 200)):  # batch-invariant rows
        wr, idr = topk_softmax(logits[rows], 6, True)
        assert torch.equal(wr, w1[rows]) and torch.equal(idr, ids1[rows])
    empty_w, empty_ids = topk_softmax(logits[:0], 6, True)
    assert empty_w.shape == empty_ids.shape == (0, 6)
    with pytest.raises(ValueError, match="top_k must be in"):
        topk_softmax(logits, 65, True)


def test_select_experts_uses_the_kernel_and_the_torch_ops_elsewhere(monkeypatch):
    from batchgen.models.layers.moe import select_experts_softmax

    torch.manual_seed(0)
    logits = torch.randn(50, 64)
    w, ids = select_experts_softmax(logits, 8, True)
    assert torch.equal(w, topk_softmax(logits, 8, True)[0])
    monkeypatch.setenv("BATCHGEN_CPU_KERNELS", "rms_norm")
    assert not topk_softmax_available(logits) and not moe_sort_available(ids)
    w0, ids0 = select_experts_softmax(logits, 8, True)
    assert torch.equal(w0, eager_routing(logits, 8, True)[0]) and torch.equal(ids0, ids)
    assert not topk_softmax_available(logits.half())
    assert not topk_softmax_available(logits.requires_grad_())


@pytest.mark.parametrize("tokens, k, experts", [(700, 8, 64), (1, 1, 1), (0, 8, 64), (33, 4, 3)])
def test_moe_sort_is_a_stable_argsort_and_a_bincount(tokens, k, experts):
    from batchgen.models.layers.moe_sort import sort_by_expert

    torch.manual_seed(tokens)
    ids = torch.randint(0, experts, (tokens, k))
    order, counts = moe_sort(ids, experts)
    flat = ids.reshape(-1)
    assert torch.equal(order, torch.argsort(flat, stable=True))
    assert torch.equal(counts, torch.bincount(flat, minlength=experts))
    order2, counts2 = sort_by_expert(ids, experts)
    assert torch.equal(order2, order) and counts2 == counts.tolist()


def test_moe_sort_refuses_ids_out_of_range():
    with pytest.raises(ValueError, match=r"outside \[0, 4\)"):
        moe_sort(torch.tensor([[0, 4]]), 4)
    with pytest.raises(ValueError, match=r"outside \[0, 4\)"):
        moe_sort(torch.tensor([[-1, 2]]), 4)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128, 40, 6])
def test_rotary_kernel_is_the_eager_rotation_bit_for_bit(dtype, head_dim):
    torch.manual_seed(head_dim)
    tokens, hq, hkv = 300, 8, 2  # 300 rows: the threaded path
    rope = RotaryEmbedding(head_dim, {"rope_type": "default", "rope_theta": 1e6})
    positions = torch.randint(0, 30000, (tokens,))
    qkv = (torch.randn(tokens, (hq + 2 * hkv) * head_dim) * 3).to(dtype)
    q = qkv[:, : hq * head_dim].view(tokens, hq, head_dim)  # views of the fused projection
    k = qkv[:, hq * head_dim : (hq + hkv) * head_dim].view(tokens, hkv, head_dim)
    v_before = qkv[:, (hq + hkv) * head_dim :].clone()
    cache: dict = {}
    q0, k0 = rope(positions, q, k, cache)  # eager, new tensors
    cos, sin = cache[(rope.cache_key, dtype)]
    assert rotary_embedding_available(q, k, cos, sin)
    q1, k1 = rope(positions, q, k, cache, inplace=True)
    assert q1.data_ptr() == q.data_ptr() and k1.data_ptr() == k.data_ptr()  # in place
    assert torch.equal(q1, q0) and torch.equal(k1, k0)
    assert torch.equal(qkv[:, (hq + hkv) * head_dim :], v_before)  # v untouched


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 70, 300])
def test_rotary_with_cache_write_is_the_rotation_then_index_copy_bit_for_bit(dtype, tokens):
    torch.manual_seed(tokens)
    hq, hkv, d, num_slots = 8, 2, 64, 1024
    rope = RotaryEmbedding(d, {"rope_type": "default", "rope_theta": 1e6})
    positions = torch.randint(0, 30000, (tokens,))
    qkv = (torch.randn(tokens, (hq + 2 * hkv) * d) * 3).to(dtype)
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)  # views of the fused projection
    q, k, v = q.view(tokens, hq, d), k.view(tokens, hkv, d), v.view(tokens, hkv, d)
    slots = torch.randperm(num_slots)[:tokens]  # int64, any order
    caches = [(torch.randn(num_slots, hkv, d).to(dtype)) for _ in range(4)]
    ref_k, ref_v, k_cache, v_cache = caches[0], caches[1], caches[0].clone(), caches[1].clone()
    cache: dict = {}
    q0, k0 = rope(positions, q, k, cache)  # eager, new tensors
    ref_k.index_copy_(0, slots, k0)
    ref_v.index_copy_(0, slots, v)
    v_before = v.clone()
    assert rope.rotate_and_cache_(positions, q, k, v, cache, (k_cache, v_cache), slots)
    assert torch.equal(q, q0) and torch.equal(k, k0)  # rotated in place, the same bits
    assert torch.equal(v, v_before)
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)  # other slots kept


def test_rotary_with_cache_write_refuses_what_it_cannot_write():
    rope = RotaryEmbedding(8, {"rope_theta": 10000.0})
    q, k, v = torch.randn(5, 2, 8), torch.randn(5, 1, 8), torch.randn(5, 1, 8)
    kv = (torch.zeros(16, 1, 8), torch.zeros(16, 1, 8))
    pos, slots = torch.arange(5), torch.arange(5)
    cos, sin = rope.cos_sin(pos, torch.float32)
    assert rotary_embedding_and_cache_available(q, k, v, cos, sin, kv, slots)
    for bad_kv, bad_slots, bad_v in [
        ((kv[0].bfloat16(), kv[1].bfloat16()), slots, v),  # cache of another dtype
        ((kv[0], kv[1][:8]), slots, v),  # caches of different sizes
        ((torch.zeros(16, 1, 16)[:, :, ::2], kv[1]), slots, v),  # not contiguous
        (kv, slots.int(), v),  # int32 slots
        (kv, slots[:4], v),  # a slot short
        (kv, slots, torch.randn(5, 1, 16)[:, :, ::2]),  # v heads not contiguous
    ]:
        assert not rotary_embedding_and_cache_available(q, k, bad_v, cos, sin, bad_kv, bad_slots)
        assert not rope.rotate_and_cache_(pos, q, k, bad_v, None, bad_kv, bad_slots)
    q_before = q.clone()
    with pytest.raises(ValueError, match=r"outside \[0, 16\)"):
        rotary_embedding_and_cache_(q, k, v, cos, sin, kv, torch.tensor([0, 1, 2, 3, 16]))
    assert torch.equal(q, q_before) and not kv[0].any()  # nothing written
    with pytest.raises(ValueError, match="slot_mapping"):
        rotary_embedding_and_cache_(q, k, v, cos, sin, kv, slots.int())


def test_rotary_kernel_serves_only_layouts_it_reads(monkeypatch):
    rope = RotaryEmbedding(8, {"rope_theta": 10000.0})
    q, k = torch.randn(5, 2, 8), torch.randn(5, 1, 8)
    cos, sin = rope.cos_sin(torch.arange(5), torch.float32)
    assert rotary_embedding_available(q, k, cos, sin)
    assert not rotary_embedding_available(torch.randn(5, 8, 2).transpose(1, 2), k, cos, sin)
    assert not rotary_embedding_available(torch.randn(5, 2, 16)[:, :, ::2], k, cos, sin)
    assert not rotary_embedding_available(q.half(), k.half(), cos.half(), sin.half())
    assert not rotary_embedding_available(q, k.bfloat16(), cos, sin)
    monkeypatch.setenv("BATCHGEN_CPU_KERNELS", "rms_norm")
    assert not rotary_embedding_available(q, k, cos, sin)
    q0, k0 = rope(torch.arange(5), q, k, inplace=True)  # eager: new tensors
    assert q0.data_ptr() != q.data_ptr()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(70, 512), (2048, 512), (3, 100), (1, 4096), (0, 512)])
def test_fused_add_rms_norm_is_the_add_then_the_norm_bit_for_bit(dtype, shape):
    torch.manual_seed(shape[0])
    x, residual = torch.randn(*shape).to(dtype), (torch.randn(*shape) * 4).to(dtype)
    weight = (torch.randn(shape[1]) * 0.5 + 1).to(dtype)
    normed, summed = fused_add_rms_norm(x, residual, weight, 1e-5)
    assert torch.equal(summed, residual + x)
    assert torch.equal(normed, rms_norm(residual + x, weight, 1e-5))
    with pytest.raises(ValueError, match="must match"):
        fused_add_rms_norm(x, residual.float() if dtype != torch.float32 else residual.double(),
                           weight, 1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_and_prenorm_attaches_the_norm_that_prenormed_would_compute(dtype):
    torch.manual_seed(0)
    norm, other = RMSNorm(512, 1e-6).to(dtype), RMSNorm(512, 1e-6).to(dtype)
    with torch.inference_mode():
        norm.weight.copy_(torch.randn(512))
        x, h = torch.randn(70, 512).to(dtype), torch.randn(70, 512).to(dtype)
        out = add_and_prenorm(x, h, norm)
        assert torch.equal(out, h + x)
        attached = getattr(out, PRENORMED_ATTR)[1]
        assert prenormed(out, norm) is attached
        assert torch.equal(attached, norm(out))  # what an unfused stage computes
        assert torch.equal(prenormed(out, other), other(out))  # another norm: computed
        # A concatenation (the executor's coalesced FFN input) carries nothing: computed again,
        # to the same bits.
        merged = torch.cat([out[:30], out[30:]])
        assert getattr(merged, PRENORMED_ATTR, None) is None
        assert torch.equal(prenormed(merged, norm), attached)
        plain = add_and_prenorm(x, h, None)  # the last layer: no next norm
        assert torch.equal(plain, out) and getattr(plain, PRENORMED_ATTR, None) is None
        half = add_and_prenorm(x.half(), h.half(), norm.half())  # no kernel: plain add
        assert getattr(half, PRENORMED_ATTR, None) is None


@pytest.mark.parametrize("dtype", DTYPES)
def test_cat_and_split_prenormed_carry_the_normed_rows_bit_for_bit(dtype):
    """The executor's coalesced FFN: `cat_prenormed` of the groups' residuals carries the
    concatenation of their normed rows, `split_prenormed` hands each group its rows back; both
    are what a stage that norms the rows itself computes."""
    torch.manual_seed(1)
    norm, other = RMSNorm(512, 1e-6).to(dtype), RMSNorm(512, 1e-6).to(dtype)
    with torch.inference_mode():
        norm.weight.copy_(torch.randn(512))
        sizes = [3, 70, 1, 16]
        outs = [
            add_and_prenorm(torch.randn(n, 512).to(dtype), torch.randn(n, 512).to(dtype), norm)
            for n in sizes
        ]
        if getattr(outs[0], PRENORMED_ATTR, None) is None:
            pytest.skip("the rms_norm kernel is not built here: nothing is attached")
        merged = cat_prenormed(outs)
        assert torch.equal(merged, torch.cat(outs))
        carried = getattr(merged, PRENORMED_ATTR)
        assert carried[0] is norm
        assert prenormed(merged, norm) is carried[1]
        assert torch.equal(carried[1], norm(torch.cat(outs)))  # the unfused stage's bits
        parts = split_prenormed(merged, sizes)
        for part, out in zip(parts, outs, strict=True):
            assert torch.equal(part, out)
            assert torch.equal(prenormed(part, norm), getattr(out, PRENORMED_ATTR)[1])
            assert torch.equal(prenormed(part, other), other(out))  # another norm: computed
        # Attachments of different norms, or a part without one: nothing is carried.
        mixed = [outs[0], add_and_prenorm(outs[1], outs[1], other)]
        assert getattr(cat_prenormed(mixed), PRENORMED_ATTR, None) is None
        assert getattr(cat_prenormed([outs[0], outs[1] + 0]), PRENORMED_ATTR, None) is None
        plain = split_prenormed(outs[0] + 0, [1, 2])
        assert all(getattr(p, PRENORMED_ATTR, None) is None for p in plain)
