"""The CPU expert path (`fused_experts_per_expert`) against the plain reference, which the
model oracle tests tie to `transformers`."""

from __future__ import annotations

import pytest
import torch

from batchgen.engine.metrics import ExpertGemmStats
from batchgen.models.layers.moe import fused_experts_per_expert, fused_experts_reference


@pytest.mark.parametrize("num_tokens", [1, 7, 300])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_per_expert_path_matches_the_reference(num_tokens, dtype):
    torch.manual_seed(num_tokens)
    e, h, i, a = 16, 32, 24, 4
    x = torch.randn(num_tokens, h).to(dtype)
    w13 = (torch.randn(e, 2 * i, h) * 0.2).to(dtype)
    w2 = (torch.randn(e, h, i) * 0.2).to(dtype)
    probs = torch.softmax(torch.randn(num_tokens, e), dim=-1)
    topk_weights, topk_ids = torch.topk(probs, a, dim=-1)
    ref_stats, stats = ExpertGemmStats(), ExpertGemmStats()
    ref = fused_experts_reference(x, w13, w2, topk_weights, topk_ids, stats=ref_stats)
    out = fused_experts_per_expert(x, w13, w2, topk_weights, topk_ids, stats=stats)
    assert out.dtype == dtype and out.shape == (num_tokens, h)
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    else:  # same GEMMs; only the float32 sum order differs before the final rounding
        torch.testing.assert_close(out.float(), ref.float(), rtol=8e-3, atol=8e-3)
    assert (stats.num_gemms, stats.rows) == (ref_stats.num_gemms, ref_stats.rows)
    assert stats.rows == num_tokens * a
