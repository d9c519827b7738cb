"""Nasty inputs for the CPU kernels added this session (RMSNorm, packed_linear, the bf16 paged
decode attention paths): NaN/inf, odd sizes, strided and misaligned views, thread counts, the
environment switches. Each test states what a user or a real model could feed in and what the
kernel must do: the same as torch's eager ops (a NaN stays a NaN), or a clear error."""

from __future__ import annotations

import pytest
import torch

from batchgen.kernels.paged_attention import decode_kernel_available, paged_decode_attention
from tests.test_paged_attention_bf16 import ISA_NAMES, _paged_case, needs_compiler


@needs_compiler
@pytest.mark.parametrize("isa", ISA_NAMES)
@pytest.mark.parametrize("hq,hkv,d,block_size", [(8, 2, 64, 16), (16, 1, 32, 16), (4, 4, 64, 32)])
def test_bf16_decode_attention_a_nan_key_makes_the_output_nan(hq, hkv, d, block_size, isa):
    """A NaN in one cached key (a corrupted slot, an overflowed activation) gives torch's SDPA
    a NaN score and a NaN output row; every path must say so too, not drop the key (the
    AVX512-BF16 path clamped NaN to -104 inside its exp, which made its weight 0)."""
    if not decode_kernel_available(torch.device("cpu"), torch.bfloat16):
        pytest.skip("kernel not built")
    kv_lens = [1, 16, 17, 40]
    q, k_cache, v_cache, tables, slots = _paged_case(kv_lens, hq, hkv, d, block_size)
    k_cache[slots[3][5]] = float("nan")  # position 5 of sequence 3, every KV head
    out = torch.zeros(q.shape, dtype=torch.bfloat16)
    paged_decode_attention(
        q, k_cache, v_cache, tables, torch.tensor(kv_lens), block_size, d**-0.5, None, out, isa
    )
    assert out[3].isnan().all(), f"{int(out[3].isnan().sum())} of {out[3].numel()} are NaN"
    assert not out[:3].isnan().any()  # the other sequences are untouched


SWITCHES = [
    ("BATCHGEN_PACKED_LINEAR", "batchgen.kernels.packed_linear", "packed_linear_enabled"),
    ("BATCHGEN_CPU_AMX", "batchgen.kernels.fused_moe", "amx_enabled"),
    ("BATCHGEN_ONEDNN_LINEAR", "batchgen.kernels.onednn_linear", "prepacked_linear_enabled"),
]


@pytest.mark.parametrize("var,module,fn", SWITCHES)
@pytest.mark.parametrize("value", ["of", "2", "disable", "0,1"])
def test_on_off_switches_reject_values_they_do_not_know(var, module, fn, value, monkeypatch):
    """A typo such as ``BATCHGEN_PACKED_LINEAR=of`` used to mean "on" (anything but the four
    off words did), so an A/B run silently measured the same path twice."""
    import importlib

    enabled = getattr(importlib.import_module(module), fn)
    monkeypatch.setenv(var, value)
    allowed = "expected 1/true/yes/on .* 0/false/no/off"
    with pytest.raises(ValueError, match=rf"{var}=.*{allowed}"):
        enabled()


