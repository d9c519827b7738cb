"""The CPU prefill attention kernel (`batchgen.kernels.prefill_attention`) against SDPA and a
float64 reference on random paged caches: spans of 1-513 tokens, cached context 0 and several
blocks deep through a shuffled block table, GQA groups 1/4/8, head sizes 64 and 128, a sliding
window, several spans per call, float32 and bf16, every path forced in turn (AMX, AVX-512, the
generic loops; a path this CPU lacks is skipped, naming it).

Tolerances. float32: the kernel's scores, softmax and sums are float32 in another order than
SDPA's (blocks of 32 keys, an online softmax; a vector exp of 1.7e-7 relative error), checked
at ``rtol = atol = 2e-5`` against SDPA in float32 and against float64. bf16 (on the same bf16
inputs, against float64): products of bf16 values are exact in float32; the kernel rounds each
unnormalised softmax weight to bf16 (relative error at most u = 2^-8) and the output once, so
``|o - o_ref| <= u |o_ref| + u (p @ |v|)`` (p the exact probabilities; as in
`test_paged_attention_bf16`), plus ``1e-4 (1 + |o_ref|)`` for float32 arithmetic.
"""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F

from batchgen.kernels import cpu_build
from batchgen.kernels.prefill_attention import (
    auto_runs_kernel,
    build_prefill_plan,
    paged_prefill_attention,
    prefill_attention_mode,
    prefill_kernel_isa,
)
from batchgen.models.layers.attention import AttentionMetadata, PrefillSpan, paged_attention

U_BF16 = 2.0**-8
pytestmark = pytest.mark.skipif(
    not shutil.which(cpu_build.cxx_command()[0]), reason="no C++ compiler to build the kernel"
)


