"""`LLM.update_weights`: an engine started on checkpoint A and updated to checkpoint B (from a
state dict or from B's directory) generates exactly what a fresh engine on B does, on a MoE
model with the CPU fused-MoE kernel active; partial updates change only what they name; bad
names or shapes change nothing."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from batchgen import LLM, SamplingParams
from batchgen.kernels import fused_moe as fm
from batchgen.models.layers.moe import SparseMoeBlock
from batchgen.models.make_model import make_model
from tests.conftest import CHECKPOINTS

pytestmark = pytest.mark.skipif(
    not fm.fused_moe_available(
        torch.zeros(1, 16), torch.zeros(1, 16, 16), torch.zeros(1, 16, 8), F.silu
    ),
    reason="the fused MoE kernel is not built here (no compiler or no AVX2/FMA)",
)

PROMPTS = [
    {"prompt_token_ids": [1, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24]},
    {"prompt_token_ids": [1, *range(100, 106)]},
    "The capital of France is",
]
# Greedy, and seeded sampling with n=3 (the samples share their prompt's KV blocks).
PARAMS = [
    SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True),
    SamplingParams(temperature=1.0, seed=7, n=3, max_tokens=10, ignore_eos=True),
]


@pytest.fixture(scope="module")
def paths(checkpoint_dir, tmp_path_factory):
    """Two tiny Mixtral checkpoints of one config with different random weights."""
    arch, overrides = CHECKPOINTS["mixtral"]
    b = make_model(arch, tmp_path_factory.mktemp("ckpt_b") / "mixtral_b", seed=4321, **overrides)
    return checkpoint_dir("mixtral"), b


def _llm(path) -> LLM:
    return LLM(str(path), device="cpu", dtype="float32", block_size=16, kv_cache_memory_gb=0.05)


def _tokens(llm: LLM) -> list:
    """Token ids of every sample of every prompt, under each of `PARAMS`."""
    out = []
    for params in PARAMS:
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
        out.append([[c.token_ids for c in o.outputs] for o in outs])
    return out


def _moe_blocks(llm: LLM) -> list[SparseMoeBlock]:
    model = llm.llm_engine.runner.model
    return [m for m in model.modules() if isinstance(m, SparseMoeBlock)]


@pytest.fixture(scope="module")
def expected(paths):
    """What fresh engines on A and on B generate."""
    a, b = paths
    return _tokens(_llm(a)), _tokens(_llm(b))


def _hf_state_dict(path) -> dict[str, torch.Tensor]:
    """B's weights as a trainer holds them: transformers' in-memory state dict (fused
    ``mlp.experts.gate_up_proj [E, 2I, H]`` names, unlike the file's per-expert ``w1/w2/w3``)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _params(llm: LLM) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in llm.llm_engine.runner.model.named_parameters()}


def test_the_two_checkpoints_generate_differently(expected):
    out_a, out_b = expected
    assert out_a != out_b


@pytest.mark.parametrize("source", ["state_dict", "directory", "float64_pairs"])
def test_update_to_b_generates_like_a_fresh_engine_on_b(paths, expected, source, monkeypatch):
    a, b = paths
    out_a, out_b = expected
    llm = _llm(a)
    assert _tokens(llm) == out_a
    blocks = _moe_blocks(llm)
    assert blocks and all(blk._packed is not None for blk in blocks)  # the kernel ran
    x = torch.zeros(1, blocks[0].w13_weight.shape[2])
    assert all(blk.uses_kernel(x) for blk in blocks)
    old_packed = [blk._packed[1].clone() for blk in blocks]

    resets = []
    kv_cache = llm.llm_engine.kv_cache
    original = kv_cache.reset_prefix_cache
    monkeypatch.setattr(kv_cache, "reset_prefix_cache", lambda: resets.append(1) or original())
    shared_before = llm.get_metrics()["shared_prefix_tokens"]
    assert kv_cache.prefix_cache.num_cached_blocks > 0  # PROMPTS[0]'s first block
    if source == "state_dict":
        weights = _hf_state_dict(b)
        expected_count = len(weights)  # one per tensor, lm_head included (not tied)
    elif source == "directory":
        weights = b
        expected_count = len(load_file(str(b / "model.safetensors")))
    else:  # another dtype, as (name, tensor) pairs: converted to the engine's float32
        weights = [(k, v.double()) for k, v in _hf_state_dict(b).items()]
        expected_count = len(weights)
    n = llm.update_weights(weights)
    assert n == expected_count
    assert resets == [1]
    assert all(blk._packed is None for blk in blocks)  # dropped, packed again on first use
    assert kv_cache.prefix_cache.num_cached_blocks == 0  # no K/V of A can be hit

    hits_before = llm.get_metrics()["prefix_cache_hits"]
    first = llm.generate(PROMPTS, PARAMS[0], use_tqdm=False)  # nothing cached: no hit
    assert llm.get_metrics()["prefix_cache_hits"] == hits_before
    assert [[c.token_ids for c in o.outputs] for o in first] == out_b[0]
    assert _tokens(llm) == out_b
    for blk, old in zip(blocks, old_packed, strict=True):  # rebuilt from the new weights
        assert not torch.equal(blk._packed[1], old)
        assert torch.equal(blk._packed[1], fm.pack_expert_weights(blk.w13_weight))
        assert torch.equal(blk._packed[2], fm.pack_expert_weights(blk.w2_weight))
    # The samples of a request still share their prompt's (new) K/V blocks.
    assert llm.get_metrics()["shared_prefix_tokens"] > shared_before
    assert kv_cache.num_free_blocks == kv_cache.num_blocks


def test_updated_engine_equals_fresh_b_parameter_by_parameter(paths):
    a, b = paths
    llm = _llm(a)
    llm.update_weights(b)
    fresh = _params(_llm(b))
    assert _params(llm).keys() == fresh.keys()
    for name, value in _params(llm).items():
        assert torch.equal(value, fresh[name]), name


def test_partial_update_changes_only_the_named_tensor(paths):
    a, b = paths
    llm = _llm(a)
    before = _params(llm)
    b_weights = load_file(str(b / "model.safetensors"))
    name = "model.layers.1.block_sparse_moe.experts.2.w3.weight"  # expert 2's up rows
    assert llm.update_weights({name: b_weights[name]}) == 1
    after = _params(llm)
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert changed == ["layers.1.mlp.w13_weight"]
    w13_before, w13_after = before[changed[0]], after[changed[0]]
    inter = w13_after.shape[1] // 2
    assert torch.equal(w13_after[2, inter:], b_weights[name])  # the up half of expert 2
    w13_after[2, inter:] = w13_before[2, inter:]
    assert torch.equal(w13_after, w13_before)  # nothing else of the stacked weight moved

    q = "model.layers.0.self_attn.k_proj.weight"  # a slice of the fused qkv_proj
    assert llm.update_weights([(q, b_weights[q])]) == 1
    qkv = llm.llm_engine.runner.model.get_parameter("layers.0.self_attn.qkv_proj.weight")
    q_rows, kv_rows = 64, 32
    assert torch.equal(qkv[q_rows : q_rows + kv_rows], b_weights[q])
    assert torch.equal(qkv[:q_rows], before["layers.0.self_attn.qkv_proj.weight"][:q_rows])


@pytest.mark.parametrize(
    "bad,match",
    [
        (
            {"model.layers.0.self_attn.q_proj.weight": torch.zeros(64, 63)},
            r"'model.layers.0.self_attn.q_proj.weight' has shape \(64, 63\), expected \(64, 64\)",
        ),
        (
            {"model.layers.0.mlp.experts.gate_up_proj": torch.zeros(4, 190, 64)},
            r"'model.layers.0.mlp.experts.gate_up_proj' has shape \(4, 190, 64\), "
            r"expected \(4, 192, 64\) \(engine parameter 'layers.0.mlp.w13_weight'\)",
        ),
        (
            {"model.layers.0.self_attn.k_proj.weight": torch.zeros(16, 64)},  # too few rows
            r"expected \(32, 64\)",
        ),
        ({"model.layers.9.input_layernorm.weight": torch.zeros(64)}, "no engine parameter"),
        ({"model.decoder.weird.weight": torch.zeros(64)}, "no engine parameter"),
        ({"model.norm.weight": torch.zeros(64, dtype=torch.int64)}, "not a floating-point"),
    ],
    ids=["shape", "fused_expert_shape", "qkv_slice_rows", "layer_out_of_range", "name", "dtype"],
)
def test_bad_name_or_shape_changes_nothing(paths, expected, bad, match):
    a, b = paths
    out_a, _ = expected
    llm = _llm(a)
    before = _params(llm)
    # Good tensors listed first: they must not be copied either.
    weights = {**_hf_state_dict(b), **bad}
    with pytest.raises(ValueError, match=match):
        llm.update_weights(weights)
    after = _params(llm)
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert _tokens(llm) == out_a


def test_directory_of_another_model_is_refused(paths, tmp_path, expected):
    a, _ = paths
    out_a, _ = expected
    arch, overrides = CHECKPOINTS["mixtral"]
    other = make_model(arch, tmp_path / "wider", seed=1, **{**overrides, "num_local_experts": 8})
    llm = _llm(a)
    with pytest.raises(ValueError, match=r"num_local_experts=8 \(engine: 4\)"):
        llm.update_weights(other)
    with pytest.raises(ValueError, match="not a checkpoint directory"):
        llm.update_weights(tmp_path / "missing")
    with pytest.raises(TypeError, match="not a tensor"):
        llm.update_weights({"model.norm.weight": [1.0] * 64})
    assert _tokens(llm) == out_a


def test_update_while_requests_are_in_flight_is_refused(paths):
    a, b = paths
    llm = _llm(a)
    llm.llm_engine.add_request("r0", "Hello", SamplingParams(max_tokens=4))
    llm.llm_engine.step()
    assert not llm.reset_prefix_cache()  # blocks are held
    with pytest.raises(RuntimeError, match="in flight"):
        llm.update_weights(b)
    llm.llm_engine.abort_request("r0")
    assert llm.reset_prefix_cache()
    assert llm.update_weights(b) > 0


@pytest.mark.parametrize("name", ["qwen2_moe", "deepseek_v3", "qwen2"])
def test_other_architectures_update_from_a_trainer_state_dict(checkpoint_dir, tmp_path, name):
    """Shared experts with a gate (Qwen2-MoE), MLA and biased sigmoid routing (DeepSeek-V3),
    tied embeddings (Qwen2: ``lm_head.weight`` is ignored, as at load time, and not counted)."""
    arch, overrides = CHECKPOINTS[name]
    b = make_model(arch, tmp_path / name, seed=4321, **overrides)
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)

    def run(llm):
        return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy, use_tqdm=False)]

    llm = _llm(checkpoint_dir(name))
    out_a = run(llm)
    weights = _hf_state_dict(b)
    tied = name == "qwen2"
    assert llm.update_weights(weights) == len(weights) - (1 if tied else 0)
    out_b = run(_llm(b))
    assert out_b != out_a
    assert run(llm) == out_b


def test_sglang_names_and_a_round_trip_back_to_a(paths, expected):
    a, b = paths
    out_a, out_b = expected
    llm = _llm(a)
    assert llm.update_weights_from_tensor(list(_hf_state_dict(b).items())) > 0
    assert _tokens(llm) == out_b
    assert llm.update_weights_from_disk(str(a)) > 0
    assert _tokens(llm) == out_a
