"""Nasty inputs for the prefill attention kernel, the fused small ops (routing, sort, RoPE,
fused add + RMSNorm) through their public functions: each case either gets correct results or
a clear error naming the argument, never a raw read past a tensor (the kernels take pointers).

Found by this file (each failed before its fix): a sliding window above 2^31 - 1 wrapped in the
AMX prefill path's int32 position compare (every key masked, garbage output); a `PrefillPlan`
with int32 or strided spans/slots, or hand-built slots out of range, was read as int64 rows past
its memory; float ``kv_slots`` were truncated (-0.5 -> slot 0); ``sliding_window=True`` ran as 1;
`moe_sort` read int32 ids as int64 (twice the memory); `topk_softmax` and `fused_add_rms_norm`
dereferenced a meta tensor's null pointer; `rotary_embedding_available` accepted rows that
overlap (stride 0), which the in-place kernel writes from several threads; `rms_norm` /
`fused_add_rms_norm` called directly read a short weight past its end and a bf16 weight as
float32, `rotary_embedding_` a one-row cos T rows deep; `EngineMetrics.reset` replaced the
`ExpertGemmStats` the CUDA graph runner records into (replayed steps' GEMMs lost after
`reset_metrics`); ``BATCHGEN_PREFILL_ATTENTION=kernel`` with the kernel off in
``BATCHGEN_CPU_KERNELS`` failed at the first prefill, not at start. Passing from the start (kept
as regression tests): odd head sizes and GQA groups 3/6 (one thread = two threads, bit for bit),
empty plans and zero heads, NaN in unwritten cache slots, chunked prefill and prefix-cache hits
through the engine.
"""

from __future__ import annotations

import dataclasses
import shutil

import pytest
import torch

from batchgen.kernels import cpu_build
from batchgen.kernels.moe_routing import moe_sort, moe_sort_available, topk_softmax
from batchgen.kernels.prefill_attention import (
    build_prefill_plan,
    paged_prefill_attention,
    prefill_kernel_isa,
)
from batchgen.kernels.rms_norm import fused_add_rms_norm, rms_norm
from batchgen.kernels.rotary_embedding import rotary_embedding_, rotary_embedding_available
from batchgen.models.layers.attention import PrefillSpan
from batchgen.models.make_model import make_model
from tests.conftest import TINY
from tests.test_prefill_attention import (
    U_BF16,
    make_case,
    reference,
    run_kernel,
    skip_unless_usable,
)

pytestmark = pytest.mark.skipif(
    not shutil.which(cpu_build.cxx_command()[0]), reason="no C++ compiler to build the kernels"
)


@pytest.mark.parametrize("isa", ["auto", "generic", "avx512", "amx"])
@pytest.mark.parametrize("window", [2**31, 10**12, 2**31 - 1, 1])
def test_prefill_huge_or_unit_sliding_window_is_exact(window, isa):
    skip_unless_usable(isa, torch.bfloat16, 64)
    # a window at least as long as every context is no window at all
    q, kc, vc, spans = make_case([(33, 64), (1, 0), (17, 5)], 4, 2, 64, torch.bfloat16, seed=3)
    scale = 64**-0.5
    ours = run_kernel(q, kc, vc, spans, scale, window, isa=isa).double()
    exact, abs_out = reference(q, kc, vc, spans, scale, window)
    bound = U_BF16 * (exact.abs() + abs_out) + 1e-4 * (1 + exact.abs())
    assert ((ours - exact).abs() <= bound).all()


