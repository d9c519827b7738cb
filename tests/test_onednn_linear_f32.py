"""float32 dense projections on oneDNN-prepacked weights (`batchgen.kernels.onednn_linear`
`onednn_f32_mode`, `batchgen.models.layers.linear.use_onednn_f32`): the switch and its
``auto`` (oneDNN on a CPU with avx512f that is not Intel's), the values against the exact
product (float32 summation error only), the engine's layers and greedy tokens against
``F.linear``'s, and `update_weights` repacking the float32 copies. The thresholds are set to -1
here so that every call takes oneDNN (the tiny test models' calls are below them)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from batchgen import LLM, SamplingParams
from batchgen.kernels import onednn_linear as ol
from batchgen.models.batch_invariant import BatchInvariantLinear
from batchgen.models.layers import linear as lin
from batchgen.models.layers.linear import PrepackedLinear, enable_prepacked_linear
from batchgen.models.make_model import make_model
from tests.conftest import CHECKPOINTS

HAS_OPS = torch.backends.mkldnn.is_available() and hasattr(
    torch.ops.mkldnn, "_reorder_linear_weight"
)
needs_ops = pytest.mark.skipif(not HAS_OPS, reason="no oneDNN prepacked linear ops in torch")


@pytest.fixture
def every_call_onednn(monkeypatch):
    """``BATCHGEN_ONEDNN_LINEAR_F32=onednn`` and no row threshold: every float32 call of a
    converted layer runs oneDNN (counted in the returned list)."""
    monkeypatch.setenv(ol.ONEDNN_LINEAR_F32_ENV, "onednn")
    monkeypatch.setattr(lin, "ONEDNN_F32_MIN_MACS", -1)
    monkeypatch.setattr(lin, "ONEDNN_F32_NARROW_MIN_MACS", -1)
    calls = []
    real = lin._onednn_bucketed

    def counted(*args, **kwargs):
        calls.append(args[0].shape)
        return real(*args, **kwargs)

    monkeypatch.setattr(lin, "_onednn_bucketed", counted)
    return calls


def test_f32_mode_auto_follows_the_cpu_vendor_and_rejects_bad_values(monkeypatch):
    monkeypatch.setattr(ol, "cpu_flags", lambda: "flags : fpu avx2 avx512f avx512bw")
    for vendor, auto in [("AuthenticAMD", "onednn"), ("GenuineIntel", "linear"), ("", "linear")]:
        monkeypatch.setattr(ol, "cpu_vendor", lambda v=vendor: v)
        monkeypatch.delenv(ol.ONEDNN_LINEAR_F32_ENV, raising=False)
        assert ol.onednn_f32_mode() == (auto if HAS_OPS else "linear")
        monkeypatch.setenv(ol.ONEDNN_LINEAR_F32_ENV, " OneDNN ")
        assert ol.onednn_f32_mode() == ("onednn" if HAS_OPS else "linear")
        monkeypatch.setenv(ol.ONEDNN_LINEAR_F32_ENV, "linear")
        assert ol.onednn_f32_mode() == "linear"
    monkeypatch.setattr(ol, "cpu_flags", lambda: "flags : fpu avx2")  # no avx512f: unmeasured
    monkeypatch.setattr(ol, "cpu_vendor", lambda: "AuthenticAMD")
    monkeypatch.delenv(ol.ONEDNN_LINEAR_F32_ENV)
    assert ol.onednn_f32_mode() == "linear"
    monkeypatch.setenv(ol.ONEDNN_LINEAR_F32_ENV, "mkl")
    with pytest.raises(ValueError, match="BATCHGEN_ONEDNN_LINEAR_F32"):
        ol.onednn_f32_mode()


def test_use_onednn_f32_thresholds():
    assert not lin.use_onednn_f32(1, 768, 512)
    assert lin.use_onednn_f32(2048, 768, 512) and lin.use_onednn_f32(70, 768, 512)
    assert not lin.use_onednn_f32(32, 512, 512) and lin.use_onednn_f32(33, 512, 512)
    assert not lin.use_onednn_f32(1024, 64, 512) and lin.use_onednn_f32(1025, 64, 512)


@needs_ops
@pytest.mark.parametrize("rows", [0, 1, 3, 17, 70, 300])
@pytest.mark.parametrize("n,k,bias", [(768, 512, False), (64, 512, True), (5, 96, True)])
def test_f32_layer_within_float32_summation_error_of_the_exact_product(
    every_call_onednn, rows, n, k, bias
):
    g = torch.Generator().manual_seed(rows * 1000 + n + k)
    layer = nn.Linear(k, n, bias=bias)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(n, k, generator=g) * k**-0.5)
    assert enable_prepacked_linear(layer) == 1 and type(layer) is PrepackedLinear
    x = torch.randn(rows, k, generator=g)
    with torch.inference_mode():
        y = layer(x)
    assert y.dtype == torch.float32 and y.shape == (rows, n)
    assert len(every_call_onednn) == 1
    w, b = layer.weight.detach().double(), layer.bias
    ref = x.double() @ w.T + (0 if b is None else b.detach().double())  # [rows, n], exact
    # float32 summation of K products and the bias (Higham, 2nd ed., eq. 3.5; u = 2^-24)
    absprod = x.double().abs() @ w.abs().T + (0 if b is None else b.detach().double().abs())
    assert ((y.double() - ref).abs() <= (k + 1) * 2.0**-24 * absprod * 1.01).all()


@needs_ops
def test_f32_layer_repacks_after_writes_and_keeps_f_linear_for_autograd(every_call_onednn):
    layer = nn.Linear(64, 40)
    assert enable_prepacked_linear(layer) == 1
    x = torch.randn(9, 64)

    def packed_result():
        return torch.ops.mkldnn._linear_pointwise(
            x, ol.pack_onednn_weight(layer.weight.detach()), layer.bias, "none", [], ""
        )

    with torch.inference_mode():
        assert torch.equal(layer(x), packed_result())
    layer.weight.data.copy_(torch.randn(40, 64))  # unseen by the version counter
    layer.invalidate_packed_weights()
    with torch.inference_mode():
        assert torch.equal(layer(x), packed_result())
    n_calls = len(every_call_onednn)
    xg = x.clone().requires_grad_(True)
    layer(xg).sum().backward()  # F.linear: the oneDNN op has no backward
    assert xg.grad is not None and len(every_call_onednn) == n_calls


def test_f32_conversion_follows_the_switch(monkeypatch):
    monkeypatch.setenv(ol.ONEDNN_LINEAR_F32_ENV, "linear")
    model = nn.Sequential(nn.Linear(8, 8), BatchInvariantLinear(8, 8), nn.Linear(8, 8).double())
    assert enable_prepacked_linear(model) == 0
    monkeypatch.setenv(ol.ONEDNN_LINEAR_F32_ENV, "onednn")
    assert enable_prepacked_linear(model) == (1 if HAS_OPS else 0)
    first = PrepackedLinear if HAS_OPS else nn.Linear
    assert [type(m) for m in model] == [first, BatchInvariantLinear, nn.Linear]


def test_a_float32_model_probes_and_logs_no_bf16_path(monkeypatch, caplog):
    """Before: a float32 run logged "bf16 dense linear layers: oneDNN prepacked weights" and
    "...: packed_linear kernel (vdpbf16ps)" (and built that kernel): the bf16 probes ran
    whatever the model's dtype."""
    import logging

    from batchgen.kernels import packed_linear as pk

    probed = []
    monkeypatch.setattr(lin, "prepacked_linear_supported", lambda: probed.append("onednn"))
    monkeypatch.setattr(pk, "packed_linear_supported", lambda: probed.append("packed"))
    monkeypatch.setattr(pk, "kernel_isa", lambda: probed.append("isa"))
    monkeypatch.setenv(ol.ONEDNN_LINEAR_F32_ENV, "onednn")
    lin._log_f32_path.cache_clear()
    with caplog.at_level(logging.INFO, logger="batchgen"):
        assert enable_prepacked_linear(nn.Sequential(nn.Linear(8, 8))) == (1 if HAS_OPS else 0)
    assert probed == []
    logged = [r.getMessage() for r in caplog.records if "dense linear" in r.getMessage()]
    f32 = "float32 dense linear layers: oneDNN prepacked weights ("
    f32 += "BATCHGEN_ONEDNN_LINEAR_F32=onednn)"
    assert logged == ([f32] if HAS_OPS else [])
    # A bfloat16 layer is what makes the bf16 paths worth probing.
    assert enable_prepacked_linear(nn.Sequential(nn.Linear(8, 8).bfloat16())) == 0
    assert probed == ["onednn", "packed"]


