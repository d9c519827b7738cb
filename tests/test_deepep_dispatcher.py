"""`DeepEPDispatcher` on a CPU fake of ``deep_ep`` (tests/fake_deep_ep.py) against the
``all_to_all_single`` reference on the same inputs, 2 and 3 gloo ranks; and the choice of
dispatcher (``BATCHGEN_EP_DISPATCHER``). No GPU and no real DeepEP: what the fake cannot show
is listed in its docstring and in docs/distributed.md.
"""

from __future__ import annotations

import sys

import fake_deep_ep
import pytest
import torch
from dist_helpers import run_ranks

from batchgen.distributed.deepep_dispatcher import (
    EP_DISPATCHER_ENV,
    check_deep_ep_supports,
    resolve_ep_dispatcher,
)

H = 16


def _case(seed, rank, num_tokens, num_experts, top_k, exact):
    """This rank's inputs: hidden [T, H] bf16, topk_ids [T, K] distinct per row, weights
    [T, K] float32. ``exact``: small integers and weights in {1/4, 1/2, 1}, so that every sum
    below is exact in bf16 and the two dispatchers must agree bit for bit."""
    g = torch.Generator().manual_seed(seed * 100 + rank)
    t = num_tokens[rank]
    if exact:
        hidden = torch.randint(-1, 2, (t, H), generator=g).to(torch.bfloat16)
        weights = 2.0 ** -torch.randint(0, 3, (t, top_k), generator=g).float()
    else:
        hidden = torch.randn(t, H, generator=g).to(torch.bfloat16)
        weights = torch.rand(t, top_k, generator=g)
    ids = [torch.randperm(num_experts, generator=g)[:top_k] for _ in range(t)]
    ids = torch.stack(ids) if t else torch.empty(0, top_k, dtype=torch.long)
    return hidden, ids.long(), weights


def _expert(x, expert_ids, weights, exact):
    """A per-row "expert", weighted, float32 ``[R, H]``: exact mode keeps |y| <= 3 on a
    quarter grid (``x * (e % 3 + 1)``); otherwise ``(e + 1) * x + e``."""
    e = expert_ids.float()[:, None]
    y = x.float() * (e % 3 + 1) if exact else (e + 1) * x.float() + e
    return y * weights[:, None]


def _pairs(recv):
    """The received pairs as a sorted list of (expert, weight, row values)."""
    rows = recv.hidden.float().tolist()
    return sorted(
        (e, w, tuple(r))
        for e, w, r in zip(recv.expert_ids.tolist(), recv.weights.tolist(), rows, strict=True)
    )


def _rank(rank, world, seed, num_tokens, num_experts, top_k, exact):
    import torch.distributed as dist

    sys.modules["deep_ep"] = fake_deep_ep  # what `import deep_ep` finds in this process
    from batchgen.distributed.all_to_all import AllToAllDispatcher
    from batchgen.distributed.deepep_dispatcher import DeepEPDispatcher
    from batchgen.distributed.layout import ExpertPlacement

    placement = ExpertPlacement(num_experts, world)
    hidden, ids, weights = _case(seed, rank, num_tokens, num_experts, top_k, exact)
    results = {}
    for name, d in (
        ("deepep", DeepEPDispatcher(dist.group.WORLD, placement, H)),
        ("ref", AllToAllDispatcher(dist.group.WORLD, placement)),
    ):
        recv = d.dispatch(hidden, ids, weights)
        assert set(recv.expert_ids.tolist()) <= set(placement.experts_of(rank))
        y = _expert(recv.hidden, recv.expert_ids, recv.weights, exact)
        out = d.combine(y, recv.handle)
        # the per-token sum of |y|, through the reference: the rounding bound below
        abs_sum = d.combine(y.abs(), recv.handle).tolist() if name == "ref" else None
        results[name] = (_pairs(recv), out.tolist(), abs_sum, d.stats.bytes_sent)
    # plain lists: a tensor sent through the result queue is shared through a file descriptor
    # that dies with this process
    return results


def _t(rows: list) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32).view(-1, H)


