"""Data-parallel attention + expert-parallel MoE on 2 and 3 local ranks (gloo) against one
process, token for token: Mixtral, Qwen2-MoE (shared expert with gate) and DeepSeek-V3 (MLA,
grouped top-k with correction bias), prompts of mixed lengths with a KV cache small enough to
force preemption, greedy and seeded sampling, ``prefill_strategy`` both ways."""

from __future__ import annotations

import random

import pytest

from batchgen import LLM, SamplingParams

KV_BLOCKS = 12  # 192 tokens per rank: the batch below cannot fit, so ranks preempt


def _prompts(vocab: int = 500) -> list[list[int]]:
    rng = random.Random(5)
    lengths = [3, 120, 17, 64, 1, 33, 90, 9, 48, 25]
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def _params() -> list[SamplingParams]:
    greedy = [
        SamplingParams(max_tokens=4 + 2 * i, temperature=0.0, ignore_eos=True) for i in range(10)
    ]
    seeded = [
        SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, n=2, seed=11, ignore_eos=True),
        SamplingParams(max_tokens=7, temperature=1.0, seed=3, ignore_eos=True),
    ]
    return greedy + seeded


def _run(llm: LLM) -> list[list[list[int]]]:
    prompts = _prompts()
    prompts = prompts + [prompts[1], prompts[3]]  # the seeded requests
    outs = llm.generate(prompts, _params(), use_tqdm=False)
    return [[c.token_ids for c in o.outputs] for o in outs]


@pytest.fixture(scope="module")
def reference(checkpoint_dir):
    cache = {}

    def get(arch: str):
        if arch not in cache:
            llm = LLM(str(checkpoint_dir(arch)), num_gpu_blocks_override=KV_BLOCKS)
            cache[arch] = (_run(llm), llm.get_metrics())
        return cache[arch]

    return get


