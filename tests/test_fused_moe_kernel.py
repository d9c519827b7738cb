"""The CPU fused MoE kernel (`batchgen.kernels.fused_moe`) against the plain torch experts
(`fused_experts_reference`), its batch invariance, when it is (not) used, and its weight cache."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from batchgen.kernels import fused_moe as fm
from batchgen.models.layers.moe import SparseMoeBlock, fused_experts_reference, sort_by_expert
from batchgen.models.model_config import RouterConfig

needs_kernel = pytest.mark.skipif(
    not fm.fused_moe_available(
        torch.zeros(1, 16), torch.zeros(1, 16, 16), torch.zeros(1, 16, 8), F.silu
    ),
    reason="the fused MoE kernel is not built here (no compiler or no AVX2/FMA)",
)


def _routing(num_tokens, num_experts, top_k, seed):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_tokens, num_experts, generator=g)
    weights, ids = torch.topk(torch.softmax(logits, -1), top_k)
    return weights / weights.sum(-1, keepdim=True), ids


def _weights(num_experts, hidden, inter, seed):
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=g) * hidden**-0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=g) * inter**-0.5
    return w13, w2


def _layer(seed):
    """A small Mixtral-style `SparseMoeBlock` (H 32, I 16, 4 experts, top-2), random weights."""
    torch.manual_seed(seed)
    layer = SparseMoeBlock(32, 16, num_experts=4, top_k=2, router=RouterConfig())
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.2)
    return layer


def _kernel(x, w13, w2, topk_weights, topk_ids):
    order, counts = sort_by_expert(topk_ids, w13.shape[0])
    return fm.fused_moe_silu(
        x, fm.pack_expert_weights(w13), fm.pack_expert_weights(w2), topk_weights, order, counts
    )


@needs_kernel
@pytest.mark.parametrize(
    "num_tokens,num_experts,top_k,hidden,inter",
    [
        (1, 4, 2, 16, 8),  # one decode token
        (5, 8, 3, 32, 24),  # 2I = 48: three panels; rows not a multiple of 6
        (37, 4, 1, 48, 16),  # top-1
        (300, 4, 2, 64, 32),  # ~150 rows per expert: two row chunks of the kernel
        (64, 64, 8, 512, 256),  # the bench model's shapes
        (300, 16, 8, 512, 64),  # y_slots 4.9 MB: above kStreamMinBytes, non-temporal stores
    ],
)
def test_kernel_matches_reference_experts(num_tokens, num_experts, top_k, hidden, inter):
    w13, w2 = _weights(num_experts, hidden, inter, seed=1)
    x = torch.randn(num_tokens, hidden, generator=torch.Generator().manual_seed(2))
    topk_weights, topk_ids = _routing(num_tokens, num_experts, top_k, seed=3)
    got = _kernel(x, w13, w2, topk_weights, topk_ids)
    want = fused_experts_reference(
        x.double(), w13.double(), w2.double(), topk_weights.double(), topk_ids
    ).float()
    assert got.shape == (num_tokens, hidden) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@needs_kernel
def test_kernel_output_of_a_token_does_not_depend_on_the_batch():
    """A token's result is bit-identical alone and among 200 others (lockstep and coalesce put
    different tokens in one MoE call)."""
    w13, w2 = _weights(8, 32, 16, seed=4)
    x = torch.randn(201, 32, generator=torch.Generator().manual_seed(5))
    topk_weights, topk_ids = _routing(201, 8, 2, seed=6)
    batch = _kernel(x, w13, w2, topk_weights, topk_ids)
    for t in (0, 77, 200):
        alone = _kernel(x[t : t + 1], w13, w2, topk_weights[t : t + 1], topk_ids[t : t + 1])
        assert torch.equal(alone[0], batch[t])


@needs_kernel
def test_a_token_alone_matches_it_in_a_call_with_non_temporal_stores():
    """Above kStreamMinBytes of y_slots (T x top-k x H floats) the down GEMM's rows are written
    with non-temporal stores, and the first row block of each panel pair prefetches: neither
    changes a value, so a token alone (regular stores) gives the same bits."""
    w13, w2 = _weights(16, 512, 64, seed=13)
    x = torch.randn(300, 512, generator=torch.Generator().manual_seed(14))
    topk_weights, topk_ids = _routing(300, 16, 8, seed=15)
    batch = _kernel(x, w13, w2, topk_weights, topk_ids)
    for t in (0, 151, 299):
        alone = _kernel(x[t : t + 1], w13, w2, topk_weights[t : t + 1], topk_ids[t : t + 1])
        assert torch.equal(alone[0], batch[t])


@needs_kernel
def test_no_tokens_gives_an_empty_result():
    w13, w2 = _weights(4, 16, 8, seed=7)
    out = _kernel(
        torch.zeros(0, 16), w13, w2, torch.zeros(0, 2), torch.zeros(0, 2, dtype=torch.int64)
    )
    assert out.shape == (0, 16)


@pytest.mark.parametrize(
    "x_dtype,hidden,inter,act,device",
    [
        (torch.bfloat16, 32, 16, F.silu, "cpu"),  # bf16 activations, float32 weights
        (torch.float32, 24, 16, F.silu, "cpu"),  # H not a multiple of 16
        (torch.float32, 32, 12, F.silu, "cpu"),  # 2I = 24 not a multiple of 16
        (torch.float32, 32, 16, F.gelu, "cpu"),  # only SiLU
        (torch.float32, 32, 16, F.silu, "meta"),  # only CPU
    ],
)
def test_kernel_declines_what_it_does_not_serve(x_dtype, hidden, inter, act, device):
    x = torch.zeros(1, hidden, dtype=x_dtype, device=device)
    w13 = torch.zeros(4, 2 * inter, hidden, device=device)
    w2 = torch.zeros(4, hidden, inter, device=device)
    assert not fm.fused_moe_available(x, w13, w2, act)


def test_kernels_off_by_env_use_the_torch_path(monkeypatch):
    monkeypatch.setenv("BATCHGEN_CPU_KERNELS", "0")
    assert not fm.fused_moe_available(
        torch.zeros(1, 16), torch.zeros(1, 16, 16), torch.zeros(1, 16, 8), F.silu
    )


def test_pack_rejects_rows_not_a_multiple_of_16():
    with pytest.raises(ValueError, match="multiple of 16, got 24"):
        fm.pack_expert_weights(torch.zeros(2, 24, 16))


@needs_kernel
def test_layer_repacks_after_its_weights_change():
    layer = _layer(seed=8)
    x = torch.randn(9, 32)
    topk_weights, topk_ids = layer.route(x)
    args = (layer.w13_weight, layer.w2_weight, topk_weights, topk_ids)
    with torch.no_grad():
        torch.testing.assert_close(
            layer(x), fused_experts_reference(x, *args), rtol=1e-5, atol=1e-5
        )
        packed = layer.packed_expert_weights()
        assert layer.packed_expert_weights()[0] is packed[0]  # cached
        layer.w2_weight.mul_(-2.0)  # in place: a new version
        torch.testing.assert_close(
            layer(x), fused_experts_reference(x, *args), rtol=1e-5, atol=1e-5
        )
        assert layer.packed_expert_weights()[0] is not packed[0]


@needs_kernel
def test_layer_built_in_inference_mode_runs_the_kernel():
    """Inference-mode tensors keep no version counter; the packed-weight cache still works."""
    with torch.inference_mode():
        layer = SparseMoeBlock(32, 16, num_experts=4, top_k=2, router=RouterConfig())
        for p in layer.parameters():
            p.normal_(std=0.2)
        x = torch.randn(5, 32)
        topk_weights, topk_ids = layer.route(x)
        want = fused_experts_reference(x, layer.w13_weight, layer.w2_weight, topk_weights, topk_ids)
        torch.testing.assert_close(layer(x), want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(layer(x), want, rtol=1e-5, atol=1e-5)


@needs_kernel
def test_workspace_is_reused_and_grown(monkeypatch):
    monkeypatch.setattr(fm, "_workspace_buffer", None)
    w13, w2 = _weights(4, 16, 8, seed=9)
    small = _routing(3, 4, 2, seed=10)
    big = _routing(50, 4, 2, seed=11)
    x = torch.randn(50, 16, generator=torch.Generator().manual_seed(12))
    a = _kernel(x[:3], w13, w2, *small)
    buffer = fm._workspace_buffer
    b = _kernel(x, w13, w2, *big)  # grows the buffer
    assert fm._workspace_buffer.numel() >= 50 * 2 * 16 and fm._workspace_buffer is not buffer
    again = _kernel(x[:3], w13, w2, *small)  # reuses the grown buffer, same result
    assert torch.equal(a, again) and b.shape == (50, 16)


@needs_kernel
def test_silu_of_very_negative_gates_is_zero_not_nan():
    """exp(-g) overflows below g = -88.7; fast math once turned 1 / (1 + inf) into NaN."""
    hidden, inter = 16, 8
    w13 = torch.zeros(1, 2 * inter, hidden)
    w13[0, :inter, 0] = 1.0  # gate = x[:, 0]
    w13[0, inter:, 1] = 1.0  # up = x[:, 1]
    w2 = torch.ones(1, hidden, inter)
    gates = torch.tensor([-3e38, -1e4, -100.0, -89.0, -88.0, -5.0, 0.0, 5.0, 80.0, 1e4])
    x = torch.zeros(len(gates), hidden)
    x[:, 0], x[:, 1] = gates, 1.0
    ids = torch.zeros(len(gates), 1, dtype=torch.int64)
    out = _kernel(x, w13, w2, torch.ones(len(gates), 1), ids)
    want = inter * F.silu(gates.double())
    assert not out.isnan().any()
    torch.testing.assert_close(out[:, 0].double(), want, rtol=1e-5, atol=1e-30)


@needs_kernel
def test_writes_through_data_need_invalidation():
    """``param.data.copy_`` bumps no version counter: `invalidate_packed_weights` repacks."""
    layer = _layer(seed=13)
    x = torch.randn(6, 32)
    with torch.no_grad():
        layer(x)
        layer.w2_weight.data.copy_(torch.randn_like(layer.w2_weight))
        layer.invalidate_packed_weights()
        topk_weights, topk_ids = layer.route(x)
        want = fused_experts_reference(x, layer.w13_weight, layer.w2_weight, topk_weights, topk_ids)
        torch.testing.assert_close(layer(x), want, rtol=1e-5, atol=1e-5)


@needs_kernel
def test_reloading_weights_after_a_run_uses_the_new_weights(checkpoint_dir):
    """`load_weights` writes through ``.data`` and drops the packed cache: after loading
    checkpoint B into an engine that ran A, greedy tokens are B's (a weight-sync loop)."""
    from batchgen import LLM, SamplingParams
    from batchgen.models.loader import checkpoint_files, load_weights

    b = checkpoint_dir("qwen2_moe")
    kw = dict(device="cpu", dtype="float32", kv_cache_memory_gb=0.05)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompt = [{"prompt_token_ids": [5, 6, 7, 8]}]
    llm_b = LLM(str(b), **kw)
    want = llm_b.generate(prompt, params)[0].outputs[0].token_ids
    llm = LLM(str(b), **kw)
    model = llm.llm_engine.runner.model
    torch.manual_seed(17)
    with torch.no_grad():
        for p in model.parameters():
            p.data.add_(torch.randn_like(p))  # another model, as a checkpoint A would be
    assert llm.generate(prompt, params)[0].outputs[0].token_ids != want  # packs A's experts
    with torch.no_grad():
        load_weights(model, checkpoint_files(b))
    assert llm.generate(prompt, params)[0].outputs[0].token_ids == want