@pytest.mark.parametrize("var,module,fn", SWITCHES)
def test_on_off_switches_accept_the_documented_words(var, module, fn, monkeypatch):
    import importlib

    enabled = getattr(importlib.import_module(module), fn)
    words = [("0", False), (" OFF ", False), ("no", False), ("false", False)]
    words += [("1", True), ("On", True), ("yes", True), ("true", True), ("", True)]
    for value, want in words:
        monkeypatch.setenv(var, value)
        assert enabled() is want, (var, value)
    monkeypatch.delenv(var)
    assert enabled() is True


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(3, 0), (0, 0), (0, 5), (2, 0, 4)])
def test_rms_norm_of_an_empty_tensor_is_the_eager_result(shape, dtype):
    """No rows, or a hidden size of 0: the eager ops return an empty tensor of x's shape; the
    kernel's wrapper raised reshape's "cannot reshape tensor of 0 elements" for H = 0."""
    from batchgen.models.layers.norm import RMSNorm

    x = torch.randn(shape).to(dtype)
    norm = RMSNorm(shape[-1]).to(dtype)
    with torch.no_grad():
        y = norm(x)
    assert y.shape == x.shape and y.dtype == dtype


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("h", [1, 7, 17, 2880, 5128])
def test_rms_norm_nan_inf_and_odd_hidden_sizes_follow_the_eager_ops(h, dtype):
    """A NaN or an inf in a row makes that row NaN as in the eager ops (inf / inf), never a
    number; the other rows are the eager result up to the kernel's summation order (one bf16
    rounding, tests/test_rms_norm.py's bound); hidden sizes not a multiple of 16 take the
    generic loops. Views at an odd element offset and transposed inputs give the same bits as
    their contiguous copies, and one thread the same bits as two."""
    from batchgen.kernels.rms_norm import rms_norm, rms_norm_available

    g = torch.Generator().manual_seed(h)
    x = torch.randn(40, h + 1, generator=g).to(dtype)[:, 1:]  # odd offset, strided rows
    w = torch.randn(h + 1, generator=g).to(dtype)[1:]
    if not rms_norm_available(x, w):
        pytest.skip("rms_norm kernel not built")
    x[1, 0], x[2, -1], x[3, h // 2] = float("nan"), float("inf"), float("-inf")
    y = rms_norm(x, w, 1e-6)
    x32 = x.float()
    want = w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)
    assert torch.equal(y.isnan(), want.isnan()) and y[1:4].isnan().any(dim=-1).all()
    finite = ~want.isnan()
    ulp = 2.0**-7 if dtype == torch.bfloat16 else 2.0**-20
    assert ((y - want).float().abs()[finite] <= ulp * want.float().abs()[finite] * 2 + 1e-30).all()
    same_bits = dict(rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(y, rms_norm(x.contiguous(), w.contiguous(), 1e-6), **same_bits)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = rms_norm(x, w, 1e-6)
    finally:
        torch.set_num_threads(threads)
    torch.testing.assert_close(one, y, **same_bits)


def _packed_linear_isas() -> list[str]:
    from batchgen.kernels import packed_linear as pk

    isa = pk.kernel_isa() if pk.packed_linear_supported() else None
    return {None: [], "avx512_bf16": ["avx512_bf16"], "amx": ["amx", "avx512_bf16"]}[isa]


@pytest.mark.parametrize("n,k", [(1, 1), (7, 7), (33, 31), (17, 5128), (2880, 2880)])
@pytest.mark.parametrize("m", [0, 1, 3, 33, 129])
def test_packed_linear_odd_shapes_nan_inf_and_views(n, k, m):
    """N, K not multiples of 16/32 (padded panels), 0/1/odd rows, NaN and inf in x: the kernel
    is F.linear in float32 rounded once to bf16 (its docstring's contract), NaN and inf where
    F.linear has them; odd-offset, strided, transposed and expanded (row stride 0) inputs give
    the bits of their contiguous copies."""
    from batchgen.kernels import packed_linear as pk

    isas = _packed_linear_isas()
    if not isas:
        pytest.skip("packed_linear kernel not available")
    g = torch.Generator().manual_seed(n * k + m)
    w = torch.randn(n, k, generator=g).bfloat16()
    bias = torch.randn(n, generator=g).bfloat16()
    packed = pk.pack_packed_linear_weight(w)
    x = torch.randn(m, k + 3, generator=g).bfloat16()[:, 1 : k + 1]  # odd offset, row stride k+3
    if m > 2:
        x[1, 0], x[2, -1] = float("nan"), float("inf")
    want = torch.nn.functional.linear(x.float(), w.float(), bias.float())
    finite = want.isfinite()
    scale = x.float().nan_to_num(0, 0, 0).abs() @ w.float().abs().T + bias.float().abs()
    for isa in isas:
        y = pk.packed_linear(x, packed, n, k, bias, isa)
        assert y.shape == (m, n) and y.dtype == torch.bfloat16
        assert torch.equal(y.isnan(), want.isnan()) and torch.equal(y.isinf(), want.isinf())
        # one bf16 rounding of the result plus float32 summation error (K terms)
        bound = 2.0**-8 * want.abs() + k * 2.0**-23 * scale + 1e-6
        assert ((y.float() - want).abs()[finite] <= bound[finite]).all(), isa
        same_bits = dict(rtol=0, atol=0, equal_nan=True)
        torch.testing.assert_close(y, pk.packed_linear(x.contiguous(), packed, n, k, bias, isa),
                                   **same_bits)
        if m:
            xt = x.contiguous().T.contiguous().T  # [m, k] with strides (1, m)
            torch.testing.assert_close(pk.packed_linear(xt, packed, n, k, bias, isa), y,
                                       **same_bits)
            xe = x[:1].expand(m, k)
            torch.testing.assert_close(pk.packed_linear(xe, packed, n, k, bias, isa),
                                       y[:1].expand(m, n), **same_bits)


@pytest.mark.parametrize(
    "arch,overrides",
    [
        # hidden 72 (not a multiple of 16 or 32), head size 18 (generic attention loops), MoE
        ("mixtral", dict(hidden_size=72, intermediate_size=40, num_attention_heads=4,
                         num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2)),
        # hidden 14, one head of 14, intermediate 9
        ("llama", dict(hidden_size=14, intermediate_size=9, num_attention_heads=1,
                       num_key_value_heads=1)),
    ],
)
def test_bf16_engine_with_odd_hidden_size_generates_like_transformers(
    arch, overrides, tmp_path
):
    """A bf16 model whose hidden and head sizes are no multiple of 16 runs end to end through
    `LLM` (each kernel serving or falling back per shape), and its greedy tokens pass the bf16
    kernel tests' criterion against `transformers` (tests/test_paged_attention_bf16.py)."""
    import transformers as tf

    from batchgen import LLM, SamplingParams
    from batchgen.models.make_model import make_model
    from tests.test_paged_attention_bf16 import assert_greedy_agrees_with_reference

    path = make_model(
        arch, tmp_path / arch, seed=1234, num_hidden_layers=2, initializer_range=0.1,
        **overrides
    )
    llm = LLM(str(path), device="cpu", dtype="bfloat16", kv_cache_memory_gb=0.05)
    tok = llm.get_tokenizer()
    prompts = [tok.encode(p) for p in ("The quick brown fox", "def fib(n):", "a b c d e f")]
    sp = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [16, 16, 16]
    ref = tf.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16).eval()
    assert_greedy_agrees_with_reference(arch, prompts, outs, ref)


