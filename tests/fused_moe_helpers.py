"""Shared helpers of the fused MoE kernel's adversarial tests (`test_fused_moe_adversarial.py`,
`test_fused_moe_memory.py`): skip marks, random expert weights and routing, one kernel call on
freshly packed weights, and the float64 reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from batchgen.kernels import fused_moe as fm
from batchgen.models.layers.moe import fused_experts_reference, sort_by_expert

needs_kernel = pytest.mark.skipif(
    not fm.fused_moe_available(
        torch.zeros(1, 16), torch.zeros(1, 16, 16), torch.zeros(1, 16, 8), F.silu
    ),
    reason="the fused MoE kernel is not built here (no compiler or no AVX2/FMA)",
)
needs_bf16 = pytest.mark.skipif(
    fm.kernel_isa(torch.bfloat16) is None, reason="no avx512_bf16 kernel on this CPU"
)
needs_amx = pytest.mark.skipif(
    fm.kernel_isa(torch.bfloat16) != "amx_bf16", reason="no AMX-BF16 on this CPU"
)
STREAM_MIN_BYTES = 4 << 20  # kStreamMinBytes in csrc/fused_moe_common.h


def weights(num_experts, hidden, inter, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=g) * hidden**-0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=g) * inter**-0.5
    return w13.to(dtype), w2.to(dtype)


def routing(num_tokens, num_experts, top_k, seed, skew=None):
    """Softmax top-k routing; ``skew`` = an expert every token picks first (all rows of slot 0
    on one expert)."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_tokens, num_experts, generator=g)
    if skew is not None:
        logits[:, skew] += 100.0
    weights, ids = torch.topk(torch.softmax(logits, -1), top_k)
    return weights / weights.sum(-1, keepdim=True), ids


def run(x, w13, w2, weights, ids, isa="auto"):
    order, counts = sort_by_expert(ids, w13.shape[0])
    return fm.fused_moe_silu(
        x, fm.pack_expert_weights(w13), fm.pack_expert_weights(w2), weights, order, counts, isa
    )


def reference(x, w13, w2, weights, ids):
    return fused_experts_reference(
        x.double(), w13.double(), w2.double(), weights.double(), ids, F.silu
    )
