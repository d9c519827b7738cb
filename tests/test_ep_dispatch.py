"""Expert-parallel dispatch / combine on 2 and 3 gloo ranks against one process.

Data movement is checked exactly with a row-wise "expert" in float64; the MoE layer with the
fused CPU kernel is checked bit for bit against the single-process layer, and the torch path
to float32 rounding. Cases: experts dividing evenly and not (7 on 2, 10 on 3), every token to
one rank's experts, a rank with zero tokens, top-k 1 and 8.
"""

from __future__ import annotations

import pytest
import torch
from dist_helpers import run_ranks

H = 32


def _case(seed: int, rank: int, num_tokens: list[int], num_experts: int, top_k: int, skew):
    """This rank's tokens: hidden [T, H], topk_ids [T, K] (distinct per row), weights [T, K]."""
    g = torch.Generator().manual_seed(seed * 100 + rank)
    t = num_tokens[rank]
    hidden = torch.randn(t, H, generator=g, dtype=torch.float64)
    pool = skew if skew is not None else list(range(num_experts))
    ids = (
        torch.stack(
            [torch.tensor(pool)[torch.randperm(len(pool), generator=g)[:top_k]] for _ in range(t)]
        )
        if t
        else torch.empty(0, top_k, dtype=torch.long)
    )
    weights = torch.rand(t, top_k, generator=g)
    return hidden, ids.long(), weights


def _rowwise_expert(x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor):
    """A deterministic per-row "expert": (e + 1) * x + e, weighted (float64, exact)."""
    e = expert_ids.to(torch.float64)[:, None]
    return ((e + 1) * x + e) * weights.to(torch.float64)[:, None]


def _dispatch_rank(
    rank, world, seed, num_tokens, num_experts, top_k, skew, oracle, pad=False, dtype=None
):
    import torch.distributed as dist

    from batchgen.distributed.all_to_all import (
        AllGatherDispatcher,
        AllToAllDispatcher,
        sum_slots,
    )
    from batchgen.distributed.layout import ExpertPlacement

    placement = ExpertPlacement(num_experts, world)
    hidden, ids, weights = _case(seed, rank, num_tokens, num_experts, top_k, skew)
    dtype = dtype or torch.float64
    hidden = hidden.to(dtype)
    if oracle:
        d = AllGatherDispatcher(dist.group.WORLD, placement, rank)
    else:
        d = AllToAllDispatcher(dist.group.WORLD, placement)
        if pad:  # every rank's token count known from the step: padded rows, no count exchange
            d.pad_rows, d.step_tokens = True, num_tokens
    recv = d.dispatch(hidden, ids, weights)
    owned = set(placement.experts_of(rank))
    assert set(recv.expert_ids.tolist()) <= owned
    y = _rowwise_expert(recv.hidden.double(), recv.expert_ids, recv.weights).to(dtype)
    out = d.combine(y, recv.handle)
    # The same arithmetic in one place: every slot's row, summed in slot order.
    flat = (
        _rowwise_expert(
            hidden.double().repeat_interleave(top_k, 0), ids.reshape(-1), weights.reshape(-1)
        )
        .to(dtype)
        .view(-1, top_k, H)
    )
    want = sum_slots(flat) if flat.shape[0] else torch.zeros(0, H)
    return (
        out.shape,
        want.shape,
        torch.equal(out.to(want.dtype), want),
        # relative to the largest value
        ((out.double() - want.double()).abs().max() / want.abs().max()).item()
        if want.numel()
        else 0.0,
        recv.hidden.shape[0],
    )


