"""DeepSeek-V2/V3 building blocks against the `transformers` modules themselves.

Every test builds a tiny HF module (`DeepseekV2Config` / `DeepseekV3Config`), copies its weights
into ours and compares on random inputs: YaRN parameters and rotations, the softmax scale, MLA
attention through the paged cache (prefill, chunked continuation, decode, mixed batches) and
expert routing.
"""

from __future__ import annotations

import math

import pytest
import torch
from transformers import DeepseekV2Config, DeepseekV3Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.deepseek_v2 import modeling_deepseek_v2 as hf_v2
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf_v3

from batchgen.models.layers.attention import AttentionMetadata, DecodeBucket, PrefillSpan
from batchgen.models.layers.deepseek_moe import deepseek_router_logits, select_experts_deepseek
from batchgen.models.layers.mla import MLAAttention, MLADims
from batchgen.models.layers.rotary import compute_inv_freq
from batchgen.models.layers.rotary_yarn import (
    ScaledRotaryEmbedding,
    compute_rope_parameters,
    compute_yarn_inv_freq,
    deepseek_softmax_scale,
)

# DeepSeek-V3's published rope_scaling (V2 uses the same with mscale = mscale_all_dim = 0.707).
YARN_V3 = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 40.0,
    "original_max_position_embeddings": 4096,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}
# Tiny: positions up to ~40 cross the YaRN correction range of an 8-dim rope.
YARN_TINY = dict(YARN_V3, factor=8.0, original_max_position_embeddings=16)

TINY_MLA = dict(
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=4,  # HF V3's default (128) would make num_key_value_groups 0
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=12,  # differs from qk_head_dim = 24 on purpose
    max_position_embeddings=128,
    vocab_size=100,
    num_hidden_layers=1,
)


def _config(version: int, **overrides):
    cls = DeepseekV3Config if version == 3 else DeepseekV2Config
    cfg = cls(**{**TINY_MLA, **overrides})
    cfg._attn_implementation = "eager"
    return cfg


def _rope_config(rope_parameters: dict, head_dim: int = 64, max_pos: int = 163840):
    return DeepseekV3Config(
        hidden_size=64,
        num_attention_heads=4,
        qk_rope_head_dim=head_dim,
        max_position_embeddings=max_pos,
        rope_parameters=dict(rope_parameters),
        num_hidden_layers=1,
        vocab_size=10,
    )


# ----------------------------------------------------------------------------- rotary / YaRN


@pytest.mark.parametrize(
    "params",
    [
        YARN_V3,
        dict(YARN_V3, mscale=0.707, mscale_all_dim=0.707),  # DeepSeek-V2
        dict(YARN_V3, mscale=1.0, mscale_all_dim=0.5),  # attention_factor != 1
        {k: v for k, v in YARN_V3.items() if k not in ("mscale", "mscale_all_dim")},
        dict(YARN_V3, attention_factor=0.9, beta_fast=16, beta_slow=2, truncate=False),
        dict(YARN_V3, rope_theta=500000.0, factor=4.0),
    ],
)
def test_yarn_inv_freq_and_attention_factor_match_hf(params):
    cfg = _rope_config(params)
    hf_inv_freq, hf_attention_factor = ROPE_INIT_FUNCTIONS["yarn"](cfg)
    inv_freq, attention_factor = compute_yarn_inv_freq(64, params, 163840)
    assert torch.equal(inv_freq, hf_inv_freq)
    assert attention_factor == hf_attention_factor
    assert compute_rope_parameters(64, params, 163840)[1] == attention_factor


