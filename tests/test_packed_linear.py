"""The bf16 `packed_linear` kernel (`batchgen.kernels.packed_linear`, csrc/packed_linear.cpp):
values against the float64 product of the same bf16 inputs within one bf16 rounding plus
float32 summation error, on shapes whose N and K are not multiples of the tiles, on both
micro-kernels (AMX, vdpbf16ps); a row's result independent of the other rows and of the
threads; the layer's choice between it and oneDNN (`use_packed_linear`), and the switches."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from batchgen.kernels import onednn_linear as ol
from batchgen.kernels import packed_linear as pk
from batchgen.kernels.cpu_build import kernels_enabled
from batchgen.models.layers import linear as lin

ISA = pk.kernel_isa()
needs_kernel = pytest.mark.skipif(ISA is None, reason="packed_linear needs avx512_bf16")
ISAS = ["avx512_bf16"] + (["amx"] if ISA == "amx" else [])
U32 = 2.0**-24  # float32 unit roundoff
U16 = 2.0**-8  # bf16 unit roundoff (8 significant bits, round to nearest)


def _bound(x, w, b, ref):
    """Largest error of the kernel against ``ref``, the float64 ``x @ w.T + b`` of the same
    bf16 inputs. Products of two bf16 are exact in float32; K of them and the bias summed in
    float32 in any order err by at most ``e = (K + 1) u32 (sum|x||w| + |b|)`` (Higham,
    Accuracy and Stability of Numerical Algorithms, 2nd ed., eq. 3.5, first order; u32 =
    2^-24); one rounding to bf16 adds ``u16 (|ref| + e)`` (u16 = 2^-8). So
    ``|y - ref| <= u16 |ref| + (1 + u16) e``."""
    k = x.shape[-1]
    absprod = x.double().abs() @ w.double().abs().T  # [M, N]
    if b is not None:
        absprod = absprod + b.double().abs()
    e = (k + 1) * U32 * absprod
    return U16 * ref.abs() + (1 + U16) * e


def _case(m, n, k, bias, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    w = (torch.randn(n, k, generator=g) * k**-0.5).to(torch.bfloat16)
    b = torch.randn(n, generator=g).to(torch.bfloat16) if bias else None
    return x, w, b


@needs_kernel
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("m", [1, 15, 16, 17, 1000])
@pytest.mark.parametrize(
    "n,k,bias",
    [(768, 512, False), (512, 512, True), (40, 96, True), (17, 50, False), (5, 33, True)],
)
def test_packed_linear_within_one_bf16_rounding_of_the_exact_product(isa, m, n, k, bias):
    x, w, b = _case(m, n, k, bias, seed=m * 7 + n * 3 + k)
    y = pk.packed_linear(x, pk.pack_packed_linear_weight(w), n, k, b, isa=isa)
    assert y.dtype == torch.bfloat16 and y.shape == (m, n)
    ref = x.double() @ w.double().T + (0 if b is None else b.double())  # [m, n], exact
    err = (y.double() - ref).abs()
    bound = _bound(x, w, b, ref)
    assert (err <= bound).all(), f"worst excess {(err - bound).max()}"
    # the bound is not vacuous: most outputs are rounded, none is off by more than an ulp
    assert (err <= 2 * U16 * ref.abs() + 1e-30).float().mean() > 0.99


@needs_kernel
@pytest.mark.parametrize("isa", ISAS)
def test_a_row_does_not_depend_on_the_other_rows_or_the_threads(isa):
    x, w, b = _case(1000, 200, 160, True, seed=3)
    packed = pk.pack_packed_linear_weight(w)
    full = pk.packed_linear(x, packed, 200, 160, b, isa=isa)
    for rows in (slice(0, 1), slice(3, 20), slice(500, 1000), slice(999, 1000)):
        assert torch.equal(pk.packed_linear(x[rows], packed, 200, 160, b, isa=isa), full[rows])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(pk.packed_linear(x, packed, 200, 160, b, isa=isa), full)
    finally:
        torch.set_num_threads(threads)


@needs_kernel
def test_packed_linear_takes_strided_and_batched_inputs():
    x, w, _ = _case(7, 48, 64, False, seed=5)
    packed = pk.pack_packed_linear_weight(w)
    wide = torch.randn(7, 130).to(torch.bfloat16)
    strided = wide[:, 33:97]  # row stride 130, odd offset
    ref = pk.packed_linear(strided.contiguous(), packed, 48, 64)
    assert torch.equal(pk.packed_linear(strided, packed, 48, 64), ref)
    cols = torch.randn(64, 7).to(torch.bfloat16).T  # column-major: copied first
    ref_cols = pk.packed_linear(cols.contiguous(), packed, 48, 64)
    assert torch.equal(pk.packed_linear(cols, packed, 48, 64), ref_cols)
    x3 = x.reshape(1, 7, 64).expand(2, 7, 64)
    y3 = pk.packed_linear(x3, packed, 48, 64)
    assert y3.shape == (2, 7, 48)
    assert torch.equal(y3[1], pk.packed_linear(x, packed, 48, 64))
    assert pk.packed_linear(x[:0], packed, 48, 64).shape == (0, 48)


@needs_kernel
def test_packed_linear_rejects_bad_inputs_by_name():
    w = torch.zeros(16, 32, dtype=torch.bfloat16)
    packed = pk.pack_packed_linear_weight(w)
    with pytest.raises(ValueError, match=r"x must be \[\.\.\., 32\]"):
        pk.packed_linear(torch.zeros(2, 16, dtype=torch.bfloat16), packed, 16, 32)
    with pytest.raises(ValueError, match="bfloat16"):
        pk.packed_linear(torch.zeros(2, 32), packed, 16, 32)
    with pytest.raises(ValueError, match="not the packing of"):
        pk.packed_linear(torch.zeros(2, 32, dtype=torch.bfloat16), packed, 40, 32)
    with pytest.raises(ValueError, match=r"bias must be \[16\]"):
        pk.packed_linear(torch.zeros(2, 32, dtype=torch.bfloat16), packed, 16, 32, w[0, :8])
    with pytest.raises(ValueError, match="isa must be one of"):
        pk.packed_linear(torch.zeros(2, 32, dtype=torch.bfloat16), packed, 16, 32, isa="sse")
    with pytest.raises(ValueError, match="weight must be a 2-D bfloat16 CPU tensor"):
        pk.pack_packed_linear_weight(torch.zeros(16, 32))


def test_packing_interleaves_pairs_of_k_and_pads():
    w = torch.arange(20 * 6, dtype=torch.float32).reshape(20, 6).to(torch.bfloat16)
    p = pk.pack_packed_linear_weight(w)
    assert p.shape == (2, 16, 16, 2)  # N 20 -> 2 panels, K 6 -> 32: 16 pairs
    for n, k in ((0, 0), (3, 5), (17, 4), (19, 1)):
        assert p[n // 16, k // 2, n % 16, k % 2] == w[n, k]
    assert (p[1, :, 4:] == 0).all() and (p[:, 3:] == 0).all()  # padded columns and k


def test_cpu_kernels_switch_lists_packed_linear(monkeypatch):
    monkeypatch.setenv("BATCHGEN_CPU_KERNELS", "packed_linear")
    assert kernels_enabled("packed_linear") and not kernels_enabled("fused_moe")
    monkeypatch.setenv("BATCHGEN_CPU_KERNELS", "fused_moe")
    assert not pk.packed_linear_supported()
    monkeypatch.setenv("BATCHGEN_CPU_KERNELS", "1")
    monkeypatch.setenv(pk.PACKED_LINEAR_ENV, "off")
    assert not pk.packed_linear_supported()


# ---- the layer's choice -------------------------------------------------------------------


def test_use_packed_linear_follows_the_measured_limits():
    # weights up to 1 MiB of bf16 (the bench model's qkv, o, router, LM head): any rows on AMX
    assert lin.use_packed_linear(70, 768, 512, 1)  # a decode step's qkv, one thread
    assert lin.use_packed_linear(2048, 768, 512, 1)  # a prefill chunk's qkv
    assert lin.use_packed_linear(4096, 512, 512, 2)
    assert lin.use_packed_linear(1, 1024, 512, 1) and not lin.use_packed_linear(512, 1025, 512, 1)
    # larger weights (hidden 2048): the multiply-add limits
    assert lin.use_packed_linear(8, 3072, 2048, 1)  # 50 M multiply-adds, below 2^26
    assert not lin.use_packed_linear(16, 3072, 2048, 1)  # 101 M
    assert lin.use_packed_linear(8, 2048, 2048, 2) and not lin.use_packed_linear(64, 2048, 2048, 2)
    assert lin.packed_linear_max_macs(4) == lin.PACKED_LINEAR_MAX_MACS



@pytest.mark.parametrize("amx_cpu", [True, False], ids=["amx_cpu", "no_amx_cpu"])
def test_use_packed_linear_without_amx_follows_the_cpu_kind(amx_cpu, monkeypatch):
    # without AMX (vdpbf16ps) only small calls, whatever the weight: on a CPU that has AMX-BF16
    # (tiles not granted) up to 2^21 multiply-adds, on one without (AMD Zen 4) up to 2^25
    monkeypatch.setattr(lin, "cpu_has_amx_bf16", lambda: amx_cpu)
    assert lin.use_packed_linear(16, 64, 512, 2, amx=False)
    assert lin.use_packed_linear(4, 768, 512, 1, amx=False)  # 1.6 M
    assert lin.use_packed_linear(70, 768, 512, 2, amx=False) is not amx_cpu  # 27.5 M
    assert lin.use_packed_linear(70, 64, 512, 2, amx=False) is not amx_cpu  # 2.3 M
    assert lin.use_packed_linear(1024, 64, 512, 1, amx=False) is not amx_cpu  # 2^25
    assert not lin.use_packed_linear(1025, 64, 512, 1, amx=False)
    assert not lin.use_packed_linear(256, 768, 512, 2, amx=False)  # 100 M
    limit = lin.PACKED_LINEAR_MAX_MACS_VNNI if amx_cpu else lin.PACKED_LINEAR_MAX_MACS_NO_AMX_CPU
    assert lin.packed_linear_max_macs(1, amx=False) == lin.packed_linear_max_macs(4, False) == limit
    # with AMX the CPU kind is not read
    assert lin.use_packed_linear(4096, 512, 512, 2) and lin.use_packed_linear(8, 3072, 2048, 1)


def test_onednn_bucket_rows_bounds_the_padding_and_the_row_counts():
    assert [lin.onednn_bucket_rows(m) for m in (1, 15, 16, 17, 300, 1024, 1025, 1899, 2048)] == [
        1, 15, 16, 18, 320, 1024, 1152, 1920, 2048
    ]  # fmt: skip
    buckets = {lin.onednn_bucket_rows(m) for m in range(1, 8193)}
    for m in range(1, 8193):
        mp = lin.onednn_bucket_rows(m)
        assert m <= mp <= m + m // 8 and mp in buckets and lin.onednn_bucket_rows(mp) == mp
    assert len(buckets) == 16 + 8 * 9  # exact to 16, then 8 sizes per power of two to 8,192


@pytest.mark.skipif(not ol.prepacked_linear_supported(), reason="no oneDNN bf16 path here")
@pytest.mark.parametrize("m", [1, 17, 300, 1899])
def test_onednn_rows_bucketed_give_the_unpadded_call_bit_for_bit(monkeypatch, m):
    monkeypatch.setattr(lin, "PACKED_LINEAR_ANY_ROWS_MAX_WEIGHT", 0)
    monkeypatch.setattr(lin, "PACKED_LINEAR_MAX_MACS", 0)
    monkeypatch.setattr(lin, "PACKED_LINEAR_MAX_MACS_ONE_THREAD", 0)
    layer = _layer(n=72, k=96)
    w, b = layer.weight, layer.bias
    x = torch.randn(m, 2 * 96).to(torch.bfloat16)[:, ::2]  # strided rows
    ref = ol.onednn_linear(x.contiguous(), ol.pack_onednn_weight(w), b)  # [m, 72], m rows
    with torch.inference_mode():
        y = layer(x)
        assert y.shape == (m, 72) and torch.equal(y, ref)
        if m % 3 == 0:
            assert torch.equal(layer(x.reshape(3, m // 3, 96)), ref.view(3, m // 3, 72))


@pytest.mark.skipif(not ol.prepacked_linear_supported(), reason="no oneDNN bf16 path here")
@pytest.mark.parametrize("m,k", [(511, 2048), (257, 2048), (1899, 1024)])
def test_onednn_rows_bucketed_are_the_bucket_sized_call_and_within_the_bound(monkeypatch, m, k):
    """What the bucketing guarantees at any K: the first M rows of oneDNN's call at
    `onednn_bucket_rows` (M) rows (the zero padding changes nothing), and within one bf16
    rounding plus float32 summation error (`_bound`) of the exact product."""
    monkeypatch.setattr(lin, "PACKED_LINEAR_ANY_ROWS_MAX_WEIGHT", 0)
    monkeypatch.setattr(lin, "PACKED_LINEAR_MAX_MACS", 0)
    monkeypatch.setattr(lin, "PACKED_LINEAR_MAX_MACS_ONE_THREAD", 0)
    layer = _layer(n=64, k=k)
    w, b = layer.weight, layer.bias
    x = torch.randn(m, k).to(torch.bfloat16)
    mp = lin.onednn_bucket_rows(m)
    x_padded = torch.cat([x, x.new_zeros(mp - m, k)])
    ref = ol.onednn_linear(x_padded, ol.pack_onednn_weight(w), b)[:m]
    exact = x.double() @ w.double().T + b.double()
    with torch.inference_mode():
        y = layer(x)
    assert torch.equal(y, ref)
    assert ((y.double() - exact).abs() <= _bound(x, w, b, exact)).all()


@pytest.mark.skipif(not ol.prepacked_linear_supported(), reason="no oneDNN bf16 path here")
@pytest.mark.xfail(
    reason="oneDNN picks its K blocking by the row count: at K = 2,048 the call at 512 rows "
    "(511's bucket) differs from the call at 511 rows in ~1e-4 of the elements by one bf16 "
    "ulp, one thread or two (torch 2.x's oneDNN, AMX CPU); bit-identity with the unpadded call "
    "holds only where the blocking does not change (small K, the test above)",
    strict=False,
)
def test_onednn_rows_bucketed_give_the_unpadded_call_bit_for_bit_at_large_k(monkeypatch):
    monkeypatch.setattr(lin, "PACKED_LINEAR_ANY_ROWS_MAX_WEIGHT", 0)
    monkeypatch.setattr(lin, "PACKED_LINEAR_MAX_MACS", 0)
    monkeypatch.setattr(lin, "PACKED_LINEAR_MAX_MACS_ONE_THREAD", 0)
    torch.manual_seed(0)
    layer = nn.Linear(2048, 512, bias=False).to(torch.bfloat16)
    assert lin.enable_prepacked_linear(layer) == 1
    x = torch.randn(511, 2048).to(torch.bfloat16)
    ref = ol.onednn_linear(x, ol.pack_onednn_weight(layer.weight), None)  # [511, 512]
    with torch.inference_mode():
        assert torch.equal(layer(x), ref)


def _layer(n=40, k=64, bias=True) -> lin.PrepackedLinear:
    torch.manual_seed(0)
    layer = nn.Linear(k, n, bias=bias).to(torch.bfloat16)
    assert lin.enable_prepacked_linear(layer) == 1
    return layer


@needs_kernel
def test_layer_runs_the_kernel_below_the_limit_and_onednn_above(monkeypatch):
    has_onednn = ol.prepacked_linear_supported()
    layer = _layer()
    w, b = layer.weight, layer.bias
    small, big = torch.randn(9, 64).to(torch.bfloat16), torch.randn(300, 64).to(torch.bfloat16)
    monkeypatch.setattr(lin, "PACKED_LINEAR_MAX_MACS", 100 * 40 * 64)
    monkeypatch.setattr(lin, "PACKED_LINEAR_MAX_MACS_ONE_THREAD", 100 * 40 * 64)
    monkeypatch.setattr(lin, "PACKED_LINEAR_ANY_ROWS_MAX_WEIGHT", 0)
    kernel = pk.packed_linear(small, pk.pack_packed_linear_weight(w), 40, 64, b)
    with torch.inference_mode():
        assert torch.equal(layer(small), kernel)
        assert torch.equal(layer(small.reshape(3, 3, 64)), kernel.reshape(3, 3, 40))
        y = layer(big)
    if has_onednn:  # above the limit: oneDNN's result
        assert torch.equal(y, ol.onednn_linear(big, ol.pack_onednn_weight(w), b))
    else:  # no oneDNN path: the kernel serves every call
        assert torch.equal(y, pk.packed_linear(big, pk.pack_packed_linear_weight(w), 40, 64, b))
    # a write the version counter sees repacks both copies
    with torch.no_grad():
        layer.weight.mul_(-1)
    with torch.inference_mode():
        again = pk.packed_linear(small, pk.pack_packed_linear_weight(w), 40, 64, b)
        assert not torch.equal(again, kernel)
        assert torch.equal(layer(small), again)


@needs_kernel
def test_packed_linear_switch_off_keeps_the_onednn_path(monkeypatch):
    monkeypatch.setenv(pk.PACKED_LINEAR_ENV, "0")
    layer = _layer()
    if not ol.prepacked_linear_supported():
        pytest.skip("no oneDNN bf16 path here")
    assert layer._packed[2] is None and layer._packed[1] is not None
    x = torch.randn(3, 64).to(torch.bfloat16)
    with torch.inference_mode():
        ref = ol.onednn_linear(x, ol.pack_onednn_weight(layer.weight), layer.bias)
        assert torch.equal(layer(x), ref)


@needs_kernel
def test_without_onednn_the_kernel_serves_every_call(monkeypatch):
    monkeypatch.setenv(ol.ONEDNN_LINEAR_ENV, "0")
    layer = _layer()
    assert layer._packed[1] is None and layer._packed[2] is not None
    x = torch.randn(3000, 64).to(torch.bfloat16)  # far above the limits
    ref = pk.packed_linear(x, pk.pack_packed_linear_weight(layer.weight), 40, 64, layer.bias)
    with torch.inference_mode():
        assert torch.equal(layer(x), ref)


def test_a_float32_bias_keeps_the_plain_layer():
    layer = nn.Linear(64, 40).to(torch.bfloat16)
    layer.bias = nn.Parameter(layer.bias.float())
    assert lin.enable_prepacked_linear(nn.Sequential(layer)) == 0
    assert type(layer) is nn.Linear


@needs_kernel
@pytest.mark.parametrize("amx_cpu", [True, False], ids=["amx_cpu", "no_amx_cpu"])
def test_amx_switch_off_runs_vdpbf16ps_under_its_own_limit(amx_cpu, monkeypatch):
    # the limit by the CPU kind (`cpu_has_amx_bf16`): 2^21 multiply-adds where the CPU has
    # AMX-BF16 (the switch off, or no tile state), 2^25 where it has none
    monkeypatch.setattr(lin, "cpu_has_amx_bf16", lambda: amx_cpu)
    monkeypatch.setenv("BATCHGEN_CPU_AMX", "0")
    assert pk.kernel_isa() == "avx512_bf16"
    layer = _layer()
    assert layer._packed[4] is False
    w, b = layer.weight, layer.bias
    x = torch.randn(9, 64).to(torch.bfloat16)  # 9 x 40 x 64 multiply-adds: below 2^21
    ref = pk.packed_linear(x, pk.pack_packed_linear_weight(w), 40, 64, b, isa="avx512_bf16")
    seen = []
    run = pk.run_packed_linear
    monkeypatch.setattr(pk, "run_packed_linear", lambda *a: seen.append(a[-1]) or run(*a))
    with torch.inference_mode():
        assert torch.equal(layer(x), ref)
        assert seen == [pk.ISAS["avx512_bf16"]]
        layer(torch.randn(200, 64).to(torch.bfloat16))  # 512,000 multiply-adds: still below
        assert len(seen) == 2
        limit = lin.packed_linear_max_macs(2, amx=False)
        assert limit == (2**21 if amx_cpu else 2**25)
        layer(torch.randn(limit // (40 * 64), 64).to(torch.bfloat16))  # at the limit: the kernel
        assert len(seen) == 3
        if ol.prepacked_linear_supported():  # one row more: above the limit, oneDNN
            layer(torch.randn(limit // (40 * 64) + 1, 64).to(torch.bfloat16))
            assert len(seen) == 3


@needs_kernel
def test_layer_without_bias_runs_the_kernel():
    layer = _layer(bias=False)
    x = torch.randn(5, 64).to(torch.bfloat16)
    ref = pk.packed_linear(x, pk.pack_packed_linear_weight(layer.weight), 40, 64)
    with torch.inference_mode():
        assert torch.equal(layer(x), ref)