CASES = {
    "7_experts_on_2_ranks_top2": (2, [5, 9], 7, 2, None),
    "10_experts_on_3_ranks_top8": (3, [4, 6, 3], 10, 8, None),
    "10_experts_on_3_ranks_top1": (3, [7, 1, 5], 10, 1, None),
    "all_tokens_to_rank0_experts": (2, [6, 6], 7, 2, [0, 1, 2, 3]),
    "a_rank_with_zero_tokens": (3, [5, 0, 4], 10, 2, None),
    "no_tokens_anywhere": (2, [0, 0], 4, 2, None),
}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("pad", [False, True], ids=["counted", "padded"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_dispatch_combine_exact(name, pad):
    world, tokens, experts, top_k, skew = CASES[name]
    results = run_ranks(_dispatch_rank, world, 1, tokens, experts, top_k, skew, False, pad)
    received = 0
    for rank, (out_shape, want_shape, equal, _, recv_rows) in enumerate(results):
        assert out_shape == (tokens[rank], H) and want_shape == (tokens[rank], H)
        assert equal, f"rank {rank}: combine differs from the single-process sum"
        received += recv_rows
    assert received == sum(tokens) * top_k  # every (token, slot) pair went somewhere once
    if skew is not None:  # every pair was owned by rank 0
        assert results[0][4] == sum(tokens) * top_k and results[1][4] == 0


@pytest.mark.timeout(300)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_dispatch_combine_exact_in_every_dtype(dtype):
    """Rows cross gloo as bytes: bf16 and f16 hidden states arrive bit for bit (gloo's
    all-to-all refuses int16, which the half-precision rows once travelled as)."""
    world, tokens, experts, top_k, skew = CASES["10_experts_on_3_ranks_top8"]
    for pad in (False, True):
        results = run_ranks(
            _dispatch_rank, world, 2, tokens, experts, top_k, skew, False, pad, dtype
        )
        assert all(r[2] for r in results), f"{dtype} pad={pad}: combine differs"


@pytest.mark.timeout(300)
def test_all_gather_oracle_agrees():
    world, tokens, experts, top_k, skew = CASES["10_experts_on_3_ranks_top8"]
    results = run_ranks(_dispatch_rank, world, 2, tokens, experts, top_k, skew, True)
    for out_shape, _, _, max_rel_err, _ in results:
        assert out_shape[1] == H
        # Another summation order, in float32 partials: a few ulp of the largest value.
        assert max_rel_err < 1e-6


def _moe_rank(rank, world, num_experts, top_k, hidden, inter, kernel, tokens):
    """A real SparseMoeBlock sharded over the group against the whole block in this process."""
    import torch.distributed as dist

    from batchgen.distributed.all_to_all import AllToAllDispatcher
    from batchgen.distributed.ep_moe import ExpertParallelMoE
    from batchgen.distributed.layout import ExpertPlacement
    from batchgen.models.layers.moe import SparseMoeBlock
    from batchgen.models.model_config import RouterConfig

    if not kernel:
        import os

        os.environ["BATCHGEN_CPU_KERNELS"] = "0"  # read on every call
    torch.manual_seed(0)
    full = SparseMoeBlock(hidden, inter, num_experts, top_k, RouterConfig(norm_topk_prob=True))
    with torch.no_grad():
        for p in full.parameters():
            p.normal_(0, 0.2)
    placement = ExpertPlacement(num_experts, world)
    mine = placement.experts_of(rank)
    part = SparseMoeBlock(
        hidden, inter, num_experts, top_k, RouterConfig(norm_topk_prob=True), expert_ids=mine
    )
    with torch.no_grad():
        part.gate.weight.copy_(full.gate.weight)
        part.w13_weight.copy_(full.w13_weight[mine])
        part.w2_weight.copy_(full.w2_weight[mine])
    d = AllToAllDispatcher(dist.group.WORLD, placement)
    part.expert_parallel = ExpertParallelMoE(0, d, placement, rank)
    g = torch.Generator().manual_seed(7 + rank)
    x = torch.randn(tokens[rank], hidden, generator=g)
    with torch.inference_mode():
        got = part(x)
        want = full(x)
    return (
        torch.equal(got, want),
        (got - want).abs().max().item() if x.numel() else 0.0,
        (full.uses_kernel(x)),
    )


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kernel", [True, False], ids=["fused_kernel", "torch_path"])
def test_ep_moe_layer_matches_one_process(kernel):
    results = run_ranks(_moe_rank, 3, 10, 3, 64, 48, kernel, [9, 0, 17])
    for rank, (equal, max_err, used_kernel) in enumerate(results):
        if kernel and used_kernel:
            assert equal, f"rank {rank}: bit-for-bit with the fused kernel, max err {max_err}"
        else:
            assert max_err < 1e-5, f"rank {rank}: max err {max_err}"
