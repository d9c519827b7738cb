"""RoPE's cos/sin computed once per step (`AttentionMetadata.rope_cache`) and reused by every
layer with the same rotary parameters: the same bits as computing them in each layer."""

from __future__ import annotations

import torch

from batchgen.models.layers.attention import AttentionMetadata
from batchgen.models.layers.rotary import RotaryEmbedding

DEFAULT = {"rope_type": "default", "rope_theta": 10000.0}


def _qk(t: int = 7, hq: int = 8, hkv: int = 2, d: int = 64):
    g = torch.Generator().manual_seed(0)
    return torch.randn(t, hq, d, generator=g), torch.randn(t, hkv, d, generator=g)


def test_cached_rotation_is_bitwise_the_uncached_one():
    positions = torch.tensor([0, 1, 5, 17, 300, 2047, 4095])
    q, k = _qk()
    layers = [RotaryEmbedding(64, dict(DEFAULT)) for _ in range(4)]  # one per decoder layer
    cache: dict = {}
    for rope in layers:
        q_ref, k_ref = rope(positions, q, k)
        q_c, k_c = rope(positions, q, k, cache)
        assert torch.equal(q_c, q_ref) and torch.equal(k_c, k_ref)
    assert len(cache) == 1  # four layers, one cos/sin


def test_layers_with_other_rope_parameters_get_their_own_entry():
    positions = torch.arange(9)
    q, k = _qk(t=9)
    a = RotaryEmbedding(64, dict(DEFAULT))
    b = RotaryEmbedding(64, {"rope_type": "default", "rope_theta": 500000.0})
    c = RotaryEmbedding(64, {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0})
    cache: dict = {}
    for rope in (a, b, c, a):
        q_ref, k_ref = rope(positions, q, k)
        q_c, k_c = rope(positions, q, k, cache)
        assert torch.equal(q_c, q_ref) and torch.equal(k_c, k_ref)
    assert len(cache) == 3
    # Another dtype is another entry, rounded as the uncached path rounds it.
    q16, k16 = q.to(torch.bfloat16), k.to(torch.bfloat16)
    q_c, k_c = a(positions, q16, k16, cache)
    q_ref, k_ref = a(positions, q16, k16)
    assert torch.equal(q_c, q_ref) and torch.equal(k_c, k_ref)
    assert len(cache) == 4


def test_each_step_metadata_starts_with_an_empty_cache():
    one = AttentionMetadata(positions=torch.arange(3), slot_mapping=torch.arange(3))
    two = AttentionMetadata(positions=torch.arange(3) + 3, slot_mapping=torch.arange(3))
    one.rope_cache["x"] = 1
    assert two.rope_cache == {}