def test_autograd_takes_the_torch_path():
    layer = _layer(seed=14)
    out = layer(torch.randn(5, 32))
    assert out.requires_grad
    out.square().sum().backward()
    assert layer.w13_weight.grad is not None and layer.w13_weight.grad.abs().sum() > 0
    assert layer.gate.weight.grad is not None


@needs_kernel
@pytest.mark.parametrize(
    "change,match",
    [
        ("counts_short", "one entry per expert"),
        ("counts_sum", "must both cover"),
        ("x_hidden", "x must be"),
        ("weights_rows", "topk_weights must be"),
    ],
)
def test_kernel_arguments_are_checked(change, match):
    w13, w2 = _weights(4, 16, 8, seed=15)
    x = torch.randn(3, 16)
    topk_weights, topk_ids = _routing(3, 4, 2, seed=16)
    order, counts = sort_by_expert(topk_ids, 4)
    args = dict(x=x, topk_weights=topk_weights, order=order, counts=counts)
    if change == "counts_short":
        args["counts"] = counts[:3]
    elif change == "counts_sum":
        args["counts"] = [c + 1 for c in counts]
    elif change == "x_hidden":
        args["x"] = torch.randn(3, 32)
    else:
        args["topk_weights"] = topk_weights[:2]
    with pytest.raises(ValueError, match=match):
        fm.fused_moe_silu(
            w13_packed=fm.pack_expert_weights(w13), w2_packed=fm.pack_expert_weights(w2), **args
        )