def make_case(specs, hq, hkv, d, dtype, block_size=16, seed=0):
    """Random q, paged caches and `PrefillSpan`s: ``specs`` a list of ``(num_tokens,
    context)``; each sequence's blocks drawn from a shuffled pool (its slots jump around)."""
    g = torch.Generator().manual_seed(seed)
    nblocks = [-(-(n + c) // block_size) for n, c in specs]
    pool = torch.randperm(sum(nblocks) + 5, generator=g)
    num_slots = (sum(nblocks) + 5) * block_size
    k_cache = torch.randn(num_slots, hkv, d, generator=g).to(dtype)
    v_cache = torch.randn(num_slots, hkv, d, generator=g).to(dtype)
    total = sum(n for n, _ in specs)
    q = torch.randn(total, hq, d, generator=g).to(dtype)
    spans, start, used = [], 0, 0
    for (n, c), nb in zip(specs, nblocks):
        table = pool[used : used + nb]
        used += nb
        p = torch.arange(n + c)
        slots = table[p // block_size] * block_size + p % block_size
        spans.append(PrefillSpan(start, n, n + c, slots))
        start += n
    return q, k_cache, v_cache, spans


def reference(q, k_cache, v_cache, spans, scale, window, dtype=torch.float64):
    """SDPA per span on the gathered context (in ``dtype``), and ``softmax @ |v|`` (float64)."""
    out = torch.zeros(q.shape, dtype=dtype)
    abs_out = torch.zeros(q.shape, dtype=torch.float64)
    for sp in spans:
        sl = slice(sp.token_start, sp.token_start + sp.num_tokens)
        qs = q[sl].to(dtype).transpose(0, 1)[None]
        ks = k_cache[sp.kv_slots].to(dtype).transpose(0, 1)[None]
        vs = v_cache[sp.kv_slots].to(dtype).transpose(0, 1)[None]
        pos = torch.arange(sp.kv_len - sp.num_tokens, sp.kv_len)
        kv = torch.arange(sp.kv_len)
        mask = kv[None, :] <= pos[:, None]
        if window is not None:
            mask &= pos[:, None] - kv[None, :] < window
        o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale, enable_gqa=True)
        out[sl] = o[0].transpose(0, 1)
        o_abs = F.scaled_dot_product_attention(
            qs.double(), ks.double(), vs.double().abs(), attn_mask=mask, scale=scale,
            enable_gqa=True,
        )
        abs_out[sl] = o_abs[0].transpose(0, 1)
    return out, abs_out


def isa_usable(isa: str, dtype: torch.dtype, d: int) -> bool:
    """Whether this CPU runs the forced path ``isa`` for ``dtype`` and head size ``d`` (the
    kernel refuses it otherwise), from /proc/cpuinfo's flags."""
    flags = set(cpu_build.cpu_flags().split())
    avx512 = {"avx512f", "avx512bw", "avx512dq"} <= flags
    bf16 = dtype == torch.bfloat16
    if isa == "avx512":
        return avx512 and (d % 32 == 0 and "avx512_bf16" in flags if bf16 else d % 16 == 0)
    if isa == "amx":
        return bf16 and {"amx_bf16", "avx512_bf16"} <= flags and d % 32 == 0 and d <= 512
    return True


def skip_unless_usable(isa: str, dtype: torch.dtype, d: int) -> None:
    if not isa_usable(isa, dtype, d):
        pytest.skip(f"this CPU lacks the instructions of the {isa} path ({dtype}, head size {d})")


def run_kernel(q, k_cache, v_cache, spans, scale, window, isa="auto"):
    out = torch.full_like(q, float("nan"))
    plan = build_prefill_plan(spans, q.shape[0], k_cache.shape[0])
    paged_prefill_attention(q, k_cache, v_cache, plan, scale, window, out, isa=isa)
    return out


CASES = [  # (spans as (num_tokens, context), Hq, Hkv, D, sliding window)
    ([(1, 0)], 4, 4, 64, None),
    ([(15, 0), (16, 40), (17, 0)], 8, 2, 64, None),
    ([(513, 0)], 8, 2, 64, None),
    ([(17, 300), (16, 0), (1, 77)], 8, 1, 128, None),
    ([(100, 0), (33, 129)], 4, 4, 128, 24),
    ([(513, 70), (15, 33)], 8, 2, 64, 100),
    ([(40, 200), (2, 5)], 16, 2, 64, 7),
]


@pytest.mark.parametrize("isa", ["auto", "generic", "avx512"])
@pytest.mark.parametrize("specs, hq, hkv, d, window", CASES)
def test_float32_matches_sdpa(specs, hq, hkv, d, window, isa):
    skip_unless_usable(isa, torch.float32, d)
    q, kc, vc, spans = make_case(specs, hq, hkv, d, torch.float32, seed=len(specs) + d)
    scale = d**-0.5
    ours = run_kernel(q, kc, vc, spans, scale, window, isa=isa)
    sdpa, _ = reference(q, kc, vc, spans, scale, window, torch.float32)
    exact, _ = reference(q, kc, vc, spans, scale, window)
    torch.testing.assert_close(ours, sdpa, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(ours.double(), exact, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("isa", ["auto", "generic", "avx512", "amx"])
@pytest.mark.parametrize("specs, hq, hkv, d, window", CASES)
def test_bf16_within_its_rounding_of_float64(specs, hq, hkv, d, window, isa):
    skip_unless_usable(isa, torch.bfloat16, d)
    q, kc, vc, spans = make_case(specs, hq, hkv, d, torch.bfloat16, seed=7 * len(specs) + d)
    scale = d**-0.5
    ours = run_kernel(q, kc, vc, spans, scale, window, isa=isa).double()
    exact, abs_out = reference(q, kc, vc, spans, scale, window)
    bound = U_BF16 * (exact.abs() + abs_out) + 1e-4 * (1 + exact.abs())
    err = (ours - exact).abs()
    assert torch.isfinite(ours).all()
    assert (err <= bound).all(), f"worst excess {(err - bound).max():.3g}"
    # and against torch's own bf16 SDPA, which rounds the same two places
    sdpa, _ = reference(q, kc, vc, spans, scale, window, torch.bfloat16)
    assert ((ours - sdpa.double()).abs() <= 2 * bound).all()


def test_the_fastest_path_is_chosen_for_the_cpu():
    flags = set(cpu_build.cpu_flags().split())
    amx = {"amx_bf16", "avx512_bf16"} <= flags
    for dtype, d in ((torch.bfloat16, 64), (torch.bfloat16, 48), (torch.float32, 64),
                     (torch.float32, 48), (torch.float32, 7)):
        want = next(p for p in ("amx", "avx512", "generic") if isa_usable(p, dtype, d))
        assert prefill_kernel_isa(dtype, d) == want, (dtype, d)
        # auto runs the kernel where its path beat SDPA: AMX, or AVX-512 (float32 on a CPU
        # without AMX); never the generic loops
        expect = want == "amx" or (want == "avx512" and (dtype == torch.bfloat16 or not amx))
        assert auto_runs_kernel(dtype, d) == expect, (dtype, d)


@pytest.mark.parametrize("isa, dtype, d", [("avx512", torch.bfloat16, 48),
                                           ("avx512", torch.float32, 7),
                                           ("amx", torch.bfloat16, 48)])
def test_a_forced_path_the_cpu_cannot_run_is_refused(isa, dtype, d):
    q, kc, vc, spans = make_case([(5, 3)], 4, 2, d, dtype)
    with pytest.raises(RuntimeError, match=f"isa '{isa}' is not usable on this CPU"):
        run_kernel(q, kc, vc, spans, 0.1, None, isa=isa)
    q, kc, vc, spans = make_case([(5, 3)], 4, 2, 64, torch.float32)
    with pytest.raises(ValueError, match="'amx' bf16 only"):
        run_kernel(q, kc, vc, spans, 0.1, None, isa="amx")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 9])
def test_paged_attention_prefill_kernel_matches_sdpa_path(monkeypatch, dtype, window):
    """`paged_attention` with the kernel against ``BATCHGEN_PREFILL_ATTENTION=sdpa``: chunks
    first and later, mixed with no decode rows; one layout, both switches."""
    specs = [(33, 0), (20, 50), (1, 0)]
    hq, hkv, d = 8, 2, 64
    q, kc, vc, spans = make_case(specs, hq, hkv, d, dtype, seed=3)
    t = q.shape[0]
    g = torch.Generator().manual_seed(5)
    k = torch.randn(t, hkv, d, generator=g).to(dtype)
    v = torch.randn(t, hkv, d, generator=g).to(dtype)
    slot_mapping = torch.cat([sp.kv_slots[sp.kv_len - sp.num_tokens :] for sp in spans])
    positions = torch.cat([torch.arange(sp.kv_len - sp.num_tokens, sp.kv_len) for sp in spans])
    outs = {}
    for mode in ("sdpa", "kernel"):
        monkeypatch.setenv("BATCHGEN_PREFILL_ATTENTION", mode)
        meta = AttentionMetadata(positions, slot_mapping, block_size=16, prefills=spans)
        caches = (kc.clone(), vc.clone())
        outs[mode] = paged_attention(q, k, v, caches, meta, d**-0.5, window).double()
    tol = 2e-5 if dtype == torch.float32 else 4 * U_BF16
    torch.testing.assert_close(outs["kernel"], outs["sdpa"], rtol=tol, atol=tol)


def test_bad_inputs_are_named(monkeypatch):
    monkeypatch.setenv("BATCHGEN_PREFILL_ATTENTION", "flash")
    with pytest.raises(ValueError, match="BATCHGEN_PREFILL_ATTENTION"):
        prefill_attention_mode()
    q, kc, vc, spans = make_case([(5, 3)], 4, 2, 64, torch.float32)
    with pytest.raises(ValueError, match="kv_slots must be in"):
        build_prefill_plan(spans, q.shape[0], 8)
    plan = build_prefill_plan(spans, q.shape[0], kc.shape[0])
    out = torch.empty_like(q)
    with pytest.raises(ValueError, match="out must be a float32 or bfloat16"):
        paged_prefill_attention(q, kc, vc, plan, 0.1, None, out.double())
    with pytest.raises(ValueError, match="plan built for"):
        paged_prefill_attention(q, kc[:16], vc[:16], plan, 0.1, None, out)
    with pytest.raises(ValueError, match="sliding_window"):
        paged_prefill_attention(q, kc, vc, plan, 0.1, 0, out)
