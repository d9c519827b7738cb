"""The grouped-GEMM expert path (`batchgen.kernels.grouped_moe`) against the reference loop,
forced on CPU in bf16, and the one place that picks the expert path
(`batchgen.models.layers.expert_path`).

On CPU ``torch._grouped_mm`` loops ``at::mm`` per group (``_grouped_mm_fallback``): the GEMM
`F.linear` runs on the same rows, its output rounded to bf16 at the same two points (gate/up
and down outputs), and the weighting and slot-order sum are the reference's float32 ops. So the
strongest true property is equality bit for bit, and that is what these tests assert. On CUDA
(CUTLASS against cuBLAS) the K-sums run in other orders; there the bound is one bf16 rounding
of each GEMM output, which only the device check can measure.
"""

from __future__ import annotations

import logging

import pytest
import torch

from batchgen.engine.metrics import ExpertGemmStats
from batchgen.kernels.grouped_moe import (
    fused_experts_grouped_mm,
    grouped_mm_fast_on,
    grouped_mm_unsupported_reason,
)
from batchgen.models.layers.expert_path import MOE_PATH_ENV, expert_path
from batchgen.models.layers.moe import SparseMoeBlock, fused_experts_reference
from batchgen.models.model_config import RouterConfig

pytestmark = pytest.mark.skipif(
    not hasattr(torch, "_grouped_mm"), reason=f"torch {torch.__version__} has no _grouped_mm"
)