CONFIGS = [
    ("mixtral", 2, "expert_parallel"),
    ("mixtral", 3, "data_parallel_offload"),
    ("qwen2_moe", 2, "data_parallel_offload"),
    ("qwen2_moe", 3, "expert_parallel"),
    ("deepseek_v3", 2, "expert_parallel"),
    ("deepseek_v3", 3, "data_parallel_offload"),
]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("arch,world,strategy", CONFIGS, ids=lambda v: str(v))
def test_expert_parallel_matches_one_process(checkpoint_dir, reference, arch, world, strategy):
    want, single = reference(arch)
    llm = LLM(
        str(checkpoint_dir(arch)),
        num_gpu_blocks_override=KV_BLOCKS,
        data_parallel_size=world,
        enable_expert_parallel=True,
        prefill_strategy=strategy,
        prefill_stream_min_tokens=1,  # stream in every step with a prefill
    )
    try:
        got = _run(llm)
        metrics = llm.get_metrics()
    finally:
        llm.shutdown()
    assert got == want
    ranks = metrics["ranks"]
    assert [r["rank"] for r in ranks] == list(range(world))
    assert sum(r["num_preemptions"] for r in ranks) > 0  # preemption happened on some rank
    assert all(r["generated_tokens"] > 0 for r in ranks)  # every rank ran requests
    # The job's decode-only steps: every rank's, their histograms merged by step size.
    assert metrics["decode_only_steps"] == sum(r["decode_only_steps"] for r in ranks) > 0
    merged: dict[int, int] = {}
    for r in ranks:
        for tokens, steps in r["decode_only_step_tokens"].items():
            merged[tokens] = merged.get(tokens, 0) + steps
    assert metrics["decode_only_step_tokens"] == merged
    assert sum(n * k for n, k in merged.items()) == metrics["decode_only_tokens"]
    # Each rank holds its share of the routed experts, together exactly the model's.
    full = single["routed_expert_bytes"]
    cfg = _model_config(checkpoint_dir(arch))
    per_expert_layer = full // (cfg.num_local_experts * sum(cfg.layer_is_moe))
    assert sum(r["routed_expert_bytes"] for r in ranks) == full
    for r in ranks:
        assert r["routed_expert_bytes"] == full * r["held_experts"] // cfg.num_local_experts
        assert r["held_experts"] in (
            cfg.num_local_experts // world,
            -(-cfg.num_local_experts // world),
        )
        assert r["all_to_all_bytes"] > 0
        if strategy == "data_parallel_offload":
            streamed = cfg.num_local_experts - r["held_experts"]
            assert r["streamed_bytes"] > 0 and r["streamed_layers"] > 0
            # The bound: stream_buffer_layers (2) layers of the experts this rank lacks.
            assert 0 < r["stream_buffer_peak_bytes"] <= 2 * streamed * per_expert_layer
        else:
            assert "streamed_bytes" not in r


def _model_config(path):
    from transformers import AutoConfig

    from batchgen.models.model_config import ModelConfig

    return ModelConfig.from_hf(AutoConfig.from_pretrained(path))


MORE = [
    ("mixtral_top4", dict(enable_expert_parallel=True)),  # padded dispatch rows
    ("qwen3_moe", dict(enable_expert_parallel=True)),
    ("olmoe", dict(enable_expert_parallel=True)),
    ("deepseek_v2", dict(enable_expert_parallel=True, prefill_strategy="data_parallel_offload")),
    ("llama", dict(enable_expert_parallel=True)),  # dense: data parallel only
    ("mixtral", dict(decode_strategy="data_parallel")),  # experts replicated on every rank
]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("arch,kwargs", MORE, ids=[f"{a}-{sorted(k)[-1]}" for a, k in MORE])
def test_every_architecture_on_two_ranks(checkpoint_dir, reference, arch, kwargs):
    want, single = reference(arch)
    llm = LLM(
        str(checkpoint_dir(arch)),
        num_gpu_blocks_override=KV_BLOCKS,
        data_parallel_size=2,
        prefill_stream_min_tokens=1,
        **kwargs,
    )
    try:
        got = _run(llm)
        ranks = llm.get_metrics()["ranks"]
    finally:
        llm.shutdown()
    assert got == want
    with pytest.raises(RuntimeError, match="this engine was shut down"):
        llm.generate(["after shutdown"], use_tqdm=False)
    sharded = kwargs.get("enable_expert_parallel") and single["routed_expert_bytes"] > 0
    for r in ranks:
        if sharded:
            assert r["routed_expert_bytes"] < single["routed_expert_bytes"]
            assert r["all_to_all_bytes"] > 0
        else:  # replicated experts (or none): no collectives in the model
            assert r["routed_expert_bytes"] == single["routed_expert_bytes"]
            assert "all_to_all_bytes" not in r


@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy", ["expert_parallel", "data_parallel_offload"])
def test_bfloat16_on_two_ranks(checkpoint_dir, strategy):
    """bf16 hidden states cross gloo and streamed bf16 experts run: same tokens as one bf16
    process (an adversarial run found every bf16 / fp16 expert-parallel job failing)."""
    path = str(checkpoint_dir("mixtral"))
    want = _run(LLM(path, dtype="bfloat16", num_gpu_blocks_override=KV_BLOCKS))
    llm = LLM(
        path,
        dtype="bfloat16",
        num_gpu_blocks_override=KV_BLOCKS,
        data_parallel_size=2,
        enable_expert_parallel=True,
        prefill_strategy=strategy,
        prefill_stream_min_tokens=1,
    )
    try:
        assert _run(llm) == want
    finally:
        llm.shutdown()


@pytest.mark.timeout(300)
def test_fp8_kv_cache_on_two_ranks(checkpoint_dir):
    """kv_cache_dtype reaches every rank (each rounds its K/V to fp8, preempting and
    recomputing under its 12 blocks): same tokens as one fp8-cache process."""
    path = str(checkpoint_dir("mixtral"))
    kw = dict(kv_cache_dtype="fp8", num_gpu_blocks_override=KV_BLOCKS)
    want = _run(LLM(path, **kw))
    llm = LLM(path, **kw, data_parallel_size=2, enable_expert_parallel=True)
    try:
        assert llm.llm_engine.config.kv_cache_dtype == "fp8"
        assert _run(llm) == want
    finally:
        llm.shutdown()


def test_two_ranks_on_the_default_model_log_the_random_weights_note(monkeypatch, caplog):
    """The frontend logs the note one process logs (the ranks get a path, not None); stopped
    before any rank starts."""
    import logging

    from batchgen.models import default_model, loader
    from batchgen.models.default_model import RANDOM_WEIGHTS_NOTE

    class Stop(Exception):
        pass

    def stop(path):
        raise Stop(path)

    monkeypatch.setattr(default_model, "default_model_path", lambda: "/cache/default-mixtral-v1")
    monkeypatch.setattr(loader, "resolve_model_path", stop)
    with caplog.at_level(logging.WARNING), pytest.raises(Stop, match="default-mixtral-v1"):
        LLM(data_parallel_size=2, enable_expert_parallel=True)
    notes = [r for r in caplog.records if r.getMessage() == RANDOM_WEIGHTS_NOTE]
    assert [r.name for r in notes] == ["batchgen.distributed.frontend"]


def test_llm_accepts_vllms_tensor_parallel_size_1_and_refuses_others():
    from batchgen.entrypoints.llm import _resolve_configs

    engine, parallel, _ = _resolve_configs(None, None, {"tensor_parallel_size": 1})
    assert (engine.model, parallel.data_parallel_size) == (None, 1)  # a no-op
    for value in (2, True, "1"):
        with pytest.raises(ValueError) as info:
            LLM(tensor_parallel_size=value)
        assert str(info.value) == (
            f"tensor_parallel_size must be 1, got {value!r}: BatchGen has no tensor parallelism "
            "(1 is accepted as a no-op); for several ranks use data_parallel_size=N, "
            "enable_expert_parallel=True (data-parallel attention, the experts sharded over "
            "the ranks: docs/distributed.md)"
        )
    # vLLM's pipeline_parallel_size: 1 is a no-op too, others are refused with the reason
    _resolve_configs(None, None, {"pipeline_parallel_size": 1})
    with pytest.raises(ValueError, match=r"vLLM's pipeline_parallel_size=2 is not taken by Batch"):
        LLM(pipeline_parallel_size=2)