@pytest.mark.parametrize(
    "params",
    [
        {"rope_type": "default", "rope_theta": 10000.0},
        {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
        {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ],
)
def test_other_rope_types_delegate(params):
    inv_freq, attention_factor = compute_rope_parameters(16, params, 1024)
    assert torch.equal(inv_freq, compute_inv_freq(16, params)) and attention_factor == 1.0
    with pytest.raises(ValueError, match="rope_type"):
        compute_rope_parameters(16, {"rope_type": "dynamic"}, 1024)


@pytest.mark.parametrize(
    "params", [YARN_V3, dict(YARN_V3, mscale_all_dim=0.707), {"rope_type": "default"}]
)
def test_softmax_scale_matches_hf(params):
    cfg = _config(3, rope_parameters=dict(params, rope_theta=10000.0))
    hf_scale = hf_v3.DeepseekV3Attention(cfg, 0).scaling
    assert deepseek_softmax_scale(24, cfg.rope_parameters) == hf_scale
    if params.get("mscale_all_dim"):
        mscale = 0.1 * params["mscale_all_dim"] * math.log(params["factor"]) + 1.0
        assert hf_scale == pytest.approx(24**-0.5 * mscale**2)


def test_rotations_match_hf_layouts():
    """rotate-half == HF V3 `apply_rotary_pos_emb`; interleaved == HF V2's complex
    `apply_rotary_emb` and, up to V3's de-interleaved output order, `apply_rotary_pos_emb_
    interleave`. attention_factor != 1 so the cos/sin scaling is exercised."""
    torch.manual_seed(0)
    params = dict(YARN_TINY, mscale_all_dim=0.5)
    t, dim = 40, 8
    cfg3, cfg2 = _config(3, rope_parameters=dict(params)), _config(2, rope_parameters=dict(params))
    pos = torch.arange(t)
    q, k = torch.randn(t, 4, dim), torch.randn(t, 1, dim)
    q_hf, k_hf = q.transpose(0, 1)[None], k.transpose(0, 1)[None]  # [1, heads, T, D]
    cos, sin = hf_v3.DeepseekV3RotaryEmbedding(cfg3)(q_hf, pos[None])

    ours = ScaledRotaryEmbedding(dim, params, 128, interleaved=False)
    assert ours.attention_factor != 1.0
    ref_q, ref_k = hf_v3.apply_rotary_pos_emb(q_hf, k_hf, cos, sin)
    out_q, out_k = ours(pos, q, k)
    torch.testing.assert_close(out_q, ref_q[0].transpose(0, 1), rtol=0, atol=1e-6)
    torch.testing.assert_close(out_k, ref_k[0].transpose(0, 1), rtol=0, atol=1e-6)

    ours_il = ScaledRotaryEmbedding(dim, params, 128, interleaved=True)
    out_q, out_k = ours_il(pos, q, k)
    freqs_cis = hf_v2.DeepseekV2RotaryEmbedding(cfg2)(q_hf, pos[None])
    ref_q, ref_k = hf_v2.apply_rotary_emb(q_hf, k_hf, freqs_cis)
    torch.testing.assert_close(out_q, ref_q[0].transpose(0, 1), rtol=0, atol=1e-6)
    torch.testing.assert_close(out_k, ref_k[0].transpose(0, 1), rtol=0, atol=1e-6)

    ref_q, _ = hf_v3.apply_rotary_pos_emb_interleave(q_hf, k_hf, cos, sin)
    deinterleaved = torch.cat((out_q[..., 0::2], out_q[..., 1::2]), dim=-1)
    torch.testing.assert_close(deinterleaved, ref_q[0].transpose(0, 1), rtol=0, atol=1e-6)


# ------------------------------------------------------------------------------------ MLA


def _randomize(module: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.2 * noise if "layernorm" in name else 0.15 * noise)


def _hf_attention(hf: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """HF eager attention of one sequence ``x [T, H]`` with a causal mask -> ``[T, H]``; the
    position embeddings come from the HF rotary class of the same version."""
    t = x.shape[0]
    pos = torch.arange(t)[None]
    mask = torch.full((t, t), torch.finfo(x.dtype).min).triu(1)[None, None]  # [1, 1, T, T]
    if isinstance(hf, hf_v3.DeepseekV3Attention):
        pe = hf_v3.DeepseekV3RotaryEmbedding(hf.config)(x[None], pos)  # (cos, sin)
    else:
        pe = hf_v2.DeepseekV2RotaryEmbedding(hf.config)(x[None], pos)  # complex freqs_cis
    out, _ = hf(x[None], position_embeddings=pe, attention_mask=mask)
    return out[0]


MLA_CASES = {
    "v3_qlora_yarn": (3, dict(q_lora_rank=24, rope_parameters=dict(YARN_TINY))),
    "v3_noqlora_yarn_bias": (
        3,
        dict(q_lora_rank=None, attention_bias=True, rope_parameters=dict(YARN_TINY)),
    ),
    "v3_rotate_half_default": (
        3,
        dict(q_lora_rank=24, rope_interleave=False, rope_parameters={"rope_type": "default"}),
    ),
    "v2_noqlora_yarn": (2, dict(q_lora_rank=None, rope_parameters=dict(YARN_TINY))),
    "v2_qlora_default": (2, dict(q_lora_rank=24, rope_parameters={"rope_type": "default"})),
}


def _build_pair(case: str, absorb_decode: bool) -> tuple[torch.nn.Module, MLAAttention]:
    """HF attention with random weights and ours with the same weights."""
    version, overrides = MLA_CASES[case]
    overrides = {**overrides, "rope_parameters": dict(overrides["rope_parameters"])}
    overrides["rope_parameters"].setdefault("rope_theta", 10000.0)
    cfg = _config(version, **overrides)
    hf_cls = hf_v3.DeepseekV3Attention if version == 3 else hf_v2.DeepseekV2Attention
    hf = hf_cls(cfg, layer_idx=0).eval()
    _randomize(hf, seed=7)
    dims = MLADims(
        cfg.num_attention_heads,
        cfg.q_lora_rank,
        cfg.kv_lora_rank,
        cfg.qk_nope_head_dim,
        cfg.qk_rope_head_dim,
        cfg.v_head_dim,
    )
    ours = MLAAttention(
        cfg.hidden_size,
        dims,
        cfg.rope_parameters,
        cfg.max_position_embeddings,
        rope_interleave=version == 2 or cfg.rope_interleave,
        attention_bias=cfg.attention_bias,
        absorb_decode=absorb_decode,
    ).eval()
    ours.load_state_dict(hf.state_dict())  # strict: HF names map 1:1
    assert ours.scale == hf.scaling
    return hf, ours


def _empty_cache(dims: MLADims, num_slots: int = 96) -> tuple[torch.Tensor, torch.Tensor]:
    shapes = MLAAttention.kv_cache_shapes(dims.kv_lora_rank, dims.qk_rope_head_dim)
    return tuple(torch.full((num_slots, *s), float("nan")) for s in shapes)


@pytest.mark.parametrize("case", list(MLA_CASES))
@torch.no_grad()
def test_mla_single_prefill_matches_hf(case):
    hf, ours = _build_pair(case, absorb_decode=True)
    torch.manual_seed(1)
    t = 37
    x = torch.randn(t, hf.config.hidden_size)
    slots = torch.randperm(96)[:t]  # scattered slots: paging is exercised
    meta = AttentionMetadata(
        positions=torch.arange(t),
        slot_mapping=slots,
        prefills=[PrefillSpan(token_start=0, num_tokens=t, kv_len=t, kv_slots=slots)],
    )
    cache = _empty_cache(ours.dims)
    out = ours(x, meta, cache)
    torch.testing.assert_close(out, _hf_attention(hf, x), rtol=1e-5, atol=1e-5)
    assert not cache[0][slots].isnan().any() and not cache[1][slots].isnan().any()


def _decode_meta(seqs: list[tuple[int, torch.Tensor]]) -> dict:
    """Decode fields for sequences given as (position of the new token, slots [pos + 1]):
    block_size 1, so a block table is the slot list (padded with slot 0, masked)."""
    max_len = max(pos + 1 for pos, _ in seqs)
    tables = torch.zeros(len(seqs), max_len, dtype=torch.int64)
    for i, (pos, slots) in enumerate(seqs):
        tables[i, : pos + 1] = slots[: pos + 1]
    bucket = DecodeBucket(0, len(seqs), tables, torch.tensor([pos + 1 for pos, _ in seqs]))
    return dict(num_decode_tokens=len(seqs), decode_buckets=[bucket], block_size=1)


@pytest.mark.parametrize("absorb_decode", [True, False])
@pytest.mark.parametrize("case", list(MLA_CASES))
@torch.no_grad()
def test_mla_chunked_prefill_and_decode_match_full_prefill(case, absorb_decode):
    """Two sequences through the paged cache in three mixed steps; every row must equal the
    corresponding row of HF's one-shot prefill of that sequence.

    step 1: A prefill [0, 20) + B first chunk [0, 12)
    step 2: A decode 20 + B continuation chunk [12, 30)
    step 3: A decode 21 + B decode 30 (decode contexts of different lengths, padded)
    """
    hf, ours = _build_pair(case, absorb_decode)
    torch.manual_seed(2)
    len_a, len_b = 22, 31
    hidden = hf.config.hidden_size
    xa, xb = torch.randn(len_a, hidden), torch.randn(len_b, hidden)
    ref_a, ref_b = _hf_attention(hf, xa), _hf_attention(hf, xb)
    perm = torch.randperm(96)
    slots_a, slots_b = perm[:len_a], perm[len_a : len_a + len_b]
    cache = _empty_cache(ours.dims)

    # step 1
    x = torch.cat((xa[:20], xb[:12]))
    meta = AttentionMetadata(
        positions=torch.cat((torch.arange(20), torch.arange(12))),
        slot_mapping=torch.cat((slots_a[:20], slots_b[:12])),
        prefills=[PrefillSpan(0, 20, 20, slots_a[:20]), PrefillSpan(20, 12, 12, slots_b[:12])],
    )
    out = ours(x, meta, cache)
    torch.testing.assert_close(out, torch.cat((ref_a[:20], ref_b[:12])), rtol=1e-5, atol=1e-5)

    # step 2
    x = torch.cat((xa[20:21], xb[12:30]))
    meta = AttentionMetadata(
        positions=torch.cat((torch.tensor([20]), torch.arange(12, 30))),
        slot_mapping=torch.cat((slots_a[20:21], slots_b[12:30])),
        prefills=[PrefillSpan(1, 18, 30, slots_b[:30])],
        **_decode_meta([(20, slots_a)]),
    )
    out = ours(x, meta, cache)
    torch.testing.assert_close(out, torch.cat((ref_a[20:21], ref_b[12:30])), rtol=1e-5, atol=1e-5)

    # step 3
    x = torch.cat((xa[21:22], xb[30:31]))
    meta = AttentionMetadata(
        positions=torch.tensor([21, 30]),
        slot_mapping=torch.stack((slots_a[21], slots_b[30])),
        **_decode_meta([(21, slots_a), (30, slots_b)]),
    )
    out = ours(x, meta, cache)
    torch.testing.assert_close(out, torch.stack((ref_a[21], ref_b[30])), rtol=1e-5, atol=1e-5)


def test_mla_kv_bytes_per_token():
    v3 = MLADims(128, 1536, 512, 128, 64, 128)
    assert v3.kv_bytes_per_token(2) == {"mla": 1152.0, "mha": 81920.0, "ratio": 81920 / 1152}
    assert MLAAttention.kv_cache_shapes(512, 64) == ((512,), (64,))


# ---------------------------------------------------------------------------------- routing


def _v3_router(norm_topk_prob: bool, seed: int = 0):
    cfg = DeepseekV3Config(
        hidden_size=32,
        n_routed_experts=32,
        n_group=4,
        topk_group=2,
        num_experts_per_tok=4,
        norm_topk_prob=norm_topk_prob,
        routed_scaling_factor=2.5,
        num_hidden_layers=1,
        vocab_size=10,
    )
    router = hf_v3.DeepseekV3TopkRouter(cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=gen) * 0.3)
        # Spread comparable to the sigmoid scores' own, so the bias changes choices.
        router.e_score_correction_bias.copy_(torch.randn(32, generator=gen) * 0.3)
    return cfg, router


@pytest.mark.parametrize("norm_topk_prob", [True, False])
@torch.no_grad()
def test_v3_noaux_tc_routing_matches_hf(norm_topk_prob):
    cfg, router = _v3_router(norm_topk_prob)
    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    hf_logits, hf_weights, hf_ids = router(x)
    logits = deepseek_router_logits(x, router.weight)
    assert logits.dtype == torch.float32 and torch.equal(logits, hf_logits)
    route = dict(
        top_k=cfg.num_experts_per_tok,
        scoring_func="sigmoid",
        topk_method="noaux_tc",
        n_group=cfg.n_group,
        topk_group=cfg.topk_group,
        norm_topk_prob=norm_topk_prob,
        routed_scaling_factor=cfg.routed_scaling_factor,
    )
    bias = router.e_score_correction_bias
    weights, ids = select_experts_deepseek(logits, e_score_correction_bias=bias, **route)
    assert ids.dtype == torch.int64 and weights.dtype == torch.float32
    assert torch.equal(ids, hf_ids)
    torch.testing.assert_close(weights, hf_weights, rtol=0, atol=0)
    if norm_topk_prob:
        torch.testing.assert_close(weights.sum(-1), torch.full((64,), 2.5))

    # The bias matters: choosing without it picks other experts for some tokens.
    _, ids_unbiased = select_experts_deepseek(
        logits, e_score_correction_bias=torch.zeros_like(bias), **route
    )
    changed = (ids.sort(-1).values != ids_unbiased.sort(-1).values).any(-1)
    assert changed.sum() >= 5
    # The group limit matters: with all groups allowed some choices change.
    _, ids_all_groups = select_experts_deepseek(
        logits, e_score_correction_bias=bias, **{**route, "topk_group": cfg.n_group}
    )
    assert (ids.sort(-1).values != ids_all_groups.sort(-1).values).any()

    # Teeth: a wrong variant taking the weights from the *biased* scores does not match.
    biased = logits.sigmoid() + bias
    wrong = biased.gather(1, ids)
    if norm_topk_prob:
        wrong = wrong / (wrong.sum(-1, keepdim=True) + 1e-20)
    wrong = wrong * cfg.routed_scaling_factor
    assert not torch.allclose(wrong, hf_weights, atol=1e-3)


@pytest.mark.parametrize("topk_method", ["greedy", "group_limited_greedy"])
@torch.no_grad()
def test_v2_routing_matches_hf(topk_method):
    cfg = DeepseekV2Config(
        hidden_size=32,
        n_routed_experts=16,
        n_group=4,
        topk_group=2,
        num_experts_per_tok=3,
        topk_method=topk_method,
        routed_scaling_factor=16.0,
        num_hidden_layers=1,
        vocab_size=10,
    )
    router = hf_v2.DeepseekV2TopkRouter(cfg)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=gen))
    x = torch.randn(64, 32, generator=gen)
    hf_logits, hf_weights, hf_ids = router(x)
    logits = deepseek_router_logits(x, router.weight)
    assert torch.equal(logits, hf_logits)
    route = dict(
        top_k=3,
        scoring_func="softmax",
        n_group=4,
        topk_group=2,
        norm_topk_prob=cfg.norm_topk_prob,  # False: HF V2 never normalises
        routed_scaling_factor=16.0,
    )
    weights, ids = select_experts_deepseek(logits, topk_method=topk_method, **route)
    assert torch.equal(ids, hf_ids)
    torch.testing.assert_close(weights, hf_weights, rtol=0, atol=0)
    if topk_method == "group_limited_greedy":
        _, greedy_ids = select_experts_deepseek(logits, topk_method="greedy", **route)
        assert (ids.sort(-1).values != greedy_ids.sort(-1).values).any()