CASES = {
    "7_experts_on_2_ranks_top2": (2, [5, 9], 7, 2),
    "8_experts_on_2_ranks_top8": (2, [6, 3], 8, 8),
    "10_experts_on_3_ranks_top8": (3, [4, 6, 3], 10, 8),
    "10_experts_on_3_ranks_top1": (3, [7, 1, 5], 10, 1),
    "a_rank_with_zero_tokens": (3, [5, 0, 4], 10, 2),
    "no_tokens_anywhere": (2, [0, 0], 4, 2),
}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", sorted(CASES))
def test_deepep_matches_all_to_all_exactly(name):
    """Same pairs received (expert, weight, row), and on bf16-exact values the same output."""
    world, tokens, experts, top_k = CASES[name]
    results = run_ranks(_rank, world, 1, tokens, experts, top_k, True, timeout=200)
    received = 0
    for rank, res in enumerate(results):
        pairs, out, _, _ = res["deepep"]
        ref_pairs, ref_out, _, _ = res["ref"]
        assert pairs == ref_pairs, f"rank {rank}: received pairs differ"
        out, ref_out = _t(out), _t(ref_out)
        assert out.shape == ref_out.shape == (tokens[rank], H)
        assert torch.equal(out, ref_out), f"rank {rank}: combine differs"
        received += len(pairs)
    assert received == sum(tokens) * top_k


@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", ["10_experts_on_3_ranks_top8", "7_experts_on_2_ranks_top2"])
def test_deepep_random_values_within_bf16_rounding(name):
    """Random values: DeepEP's combine rounds each rank's partial sum and the total to bf16
    (u = 2^-8 each), so |deepep - ref| <= 2u * sum|y| (plus float32 noise) per element."""
    world, tokens, experts, top_k = CASES[name]
    results = run_ranks(_rank, world, 2, tokens, experts, top_k, False, timeout=200)
    rounded = False
    for rank, res in enumerate(results):
        assert res["deepep"][0] == res["ref"][0]
        out, ref, abs_sum = _t(res["deepep"][1]), _t(res["ref"][1]), _t(res["ref"][2])
        bound = 2 * 2.0**-8 * abs_sum * 1.01 + 1e-5
        assert ((out - ref).abs() <= bound).all(), f"rank {rank}: beyond bf16 rounding"
        rounded |= not torch.equal(out, ref)
    assert rounded, "random values should show some bf16 rounding (else the bound is idle)"


@pytest.mark.timeout(240)
def test_deepep_counts_remote_bytes():
    """``bytes_sent``: bf16 rows leaving the rank, one per (token, other owner rank) at
    dispatch and one per row received from another rank at combine."""
    from batchgen.distributed.layout import ExpertPlacement

    world, tokens, experts, top_k = CASES["10_experts_on_3_ranks_top8"]
    results = run_ranks(_rank, world, 1, tokens, experts, top_k, True, timeout=200)
    owner = ExpertPlacement(experts, world).owner
    # dests[s]: [T_s, W] whether rank s's token has an expert on each rank
    dests = []
    for s in range(world):
        ids = _case(1, s, tokens, experts, top_k, True)[1]
        dests.append(torch.stack([(owner[ids] == r).any(1) for r in range(world)], 1))
    for r, res in enumerate(results):
        sent = int(dests[r].sum()) - int(dests[r][:, r].sum())
        back = sum(int(dests[s][:, r].sum()) for s in range(world) if s != r)
        assert res["deepep"][3] == (sent + back) * H * 2


def test_auto_picks_all_to_all_on_cpu(monkeypatch):
    monkeypatch.setitem(sys.modules, "deep_ep", fake_deep_ep)
    env = {}
    kind, why = resolve_ep_dispatcher(torch.device("cpu"), torch.bfloat16, 2, env)
    assert kind == "all_to_all" and "cpu" in why


def test_auto_picks_deepep_on_cuda_when_it_imports(monkeypatch):
    """No CUDA needed: the choice looks at the device type, the import and DeepEP's configs."""
    monkeypatch.setitem(sys.modules, "deep_ep", fake_deep_ep)
    for env in ({}, {EP_DISPATCHER_ENV: "auto"}, {EP_DISPATCHER_ENV: "deepep"}):
        assert resolve_ep_dispatcher(torch.device("cuda", 0), torch.bfloat16, 2, env)[0] == (
            "deepep"
        )
    forced = {EP_DISPATCHER_ENV: "all_to_all"}
    assert resolve_ep_dispatcher(torch.device("cuda"), torch.bfloat16, 2, forced)[0] == (
        "all_to_all"
    )
    # one rank, or a float32 model: the reference
    assert resolve_ep_dispatcher(torch.device("cuda"), torch.bfloat16, 1, {})[0] == "all_to_all"
    kind, why = resolve_ep_dispatcher(torch.device("cuda"), torch.float32, 2, {})
    assert kind == "all_to_all" and "bfloat16" in why


