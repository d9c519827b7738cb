"""The decode roofline of `batchgen bench` (`batchgen.bench.roofline`): its arithmetic by hand
on a tiny model, the engine's decode-only step counts it reads, and the bench's record."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from batchgen.bench.flops import active_params_per_token, attention_flops
from batchgen.bench.roofline import (
    decode_roofline,
    kv_bytes_per_position,
    measure_read_gbps,
    weight_bytes,
)


@pytest.fixture
def mixtral_cfg(checkpoint_dir):
    from transformers import AutoConfig

    from batchgen.models.model_config import ModelConfig

    return ModelConfig.from_hf(AutoConfig.from_pretrained(checkpoint_dir("mixtral")))


def test_kv_and_weight_bytes_by_hand(mixtral_cfg):
    c = mixtral_cfg
    per_layer = 2 * c.num_key_value_heads * c.head_dim  # K and V of every KV head
    assert kv_bytes_per_position(c, 2) == per_layer * 2 * c.num_hidden_layers
    assert kv_bytes_per_position(c, 1) * 4 == kv_bytes_per_position(c, 4)
    h, q, kv = c.hidden_size, c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    # Every expert of every layer (a step of many tokens touches them all), router, attention,
    # LM head; not the embedding (a gather).
    layer = h * (q + 2 * kv) + q * h + h * c.num_local_experts
    layer += c.num_local_experts * 3 * h * c.moe_intermediate_size
    assert weight_bytes(c, 4) == 4 * (c.num_hidden_layers * layer + h * c.vocab_size)
    assert weight_bytes(c, 4) > 4 * active_params_per_token(c)  # top-k < experts
    # A step of one token reads its top-k experts only; of n tokens the expected number of
    # distinct experts under uniform routing, E (1 - (1 - k / E)^n), nearly all from dozens.
    e, k = c.num_local_experts, c.num_experts_per_tok
    expert = 3 * h * c.moe_intermediate_size * 4
    assert weight_bytes(c, 4, 1) == pytest.approx(4 * active_params_per_token(c))
    touched = e * (1 - (1 - k / e) ** 3)
    assert weight_bytes(c, 4, 3) == pytest.approx(
        4 * active_params_per_token(c) + c.num_hidden_layers * (touched - k) * expert
    )
    assert weight_bytes(c, 4, 10_000) == pytest.approx(weight_bytes(c, 4))
    # MLA caches one latent + RoPE key per position and layer, shared by the heads.
    mla = dataclasses.make_dataclass("M", [("kv_lora_rank", int), ("qk_rope_head_dim", int)])
    c_mla = dataclasses.replace(c, mla=mla(kv_lora_rank=32, qk_rope_head_dim=8))
    assert kv_bytes_per_position(c_mla, 2) == (32 + 8) * 2 * c.num_hidden_layers


def test_decode_roofline_by_hand(mixtral_cfg):
    c = mixtral_cfg
    peak_gflops, read_gbps = 100.0, 20.0
    per_token = 2 * active_params_per_token(c)
    weights_s = weight_bytes(c, 4, 1) / 20e9  # one token: its top-k experts
    # Steps of 1 token wait on their weights; steps of 10,000 tokens on their FLOPs.
    big = 10_000
    assert big * per_token / 100e9 > weight_bytes(c, 4, big) / 20e9
    assert weights_s > per_token / 100e9
    steps = {1: 3, big: 2}
    tokens = 3 + 2 * big
    ctx = 100.0
    r = decode_roofline(
        c, step_tokens={str(n): k for n, k in steps.items()},  # keys as JSON gives them back
        mean_context=ctx, seconds=4.0, weight_itemsize=4, kv_itemsize=2,
        peak_gflops=peak_gflops, read_gbps=read_gbps,
    )
    matmul_s = 3 * weights_s + 2 * big * per_token / 100e9
    kv_bytes = kv_bytes_per_position(c, 2) * ctx * tokens
    attn_flops = attention_flops(c, 1) * ctx * tokens
    attention_s = max(kv_bytes / 20e9, attn_flops / 100e9)
    assert r["matmul_s"] == pytest.approx(matmul_s, rel=1e-12)
    assert r["matmul_memory_bound_steps"] == 3 and r["steps"] == 5
    assert r["attention_s"] == pytest.approx(attention_s, rel=1e-12)
    memory_bound = kv_bytes / 20e9 >= attn_flops / 100e9
    assert r["attention_bound"] == ("memory" if memory_bound else "compute")
    assert r["kv_gb"] == pytest.approx(kv_bytes / 1e9, rel=1e-12)
    assert r["roofline_s"] == pytest.approx(matmul_s + attention_s, rel=1e-12)
    assert r["decode_roofline_fraction"] == pytest.approx((matmul_s + attention_s) / 4.0)
    ceiling = (per_token * tokens + attn_flops) / 100e9 / (matmul_s + attention_s)
    assert r["decode_mfu_ceiling"] == pytest.approx(ceiling, rel=1e-12) and 0 < ceiling < 1


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(peak_gflops=0.0), "peak_gflops and read_gbps must be > 0, got 0.0"),
        (dict(read_gbps=-1.0), "read_gbps must be > 0, got 1.0 and -1.0"),
        (dict(step_tokens={0: 4}), "step_tokens holds no step with tokens"),
        (dict(peak_gflops=float("nan")), "peak_gflops and read_gbps must be > 0, got nan"),
        (dict(read_gbps=float("nan")), "must be > 0, got 1.0 and nan"),
        (dict(mean_context=-1.0), "mean_context must be >= 0, got -1.0"),
        (dict(kv_itemsize=0), "weight_itemsize and kv_itemsize must be >= 1 byte, got 4 and 0"),
        (dict(step_tokens={"1.0": 3}), "step_tokens keys must be whole token counts, got '1.0'"),
        (dict(step_tokens={2: 1.5}), "step counts \\(ints >= 0\\), got 2: 1.5"),
        (dict(step_tokens={-2: 1}), "got -2: 1"),
    ],
)
def test_decode_roofline_refuses_what_it_cannot_bound(mixtral_cfg, kwargs, match):
    args = dict(
        step_tokens={4: 1}, mean_context=10.0, seconds=1.0, weight_itemsize=4, kv_itemsize=4,
        peak_gflops=1.0, read_gbps=1.0,
    )
    with pytest.raises(ValueError, match=match):
        decode_roofline(mixtral_cfg, **{**args, **kwargs})


def test_measure_read_gbps_is_a_positive_rate():
    assert 0 < measure_read_gbps(torch.device("cpu"), mib=16, seconds=0.05) < 10_000


def test_engine_counts_its_decode_only_steps_by_size(checkpoint_dir):
    from batchgen import LLM, SamplingParams

    llm = LLM(str(checkpoint_dir("mixtral")), kv_cache_memory_gb=0.05, max_model_len=256)
    prompts = [[3 + i, 7, 9, 11 + i] for i in range(5)]
    lens = [2, 5, 9, 9, 14]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lens]
    llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    m = llm.get_metrics()
    hist = m["decode_only_step_tokens"]
    assert sum(hist.values()) == m["decode_only_steps"] > 0
    assert sum(n * k for n, k in hist.items()) == m["decode_only_tokens"]
    # All five start together and leave one by one: the last steps decode the longest alone.
    assert max(hist) <= 5 and hist.get(1, 0) >= 14 - 9 - 1


def test_measured_rates_are_positive_even_past_their_deadline():
    from batchgen.bench.flops import measure_peak_gflops

    # seconds=0: the deadline has passed after the warm-up call (as float16 matmuls on a CPU
    # take longer than the default second): one timed call still gives a rate, not 0.
    assert measure_peak_gflops(torch.float32, torch.device("cpu"), size=64, seconds=0.0) > 0
    assert measure_read_gbps(torch.device("cpu"), mib=4, seconds=0.0) > 0


def test_decode_roofline_sums_equal_keys_and_formats_without_a_fraction(mixtral_cfg):
    from batchgen.bench.report import _roofline_lines

    args = dict(mean_context=10.0, weight_itemsize=4, kv_itemsize=4, peak_gflops=100.0,
                read_gbps=20.0)
    mixed = decode_roofline(mixtral_cfg, step_tokens={"1": 3, 1: 2}, seconds=1.0, **args)
    assert mixed["steps"] == 5  # "1" and 1 are the same step size: counts add
    assert mixed == decode_roofline(mixtral_cfg, step_tokens={1: 5}, seconds=1.0, **args)
    none = decode_roofline(mixtral_cfg, step_tokens={1: 5}, seconds=0.0, **args)
    assert none["decode_roofline_fraction"] is None
    assert "decode at - of it" in _roofline_lines(none)[0] and len(_roofline_lines(none)) == 1
    fast = decode_roofline(mixtral_cfg, step_tokens={1: 5}, seconds=1e-9, **args)
    assert fast["decode_roofline_fraction"] > 1 and "above 1" in _roofline_lines(fast)[1]


def test_table_says_when_mfu_exceeds_1():
    """float16 on a CPU: torch's float16 matmul (the measured peak) is far slower than the
    engine's paths, so MFU came out at 15-21 with no word on why."""
    from batchgen.bench.report import format_table

    mode = dict(tokens_per_s=10.0, seconds=1.0, useful_tokens=10, mfu=14.9, tile_density=None,
                decode_mfu=4.4, mean_rows_per_expert_gemm=None, num_expert_gemms=None, extra={})
    record = dict(peak_gflops=1.0, dtype="float16", device="cpu", torch_threads=2,
                  workloads={"extraction": {"requests": 1, "coalesce": mode}})
    table = format_table(record)
    assert ("MFU above 1 (extraction/coalesce): the measured matmul peak (1.0 GFLOP/s in "
            "float16) is below what the engine reached") in table
    mode["mfu"] = 0.5
    assert "MFU above 1" not in format_table(record)
