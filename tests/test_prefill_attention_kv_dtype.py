"""The CPU prefill attention kernel on a KV cache narrower than q (vLLM's ``kv_cache_dtype``):
float32 q on bfloat16 / float8_e4m3fn / float8_e5m2 caches, bf16 q on the two fp8 formats,
against SDPA on the dequantised context (``cache.to(q.dtype) * scale``) and float64.

Cases: the spans of tests/test_prefill_attention.py (first chunks and later chunks over
shuffled blocks, GQA groups 1-8, head sizes 64 and 128, sliding windows) plus a head size no
vector path takes (40: the generic loops); every path forced in turn; ``k_scale``,
``v_scale`` != 1; cache values from e4m3's subnormals (2^-9) to 300 (rounded to 288 / 320, in
V), and every finite value of each format read back exactly.
Tolerances are that file's for q's dtype: the kernel reads every cache value exactly (each is a
float32 and a bf16 value), so only the order of float32 sums and, in bf16, the rounding of the
softmax weights and of the output remain.
"""

from __future__ import annotations

import shutil

import pytest
import torch

import batchgen.models.layers.attention as attention_mod
from batchgen import LLM
from batchgen.kernels import cpu_build
from batchgen.kernels.prefill_attention import (
    CACHE_DTYPES,
    auto_runs_kernel,
    build_prefill_plan,
    paged_prefill_attention,
    prefill_kernel_isa,
    use_prefill_kernel,
)
from batchgen.models.layers.attention import AttentionMetadata, PrefillSpan, paged_attention
from batchgen.models.layers.kv_cache_dtype import quantize_kv
from tests.test_kv_cache_dtype import FORMATS, GREEDY, _hf_rounded
from tests.test_model_oracle import PROMPTS, _hf_greedy
from tests.test_prefill_attention import (
    CASES,
    U_BF16,
    isa_usable,
    make_case,
    reference,
    skip_unless_usable,
)

pytestmark = pytest.mark.skipif(
    not shutil.which(cpu_build.cxx_command()[0]), reason="no C++ compiler to build the kernel"
)
PAIRS = [  # (q dtype, cache dtype): every narrower pair the kernel serves
    (torch.float32, torch.bfloat16),
    (torch.float32, torch.float8_e4m3fn),
    (torch.float32, torch.float8_e5m2),
    (torch.bfloat16, torch.float8_e4m3fn),
    (torch.bfloat16, torch.float8_e5m2),
]
KV_CASES = [*CASES, ([(20, 37), (9, 0)], 6, 2, 40, None), ([(33, 64)], 4, 4, 40, 16)]


def wide_cache(shape, cache_dtype, g, big=0.0):
    """Values of magnitude 2^-10 .. 4 (e4m3's subnormals lie below 2^-6) and a fraction
    ``big`` at +-300, in the cache's dtype (clamped and rounded as the engine writes them)."""
    mag = torch.exp2(torch.empty(shape).uniform_(-10, 2, generator=g))
    x = torch.randn(shape, generator=g) * mag
    x = torch.where(torch.rand(shape, generator=g) < big, 300.0 * torch.sign(x), x)
    return quantize_kv(x, cache_dtype)


