"""`ExpertWeightStreamer`: the slots hold exactly the checkpoint's experts (packed for the CPU
kernel or plain), from per-expert, fused and bfloat16 checkpoints; the buffer is bounded;
misuse and copy failures are errors, not wrong weights. And sharded loading reads only the
held experts."""

from __future__ import annotations

import pytest
import torch
from test_loader import _copy, _rewrite
from transformers import AutoConfig

from batchgen.distributed.weight_stream import ExpertWeightStreamer, MappedSafetensors
from batchgen.kernels.fused_moe import pack_expert_weights
from batchgen.models.loader import load_model
from batchgen.models.model_config import ModelConfig

STREAMED = [1, 3]


def _cfg(path) -> ModelConfig:
    return ModelConfig.from_hf(AutoConfig.from_pretrained(path))


def _full(path):
    return load_model(path, _cfg(path), torch.device("cpu"), torch.float32)


def _fuse(t):
    for layer in range(2):
        p = f"model.layers.{layer}.block_sparse_moe."
        w1 = [t.pop(f"{p}experts.{e}.w1.weight") for e in range(4)]
        w3 = [t.pop(f"{p}experts.{e}.w3.weight") for e in range(4)]
        w2 = [t.pop(f"{p}experts.{e}.w2.weight") for e in range(4)]
        q = f"model.layers.{layer}.mlp."
        t[q + "experts.gate_up_proj"] = torch.stack([torch.cat([g, u]) for g, u in zip(w1, w3)])
        t[q + "experts.down_proj"] = torch.stack(w2)
        t[q + "gate.weight"] = t.pop(p + "gate.weight")


def _bf16(t):
    for k in list(t):
        t[k] = t[k].to(torch.bfloat16)


@pytest.mark.parametrize("layout", ["per_expert", "fused", "bfloat16"])
@pytest.mark.parametrize("packed", [True, False], ids=["packed", "plain"])
def test_slots_hold_the_checkpoint_experts(checkpoint_dir, tmp_path, layout, packed):
    path = _copy(checkpoint_dir, tmp_path)
    if layout == "fused":
        _rewrite(path, _fuse)
    elif layout == "bfloat16":
        _rewrite(path, _bf16)
    cfg = _cfg(path)
    full = _full(path)
    s = ExpertWeightStreamer(
        path, cfg, STREAMED, [0, 1], torch.float32, torch.device("cpu"), packed, num_slots=1
    )
    try:
        assert s.slot_of.tolist() == [-1, 0, -1, 1]
        s.begin_step()
        for layer in (0, 1):
            w13, w2 = s.acquire(layer)
            want13 = full.layers[layer].mlp.w13_weight[STREAMED]
            want2 = full.layers[layer].mlp.w2_weight[STREAMED]
            if packed:
                want13, want2 = pack_expert_weights(want13), pack_expert_weights(want2)
            assert torch.equal(w13, want13) and torch.equal(w2, want2)
            s.release(layer)
        per_layer = (w13.numel() + w2.numel()) * 4
        assert s.stats.peak_buffer_bytes == per_layer  # one slot: the bound
        assert s.stats.layers_streamed == 2
        source_bytes = 2 if layout == "bfloat16" else 4
        assert s.stats.bytes_streamed == 2 * per_layer // 4 * source_bytes
    finally:
        s.close()


def test_two_slots_prefetch_ahead_and_misuse_is_an_error(checkpoint_dir):
    path = checkpoint_dir("mixtral")
    s = ExpertWeightStreamer(
        path, _cfg(path), STREAMED, [0, 1], torch.float32, torch.device("cpu"), True
    )
    try:
        with pytest.raises(RuntimeError, match="layer 0 was not queued"):
            s.acquire(0)
        s.begin_step()
        with pytest.raises(RuntimeError, match="previous step still holds"):
            s.begin_step()
        s.acquire(1)  # both layers are queued at once with two slots
        s.abort_step()
        s.begin_step()  # a fresh step after an aborted one
        s.acquire(0)
        s.release(0)
        s.acquire(1)
        s.release(1)
        assert s.stats.hidden_share is not None and 0.0 <= s.stats.hidden_share <= 1.0
    finally:
        s.close()


def test_a_failed_copy_is_raised_by_acquire(checkpoint_dir, tmp_path):
    path = _copy(checkpoint_dir, tmp_path)
    _rewrite(path, lambda t: t.pop("model.layers.1.block_sparse_moe.experts.3.w2.weight"))
    s = ExpertWeightStreamer(
        path, _cfg(path), STREAMED, [0, 1], torch.float32, torch.device("cpu"), True
    )
    try:
        s.begin_step()
        s.acquire(0)
        s.release(0)
        with pytest.raises(RuntimeError, match="streaming layer 1") as info:
            s.acquire(1)
        assert "expert 3: no w2" in str(info.value.__cause__)
    finally:
        s.close()


def test_mapped_safetensors_views_match_safetensors(checkpoint_dir):
    from safetensors import safe_open

    path = checkpoint_dir("mixtral") / "model.safetensors"
    mapped = MappedSafetensors([path])
    with safe_open(str(path), "pt") as f:
        for name in f.keys():
            assert torch.equal(mapped.tensor(name), f.get_tensor(name)), name


@pytest.mark.parametrize("layout", ["per_expert", "fused"])
def test_sharded_loading_reads_only_held_experts(checkpoint_dir, tmp_path, layout):
    path = _copy(checkpoint_dir, tmp_path)
    if layout == "fused":
        _rewrite(path, _fuse)
    full = _full(path)
    part = load_model(path, _cfg(path), torch.device("cpu"), torch.float32, expert_ids=[2, 3])
    for layer in range(2):
        a, b = full.layers[layer].mlp, part.layers[layer].mlp
        assert b.w13_weight.shape[0] == 2
        assert torch.equal(a.w13_weight[2:], b.w13_weight)
        assert torch.equal(a.w2_weight[2:], b.w2_weight)
        assert torch.equal(a.gate.weight, b.gate.weight)  # the router stays whole
    assert part.routed_expert_bytes() * 2 == full.routed_expert_bytes()