def test_routing_rejects_bad_arguments():
    logits = torch.randn(4, 8)
    with pytest.raises(ValueError, match="scoring_func"):
        select_experts_deepseek(logits, 2, scoring_func="relu")
    with pytest.raises(ValueError, match="topk_method"):
        select_experts_deepseek(logits, 2, topk_method="random")
    with pytest.raises(ValueError, match="e_score_correction_bias"):
        select_experts_deepseek(logits, 2, scoring_func="sigmoid", topk_method="noaux_tc")
    with pytest.raises(ValueError, match="n_group"):
        select_experts_deepseek(logits, 2, topk_method="group_limited_greedy", n_group=3)


@pytest.mark.parametrize("absorb_decode", [True, False])
@torch.no_grad()
def test_mla_bfloat16_close_to_float32_reference(absorb_decode):
    """bf16 weights, activations and cache (prefill then decode) stay within bf16 rounding of
    HF's float32 output."""
    hf, ours = _build_pair("v3_qlora_yarn", absorb_decode)
    ours = ours.to(torch.bfloat16)
    torch.manual_seed(3)
    t = 24
    x = torch.randn(t, hf.config.hidden_size)
    ref = _hf_attention(hf, x)
    slots = torch.randperm(96)[:t]
    cache = tuple(c.to(torch.bfloat16) for c in _empty_cache(ours.dims))
    xb = x.to(torch.bfloat16)
    meta = AttentionMetadata(
        positions=torch.arange(t - 1),
        slot_mapping=slots[: t - 1],
        prefills=[PrefillSpan(0, t - 1, t - 1, slots[: t - 1])],
    )
    prefill = ours(xb[: t - 1], meta, cache)
    meta = AttentionMetadata(
        positions=torch.tensor([t - 1]),
        slot_mapping=slots[t - 1 :],
        **_decode_meta([(t - 1, slots)]),
    )
    decode = ours(xb[t - 1 :], meta, cache)
    out = torch.cat((prefill, decode)).float()
    assert out.dtype == torch.float32 and cache[0].dtype == torch.bfloat16
    torch.testing.assert_close(out, ref, rtol=0, atol=0.03 * ref.abs().max().item())