def mixed_case(specs, hq, hkv, d, q_dtype, cache_dtype, seed):
    """make_case's q and spans; K of `wide_cache`, V with 1 in 200 values at +-300 (large keys
    would make the scores ill-conditioned: torch's own float32 SDPA is 2e-3 off float64 with
    keys of 100; `test_every_cache_value_reads_back_exactly` covers every value, 448 too)."""
    q, kc, _, spans = make_case(specs, hq, hkv, d, q_dtype, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    k_cache = wide_cache(kc.shape, cache_dtype, g)
    return q, k_cache, wide_cache(kc.shape, cache_dtype, g, big=0.005), spans


def count_kernel_calls(monkeypatch) -> list[torch.dtype]:
    """Wraps the kernel as `paged_attention` calls it; returns the list of the cache dtypes of
    its calls."""
    calls, kernel = [], attention_mod.paged_prefill_attention

    def counted(q, k_cache, *args, **kwargs):
        calls.append(k_cache.dtype)
        return kernel(q, k_cache, *args, **kwargs)

    monkeypatch.setattr(attention_mod, "paged_prefill_attention", counted)
    return calls


def run_kernel(q, kc, vc, spans, scale, window, isa="auto", k_scale=1.0, v_scale=1.0):
    out = torch.full_like(q, float("nan"))
    plan = build_prefill_plan(spans, q.shape[0], kc.shape[0])
    paged_prefill_attention(
        q, kc, vc, plan, scale, window, out, isa=isa, k_scale=k_scale, v_scale=v_scale
    )
    return out


@pytest.mark.parametrize("isa", ["auto", "generic", "avx512"])
@pytest.mark.parametrize("specs, hq, hkv, d, window", KV_CASES)
@pytest.mark.parametrize("q_dtype, cache_dtype", PAIRS)
def test_narrow_cache_matches_sdpa_on_the_dequantised_context(
    q_dtype, cache_dtype, specs, hq, hkv, d, window, isa
):
    skip_unless_usable(isa, q_dtype, d)
    seed = 3 * len(specs) + d + PAIRS.index((q_dtype, cache_dtype))
    q, kc, vc, spans = mixed_case(specs, hq, hkv, d, q_dtype, cache_dtype, seed)
    scale, k_scale, v_scale = d**-0.5, 0.37, 1.9
    ours = run_kernel(q, kc, vc, spans, scale, window, isa, k_scale, v_scale)
    deq = kc.double() * k_scale, vc.double() * v_scale
    exact, abs_out = reference(q, *deq, spans, scale, window)
    deq_k, deq_v = kc.to(q_dtype) * k_scale, vc.to(q_dtype) * v_scale  # SDPA's inputs
    sdpa, _ = reference(q, deq_k, deq_v, spans, scale, window, q_dtype)
    assert torch.isfinite(ours).all()
    if q_dtype == torch.float32:
        torch.testing.assert_close(ours, sdpa, rtol=2e-5, atol=2e-5)
        torch.testing.assert_close(ours.double(), exact, rtol=2e-5, atol=2e-5)
    else:  # tests/test_prefill_attention.py's bf16 bound (exact: the unrounded scaled values)
        ours = ours.double()
        bound = U_BF16 * (exact.abs() + abs_out) + 1e-4 * (1 + exact.abs())
        err = (ours - exact).abs()
        assert (err <= bound).all(), f"worst excess {(err - bound).max():.3g}"
        assert ((ours - sdpa.double()).abs() <= 2 * bound).all()


@pytest.mark.parametrize("q_dtype, cache_dtype", PAIRS)
def test_every_cache_value_reads_back_exactly(q_dtype, cache_dtype):
    """One key per query (a single first-chunk token): the output is that key's value row,
    so each of the format's 256 bit patterns comes back as torch reads it (then rounded to q's
    dtype: exact, it fits), e4m3fn's NaN and e5m2's inf and NaN included."""
    if cache_dtype == torch.bfloat16:  # a spread of magnitudes, 2^-30 .. 2^30
        vals = (torch.randn(256) * torch.exp2(torch.linspace(-30, 30, 256))).to(cache_dtype)
    else:
        vals = torch.arange(256, dtype=torch.uint8).view(cache_dtype)
    n, d = vals.numel(), 64
    rows = -(-n // d)
    vc = torch.cat([vals, torch.zeros(rows * d - n).to(cache_dtype)]).reshape(rows, 1, d)
    kc = torch.zeros_like(vc)
    q = torch.ones(rows, 1, d, dtype=q_dtype)
    spans = [PrefillSpan(i, 1, 1, torch.tensor([i])) for i in range(rows)]  # token i: slot i
    for isa in ("generic", "avx512"):
        if not isa_usable(isa, q_dtype, d):
            continue
        out = run_kernel(q, kc, vc, spans, 1.0, None, isa)
        got = out.reshape(-1)[:n].float()
        torch.testing.assert_close(got, vals.float(), rtol=0, atol=0, equal_nan=True, msg=isa)


@pytest.mark.parametrize("bits", [0x7C, 0x7F])  # e5m2's inf and a NaN
def test_a_key_hidden_from_a_tile_adds_nothing_even_if_not_finite(bits):
    """Two tiles share a task on a narrow cache: tokens at positions 1-16 (keys 0-16, an odd
    count) and 17-32. Key 17's value is inf / NaN: the first tile's outputs stay those of
    the keys it sees (its weight 0 must not meet the value: 0 x inf is NaN)."""
    hq = hkv = 1
    d = 64
    for q_dtype in (torch.float32, torch.bfloat16):
        for isa in ("generic", "avx512"):
            if not isa_usable(isa, q_dtype, d):
                continue
            q, kc, vc, spans = mixed_case([(32, 1)], hq, hkv, d, q_dtype, torch.float8_e5m2, 9)
            slot17 = int(spans[0].kv_slots[17])
            clean = run_kernel(q, kc, vc, spans, d**-0.5, None, isa)
            vc.view(torch.uint8)[slot17] = bits
            ours = run_kernel(q, kc, vc, spans, d**-0.5, None, isa)
            torch.testing.assert_close(ours[:16], clean[:16], rtol=0, atol=0, msg=isa)
            assert not torch.isfinite(ours[16:].float()).all()  # the second tile sees it


def test_paths_and_auto_for_the_narrow_pairs():
    """The vector path serves every pair where it serves q's dtype; AMX only bf16 on bf16;
    auto runs the kernel for the narrow pairs where the AVX-512 path runs on a CPU without AMX
    (measured faster than SDPA there: benchmarks/prefill_attention.py)."""
    amx = "amx_bf16" in cpu_build.cpu_flags().split()
    for q_dtype, cache_dtype in PAIRS:
        for d in (64, 48, 40, 32):
            want = "avx512" if isa_usable("avx512", q_dtype, d) else "generic"
            assert prefill_kernel_isa(q_dtype, d, cache_dtype) == want, (q_dtype, cache_dtype, d)
            assert auto_runs_kernel(q_dtype, d, cache_dtype) == (want == "avx512" and not amx)
    assert prefill_kernel_isa(torch.bfloat16, 64, torch.float32) is None  # wider: not served
    assert not use_prefill_kernel(torch.device("cpu"), torch.bfloat16, 64, torch.float32)
    assert set(CACHE_DTYPES[torch.float32]) == {torch.float32, *FORMATS.values()}


def test_amx_and_bad_pairs_are_refused():
    q, kc, vc, spans = mixed_case([(5, 3)], 4, 2, 64, torch.bfloat16, torch.float8_e4m3fn, 0)
    with pytest.raises(RuntimeError, match="isa 'amx' is not usable on this CPU"):
        run_kernel(q, kc, vc, spans, 0.1, None, isa="amx")
    with pytest.raises(ValueError, match="k_cache and v_cache must share a dtype"):
        run_kernel(q, kc, vc.view(torch.float8_e5m2), spans, 0.1, None)
    with pytest.raises(ValueError, match="k_cache and v_cache must share a dtype"):
        run_kernel(q, kc.float(), vc.float(), spans, 0.1, None)  # bf16 q on a float32 cache


@pytest.mark.parametrize("q_dtype, cache_dtype", PAIRS)
@pytest.mark.parametrize("window", [None, 9])
def test_paged_attention_runs_the_kernel_on_a_narrow_cache(
    monkeypatch, q_dtype, cache_dtype, window
):
    """`paged_attention` with the kernel against ``BATCHGEN_PREFILL_ATTENTION=sdpa`` on a
    narrow cache: first and later chunks; the new K/V quantised on the write either way
    (tests/test_prefill_attention.py's data and tolerances)."""
    specs = [(33, 0), (20, 50), (1, 0)]
    hq, hkv, d = 8, 2, 64
    q, kc, vc, spans = make_case(specs, hq, hkv, d, q_dtype, seed=3)  # that file's data
    kc, vc = quantize_kv(kc, cache_dtype), quantize_kv(vc, cache_dtype)
    t = q.shape[0]
    g = torch.Generator().manual_seed(5)
    k = torch.randn(t, hkv, d, generator=g).to(q_dtype)
    v = torch.randn(t, hkv, d, generator=g).to(q_dtype)
    slot_mapping = torch.cat([sp.kv_slots[sp.kv_len - sp.num_tokens :] for sp in spans])
    positions = torch.cat([torch.arange(sp.kv_len - sp.num_tokens, sp.kv_len) for sp in spans])
    calls = count_kernel_calls(monkeypatch)
    outs = {}
    for mode in ("sdpa", "kernel"):
        monkeypatch.setenv("BATCHGEN_PREFILL_ATTENTION", mode)
        meta = AttentionMetadata(positions, slot_mapping, block_size=16, prefills=spans)
        caches = (kc.clone(), vc.clone())
        outs[mode] = paged_attention(q, k, v, caches, meta, d**-0.5, window).double()
    assert calls == [cache_dtype]  # the kernel ran once, in "kernel" mode, on the narrow cache
    tol = 2e-5 if q_dtype == torch.float32 else 4 * U_BF16
    torch.testing.assert_close(outs["kernel"], outs["sdpa"], rtol=tol, atol=tol)


@pytest.mark.parametrize("kv_cache_dtype", list(FORMATS))
def test_engine_prefill_runs_the_kernel_on_a_narrow_cache(
    monkeypatch, checkpoint_dir, kv_cache_dtype
):
    """tests/test_kv_cache_dtype.py's oracle (transformers with K/V rounded to the cache
    format, token for token) with the kernel running every prefill chunk of the engine on the
    narrow cache (forced: auto takes it where the AVX-512 path runs, asserted above)."""
    monkeypatch.setenv("BATCHGEN_PREFILL_ATTENTION", "kernel")
    calls = count_kernel_calls(monkeypatch)
    path = checkpoint_dir("mixtral")
    llm = LLM(
        str(path),
        dtype="float32",
        kv_cache_dtype=kv_cache_dtype,
        kv_cache_memory_gb=0.05,
        max_num_batched_tokens=16,  # later chunks read their earlier ones from the cache
    )
    ids = [llm.get_tokenizer().encode(p) for p in PROMPTS]
    outs = llm.generate([{"prompt_token_ids": i} for i in ids], GREEDY, use_tqdm=False)
    assert calls and set(calls) == {FORMATS[kv_cache_dtype]}
    ref = _hf_rounded(path, kv_cache_dtype)
    for prompt_ids, out in zip(ids, outs):
        assert out.outputs[0].token_ids == _hf_greedy(ref, prompt_ids, GREEDY.max_tokens)