def test_forced_deepep_without_deep_ep_raises(monkeypatch):
    monkeypatch.setitem(sys.modules, "deep_ep", None)  # `import deep_ep` raises ImportError
    env = {EP_DISPATCHER_ENV: "deepep"}
    with pytest.raises(RuntimeError, match=r"BATCHGEN_EP_DISPATCHER=deepep.*import deep_ep"):
        resolve_ep_dispatcher(torch.device("cuda"), torch.bfloat16, 2, env)
    with pytest.raises(RuntimeError, match=r"needs CUDA.*cpu"):
        resolve_ep_dispatcher(torch.device("cpu"), torch.bfloat16, 2, env)
    # auto falls back, naming the reason
    kind, why = resolve_ep_dispatcher(torch.device("cuda"), torch.bfloat16, 2, {})
    assert kind == "all_to_all" and "import deep_ep" in why


def test_bad_env_value_is_refused():
    with pytest.raises(ValueError, match="BATCHGEN_EP_DISPATCHER='nccl'"):
        resolve_ep_dispatcher(torch.device("cpu"), torch.bfloat16, 2, {EP_DISPATCHER_ENV: "nccl"})


def test_rank_counts_deepep_has_no_config_for(monkeypatch):
    monkeypatch.setattr(fake_deep_ep, "STRICT_NUM_RANKS", True)
    assert check_deep_ep_supports(fake_deep_ep, 4, torch.bfloat16) is None
    assert "3 ranks" in check_deep_ep_supports(fake_deep_ep, 3, torch.bfloat16)
    monkeypatch.setitem(sys.modules, "deep_ep", fake_deep_ep)
    kind, why = resolve_ep_dispatcher(torch.device("cuda"), torch.bfloat16, 3, {})
    assert kind == "all_to_all" and "3 ranks" in why


def _layer_rank(rank, world, num_experts, top_k, hidden, inter, tokens):
    """A real bf16 SparseMoeBlock sharded over the group, through `ExpertParallelMoE`, once
    with each dispatcher."""
    import torch.distributed as dist

    sys.modules["deep_ep"] = fake_deep_ep
    from batchgen.distributed.all_to_all import AllToAllDispatcher
    from batchgen.distributed.deepep_dispatcher import DeepEPDispatcher
    from batchgen.distributed.ep_moe import ExpertParallelMoE
    from batchgen.distributed.layout import ExpertPlacement
    from batchgen.models.layers.moe import SparseMoeBlock
    from batchgen.models.model_config import RouterConfig

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
    part = part.to(torch.bfloat16)
    x = torch.randn(tokens[rank], hidden, generator=torch.Generator().manual_seed(7 + rank))
    x = x.to(torch.bfloat16)
    out = {}
    for name, d in (
        ("ref", AllToAllDispatcher(dist.group.WORLD, placement)),
        ("deepep", DeepEPDispatcher(dist.group.WORLD, placement, hidden)),
    ):
        part.expert_parallel = ExpertParallelMoE(0, d, placement, rank)
        with torch.inference_mode():
            out[name] = part(x).float().tolist()
    return out


@pytest.mark.timeout(240)
def test_moe_layer_with_deepep_within_bf16_rounding_of_the_reference():
    """The whole EP MoE layer in bf16: DeepEP's extra bf16 rounding of per-rank partial sums
    (module docstring) stays within a few bf16 steps of the largest output; summation order
    makes a per-element bound meaningless where slots cancel."""
    tokens, hidden = [9, 0, 17], 64
    results = run_ranks(_layer_rank, 3, 10, 3, hidden, 48, tokens, timeout=200)
    for rank, res in enumerate(results):
        ref = torch.tensor(res["ref"]).view(-1, hidden)
        got = torch.tensor(res["deepep"]).view(-1, hidden)
        assert got.shape == ref.shape == (tokens[rank], hidden)
        if ref.numel():
            err = (got - ref).abs().max().item()
            assert err <= 2.0**-6 * ref.abs().max().item(), f"rank {rank}: max err {err}"
            assert ref.abs().max() > 0