@pytest.mark.parametrize("version", [2, 3])
@torch.no_grad()
def test_mla_from_model_config_matches_hf(version):
    """`MLAAttention.from_config` reads `ModelConfig.from_hf` of a DeepSeek config correctly
    (rope layout, attention_bias, q_lora_rank, YaRN scale)."""
    from batchgen.models.model_config import ModelConfig

    arch = f"DeepseekV{version}ForCausalLM"
    cfg = _config(
        version,
        q_lora_rank=24 if version == 3 else None,
        attention_bias=True,
        rope_parameters=dict(YARN_TINY),
        architectures=[arch],
        intermediate_size=32,
        moe_intermediate_size=16,
        n_routed_experts=8,
        num_experts_per_tok=2,
    )
    hf = (hf_v3.DeepseekV3Attention if version == 3 else hf_v2.DeepseekV2Attention)(cfg, 0)
    _randomize(hf, seed=5)
    ours = MLAAttention.from_config(ModelConfig.from_hf(cfg))
    ours.load_state_dict(hf.state_dict())
    t = 30
    x = torch.randn(t, cfg.hidden_size, generator=torch.Generator().manual_seed(4))
    slots = torch.arange(t)
    meta = AttentionMetadata(
        positions=torch.arange(t), slot_mapping=slots, prefills=[PrefillSpan(0, t, t, slots)]
    )
    out = ours(x, meta, _empty_cache(ours.dims))
    torch.testing.assert_close(out, _hf_attention(hf, x), rtol=1e-5, atol=1e-5)


