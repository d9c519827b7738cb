"""The fused MoE kernel's micro-kernels (`batchgen.kernels.fused_moe`): the AVX-512 float32
one against the AVX2 one, and the bfloat16 one (AVX512-BF16) against a float32 reference on the
same bf16 inputs, in a layer, and in a bf16 model against `transformers` in bf16."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from batchgen.kernels import fused_moe as fm
from batchgen.models.layers.moe import SparseMoeBlock, fused_experts_reference, sort_by_expert
from batchgen.models.model_config import RouterConfig
from tests.test_paged_attention_bf16 import MIXTRAL_BF16

needs_bf16 = pytest.mark.skipif(
    fm.kernel_isa(torch.bfloat16) is None,
    reason="the bf16 fused MoE kernel needs a CPU with avx512_bf16",
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
def test_bf16_kernel_within_one_bf16_rounding_of_the_activation(
    num_tokens, num_experts, top_k, hidden, inter
):
    """Against float64 math on the same bf16 inputs. The kernel's products of bf16 inputs are
    exact and its sums float32; its one rounding to bf16 is the SiLU-gated activation ``a``
    (relative error <= u = 2^-8) before the down projection. So for each output
    ``|got - want| <= u * sum_a w_a * sum_j |W2[h, j] * a_j|`` (+ float32 sums: K * 2^-24 of
    the same magnitude, and 1e-6 absolute)."""
    x, w13, w2, weights, ids = _case(num_tokens, num_experts, top_k, hidden, inter, seed=2)
    got = _kernel(x, w13, w2, weights, ids)
    xd, w13d, w2d, wd = x.double(), w13.double(), w2.double(), weights.double()
    want = fused_experts_reference(xd, w13d, w2d, wd, ids)
    # The bound's magnitude: the same experts with |W2| and |activation|.

    def abs_act(h):
        gate, up = h.chunk(2, dim=-1)
        return (F.silu(gate) * up).abs()

    mag = torch.zeros_like(want)  # [T, H]
    for a in range(top_k):
        e = ids[:, a]
        act = abs_act(torch.einsum("th,tnh->tn", xd, w13d[e]))  # [T, I]
        mag += wd[:, a : a + 1] * torch.einsum("ti,thi->th", act, w2d[e].abs())
    bound = (U_BF16 + 2 * inter * 2.0**-24) * mag + 1e-6
    assert got.dtype == torch.float32 and got.shape == (num_tokens, hidden)
    excess = (got.double() - want).abs() - bound
    assert excess.max() <= 0, f"max excess over the bound {excess.max().item():.3g}"
    # The bound is not vacuous: the error is of the order of one bf16 rounding.
    assert (got.double() - want).abs().max() < 0.1 * want.abs().max()


@needs_bf16
def test_bf16_kernel_output_of_a_token_does_not_depend_on_the_batch():
    x, w13, w2, weights, ids = _case(201, 8, 2, 32, 16, seed=3)
    batch = _kernel(x, w13, w2, weights, ids)
    for t in (0, 77, 200):
        alone = _kernel(x[t : t + 1], w13, w2, weights[t : t + 1], ids[t : t + 1])
        assert torch.equal(alone[0], batch[t])


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
    exact = total = 0
    for prompt, out in zip(prompts, outs):
        ours = list(out.outputs[0].token_ids)
        with torch.no_grad():
            logits = ref(torch.tensor([prompt + ours])).logits[0, len(prompt) - 1 : -1].float()
        delta = 4 * 2.0**-7 * logits.abs().max().item()
        chosen = logits.gather(1, torch.tensor(ours)[:, None])[:, 0]
        assert (chosen >= logits.max(-1).values - delta).all(), (name, ours)
        exact += int((logits.argmax(-1) == torch.tensor(ours)).sum())
        total += len(ours)
    assert exact >= 0.9 * total, f"{exact}/{total} positions are the reference's argmax"
