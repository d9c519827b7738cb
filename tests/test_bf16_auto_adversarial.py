"""Adversarial checks of the bf16 choices for CPUs with avx512_bf16 and no AMX (AMD Zen 4):
``dtype="auto"`` picks bfloat16 for a bfloat16 checkpoint where the fused MoE kernel runs bf16
natively (`batchgen.models.loader.resolve_dtype`), and the vdpbf16ps `packed_linear` kernel
serves dense calls up to `PACKED_LINEAR_MAX_MACS_NO_AMX_CPU` multiply-adds on such CPUs
(`batchgen.models.layers.linear`).

Covered: the kernel switch read at resolve time (not only when the library was first loaded);
`PrepackedLinear` on odd N / K, 0 to 3,000 rows (both sides of the limit), strided, transposed,
misaligned and broadcast inputs, with and without bias, against the float64 product; a bf16
checkpoint with auto end to end (greedy tokens vs `transformers` in bf16 with the oracle
tests' criterion, tied lm_head, `update_weights` after the first forward); float16
checkpoints, ``BATCHGEN_CPU_KERNELS=0`` and the batch-invariant mode staying float32."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from batchgen.kernels import packed_linear as pk
from batchgen.models.layers import linear as lin

PROMPTS = [[1, 5, 9, 33, 200, 7], list(range(3, 60)), [4] * 3]


def test_auto_follows_the_kernel_switch_after_the_library_is_loaded(monkeypatch):
    """``BATCHGEN_CPU_KERNELS`` without ``fused_moe``, set after the MoE library was loaded in
    this process, makes the experts take the torch GEMMs: auto must then be float32, as in a
    fresh process (the probe `kernel_isa` cached the library and ignored the switch)."""
    from batchgen.kernels import fused_moe
    from batchgen.models.loader import cpu_has_fast_bf16, resolve_dtype

    cpu, bf16 = torch.device("cpu"), SimpleNamespace(torch_dtype="bfloat16")
    fused_moe._library()  # loaded, as after any earlier engine in the process
    for value in ("0", "packed_linear,rms_norm"):
        monkeypatch.setenv("BATCHGEN_CPU_KERNELS", value)
        assert fused_moe.kernel_isa(torch.bfloat16) is None, value
        assert fused_moe.kernel_isa(torch.float32) is None, value
        assert not cpu_has_fast_bf16(), value
        assert resolve_dtype("auto", cpu, bf16) == torch.float32, value


def _within_bound(y, x, w, b):
    """True where ``y`` is within one bf16 rounding plus float32 summation error of the float64
    ``x @ w.T + b`` (the bound of tests/test_packed_linear.py, doubled for slack)."""
    ref = x.double() @ w.double().T + (0 if b is None else b.double())
    absprod = x.double().abs() @ w.double().abs().T + (0 if b is None else b.double().abs())
    bound = 2**-7 * ref.abs() + (x.shape[-1] + 1) * 2**-23 * absprod + 1e-30
    return y.shape == ref.shape and bool(((y.double() - ref).abs() <= bound).all())


def _inputs(m, k, g):
    """The same ``[m, k]`` bf16 values as contiguous, column-sliced, transposed, every other
    row, misaligned by one element (odd data pointer), and one broadcast row."""
    base = torch.randn(m, k, generator=g).to(torch.bfloat16)
    wide = torch.zeros(m, k + 5, dtype=torch.bfloat16)
    wide[:, 3 : 3 + k] = base
    every_other = torch.zeros(2 * m, k, dtype=torch.bfloat16)
    every_other[::2] = base
    flat = torch.zeros(m * k + 1, dtype=torch.bfloat16)
    flat[1:] = base.reshape(-1)
    yield "contiguous", base
    yield "sliced", wide[:, 3 : 3 + k]
    yield "transposed", base.T.contiguous().T
    yield "row_stride", every_other[::2]
    yield "misaligned", flat[1:].view(m, k)
    if m:
        yield "broadcast", base[:1].expand(m, k)


@pytest.mark.skipif(pk.kernel_isa() is None, reason="packed_linear needs avx512_bf16")
@pytest.mark.parametrize("n,k,bias", [(17, 50, True), (5, 33, False), (1, 1, True), (31, 63, True),
                                      (64, 512, True), (1000, 31, False)])
def test_prepacked_linear_on_vdpbf16ps_without_an_amx_cpu_on_nasty_inputs(n, k, bias, monkeypatch):
    """vdpbf16ps with the no-AMX-CPU limit (forced on any CPU: ``BATCHGEN_CPU_AMX=0`` and
    `cpu_has_amx_bf16` False), rows on both sides of the limit: every input layout gives the
    exact product within one bf16 rounding, and the same values whatever the layout."""
    monkeypatch.setenv("BATCHGEN_CPU_AMX", "0")
    monkeypatch.setattr(lin, "cpu_has_amx_bf16", lambda: False)
    g = torch.Generator().manual_seed(n * 131 + k)
    layer = nn.Linear(k, n, bias=bias).to(torch.bfloat16)
    assert lin.enable_prepacked_linear(layer) == 1
    limit_rows = lin.PACKED_LINEAR_MAX_MACS_NO_AMX_CPU // (n * k)
    for m in sorted({0, 1, 2, 17, 70, 1025, min(limit_rows, 3000), min(limit_rows + 1, 3000)}):
        first = None
        for name, x in _inputs(m, k, g):
            with torch.no_grad():
                y = layer(x)
            assert _within_bound(y, x, layer.weight, layer.bias), (n, k, m, name)
            if name != "broadcast":
                first = y if first is None else first
                assert torch.equal(y, first), (n, k, m, name)
        with torch.no_grad():  # leading dimensions
            y3 = layer(torch.randn(2, m, k, generator=g).to(torch.bfloat16))
        assert y3.shape == (2, m, n)


def _bf16_checkpoint(path, name, seed):
    """The tiny checkpoint ``name`` of tests/conftest.py, saved again in bfloat16."""
    import transformers as tf

    from batchgen.models.make_model import make_model
    from tests.conftest import CHECKPOINTS

    arch, overrides = CHECKPOINTS[name]
    out = make_model(arch, path, seed=seed, **overrides)
    tf.AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16).save_pretrained(out)
    return out


def _tokens(llm):
    from batchgen import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    return llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sp, use_tqdm=False)


@pytest.mark.parametrize("name", ["mixtral", "llama_linear_tied", "llama_mqa_bias_llama3"])
def test_bf16_checkpoint_with_auto_end_to_end(name, tmp_path):
    """A bf16 checkpoint with ``dtype="auto"``: bf16 where `cpu_has_fast_bf16` (float32
    elsewhere), greedy tokens within the oracle tests' bf16 criterion of `transformers` in
    bf16; `update_weights` after the first forward gives a fresh engine's tokens."""
    import transformers as tf

    from batchgen import LLM
    from batchgen.models.loader import cpu_has_fast_bf16
    from tests.test_paged_attention_bf16 import assert_greedy_agrees_with_reference

    path = _bf16_checkpoint(tmp_path / "a", name, seed=1234)
    llm = LLM(str(path), dtype="auto", kv_cache_memory_gb=0.05)
    model = llm.llm_engine.runner.model
    want = torch.bfloat16 if cpu_has_fast_bf16() else torch.float32
    assert {p.dtype for p in model.parameters()} == {want}
    outs = _tokens(llm)
    if want == torch.bfloat16:
        ref = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
        assert_greedy_agrees_with_reference(name, PROMPTS, outs, ref)
    other = _bf16_checkpoint(tmp_path / "b", name, seed=99)
    llm.update_weights(str(other))
    got = [o.outputs[0].token_ids for o in _tokens(llm)]
    fresh = LLM(str(other), dtype="auto", kv_cache_memory_gb=0.05)
    assert got == [o.outputs[0].token_ids for o in _tokens(fresh)]
    assert got != [o.outputs[0].token_ids for o in outs]  # the update did change something


@pytest.mark.parametrize("case", ["float16_checkpoint", "kernels_off", "batch_invariant"])
def test_auto_stays_float32_where_bf16_is_not_chosen(case, tmp_path, monkeypatch):
    """auto is float32 for a float16 checkpoint, with ``BATCHGEN_CPU_KERNELS=0`` and in the
    batch-invariant mode (bf16 checkpoint), and the engine runs."""
    import transformers as tf

    from batchgen import LLM

    path = _bf16_checkpoint(tmp_path / "a", "mixtral", seed=1234)
    kwargs = {}
    if case == "float16_checkpoint":
        tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float16).save_pretrained(path)
    elif case == "kernels_off":
        monkeypatch.setenv("BATCHGEN_CPU_KERNELS", "0")
    else:
        kwargs["batch_invariant"] = True
    llm = LLM(str(path), dtype="auto", kv_cache_memory_gb=0.05, **kwargs)
    assert {p.dtype for p in llm.llm_engine.runner.model.parameters()} == {torch.float32}
    outs = _tokens(llm)
    assert all(len(o.outputs[0].token_ids) == 16 for o in outs)