def test_v3_router_stays_float32_in_a_bfloat16_model(checkpoint_dir):
    """HF keeps DeepSeek-V3's ``gate.weight`` and ``e_score_correction_bias`` in float32 in any
    dtype (``_keep_in_fp32_modules_strict``); so do we, and the loaded bf16 model then routes
    bf16 activations exactly as HF's bf16 router does (ids and weights)."""
    from transformers import AutoModelForCausalLM

    from batchgen import LLM

    path = checkpoint_dir("deepseek_v3_plain")
    model = LLM(str(path), dtype="bfloat16", kv_cache_memory_gb=0.01).llm_engine.runner.model
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    x = torch.randn(64, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    x = x.bfloat16()
    for ours, theirs in zip(model.layers, ref.model.layers):
        gate = ours.mlp.gate
        assert gate.weight.dtype == gate.e_score_correction_bias.dtype == torch.float32
        assert ours.mlp.w13_weight.dtype == torch.bfloat16
        assert torch.equal(gate.weight, theirs.mlp.gate.weight)
        assert torch.equal(gate.e_score_correction_bias, theirs.mlp.gate.e_score_correction_bias)
        with torch.no_grad():
            weights, ids = ours.mlp.route(x)
            _, want_weights, want_ids = theirs.mlp.gate(x)
        order, want_order = ids.argsort(-1), want_ids.argsort(-1)
        assert torch.equal(ids.gather(1, order), want_ids.gather(1, want_order))
        assert torch.equal(weights.gather(1, order), want_weights.gather(1, want_order))
