"""The CPU paged decode attention kernel over a KV cache narrower than q (vLLM's
``kv_cache_dtype``): q float32 over bfloat16, float8_e4m3fn or float8_e5m2 caches, q bfloat16
over fp8 caches (``csrc/paged_decode_attention_mixed.h``).

Contract: a cached key is worth its stored value (exact in float32) times ``k_scale``, a value
times ``v_scale``; the result is attention over those values in q's dtype's arithmetic.

Tolerances. The established ones (`test_paged_attention_f32.py`, `test_cpu_kernels.py`: rtol =
atol = 1e-5 for O(1) values; `test_paged_attention_bf16.py`: the kernel's two bf16 roundings),
with the absolute float32 terms scaled by the largest dequantised value ``vmax``: the values here
span 1e-3 (e4m3 subnormals) to 300, and float32 sums of terms of size ``vmax`` err in proportion
to ``vmax``. float32 q: ``|out - ref| <= 1e-5 |ref| + 1e-5 vmax``. bfloat16 q (softmax weights and
output rounded to bf16, u = 2^-8): ``u |o| + u (p @ |v|) + 1e-5 (|o| + vmax)``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from batchgen.kernels import cpu_build
from batchgen.kernels.paged_attention import (
    MIXED_PAIRS,
    decode_kernel_available,
    decode_kernel_isa,
    paged_decode_attention,
)

pytestmark = pytest.mark.skipif(
    not decode_kernel_available(torch.device("cpu"), torch.float32), reason="kernel not built"
)
U_BF16 = 2.0**-8
PAIR_IDS = [f"{str(q)[6:]}-{str(c)[6:]}" for q, c in MIXED_PAIRS]
KV_LENS = [1, 2, 15, 16, 17, 40, 333, 700]  # incl. 1, block edges, non-multiples of 16


def _to_cache(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """What the writer stores: clamped to the format's finite range, cast by torch."""
    big = torch.finfo(dtype).max
    return x.clamp(-big, big).to(dtype)


