"""The fused MoE kernel's micro-kernels (`batchgen.kernels.fused_moe`): the AVX-512 float32
one against the AVX2 one, and the bfloat16 ones (AVX512-BF16's vdpbf16ps, AMX-BF16) against a
float64 reference on the same bf16 inputs, in a layer, and in a bf16 model against
`transformers` in bf16."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from batchgen.kernels import fused_moe as fm
from batchgen.models.layers.moe import SparseMoeBlock, fused_experts_reference, sort_by_expert
from batchgen.models.model_config import RouterConfig
from tests.test_paged_attention_bf16 import MIXTRAL_BF16, assert_greedy_agrees_with_reference

needs_bf16 = pytest.mark.skipif(
    fm.kernel_isa(torch.bfloat16) is None,
    reason="the bf16 fused MoE kernel needs a CPU with avx512_bf16",
)
needs_amx = pytest.mark.skipif(
    fm.kernel_isa(torch.bfloat16) != "amx_bf16",
    reason="the AMX bf16 micro-kernel needs a CPU with amx_bf16 and the OS's tile permission",
)
needs_avx512 = pytest.mark.skipif(
    fm.kernel_isa(torch.float32) != "avx512f", reason="the kernel is not built for AVX-512F"
)
U_BF16 = 2.0**-8  # bf16's unit roundoff: 8 significant bits, round to nearest


def _case(num_tokens, num_experts, top_k, hidden, inter, seed, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(num_experts, 2 * inter, hidden, generator=g) * hidden**-0.5).to(dtype)
    w2 = (torch.randn(num_experts, hidden, inter, generator=g) * inter**-0.5).to(dtype)
    x = torch.randn(num_tokens, hidden, generator=g).to(dtype)
    probs = torch.softmax(torch.randn(num_tokens, num_experts, generator=g), -1)
    weights, ids = torch.topk(probs, top_k)
    return x, w13, w2, weights / weights.sum(-1, keepdim=True), ids


def _kernel(x, w13, w2, weights, ids, isa="auto"):
    order, counts = sort_by_expert(ids, w13.shape[0])
    w13p, w2p = fm.pack_expert_weights(w13), fm.pack_expert_weights(w2)
    return fm.fused_moe_silu(x, w13p, w2p, weights, order, counts, isa=isa)


@needs_avx512
@pytest.mark.parametrize("num_tokens,inter", [(1, 8), (37, 24), (300, 32), (64, 256)])
def test_avx512_kernel_equals_the_avx2_kernel_bit_for_bit(num_tokens, inter):
    """Both sum each output over k in one FMA chain, k = 0, 1, ...: the same bits. 2I = 48
    (inter 24) leaves an odd last 16-column panel; 300 tokens make row chunks and row tails."""
    x, w13, w2, weights, ids = _case(num_tokens, 8, 2, 64, inter, seed=1, dtype=torch.float32)
    assert torch.equal(_kernel(x, w13, w2, weights, ids), _kernel(x, w13, w2, weights, ids, "avx2"))


def bf16_error_bound(x, w13, w2, weights, ids):
    """``(want, bound)``: float64 math on the same bf16 inputs, ``[T, H]``, and a bound on
    ``|got - want|`` for the bf16 kernels. Their products of bf16 inputs are exact and their
    sums float32; their one rounding to bf16 is the SiLU-gated activation ``a`` (relative
    error <= u = 2^-8) before the down projection. So for each output
    ``|got - want| <= u * sum_a w_a * sum_j |W2[h, j] * a_j|`` (+ float32 sums: 2I * 2^-24 of
    the same magnitude, and 1e-6 absolute)."""
    xd, w13d, w2d, wd = x.double(), w13.double(), w2.double(), weights.double()
    want = fused_experts_reference(xd, w13d, w2d, wd, ids)
    inter = w2.shape[2]
    mag = torch.zeros_like(want)  # [T, H]: the same experts with |W2| and |activation|
    for a in range(ids.shape[1]):
        e = ids[:, a]
        gate, up = torch.einsum("th,tnh->tn", xd, w13d[e]).chunk(2, dim=-1)
        act = (F.silu(gate) * up).abs()  # [T, I]
        mag += wd[:, a : a + 1] * torch.einsum("ti,thi->th", act, w2d[e].abs())
    return want, (U_BF16 + 2 * inter * 2.0**-24) * mag + 1e-6


def assert_within_bf16_bound(got, x, w13, w2, weights, ids):
    want, bound = bf16_error_bound(x, w13, w2, weights, ids)
    assert got.dtype == torch.float32 and got.shape == want.shape
    excess = (got.double() - want).abs() - bound
    assert excess.max() <= 0, f"max excess over the bound {excess.max().item():.3g}"
    # The bound is not vacuous: the error is of the order of one bf16 rounding.
    assert (got.double() - want).abs().max() < 0.1 * want.abs().max()


@needs_bf16
@pytest.mark.parametrize(
    "num_tokens,num_experts,top_k,hidden,inter",
    [
        (1, 4, 2, 16, 8),  # one decode token, one 16-column panel
        (5, 8, 3, 32, 24),  # 2I = 48: an odd last panel; rows not a multiple of 12
        (37, 4, 1, 48, 16),  # top-1
        (300, 4, 2, 64, 32),  # ~150 rows per expert: two row chunks
        (64, 64, 8, 512, 256),  # the bench model's shapes
    ],
)
@pytest.mark.parametrize("isa", ["avx512_bf16", "auto"])
def test_bf16_kernel_within_one_bf16_rounding_of_the_activation(
    num_tokens, num_experts, top_k, hidden, inter, isa
):
    """Against float64 math on the same bf16 inputs, within `bf16_error_bound`. ``auto`` is
    AMX where the CPU has it and H and I are multiples of 32 (the last two cases), else
    vdpbf16ps."""
    x, w13, w2, weights, ids = _case(num_tokens, num_experts, top_k, hidden, inter, seed=2)
    got = _kernel(x, w13, w2, weights, ids, isa)
    assert_within_bf16_bound(got, x, w13, w2, weights, ids)


@needs_bf16
def test_bf16_kernel_output_of_a_token_does_not_depend_on_the_batch():
    x, w13, w2, weights, ids = _case(201, 8, 2, 32, 16, seed=3)
    batch = _kernel(x, w13, w2, weights, ids)
    for t in (0, 77, 200):
        alone = _kernel(x[t : t + 1], w13, w2, weights[t : t + 1], ids[t : t + 1])
        assert torch.equal(alone[0], batch[t])


def _routed_rows(rows_per_expert, hidden, inter, seed, top_k=1):
    """A case whose expert e gets exactly ``rows_per_expert[e]`` rows (zero allowed): slot 0
    of the first rows goes to expert 0, and so on; other slots to the next expert."""
    num_tokens, num_experts = sum(rows_per_expert), len(rows_per_expert)
    x, w13, w2, weights, _ = _case(num_tokens, num_experts, top_k, hidden, inter, seed)
    first = torch.repeat_interleave(torch.arange(num_experts), torch.tensor(rows_per_expert))
    ids = torch.stack([(first + a) % num_experts for a in range(top_k)], dim=1)  # [T, A]
    return x, w13, w2, weights, ids


@needs_amx
@pytest.mark.parametrize(
    "rows_per_expert,top_k",
    [
        ([1], 1),  # one decode row: 15 zero pad rows
        ([0, 15, 0], 1),  # experts with zero rows around a partial row tile
        ([17, 0, 33], 1),  # one full tile plus one row; 2 tiles plus one row
        ([16, 32, 1, 0], 2),  # whole tiles, top-2
        ([300, 5], 1),  # three row chunks of 100 rows (chunks of at most 128)
    ],
)
def test_amx_kernel_odd_row_counts_within_the_bound_and_near_vdpbf16ps(rows_per_expert, top_k):
    """AMX against float64 within `bf16_error_bound`, and against vdpbf16ps: both within the
    bound of the exact result, so within twice the bound of each other (not bit-equal: AMX
    adds 32 products per tile step, vdpbf16ps 2). H 96: three k tiles in the gate/up GEMM."""
    x, w13, w2, weights, ids = _routed_rows(rows_per_expert, 96, 32, 6, top_k)
    amx = _kernel(x, w13, w2, weights, ids, "amx")
    assert_within_bf16_bound(amx, x, w13, w2, weights, ids)
    vdp = _kernel(x, w13, w2, weights, ids, "avx512_bf16")
    _, bound = bf16_error_bound(x, w13, w2, weights, ids)
    assert ((amx.double() - vdp.double()).abs() <= 2 * bound).all()


@needs_amx
def test_amx_kernel_output_of_a_token_does_not_depend_on_the_batch():
    """201 tokens top-2 over 4 experts (~100 rows each: tiles of 16, a partial last tile);
    each token alone (one row, 15 zero pad rows) gives the same bits as in the batch."""
    x, w13, w2, weights, ids = _case(201, 4, 2, 64, 32, seed=7)
    batch = _kernel(x, w13, w2, weights, ids, "amx")
    for t in (0, 15, 16, 77, 200):
        alone = _kernel(x[t : t + 1], w13, w2, weights[t : t + 1], ids[t : t + 1], "amx")
        assert torch.equal(alone[0], batch[t]), t
    assert torch.equal(_kernel(x, w13, w2, weights, ids), batch)  # auto is AMX here


@needs_amx
def test_amx_switch_and_shapes_amx_cannot_run(monkeypatch):
    """``BATCHGEN_CPU_AMX=0`` makes auto run vdpbf16ps (bit for bit); H or I not a multiple
    of 32: auto runs vdpbf16ps, ``isa="amx"`` is refused; a float32 isa is refused for bf16."""
    x, w13, w2, weights, ids = _case(40, 4, 2, 64, 32, seed=8)
    vdp = _kernel(x, w13, w2, weights, ids, "avx512_bf16")
    assert torch.equal(_kernel(x, w13, w2, weights, ids), _kernel(x, w13, w2, weights, ids, "amx"))
    monkeypatch.setenv("BATCHGEN_CPU_AMX", "0")
    assert fm.kernel_isa(torch.bfloat16) == "avx512_bf16"
    assert torch.equal(_kernel(x, w13, w2, weights, ids), vdp)
    monkeypatch.delenv("BATCHGEN_CPU_AMX")
    x, w13, w2, weights, ids = _case(40, 4, 2, 48, 16, seed=8)
    assert torch.equal(
        _kernel(x, w13, w2, weights, ids), _kernel(x, w13, w2, weights, ids, "avx512_bf16")
    )
    with pytest.raises(RuntimeError, match="rejected the shapes"):
        _kernel(x, w13, w2, weights, ids, "amx")
    with pytest.raises(ValueError, match="isa must be one of"):
        _kernel(x, w13, w2, weights, ids, "avx2")


def test_bf16_packing_interleaves_pairs_of_k():
    w = torch.arange(2 * 16 * 4, dtype=torch.float32).view(1, 32, 4).bfloat16()  # E 1, N 32, K 4
    packed = fm.pack_expert_weights(w)
    assert packed.shape == (1, 2, 2, 16, 2) and packed.dtype == torch.bfloat16
    # panel p, pair kp, column c, lane l holds w[p * 16 + c, 2 * kp + l]
    assert packed[0, 1, 1, 3, 0] == w[0, 16 + 3, 2] and packed[0, 1, 1, 3, 1] == w[0, 19, 3]
    one = torch.empty(fm.packed_expert_shape(32, 4, torch.bfloat16), dtype=torch.bfloat16)
    fm.pack_expert_weight_into(one, w[0].float())
    assert torch.equal(one, packed[0])


def test_bf16_kernel_refuses_mixed_dtypes():
    x, w13, w2, weights, ids = _case(3, 4, 2, 16, 8, seed=4)
    order, counts = sort_by_expert(ids, 4)
    w13p, w2p = fm.pack_expert_weights(w13), fm.pack_expert_weights(w2.float())
    if fm.kernel_isa(torch.bfloat16) is None:
        pytest.skip("the bf16 kernel is not available here")
    with pytest.raises(ValueError, match="5-D for torch.bfloat16|one dtype"):
        fm.fused_moe_silu(x, w13p, w2p, weights, order, counts)


@needs_bf16
def test_bf16_layer_runs_the_kernel_and_returns_bf16():
    torch.manual_seed(5)
    layer = SparseMoeBlock(32, 16, num_experts=4, top_k=2, router=RouterConfig())
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.2)
    layer = layer.bfloat16()
    x = torch.randn(9, 32).bfloat16()
    with torch.no_grad():
        assert layer.uses_kernel(x)
        out = layer(x)
        weights, ids = layer.route(x)
        want = fused_experts_reference(
            x.float(), layer.w13_weight.float(), layer.w2_weight.float(), weights, ids
        )
    assert out.dtype == torch.bfloat16
    # float32 reference on the same bf16 inputs; the kernel rounds the activation (u) and
    # its float32 result once to bf16 (u): within 2u of the output's scale.
    atol = 2 * U_BF16 * want.abs().max().item()
    torch.testing.assert_close(out.float(), want, rtol=2 * U_BF16, atol=atol)


@needs_bf16
@pytest.mark.parametrize(
    "name",
    [
        pytest.param("mixtral", marks=pytest.mark.xfail(reason=MIXTRAL_BF16)),
        "qwen3_moe",
    ],
)
def test_bf16_greedy_tokens_agree_with_transformers_in_bf16(checkpoint_dir, name):
    """A bf16 model's greedy continuation, teacher-forced through `transformers` in bf16: at
    every generated position our token is the reference's argmax or within ``delta`` of its
    logit. Two bf16 implementations round differently (ours: float32 expert sums, one bf16
    rounding of the activation; HF's: bf16 after every op), so a near-tie may flip; ``delta``
    is 4 bf16 ulps at the largest logit (4 * 2^-7 * max|logit|), and at least 90% of the
    positions must be the reference's exact argmax."""
    import transformers as tf

    from batchgen import LLM, SamplingParams

    path = str(checkpoint_dir(name))
    llm = LLM(path, device="cpu", dtype="bfloat16", kv_cache_memory_gb=0.05)
    tok = llm.get_tokenizer()
    prompts = [tok.encode(p) for p in ("The quick brown fox", "def fib(n):", "a b c d e f")]
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    ref = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    assert_greedy_agrees_with_reference(name, prompts, outs, ref)


@needs_bf16
@pytest.mark.parametrize("isa", ["avx512_bf16", "amx"])
def test_bf16_kernel_gives_the_same_bits_with_a_misaligned_slot_buffer(isa):
    """In a call whose per-slot buffer is streamed (over 4 MiB: 8,200 tokens x top-2 x H 64
    float32), the down GEMM writes its weighted rows with non-temporal stores where a row is
    64-byte aligned, else with ordinary stores: a buffer 4 bytes off (every row misaligned)
    gives the same bits as the aligned workspace."""
    if isa == "amx" and fm.kernel_isa(torch.bfloat16) != "amx_bf16":
        pytest.skip("the AMX bf16 micro-kernel needs amx_bf16 and the OS's tile permission")
    n = 8200
    assert n * 2 * 64 * 4 > 4 << 20
    x, w13, w2, weights, ids = _case(n, 4, 2, 64, 32, seed=9)
    want = _kernel(x, w13, w2, weights, ids, isa)
    order, counts = sort_by_expert(ids, 4)
    starts = torch.zeros(5, dtype=torch.int64)
    torch.cumsum(torch.tensor(counts), 0, out=starts[1:])
    w13p, w2p = fm.pack_expert_weights(w13), fm.pack_expert_weights(w2)
    weights = weights.float().contiguous()
    order = order.contiguous()
    y_slots = torch.empty(n * 2 * 64 + 16)
    assert y_slots.data_ptr() % 64 == 0
    out = torch.empty(n, 64)
    rc = fm._library().batchgen_fused_moe_silu_bf16(
        x.data_ptr(), w13p.data_ptr(), w2p.data_ptr(), weights.data_ptr(), order.data_ptr(),
        starts.data_ptr(), y_slots.data_ptr() + 4, out.data_ptr(), n, 64, 32, 2, 4, 1,
        fm.ISAS[torch.bfloat16][isa],
    )
    assert rc == 0
    assert torch.equal(out, want)


@needs_bf16
@pytest.mark.parametrize("isa", ["avx512_bf16", "amx"])
def test_bf16_kernel_same_bits_whether_the_slot_buffer_is_streamed_or_cached(isa):
    """The down GEMM writes the per-slot buffer (T x top-k x H float32) with non-temporal
    stores only when it is larger than 4 MiB (``kStreamMinBytes`` in csrc/fused_moe_common.h),
    with ordinary stores below: 1,100 tokens top-2 at H 512 (4.3 MiB, streamed) give each
    token the same bits as the token alone (8 KiB, cached)."""
    if isa == "amx" and fm.kernel_isa(torch.bfloat16) != "amx_bf16":
        pytest.skip("the AMX bf16 micro-kernel needs amx_bf16 and the OS's tile permission")
    x, w13, w2, weights, ids = _case(1100, 4, 2, 512, 32, seed=10)
    assert 1100 * 2 * 512 * 4 > 4 << 20
    batch = _kernel(x, w13, w2, weights, ids, isa)
    for t in (0, 15, 550, 1099):
        alone = _kernel(x[t : t + 1], w13, w2, weights[t : t + 1], ids[t : t + 1], isa)
        assert torch.equal(alone[0], batch[t]), t


@needs_bf16
@pytest.mark.parametrize("isa", ["avx512_bf16", "amx"])
@pytest.mark.parametrize("num_tokens,top_k,hidden", [(1, 2, 64), (37, 8, 512), (300, 2, 64)])
def test_bf16_output_is_the_float32_result_cast_to_bf16_bit_for_bit(isa, num_tokens, top_k, hidden):
    """``out_dtype=torch.bfloat16`` rounds the float32 slot sum in the kernel: the same bits as
    the float32 result's ``.to(torch.bfloat16)`` (the old path), NaN and infinity included."""
    if isa == "amx" and fm.kernel_isa(torch.bfloat16) != "amx_bf16":
        pytest.skip("the AMX bf16 micro-kernel needs amx_bf16 and the OS's tile permission")
    x, w13, w2, weights, ids = _case(num_tokens, 8, top_k, hidden, 32, seed=11)
    x[0, 0] = float("nan")  # token 0: NaN everywhere
    if num_tokens > 1:
        x[-1] *= 1e30  # the last token: overflows to infinity / NaN
    order, counts = sort_by_expert(ids, 8)
    w13p, w2p = fm.pack_expert_weights(w13), fm.pack_expert_weights(w2)
    args = (x, w13p, w2p, weights, order, counts)
    want = fm.fused_moe_silu(*args, isa=isa).to(torch.bfloat16)
    got = fm.fused_moe_silu(*args, isa=isa, out_dtype=torch.bfloat16)
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    assert got[0].isnan().all()
    if num_tokens > 2:  # finite rows too, not only NaN
        assert want[1:-1].isfinite().all()


def test_fused_moe_refuses_a_bf16_output_for_float32_x():
    x, w13, w2, weights, ids = _case(4, 4, 2, 64, 32, seed=12, dtype=torch.float32)
    order, counts = sort_by_expert(ids, 4)
    w13p, w2p = fm.pack_expert_weights(w13), fm.pack_expert_weights(w2)
    with pytest.raises(ValueError, match="out_dtype"):
        fm.fused_moe_silu(x, w13p, w2p, weights, order, counts, out_dtype=torch.bfloat16)
