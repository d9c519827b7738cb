"""bf16 dense projections on oneDNN-prepacked weights (`batchgen.kernels.onednn_linear`,
`batchgen.models.layers.linear`): the values against the float32 product of the same bf16
inputs (one bf16 rounding), the fallbacks to ``F.linear``, repacking after weight writes, and
the engine: a bf16 model's ``nn.Linear`` layers become `PrepackedLinear`, float32 and
batch-invariant models keep theirs, and `update_weights` of dense weights is seen."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from batchgen import LLM, SamplingParams
from batchgen.kernels import onednn_linear as ol
from batchgen.kernels import packed_linear as pk
from batchgen.models.batch_invariant import BatchInvariantLinear
from batchgen.models.layers.linear import PrepackedLinear, enable_prepacked_linear
from batchgen.models.make_model import make_model
from tests.conftest import CHECKPOINTS

HAS_PATH = ol.prepacked_linear_available(
    torch.zeros(1, 2, dtype=torch.bfloat16), torch.zeros(2, 2, dtype=torch.bfloat16)
)
needs_onednn = pytest.mark.skipif(
    not HAS_PATH, reason="no oneDNN in torch or no avx512_bf16 on this CPU: F.linear serves bf16"
)
BF16_EPS = 2.0**-8  # half an ulp of bf16 relative to the value (8 significant bits)


def _bound(x: torch.Tensor, w: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """The largest error of a float32-accumulated, once-rounded bf16 result against the float64
    product of the same bf16 inputs: half a bf16 ulp of the value (``2^-9 |y|`` below the
    power of two, bounded here by ``2^-8 |y|``) plus float32 summation error, ``K u sum|x||w|``
    (Higham, Accuracy and Stability of Numerical Algorithms, 2nd ed., eq. 3.5; u = 2^-24)."""
    k = x.shape[-1]
    absprod = x.double().abs() @ w.double().abs().T
    return BF16_EPS * ref.abs() + k * 2.0**-24 * absprod * (1 + BF16_EPS)


@needs_onednn
@pytest.mark.parametrize("rows", [0, 1, 3, 17, 64, 300])
@pytest.mark.parametrize("n,k,bias", [(768, 512, False), (512, 512, True), (5, 96, True)])
def test_onednn_linear_within_one_bf16_rounding_of_the_exact_product(rows, n, k, bias):
    g = torch.Generator().manual_seed(rows * 1000 + n + k)
    x = torch.randn(rows, k, generator=g).to(torch.bfloat16)
    w = (torch.randn(n, k, generator=g) * 0.05).to(torch.bfloat16)
    b = torch.randn(n, generator=g).to(torch.bfloat16) if bias else None
    y = ol.onednn_linear(x, ol.pack_onednn_weight(w), b)
    assert y.dtype == torch.bfloat16 and y.shape == (rows, n)
    ref = x.double() @ w.double().T + (0 if b is None else b.double())  # [rows, n], exact
    bound = _bound(x, w, ref) + (0 if b is None else 2.0**-24 * b.double().abs())
    assert ((y.double() - ref).abs() <= bound).all()
    # and F.linear in bf16 (the path it replaces) is within the same rounding
    torch.testing.assert_close(y, F.linear(x, w, b), rtol=2 * BF16_EPS, atol=1e-6)


@needs_onednn
def test_onednn_linear_takes_strided_and_batched_inputs():
    w = torch.randn(48, 64).to(torch.bfloat16)
    packed = ol.pack_onednn_weight(w)
    wide = torch.randn(7, 128).to(torch.bfloat16)
    x = wide[:, 32:96]  # not contiguous
    assert torch.equal(ol.onednn_linear(x, packed), ol.onednn_linear(x.contiguous(), packed))
    x3 = torch.randn(2, 5, 64).to(torch.bfloat16)
    y3 = ol.onednn_linear(x3, packed)
    assert y3.shape == (2, 5, 48)
    assert torch.equal(y3.reshape(10, 48), ol.onednn_linear(x3.reshape(10, 64), packed))


@needs_onednn
def test_onednn_linear_rejects_bad_inputs_by_name():
    packed = ol.pack_onednn_weight(torch.zeros(16, 32, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"x must be \[\.\.\., 32\]"):
        ol.onednn_linear(torch.zeros(2, 16, dtype=torch.bfloat16), packed)
    with pytest.raises(ValueError, match="bfloat16"):
        ol.onednn_linear(torch.zeros(2, 32), packed)
    with pytest.raises(ValueError, match="weight must be a 2-D bfloat16 or float32 CPU tensor"):
        ol.pack_onednn_weight(torch.zeros(16, 32, dtype=torch.float64))
    with pytest.raises(ValueError, match="weight must be a 2-D bfloat16 or float32 CPU tensor"):
        ol.pack_onednn_weight(torch.zeros(2, 16, 32, dtype=torch.bfloat16))


def _layer(n=40, k=64, bias=True) -> PrepackedLinear:
    """A converted layer; callers turn the packed_linear kernel off (``BATCHGEN_PACKED_LINEAR``
    0, tests/test_packed_linear.py covers it) so that every call here takes oneDNN."""
    torch.manual_seed(0)
    layer = nn.Linear(k, n, bias=bias).to(torch.bfloat16)
    assert enable_prepacked_linear(layer) == 1
    assert type(layer) is PrepackedLinear
    return layer


def _packed_result(layer, x):
    return ol.onednn_linear(x, ol.pack_onednn_weight(layer.weight), layer.bias)


@needs_onednn
def test_prepacked_linear_packs_once_and_again_after_writes(monkeypatch):
    monkeypatch.setenv(pk.PACKED_LINEAR_ENV, "0")
    layer = _layer()
    x = torch.randn(9, 64).to(torch.bfloat16)
    with torch.inference_mode():
        first = layer._packed
        assert first is not None  # packed by enable_prepacked_linear, before any forward
        y = layer(x)
        assert layer._packed is first
        assert torch.equal(y, _packed_result(layer, x))
        ref = F.linear(x, layer.weight, layer.bias)
        torch.testing.assert_close(y, ref, rtol=2 * BF16_EPS, atol=0)
        x3 = torch.randn(2, 64, 3).to(torch.bfloat16).transpose(1, 2)  # [2, 3, 64], strided
        assert torch.equal(layer(x3), _packed_result(layer, x3.contiguous()))
        with pytest.raises(ValueError, match=r"x must be \[\.\.\., 64\]"):
            layer(torch.zeros(2, 32, dtype=torch.bfloat16))
    with torch.no_grad():  # a write the version counter sees: repacked on the next forward
        layer.weight.mul_(-1)
    with torch.inference_mode():
        assert torch.equal(layer(x), _packed_result(layer, x))
    # a write it does not see (what the loader and update_weights do) needs the invalidation
    layer.weight.data.copy_(torch.randn(40, 64))
    layer.invalidate_packed_weights()
    with torch.inference_mode():
        assert torch.equal(layer(x), _packed_result(layer, x))


@needs_onednn
def test_prepacked_linear_runs_f_linear_for_float32_and_autograd(monkeypatch):
    monkeypatch.setenv(pk.PACKED_LINEAR_ENV, "0")
    layer = _layer()
    x32 = torch.randn(5, 64)
    with pytest.raises(RuntimeError):  # as nn.Linear: a float32 input to bf16 weights fails
        layer(x32)
    layer.float()  # a float32 weight (the packed bf16 copy is not used)
    with torch.inference_mode():
        assert torch.equal(layer(x32), F.linear(x32, layer.weight, layer.bias))
    layer.bfloat16()
    x = torch.randn(5, 64).to(torch.bfloat16).requires_grad_(True)
    y = layer(x)  # F.linear has a backward; the oneDNN op has none
    y.float().sum().backward()
    assert x.grad is not None
    assert torch.equal(y, F.linear(x, layer.weight, layer.bias))


def test_enable_prepacked_linear_converts_only_bf16_plain_linear_layers(monkeypatch):
    monkeypatch.setenv(ol.ONEDNN_LINEAR_F32_ENV, "linear")  # float32: tests below
    model = nn.Sequential(
        nn.Linear(8, 8).bfloat16(), nn.Linear(8, 8), BatchInvariantLinear(8, 8).bfloat16()
    )
    monkeypatch.setenv(ol.ONEDNN_LINEAR_ENV, "0")  # both packed paths off: nothing converted
    monkeypatch.setenv(pk.PACKED_LINEAR_ENV, "0")
    assert enable_prepacked_linear(model) == 0
    assert [type(m) for m in model] == [nn.Linear, nn.Linear, BatchInvariantLinear]
    monkeypatch.delenv(ol.ONEDNN_LINEAR_ENV)
    monkeypatch.delenv(pk.PACKED_LINEAR_ENV)
    assert enable_prepacked_linear(model) == (1 if HAS_PATH else 0)
    first = PrepackedLinear if HAS_PATH else nn.Linear
    assert [type(m) for m in model] == [first, nn.Linear, BatchInvariantLinear]


def test_no_avx512_bf16_means_no_conversion(monkeypatch):
    """Without avx512_bf16 (oneDNN would emulate bf16, unmeasured) the model keeps F.linear."""
    flags = ol.cpu_flags().replace("avx512_bf16", "").replace("amx_bf16", "")
    monkeypatch.setattr(ol, "cpu_flags", lambda: flags)
    monkeypatch.setattr(pk, "packed_linear_supported", lambda: False)  # its own CPU check
    ol._onednn_bf16_fast.cache_clear()
    try:
        model = nn.Sequential(nn.Linear(8, 8).bfloat16())
        assert not ol.prepacked_linear_supported()
        assert enable_prepacked_linear(model) == 0 and type(model[0]) is nn.Linear
    finally:
        ol._onednn_bf16_fast.cache_clear()  # the real answer again for later tests


# ---- the engine ---------------------------------------------------------------------------

PROMPTS = [[1, 9, 10, 11, 12, 13, 14, 15, 16, 17], [1, *range(100, 106)], [1, 300, 301]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def _llm(path, dtype="bfloat16", **kwargs) -> LLM:
    return LLM(str(path), device="cpu", dtype=dtype, kv_cache_memory_gb=0.05, **kwargs)


def _tokens(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def _linears(llm: LLM, cls) -> list[nn.Module]:
    return [m for m in llm.llm_engine.runner.model.modules() if type(m) is cls]


@needs_onednn
def test_bf16_engine_runs_every_dense_projection_prepacked(checkpoint_dir):
    llm = _llm(checkpoint_dir("mixtral"))
    assert not _linears(llm, nn.Linear)
    layers = _linears(llm, PrepackedLinear)
    model = llm.llm_engine.runner.model
    names = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if m in layers}
    assert {"qkv_proj", "o_proj", "gate", "lm_head"} <= names
    assert all(m._packed is not None for m in layers)
    _tokens(llm)


def test_float32_and_batch_invariant_engines_keep_their_linear_layers(
    checkpoint_dir, monkeypatch
):
    monkeypatch.setenv(ol.ONEDNN_LINEAR_F32_ENV, "linear")
    path = checkpoint_dir("mixtral")
    fp32 = _llm(path, dtype="float32")
    assert _linears(fp32, nn.Linear) and not _linears(fp32, PrepackedLinear)
    inv = _llm(path, dtype="float32", batch_invariant=True)
    assert _linears(inv, BatchInvariantLinear) and not _linears(inv, PrepackedLinear)


@pytest.fixture(scope="module")
def dense_paths(checkpoint_dir, tmp_path_factory):
    """Two tiny Llama checkpoints (every weight dense) of one config, different weights."""
    arch, overrides = CHECKPOINTS["llama"]
    b = make_model(arch, tmp_path_factory.mktemp("dense_b") / "llama_b", seed=4321, **overrides)
    return checkpoint_dir("llama"), b


@needs_onednn
def test_update_of_dense_weights_is_seen_by_the_prepacked_layers(dense_paths):
    a, b = dense_paths
    fresh_b = _tokens(_llm(b))
    llm = _llm(a)
    before = _tokens(llm)
    assert before != fresh_b
    layers = _linears(llm, PrepackedLinear)
    old = {id(m): m._packed for m in layers}
    assert llm.update_weights(b) > 0
    assert _tokens(llm) == fresh_b  # token for token as a fresh bf16 engine on B
    assert all(m._packed is not old[id(m)] for m in layers)  # every layer packed again
    for m in layers:  # from the new weight (3 rows: the packed_linear kernel where it runs)
        x = torch.randn(3, m.in_features).to(torch.bfloat16)
        if pk.packed_linear_supported():
            n, k = m.weight.shape
            ref = pk.packed_linear(x, pk.pack_packed_linear_weight(m.weight), n, k, m.bias)
        else:
            ref = ol.onednn_linear(x, ol.pack_onednn_weight(m.weight), m.bias)
        with torch.inference_mode():
            assert torch.equal(m(x), ref)