def _case(kv_lens, hq, hkv, d, q_dtype, cache_dtype, block_size=16, seed=0):
    """q ``[B, Hq, D]`` and caches over scattered blocks (padding ids past the cache, never
    read); magnitudes drawn from {1e-3 (e4m3 subnormals), 1, 300}; q small enough that the
    scores stay O(10)."""
    g = torch.Generator().manual_seed(seed)
    nbs = [-(-n // block_size) for n in kv_lens]
    num_blocks = sum(nbs) + 3
    perm = torch.randperm(num_blocks, generator=g)
    tables = torch.full((len(kv_lens), max(nbs) + 1), 10**9, dtype=torch.int64)
    taken = 0
    for i, nb in enumerate(nbs):
        tables[i, :nb] = perm[taken : taken + nb]
        taken += nb
    mags = torch.tensor([1e-3, 1.0, 300.0])

    def draw():
        shape = (num_blocks * block_size, hkv, d)
        x = torch.randn(shape, generator=g) * mags[torch.randint(0, 3, shape, generator=g)]
        return _to_cache(x, cache_dtype)

    k, v = draw(), draw()
    q = (torch.randn(len(kv_lens), hq, d, generator=g) * 0.02).to(q_dtype)
    return q, k, v, tables, torch.tensor(kv_lens)


def _slots(tables, i, n, block_size, window):
    p = torch.arange(max(0, n - window) if window else 0, n)
    return tables[i, p // block_size] * block_size + p % block_size


def _reference64(q, k, v, tables, lens, block_size, scale, window, k_scale, v_scale):
    """float64 attention over the dequantised values; also the softmax-weighted |v|."""
    outs, absv = [], []
    hq, hkv = q.shape[1], k.shape[1]
    for i, n in enumerate(lens.tolist()):
        s = _slots(tables, i, n, block_size, window)
        kk = (k[s].double() * k_scale).repeat_interleave(hq // hkv, 1)  # [n, Hq, D]
        vv = (v[s].double() * v_scale).repeat_interleave(hq // hkv, 1)
        p = (torch.einsum("hd,nhd->hn", q[i].double(), kk) * scale).softmax(-1)
        outs.append(torch.einsum("hn,nhd->hd", p, vv))
        absv.append(torch.einsum("hn,nhd->hd", p, vv.abs()))
    return torch.stack(outs), torch.stack(absv)


def _bound(q_dtype, ref, absv, vmax):
    if q_dtype == torch.float32:
        return 1e-5 * ref.abs() + 1e-5 * vmax
    return U_BF16 * ref.abs() + U_BF16 * absv + 1e-5 * (ref.abs() + vmax)


def _torch_reference(q, k, v, tables, lens, block_size, scale, window, k_scale, v_scale):
    """The lead's fallback: gather, dequantise ``.to(q.dtype) * scale``, SDPA in q's dtype."""
    outs = []
    hq, hkv = q.shape[1], k.shape[1]
    for i, n in enumerate(lens.tolist()):
        s = torch.arange(n)
        slots = tables[i, s // block_size] * block_size + s % block_size
        kk = (k[slots].to(q.dtype) * k_scale).repeat_interleave(hq // hkv, 1).transpose(0, 1)
        vv = (v[slots].to(q.dtype) * v_scale).repeat_interleave(hq // hkv, 1).transpose(0, 1)
        mask = None
        if window is not None:
            mask = (n - 1 - s < window)[None, None, :]  # HF's rule: pos - j < window
        o = F.scaled_dot_product_attention(q[i][:, None], kk, vv, attn_mask=mask, scale=scale)
        outs.append(o[:, 0])
    return torch.stack(outs)


SHAPES = [
    (8, 2, 64),  # the bench model's GQA
    (8, 2, 128),
    (4, 4, 64),  # MHA: head pairs over two KV heads
    (8, 8, 128),  # MHA, D 128: passes of 2 heads
    (16, 2, 64),  # G = 8: two passes of P @ V per KV head
    (3, 1, 64),  # odd Hq: the last head paired with itself
    (8, 2, 48),  # a head size the AVX-512F path does not take: generic loops
    (4, 2, 80),
]


@pytest.mark.parametrize("q_dtype,cache_dtype", MIXED_PAIRS, ids=PAIR_IDS)
@pytest.mark.parametrize("hq,hkv,d", SHAPES)
@pytest.mark.parametrize("window", [None, 37])
def test_mixed_kernel_matches_float64_reference_and_generic(
    q_dtype, cache_dtype, hq, hkv, d, window, monkeypatch
):
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    q, k, v, tables, lens = _case(KV_LENS, hq, hkv, d, q_dtype, cache_dtype)
    k_scale, v_scale = 0.37, 1.7
    outs = {}
    for isa in ("auto", "generic"):
        outs[isa] = torch.full_like(q, float("nan"))
        paged_decode_attention(
            q, k, v, tables, lens, 16, d**-0.5, window, outs[isa], isa=isa,
            k_scale=k_scale, v_scale=v_scale,
        )  # fmt: skip
        assert outs[isa].dtype == q_dtype
    ref, absv = _reference64(q, k, v, tables, lens, 16, d**-0.5, window, k_scale, v_scale)
    vmax = v.double().abs().max() * v_scale
    bound = _bound(q_dtype, ref, absv, vmax)
    for isa, out in outs.items():
        err = (out.double() - ref).abs()
        assert (err <= bound).all(), f"{isa}: worst error/bound {(err / bound).max():.3f}"
    # the forced generic loops against the vector path, within the same tolerance
    gap = (outs["auto"].double() - outs["generic"].double()).abs()
    assert (gap <= bound).all(), f"auto vs generic: worst gap/bound {(gap / bound).max():.3f}"
    if decode_kernel_isa(q_dtype, d, hq // hkv, 16, cache_dtype) == "generic":
        # auto ran the generic loops too, its rows decoded by vector: the same floats
        assert torch.equal(outs["auto"], outs["generic"])


@pytest.mark.parametrize("q_dtype,cache_dtype", MIXED_PAIRS, ids=PAIR_IDS)
@pytest.mark.parametrize("hq,hkv,d,window", [(8, 2, 64, None), (4, 4, 128, 21), (8, 2, 48, 5)])
def test_mixed_kernel_matches_the_torch_fallback(q_dtype, cache_dtype, hq, hkv, d, window):
    """Against gather + ``.to(q.dtype) * scale`` + SDPA in q's dtype. Scales of powers of two,
    so that dequantising in bf16 is exact as the contract says (another scale rounds each
    dequantised value to bf16 there, which the kernel, computing stored x scale in float32,
    does not). bf16: the established tolerance against torch (rtol = 2u + 1e-5, atol = u x
    max|v| + 1e-5), its atol's float32 term scaled by max|v| as above."""
    q, k, v, tables, lens = _case(KV_LENS, hq, hkv, d, q_dtype, cache_dtype, seed=1)
    k_scale, v_scale = 0.5, 2.0
    out = torch.full_like(q, float("nan"))
    paged_decode_attention(
        q, k, v, tables, lens, 16, d**-0.5, window, out, k_scale=k_scale, v_scale=v_scale
    )
    want = _torch_reference(q, k, v, tables, lens, 16, d**-0.5, window, k_scale, v_scale)
    vmax = float(v.float().abs().max()) * v_scale
    if q_dtype == torch.float32:
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5 * vmax)
    else:
        atol = U_BF16 * vmax + 1e-5 * vmax
        torch.testing.assert_close(out.float(), want.float(), rtol=2 * U_BF16 + 1e-5, atol=atol)


@pytest.mark.parametrize("q_dtype,cache_dtype", MIXED_PAIRS, ids=PAIR_IDS)
@pytest.mark.parametrize("isa", ["auto", "generic"])
def test_every_stored_value_decodes_exactly(q_dtype, cache_dtype, isa):
    """One position per sequence (softmax weight exactly 1): the output is the value row
    itself, so every finite code of the format (subnormals, the largest, -0) must come out
    exactly as torch decodes it."""
    if cache_dtype == torch.bfloat16:  # a sample of bf16 codes: every exponent, both signs
        codes = torch.arange(0, 2**16, 97, dtype=torch.int32).to(torch.int16)
    else:
        codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    vals = codes.view(cache_dtype) if cache_dtype != torch.bfloat16 else codes.view(torch.bfloat16)
    vals = torch.where(vals.float().isfinite(), vals.float(), 0.0).to(cache_dtype)
    if q_dtype == torch.bfloat16:  # bf16 output: values that bf16 holds exactly (all fp8)
        assert torch.equal(vals.float().bfloat16().float(), vals.float())
    d = 64
    pad = (-vals.numel()) % d
    v = torch.cat([vals, torch.zeros(pad, dtype=cache_dtype)]).view(-1, 1, d)  # [B, 1, D]
    b = v.shape[0]
    k = torch.zeros_like(v)
    q = torch.randn(b, 2, d).to(q_dtype)
    out = torch.full_like(q, float("nan"))
    tables, lens = torch.arange(b)[:, None], torch.ones(b, dtype=torch.int64)
    paged_decode_attention(q, k, v, tables, lens, 1, 0.125, None, out, isa=isa)
    want = v.float().expand(b, 2, d)
    assert torch.equal(out.float(), want)


def test_isa_environment_variable_forces_generic_on_mixed_caches(monkeypatch):
    q, k, v, tables, lens = _case([5, 33, 300], 8, 2, 64, torch.float32, torch.float8_e4m3fn)
    explicit, from_env = torch.empty_like(q), torch.empty_like(q)
    paged_decode_attention(q, k, v, tables, lens, 16, 0.125, None, explicit, isa="generic")
    monkeypatch.setenv("BATCHGEN_PAGED_ATTENTION_ISA", "generic")
    paged_decode_attention(q, k, v, tables, lens, 16, 0.125, None, from_env)
    assert torch.equal(explicit, from_env)
    monkeypatch.delenv("BATCHGEN_PAGED_ATTENTION_ISA")
    auto = torch.empty_like(q)
    paged_decode_attention(q, k, v, tables, lens, 16, 0.125, None, auto)
    if decode_kernel_isa(torch.float32, 64, 4, 16, torch.float8_e4m3fn) == "avx512f":
        assert not torch.equal(auto, explicit)  # another path ran (another summation order)


def test_availability_and_isa_name_the_pairs():
    cpu = torch.device("cpu")
    for q_dtype, cache_dtype in MIXED_PAIRS:
        assert decode_kernel_available(cpu, q_dtype, cache_dtype)
    assert decode_kernel_available(cpu, torch.bfloat16, None)
    assert decode_kernel_available(cpu, torch.float32, torch.float32)
    for q_dtype, cache_dtype in (
        (torch.bfloat16, torch.float32),
        (torch.bfloat16, torch.float16),
        (torch.float32, torch.float16),
        (torch.float16, torch.float8_e4m3fn),
    ):
        assert not decode_kernel_available(cpu, q_dtype, cache_dtype)
        assert decode_kernel_isa(q_dtype, 64, cache_dtype=cache_dtype) is None
    assert not decode_kernel_available(torch.device("meta"), torch.float32, torch.bfloat16)
    avx512 = "avx512f" in cpu_build.cpu_flags().split()
    for q_dtype, cache_dtype in MIXED_PAIRS:
        for d in (64, 128):
            path = decode_kernel_isa(q_dtype, d, 4, 16, cache_dtype)
            assert path == ("avx512f" if avx512 else "generic")
        assert decode_kernel_isa(q_dtype, 48, 4, 16, cache_dtype) == "generic"
        assert decode_kernel_isa(q_dtype, 256, 1, 16, cache_dtype) == "generic"


def test_bad_pairings_and_scales_raise_naming_the_argument():
    q, k, v, tables, lens = _case([5, 20], 4, 2, 64, torch.bfloat16, torch.float8_e4m3fn)

    def call(**change):
        args = dict(
            q=q, k_cache=k, v_cache=v, block_tables=tables, kv_lens=lens, block_size=16,
            scale=0.125, sliding_window=None, out=torch.empty_like(q),
        )  # fmt: skip
        args.update(change)
        paged_decode_attention(**args)

    call()  # the valid call
    cases = [
        # k and v of different dtypes: the one that is not q's is named (both not: v_cache)
        (dict(v_cache=v.bfloat16()), "k_cache must be a torch.bfloat16 CPU tensor like q"),
        (dict(k_cache=k.bfloat16()), "v_cache must be a torch.bfloat16 CPU tensor like q"),
        (dict(k_cache=k.bfloat16(), v_cache=v.float()), "v_cache must be"),
        (dict(v_cache=v.float().to(torch.float8_e5m2)), "v_cache must be"),
        (dict(k_cache=k.half(), v_cache=v.half()), "k_cache must be a torch.bfloat16 CPU"),
        (dict(k_cache=k.float(), v_cache=v.float()), "k_cache must be"),
        (dict(q=q.half(), out=q.half()), "q must be a float32 or bfloat16 CPU tensor"),
        (dict(out=q.float()), "out must be a torch.bfloat16 CPU tensor"),
        (dict(k_scale=0.0), "k_scale must be a finite float > 0"),
        (dict(v_scale=float("nan")), "v_scale must be a finite float > 0"),
        (dict(k_scale=True), "k_scale must be"),
        (dict(k_cache=k.bfloat16(), v_cache=v.bfloat16(), k_scale=2.0), "must be 1.0"),
    ]
    for change, message in cases:
        with pytest.raises(ValueError, match=message):
            call(**change)
    # the message lists the served pairs
    with pytest.raises(ValueError, match="float32/float8_e5m2"):
        call(k_cache=k.half(), v_cache=v.half())
    # float32 q: a bf16 key cache beside a float32 value cache names the key cache
    q32 = q.float()
    with pytest.raises(ValueError, match="k_cache must be a torch.float32 CPU tensor like q"):
        call(q=q32, out=q32.clone(), k_cache=k.bfloat16(), v_cache=v.float())


def test_scales_of_one_leave_same_dtype_paths_bit_identical():
    q, k, v, tables, lens = _case([5, 40, 300], 8, 2, 64, torch.bfloat16, torch.bfloat16)
    a, b = torch.empty_like(q), torch.empty_like(q)
    paged_decode_attention(q, k, v, tables, lens, 16, 0.125, None, a)
    paged_decode_attention(q, k, v, tables, lens, 16, 0.125, None, b, k_scale=1.0, v_scale=1.0)
    assert torch.equal(a, b)


def test_forced_paths_fall_back_on_mixed_caches():
    """A narrower cache has the AVX-512F path and the generic loops: ``avx512_bf16`` and
    ``amx`` fall back to ``avx512f`` (bit-identical to it), ``avx2`` to the generic loops."""
    q, k, v, tables, lens = _case([5, 33, 300], 8, 2, 64, torch.bfloat16, torch.float8_e5m2)
    outs = {}
    for isa in ("avx512f", "avx512_bf16", "amx", "avx2", "generic"):
        outs[isa] = torch.empty_like(q)
        paged_decode_attention(q, k, v, tables, lens, 16, 0.125, None, outs[isa], isa=isa)
    assert torch.equal(outs["avx512_bf16"], outs["avx512f"])
    assert torch.equal(outs["amx"], outs["avx512f"])
    assert torch.equal(outs["avx2"], outs["generic"])


def test_log_line_names_the_cache_dtype(monkeypatch, caplog):
    import logging

    from batchgen.kernels import paged_attention as pa

    monkeypatch.setattr(pa, "_logged", set())
    with caplog.at_level(logging.INFO, logger="batchgen.kernels.paged_attention"):
        pa._log_once(torch.bfloat16, 64, 4, 16, "auto", torch.float8_e4m3fn)
        pa._log_once(torch.float32, 48, 4, 16, "generic", torch.bfloat16)
    path = decode_kernel_isa(torch.bfloat16, 64, 4, 16, torch.float8_e4m3fn)
    assert [r.getMessage() for r in caplog.records] == [
        "paged decode attention, torch.bfloat16, head size 64, 4 query heads per KV head, "
        f"blocks of 16, torch.float8_e4m3fn KV cache: {path} path",
        "paged decode attention, torch.float32, head size 48, 4 query heads per KV head, "
        "blocks of 16, torch.bfloat16 KV cache: forced generic path",
    ]


def test_log_line_says_why_a_narrower_cache_takes_the_generic_loops(monkeypatch, caplog):
    """The narrower-cache AVX-512F path covers head sizes 64 and 128; elsewhere the log names
    the rule instead of leaving "generic path" unexplained on an AVX-512 CPU."""
    import logging

    from batchgen.kernels import paged_attention as pa

    monkeypatch.setattr(pa, "_logged", set())
    monkeypatch.setattr(pa, "cpu_flags", lambda: "flags : fpu avx2 avx512f")
    monkeypatch.setattr(pa, "decode_kernel_isa", lambda *a: "generic" if a[1] == 96 else "avx512f")
    with caplog.at_level(logging.INFO, logger="batchgen.kernels.paged_attention"):
        pa._log_once(torch.float32, 96, 4, 16, "auto", torch.float8_e4m3fn)
        pa._log_once(torch.float32, 64, 4, 16, "auto", torch.float8_e4m3fn)
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "paged decode attention, torch.float32, head size 96, 4 query heads per KV head, blocks "
        "of 16, torch.float8_e4m3fn KV cache: generic path (the AVX-512F path for a narrower KV "
        "cache needs head size 64 or 128)",
        "paged decode attention, torch.float32, head size 64, 4 query heads per KV head, blocks "
        "of 16, torch.float8_e4m3fn KV cache: avx512f path",
    ]
    monkeypatch.setattr(pa, "cpu_flags", lambda: "flags : fpu avx2")  # no AVX-512: no reason
    assert pa._why_generic_mixed("generic") == ""