# ---- the engine ---------------------------------------------------------------------------

PROMPTS = [[1, 9, 10, 11, 12, 13, 14, 15, 16, 17], [1, *range(100, 106)], [1, 300, 301]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def _llm(path, **kwargs) -> LLM:
    return LLM(str(path), device="cpu", dtype="float32", kv_cache_memory_gb=0.05, **kwargs)


def _tokens(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def _linears(llm: LLM, cls) -> list[nn.Module]:
    return [m for m in llm.llm_engine.runner.model.modules() if type(m) is cls]


@needs_ops
def test_f32_engine_on_onednn_gives_f_linears_greedy_tokens(
    checkpoint_dir, monkeypatch, every_call_onednn
):
    path = checkpoint_dir("mixtral")
    llm = _llm(path)
    layers = _linears(llm, PrepackedLinear)
    model = llm.llm_engine.runner.model
    names = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if m in layers}
    assert {"qkv_proj", "o_proj", "gate", "lm_head"} <= names
    assert not _linears(llm, nn.Linear)
    tokens = _tokens(llm)
    assert every_call_onednn
    monkeypatch.setenv(ol.ONEDNN_LINEAR_F32_ENV, "linear")
    plain = _llm(path)
    assert not _linears(plain, PrepackedLinear)
    assert tokens == _tokens(plain)
    inv = _llm(path, batch_invariant=True)  # the batch-invariant mode is never converted
    assert not _linears(inv, PrepackedLinear)


@needs_ops
def test_f32_update_of_dense_weights_repacks(checkpoint_dir, tmp_path, every_call_onednn):
    arch, overrides = CHECKPOINTS["llama"]
    b = make_model(arch, tmp_path / "llama_b", seed=4321, **overrides)
    fresh_b = _tokens(_llm(b))
    llm = _llm(checkpoint_dir("llama"))
    assert _tokens(llm) != fresh_b
    layers = _linears(llm, PrepackedLinear)
    assert layers
    old = {id(m): m._packed for m in layers}
    assert llm.update_weights(b) > 0
    assert _tokens(llm) == fresh_b
    assert all(m._packed is not old[id(m)] for m in layers)
    for m in layers:  # from the new weight
        x = torch.randn(3, m.in_features)
        packed = ol.pack_onednn_weight(m.weight.detach())
        ref = torch.ops.mkldnn._linear_pointwise(x, packed, m.bias, "none", [], "")
        with torch.inference_mode():
            assert torch.equal(m(x), ref)