def _odd_offset(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of ``t`` whose data starts one element into its buffer (a pointer
    aligned to 2 bytes only in bf16)."""
    buf = torch.empty(t.numel() + 1, dtype=t.dtype)
    view = buf[1:].view(t.shape)
    view.copy_(t)
    return view


@needs_compiler
@pytest.mark.parametrize("isa", ISA_NAMES)
@pytest.mark.parametrize(
    "hq,hkv,d,block_size",
    [(16, 1, 64, 16), (32, 2, 64, 16), (16, 1, 192, 32), (16, 16, 64, 1), (8, 2, 64, 8),
     (17, 17, 32, 16)],
)
def test_bf16_decode_attention_edges_of_the_cache_and_the_arguments(hq, hkv, d, block_size, isa):
    """G = 16 (AMX's limit) and 1, blocks of 1/8/16/32, contexts at block edges; then: a block
    table pointing at the last block of an exactly sized cache, every tensor at an odd element
    offset, a window far larger than the context, one thread against two, and a row with
    kv_len 0 under ``context_checked`` (zeros, the other rows unchanged). The reference is
    tests/test_paged_attention_bf16.py's float64 one with its error bound."""
    from tests.test_paged_attention_bf16 import _reference

    if not decode_kernel_available(torch.device("cpu"), torch.bfloat16):
        pytest.skip("kernel not built")
    lens = [1, block_size, block_size + 1, 2 * block_size, 3 * block_size - 1, 48]
    q, k, v, tables, slots = _paged_case(lens, hq, hkv, d, block_size)
    scale = d**-0.5

    def run(q, k, v, tables, lens, window=None, out=None, checked=False):
        out = torch.zeros(q.shape, dtype=q.dtype) if out is None else out
        paged_decode_attention(
            q, k, v, tables, torch.tensor(lens), block_size, scale, window, out, isa, checked
        )
        return out

    def within_bound(out, tables_slots, window=None):
        for i, s in enumerate(tables_slots):
            want, bound = _reference(q[i], k[s], v[s], scale, window, with_bound=True)
            assert ((out[i].double() - want).abs() <= bound).all(), i

    out = run(q, k, v, tables, lens)
    within_bound(out, slots)
    last = k.shape[0] // block_size - 1
    at_end = tables.clone()
    at_end[0, 0] = last  # sequence 0 (kv_len 1) reads the cache's very last block
    within_bound(run(q, k, v, at_end, lens)[:1], [torch.tensor([last * block_size])])
    odd = run(_odd_offset(q), _odd_offset(k), _odd_offset(v), tables, lens,
              out=_odd_offset(torch.zeros_like(q)))
    assert torch.equal(odd, out)
    assert torch.equal(run(q, k, v, tables, lens, window=10**9), out)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(run(q, k, v, tables, lens), out)
    finally:
        torch.set_num_threads(threads)
    empty = list(lens)
    empty[1] = 0
    zeros = run(q, k, v, tables, empty, checked=True)
    assert (zeros[1] == 0).all() and torch.equal(zeros[2:], out[2:])
    with pytest.raises(ValueError, match="kv_lens must be in"):
        run(q, k, v, tables, empty)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_100k_rows_and_subnormals(dtype):
    """100,000 rows (threads split them) give the bits of one thread and the eager result
    within tests/test_rms_norm.py's bound; so does a row of subnormals (its mean square
    underflows to 0, so eps decides), not flushed to zero."""
    from batchgen.kernels.rms_norm import rms_norm, rms_norm_available

    g = torch.Generator().manual_seed(7)
    x = torch.randn(100_000, 64, generator=g).to(dtype)
    w = torch.randn(64, generator=g).to(dtype)
    if not rms_norm_available(x, w):
        pytest.skip("rms_norm kernel not built")
    x[5] = torch.finfo(dtype).tiny / 4  # subnormal (bf16 shares float32's exponent range)
    y = rms_norm(x, w, 1e-6)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(rms_norm(x, w, 1e-6), y)
    finally:
        torch.set_num_threads(threads)
    x32 = x.float()
    want = w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)
    ulp = 2.0**-7 if dtype == torch.bfloat16 else 4 * 2.0**-23
    assert ((y - want).float().abs() <= ulp * want.float().abs() + 1e-30).all()
    assert (y[5] != 0).all() and y[5].isfinite().all()  # not flushed: eps sets the scale


@pytest.mark.parametrize(
    "case,field",
    [
        ("packed_float32", "packed"),  # read as bf16 bits: silent garbage
        ("packed_strided", "packed"),  # read as if contiguous: silently wrong
        ("bias_meta", "bias"),  # data_ptr 0 read as "no bias": silently dropped
        ("x_meta", "x"),  # data_ptr 0 handed to the kernel: segmentation fault
        ("packed_meta", "packed"),  # the same
    ],
)
def test_packed_linear_rejects_tensors_it_cannot_read(case, field):
    """`packed_linear` is public and hands raw pointers to C++: a packed weight of another
    dtype or layout, or a tensor off the CPU (meta here; CUDA on a GPU machine), must be a
    ValueError naming the argument, not garbage, a dropped bias or a crash."""
    from batchgen.kernels import packed_linear as pk

    if not _packed_linear_isas():
        pytest.skip("packed_linear kernel not available")
    w = torch.randn(16, 32).bfloat16()
    packed = pk.pack_packed_linear_weight(w)
    x, bias = torch.randn(2, 32).bfloat16(), None
    if case == "packed_float32":
        packed = packed.float()
    elif case == "packed_strided":
        packed = torch.cat([packed, packed], -1)[..., ::2]
    elif case == "bias_meta":
        bias = torch.empty(16, dtype=torch.bfloat16, device="meta")
    elif case == "x_meta":
        x = x.to("meta")
    else:
        packed = packed.to("meta")
    with pytest.raises(ValueError, match=rf"^{field} "):
        pk.packed_linear(x, packed, 16, 32, bias)


@needs_compiler
@pytest.mark.parametrize("checked", [False, True])
@pytest.mark.parametrize("name", ["block_tables", "kv_lens"])
def test_decode_attention_metadata_off_the_cpu_is_an_error(name, checked):
    """Block tables or context lengths on another device (meta here, CUDA on a GPU machine)
    went to the kernel as raw pointers: a segmentation fault under ``context_checked`` (and on
    CUDA without it, after the context check ran there). A ValueError names the argument."""
    if not decode_kernel_available(torch.device("cpu"), torch.bfloat16):
        pytest.skip("kernel not built")
    q, k, v, tables, _ = _paged_case([3, 17], 8, 2, 64, 16)
    args = {"block_tables": tables, "kv_lens": torch.tensor([3, 17])}
    args[name] = args[name].to("meta")
    with pytest.raises(ValueError, match=rf"{name} must be on the CPU"):
        paged_decode_attention(
            q, k, v, args["block_tables"], args["kv_lens"], 16, 0.125, None,
            torch.zeros_like(q), context_checked=checked,
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("h,hw", [(16, 8), (8, 16), (32, 1)])
def test_rms_norm_weight_of_another_size_is_the_eager_error(h, hw, dtype):
    """An RMSNorm applied to rows of another width (a per-head q/k norm given whole hidden
    rows, a mis-sized checkpoint) raises in the eager ops (no broadcast of [hw] to [..., h],
    except hw = 1); the kernel read ``h`` weights from a tensor of ``hw``: past its end, or
    the first ``h`` of them, silently. Now the kernel serves only a weight of [h] and the
    eager ops decide."""
    from batchgen.models.layers.norm import RMSNorm

    norm = RMSNorm(hw).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 2.0, hw))
    x = torch.randn(4, h).to(dtype)
    x32 = x.float()
    with torch.no_grad():
        try:
            want = norm.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)).to(
                dtype
            )
        except RuntimeError:
            with pytest.raises(RuntimeError, match="size of tensor"):
                norm(x)
            return
        torch.testing.assert_close(norm(x), want)