@pytest.mark.parametrize("d, hq, hkv", [(96, 6, 2), (80, 12, 2), (7, 3, 1), (544, 2, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_odd_heads_one_thread_and_two_give_the_same_bits(d, hq, hkv, dtype):
    # GQA groups 3 and 6, head sizes off the AMX path's multiple of 32 (and above its 512),
    # contexts of exactly two key blocks; checked against float64 and across thread counts
    q, kc, vc, spans = make_case([(33, 31), (32, 64), (1, 0)], hq, hkv, d, dtype, seed=d)
    scale = d**-0.5
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = run_kernel(q, kc, vc, spans, scale, None)
        torch.set_num_threads(2)
        two = run_kernel(q, kc, vc, spans, scale, None)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)
    exact, abs_out = reference(q, kc, vc, spans, scale, None)
    u = U_BF16 if dtype == torch.bfloat16 else 2e-5
    bound = u * (exact.abs() + abs_out) + 1e-4 * (1 + exact.abs())
    assert ((one.double() - exact).abs() <= bound).all()


def _plan_case():
    q, kc, vc, spans = make_case([(5, 3), (2, 0)], 4, 2, 64, torch.float32)
    return q, kc, vc, build_prefill_plan(spans, q.shape[0], kc.shape[0])


@pytest.mark.parametrize(
    "field, bad, match",
    [
        ("spans", lambda p: p.spans.int(), "spans"),
        ("spans", lambda p: p.spans.t().contiguous().t(), "spans"),
        ("spans", lambda p: p.spans[:, :3], "spans"),
        ("slots", lambda p: p.slots.int(), "slots"),
        ("slots", lambda p: p.slots + 10**9, "slots must be in"),
        ("slots", lambda p: p.slots[:3], "slots"),
        ("spans", lambda p: p.spans + torch.tensor([[3, 0, 0, 0]]), "tokens"),
        ("spans", lambda p: p.spans * torch.tensor([[1, 1, 1, 5]]), "slots"),
        ("spans", lambda p: p.spans.to("meta"), "spans"),
    ],
)
def test_prefill_plan_that_the_kernel_would_read_past_is_refused(field, bad, match):
    q, kc, vc, plan = _plan_case()
    with pytest.raises(ValueError, match=match):
        plan = dataclasses.replace(plan, **{field: bad(plan)})
        paged_prefill_attention(q, kc, vc, plan, 0.1, None, torch.empty_like(q))


@pytest.mark.parametrize(
    "slots, match",
    [
        (torch.arange(8).float() - 0.5, "integer"),
        (torch.arange(8, device="meta"), "CPU"),
        (list(range(8)), "tensor"),
    ],
)
def test_prefill_span_slots_of_the_wrong_kind_are_named(slots, match):
    with pytest.raises(ValueError, match=f"prefills\\[0\\].*kv_slots.*{match}"):
        build_prefill_plan([PrefillSpan(0, 5, 8, slots)], 5, 100)


def test_prefill_sliding_window_bool_is_refused():
    q, kc, vc, plan = _plan_case()
    with pytest.raises(ValueError, match="sliding_window"):
        paged_prefill_attention(q, kc, vc, plan, 0.1, True, torch.empty_like(q))


def test_prefill_empty_plans_and_zero_query_heads_write_nothing():
    q, kc, vc, plan = _plan_case()
    out = torch.full_like(q, 7.0)
    paged_prefill_attention(q, kc, vc, build_prefill_plan([], 7, kc.shape[0]), 0.1, None, out)
    assert (out == 7.0).all()
    empty = q[:0]
    paged_prefill_attention(empty, kc, vc, build_prefill_plan([], 0, kc.shape[0]), 0.1, None, empty)
    paged_prefill_attention(q[:, :0], kc, vc, plan, 0.1, None, out[:, :0])


def test_moe_sort_refuses_ids_it_would_misread():
    ids = torch.zeros(500, 2, dtype=torch.int32)  # read as int64: 8000 bytes of a 4000 byte buffer
    assert not moe_sort_available(ids)
    with pytest.raises(ValueError, match="topk_ids"):
        moe_sort(ids, 4)
    with pytest.raises(ValueError, match="topk_ids"):
        moe_sort(torch.zeros(3, 2, dtype=torch.int64, device="meta"), 4)


@pytest.mark.parametrize(
    "logits", [torch.randn(3, 4, device="meta"), torch.randn(3, 4).half(), torch.randn(4)]
)
def test_topk_softmax_refuses_logits_it_cannot_read(logits):
    with pytest.raises(ValueError, match="router_logits"):
        topk_softmax(logits, 2, True)


@pytest.mark.parametrize("top_k", [True, 2.0])
def test_topk_softmax_top_k_must_be_an_int(top_k):
    with pytest.raises(ValueError, match="top_k"):
        topk_softmax(torch.randn(3, 4), top_k, True)


def test_fused_add_rms_norm_residual_off_the_cpu_is_named():
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match="residual"):
        fused_add_rms_norm(x, x.to("meta"), torch.ones(8), 1e-6)


@pytest.mark.parametrize(
    "weight",
    [torch.ones(3), torch.ones(4096, dtype=torch.bfloat16), torch.ones(1, 4096), torch.ones(4097)],
)
def test_rms_norm_kernels_refuse_a_weight_they_would_misread(weight):
    # a [3] weight was read as 4096 floats (NaN rows), a bf16 weight as float32 bits
    x = torch.randn(4, 4096)
    with pytest.raises(ValueError, match="rms_norm: weight"):
        rms_norm(x, weight, 1e-6)
    with pytest.raises(ValueError, match="fused_add_rms_norm: weight"):
        fused_add_rms_norm(x, x.clone(), weight, 1e-6)


def test_rotary_kernel_is_not_offered_rows_that_overlap():
    q, k = torch.randn(1, 4, 8).expand(3, 4, 8), torch.randn(3, 2, 8)
    cos, sin = torch.randn(3, 1, 8), torch.randn(3, 1, 8)
    assert not rotary_embedding_available(q, k, cos, sin)
    assert not rotary_embedding_available(k, q, cos, sin)
    assert rotary_embedding_available(q.contiguous(), k, cos, sin)


# GQA group 3 and a sliding window of 8 through the engine. In float32 only: in bf16 the 65-token
# prompt's first token is a near tie (float32 logits 3.5472 against 3.5422) that bf16 rounding
# flips: SDPA in bf16 (and transformers in bf16, eager and sdpa) pick 480, the kernel in bf16 picks
# float32's 30, so bf16 token equality with SDPA is not a property to test on this checkpoint.
MISTRAL_G3_D64 = dict(
    TINY, hidden_size=128, num_attention_heads=6, num_key_value_heads=2, head_dim=64,
    sliding_window=8,
)  # fmt: skip


@pytest.mark.parametrize(
    "name, dtype",
    [
        # bf16 token equality with SDPA holds for the AMX path; on the avx512 and generic paths
        # (AMD Zen 4) a later token of this checkpoint is a bf16 near tie: the kernel's top two
        # logprobs round to the same -4.1928, SDPA's are -4.1924 and -4.208, so another token is
        # picked (both paths agree with each other; the same failure on main's generic path)
        pytest.param(
            "llama_d64", "bfloat16",
            marks=pytest.mark.xfail(
                prefill_kernel_isa(torch.bfloat16, 64) != "amx", strict=False,
                reason="bf16 near tie off the AMX path (see the comment above)",
            ),
        ),
        ("mistral_sliding", "float32"),
        ("mistral_g3_d64", "float32"),
    ],
)
def test_engine_chunked_prefill_and_prefix_cache_hits_through_the_kernel_match_sdpa(
    checkpoint_dir, tmp_path, monkeypatch, name, dtype
):
    # Prompts of a shared 48-token prefix (3 blocks of 16 exactly) and tails of 0, 1 and 17:
    # chunks of 16 tokens (every later chunk reads its cached context through the plan's
    # slots), then the second generate call's prompts hit the prefix cache. Kernel (forced)
    # and SDPA (the oracle) must give the same greedy tokens; the kernel must have run.
    from batchgen import LLM, SamplingParams
    from batchgen.models.layers import attention

    calls = []
    real = attention.paged_prefill_attention
    monkeypatch.setattr(
        attention,
        "paged_prefill_attention",
        lambda *a, **k: (calls.append(a[3].spans.shape[0]), real(*a, **k))[1],
    )
    if name == "mistral_g3_d64":
        path = make_model("mistral", tmp_path / name, seed=1234, **MISTRAL_G3_D64)
    else:
        path = checkpoint_dir(name)
    prefix = [(7 * i) % 500 + 3 for i in range(48)]
    first = [{"prompt_token_ids": prefix + [11, 12, 13]}]
    second = [{"prompt_token_ids": prefix + tail} for tail in ([], [9], list(range(20, 37)))]
    params = SamplingParams(max_tokens=6, temperature=0.0)
    tokens = {}
    for mode in ("sdpa", "kernel"):
        monkeypatch.setenv("BATCHGEN_PREFILL_ATTENTION", mode)
        llm = LLM(
            str(path), device="cpu", dtype=dtype, kv_cache_memory_gb=0.05,
            max_model_len=256, block_size=16, max_num_batched_tokens=16,
            enable_prefix_caching=True,
        )  # fmt: skip
        outs = llm.generate(first, params, use_tqdm=False)
        done = llm.get_metrics()["prefill_tokens"]
        outs += llm.generate(second, params, use_tqdm=False)
        computed = llm.get_metrics()["prefill_tokens"] - done
        # at least the first call's cached 48 prefix tokens were not computed again
        assert computed <= sum(len(p["prompt_token_ids"]) for p in second) - 48
        tokens[mode] = [o.outputs[0].token_ids for o in outs]
        if mode == "sdpa":
            assert not calls
    assert calls, "the prefill kernel never ran"
    assert tokens["kernel"] == tokens["sdpa"]


def test_expert_stats_of_replayed_steps_survive_reset_metrics(checkpoint_dir, monkeypatch):
    # The graph runner recorded replayed steps' rows per expert into the ExpertGemmStats it
    # was built with; reset_metrics replaces metrics.expert, so after a reset the replayed
    # decode steps' GEMMs went to the old object and get_metrics lost them (CUDA graphs: the
    # CPU stand-in backend replays here). Eager and replayed engines must count the same.
    from batchgen.config import EngineConfig
    from batchgen.engine import cuda_graphs
    from batchgen.engine.cuda_graphs import RecordingGraphBackend
    from batchgen.engine.llm_engine import LLMEngine
    from tests.test_host_staging import _greedy

    path = str(checkpoint_dir("mixtral"))
    prompts = [[5, 6, 7, 8, 9], [11, 12], [40] * 19]
    counts = {}
    for graphs in (False, True):
        if graphs:
            monkeypatch.setattr(
                cuda_graphs, "graph_backend_for", lambda device, eager: RecordingGraphBackend()
            )
        config = EngineConfig(
            model=path, device="cpu", dtype="float32", cudagraph_capture_sizes=[1, 2, 4]
        )
        engine = LLMEngine(config)
        assert (engine.executor.graph_runner is not None) == graphs
        _greedy(engine, prompts, 4)
        engine.reset_metrics()
        _greedy(engine, prompts, 6)
        m = engine.get_metrics()
        counts[graphs] = (m["num_expert_gemms"], m["mean_rows_per_expert_gemm"])
        if graphs:
            assert engine.executor.graph_runner.num_graph_steps >= 5
    assert counts[True] == counts[False]


@pytest.mark.parametrize("cpu_kernels", ["0", "rms_norm,moe_routing"])
def test_forcing_the_prefill_kernel_while_cpu_kernels_turn_it_off_fails_at_start(
    checkpoint_dir, monkeypatch, cpu_kernels
):
    # Before: the engine started, the first prefill raised inside the model forward and the
    # request failed ("the model forward failed on 1 sequences").
    from batchgen import LLM

    monkeypatch.setenv("BATCHGEN_PREFILL_ATTENTION", "kernel")
    monkeypatch.setenv("BATCHGEN_CPU_KERNELS", cpu_kernels)
    with pytest.raises(ValueError, match="BATCHGEN_PREFILL_ATTENTION=kernel.*BATCHGEN_CPU_KERNELS"):
        LLM(str(checkpoint_dir("llama")), device="cpu", dtype="float32", kv_cache_memory_gb=0.05)


@pytest.mark.parametrize("bad", ["cos_one_row", "sin_bf16", "k_rows", "q_meta"])
def test_rotary_kernel_called_directly_refuses_what_it_would_misread(bad):
    # a [1, 1, D] cos for T tokens was read T rows deep (rotary_embedding_ trusted its caller)
    q, k = torch.randn(5, 4, 8), torch.randn(5, 2, 8)
    cos, sin = torch.randn(5, 1, 8), torch.randn(5, 1, 8)
    if bad == "cos_one_row":
        cos = cos[:1]
    elif bad == "sin_bf16":
        sin = sin.bfloat16()
    elif bad == "k_rows":
        k = k[:3]
    else:
        q = q.to("meta")
    with pytest.raises(ValueError, match="rotary_embedding_"):
        rotary_embedding_(q, k, cos, sin)


@pytest.mark.parametrize("isa", ["auto", "generic"])
def test_prefill_ignores_nan_in_cache_slots_past_the_context(isa):
    # a cache from torch.empty may hold NaN bits where nothing was written yet; the AMX path
    # loads keys and values 32 at a time, so rows past a span's last key must never enter
    # a product (0 x NaN = NaN)
    q, kc, vc, spans = make_case([(5, 12), (33, 0), (1, 30)], 8, 2, 64, torch.bfloat16)
    used = torch.cat([s.kv_slots for s in spans])
    kn, vn = torch.full_like(kc, float("nan")), torch.full_like(vc, float("nan"))
    kn[used], vn[used] = kc[used], vc[used]
    clean = run_kernel(q, kc, vc, spans, 0.125, None, isa)
    assert torch.equal(run_kernel(q, kn, vn, spans, 0.125, None, isa), clean)