def _experts(num_tokens, e, h, i, a, seed, skew=False, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, h, generator=g).to(dtype)
    w13 = (torch.randn(e, 2 * i, h, generator=g) * 0.2).to(dtype)
    w2 = (torch.randn(e, h, i, generator=g) * 0.2).to(dtype)
    logits = torch.randn(num_tokens, e, generator=g)
    if skew:  # half the experts never chosen: zero-row groups inside offs
        logits[:, e // 2 :] -= 100.0
    topk_weights, topk_ids = torch.topk(torch.softmax(logits, -1), a, dim=-1)
    return x, w13, w2, topk_weights, topk_ids


@pytest.mark.parametrize(
    "num_tokens, e, h, i, a, skew",
    [
        (0, 4, 16, 8, 2, False),  # T=0
        (1, 4, 16, 8, 1, False),  # one token, top-1: a single non-empty group
        (1, 12, 32, 16, 8, False),  # one token, top-8
        (7, 6, 24, 40, 1, True),  # top-1, E not a power of two, zero-row experts
        (33, 10, 64, 24, 8, True),  # top-8 of 10, experts 5..9 get rows only past the top-5
        (300, 7, 32, 16, 2, True),  # many rows, E=7, three zero-row experts
    ],
)
def test_grouped_path_equals_the_reference_bit_for_bit(num_tokens, e, h, i, a, skew):
    x, w13, w2, tw, ids = _experts(num_tokens, e, h, i, a, seed=num_tokens + e, skew=skew)
    ref_stats, stats = ExpertGemmStats(), ExpertGemmStats()
    ref = fused_experts_reference(x, w13, w2, tw, ids, stats=ref_stats)
    out = fused_experts_grouped_mm(x, w13, w2, tw, ids, stats=stats)
    assert out.dtype == torch.bfloat16 and out.shape == (num_tokens, h)
    assert torch.equal(out, ref)
    assert stats.rows == 0 and stats.num_moe_calls == 1  # counted on the device until flush
    stats.flush()
    assert stats.__dict__ == ref_stats.__dict__  # gemms, rows, tile rows and calls
    # Without stats the row counts stay on the device (no host sync: CUDA-graph capturable).
    assert torch.equal(fused_experts_grouped_mm(x, w13, w2, tw, ids), out)
    if skew and a < e // 2:
        assert torch.bincount(ids.reshape(-1), minlength=e)[e // 2 :].sum() == 0
    # out_dtype=float32: the float32 slot sum before the cast, still the reference's.
    out32 = fused_experts_grouped_mm(x, w13, w2, tw, ids, out_dtype=torch.float32)
    assert torch.equal(out32, fused_experts_reference(x, w13, w2, tw, ids, out_dtype=torch.float32))


def test_grouped_path_takes_the_blocks_activation():
    x, w13, w2, tw, ids = _experts(9, 5, 16, 8, 2, seed=3)
    gelu = torch.nn.functional.gelu
    ref = fused_experts_reference(x, w13, w2, tw, ids, act=gelu)
    assert torch.equal(fused_experts_grouped_mm(x, w13, w2, tw, ids, act=gelu), ref)
    assert not torch.equal(fused_experts_grouped_mm(x, w13, w2, tw, ids), ref)


def test_unsupported_shapes_and_dtypes_are_named():
    assert grouped_mm_unsupported_reason(torch.bfloat16, 64, 32, 8) is None
    assert grouped_mm_unsupported_reason(torch.float32, 12, 36, 8) is None  # 4-element rule
    assert "hidden_size=12" in grouped_mm_unsupported_reason(torch.bfloat16, 12, 32, 8)
    assert "moe_intermediate_size=20" in grouped_mm_unsupported_reason(torch.float16, 64, 20, 8)
    assert "num_experts=1024" in grouped_mm_unsupported_reason(torch.bfloat16, 64, 32, 1024)
    assert "dtype" in grouped_mm_unsupported_reason(torch.int8, 64, 32, 8)
    x, w13, w2, tw, ids = _experts(3, 4, 12, 8, 2, seed=1)
    with pytest.raises(ValueError, match="hidden_size=12"):
        fused_experts_grouped_mm(x, w13, w2, tw, ids)
    x, w13, w2, tw, ids = _experts(3, 4, 16, 8, 2, seed=1)
    with pytest.raises(ValueError, match="one dtype"):
        fused_experts_grouped_mm(x.float(), w13, w2, tw, ids)
    assert not grouped_mm_fast_on(torch.device("cpu"), torch.bfloat16)


def _path(device="cpu", dtype=torch.bfloat16, batch_invariant=False, cpu_kernel=False, h=64):
    return expert_path(
        torch.device(device), dtype, batch_invariant=batch_invariant, cpu_kernel=cpu_kernel,
        hidden_size=h, intermediate_size=32, num_experts=8,
    )  # fmt: skip


def test_expert_path_rules(monkeypatch):
    monkeypatch.delenv(MOE_PATH_ENV, raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # forced triton on CPU needs it
    # auto on CPU: unchanged (the kernel where it serves, else the CPU torch path).
    assert _path(cpu_kernel=True) == "cpu_kernel"
    assert _path() == "per_expert"
    assert _path(batch_invariant=True) == "per_expert"
    monkeypatch.setenv(MOE_PATH_ENV, "grouped_mm")
    assert _path(cpu_kernel=True) == "grouped_mm"
    assert _path(dtype=torch.float32) == "grouped_mm"
    assert _path(batch_invariant=True) == "per_expert"  # the invariance contract wins
    assert _path(batch_invariant=True, cpu_kernel=True) == "cpu_kernel"
    with pytest.raises(ValueError, match=f"{MOE_PATH_ENV}=grouped_mm: hidden_size=60"):
        _path(h=60)
    monkeypatch.setenv(MOE_PATH_ENV, "Reference")
    assert _path(cpu_kernel=True) == "reference"
    monkeypatch.setenv(MOE_PATH_ENV, "triton")
    with pytest.raises(ValueError, match=f"{MOE_PATH_ENV}=triton: device cpu"):
        _path()
    monkeypatch.setenv(MOE_PATH_ENV, "cutlass")
    with pytest.raises(ValueError, match=f"{MOE_PATH_ENV}='cutlass'"):
        _path()


@pytest.mark.parametrize("triton_imports", [True, False])
def test_auto_on_cuda_without_the_fast_kernel_takes_triton_else_the_reference(
    monkeypatch, triton_imports
):
    """The CUDA branch of auto, with the capability query and triton's import faked (no GPU
    here): grouped_mm where CUTLASS runs it, else the Triton kernels, else the reference."""
    monkeypatch.delenv(MOE_PATH_ENV, raising=False)
    import batchgen.kernels.grouped_moe as gm
    import batchgen.models.layers.expert_path as ep

    if not triton_imports:
        monkeypatch.setattr(ep, "triton_unsupported_reason", lambda d, t: "triton does not import")
    else:
        monkeypatch.setattr(ep, "triton_unsupported_reason", lambda d, t: None)
    slow = "triton" if triton_imports else "reference"
    for cap, bf16_path in [((9, 0), "grouped_mm"), ((10, 0), "grouped_mm"), ((8, 0), slow)]:
        monkeypatch.setattr(gm.torch.cuda, "get_device_capability", lambda d, c=cap: c)
        monkeypatch.setattr(gm.torch.version, "hip", None)
        assert _path("cuda") == bf16_path, cap
        assert _path("cuda", dtype=torch.float16) == slow, cap  # grouped_mm: a per-group loop
        assert _path("cuda", dtype=torch.float32) == slow, cap


def test_block_runs_the_chosen_path_and_logs_it_once(monkeypatch, caplog):
    import batchgen.models.layers.expert_path as ep

    monkeypatch.setattr(ep, "_logged", set())
    torch.manual_seed(0)
    block = SparseMoeBlock(32, 16, 6, 2, RouterConfig()).to(torch.bfloat16)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.2)
    x = torch.randn(11, 32).to(torch.bfloat16)
    with torch.no_grad():
        tw, ids = block.route(x)
        want = fused_experts_reference(x, block.w13_weight, block.w2_weight, tw, ids)
        monkeypatch.setenv(MOE_PATH_ENV, "grouped_mm")
        called = []
        import batchgen.models.layers.moe as moe

        real = moe.fused_experts_grouped_mm
        monkeypatch.setattr(
            moe, "fused_experts_grouped_mm", lambda *a, **k: called.append(1) or real(*a, **k)
        )
        with caplog.at_level(logging.INFO, logger="batchgen.models.layers.expert_path"):
            assert torch.equal(block(x), want)
            assert torch.equal(block(x), want)
        assert len(called) == 2
        logged = [r for r in caplog.records if "grouped_mm path" in r.getMessage()]
        assert len(logged) == 1  # two calls, one line


@pytest.mark.parametrize("name", ["mixtral_top4", "qwen3_moe"])
def test_bf16_engine_greedy_tokens_equal_the_reference_path(checkpoint_dir, name, monkeypatch):
    """A tiny bf16 engine with ``BATCHGEN_MOE_PATH=grouped_mm`` (counted: every MoE call runs
    it) generates the reference path's greedy tokens and log-probabilities exactly: on CPU the
    two paths are equal bit for bit, so nothing downstream can differ."""
    from batchgen import LLM, SamplingParams
    import batchgen.models.layers.moe as moe

    calls = []
    real = moe.fused_experts_grouped_mm
    monkeypatch.setattr(
        moe, "fused_experts_grouped_mm", lambda *a, **k: calls.append(1) or real(*a, **k)
    )
    sp = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=1)
    results = {}
    for path in ("reference", "grouped_mm"):
        monkeypatch.setenv(MOE_PATH_ENV, path)
        path_dir = str(checkpoint_dir(name))
        llm = LLM(path_dir, device="cpu", dtype="bfloat16", kv_cache_memory_gb=0.05)
        tok = llm.get_tokenizer()
        prompts = [tok.encode(p) for p in ("The quick brown fox", "def fib(n):", "a b c d e f")]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        results[path] = [
            (list(o.outputs[0].token_ids), o.outputs[0].cumulative_logprob) for o in outs
        ]
        if path == "reference":
            assert not calls
    assert calls  # the grouped path served the second engine
    assert results["grouped_mm"] == results["reference"]
    assert all(len(ids) == 16 and lp is not None for ids, lp in results["grouped_mm"])
