"""`batchgen.kernels.profiling.kernel_scope`: the C++ kernels keep their names in torch.profiler
traces, and cost no ``record_function`` scope when nothing records."""

from __future__ import annotations

import pytest
import torch

from batchgen.kernels import fused_moe as fm
from batchgen.kernels.profiling import kernel_scope
from tests.test_fused_moe_bf16 import _case, _kernel


def test_no_scope_without_a_profiler():
    assert not torch.autograd._profiler_enabled()
    scope = kernel_scope("batchgen::x")
    assert not isinstance(scope, torch.profiler.record_function)
    with scope, kernel_scope("batchgen::y"):  # reusable and nestable
        pass


@pytest.mark.skipif(fm.kernel_isa(torch.float32) is None, reason="fused MoE kernel not built")
def test_kernel_time_is_named_in_a_trace():
    x, w13, w2, weights, ids = _case(16, 8, 2, 32, 16, seed=0, dtype=torch.float32)
    plain = _kernel(x, w13, w2, weights, ids)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        assert isinstance(kernel_scope("batchgen::x"), torch.profiler.record_function)
        traced = _kernel(x, w13, w2, weights, ids)
    names = {e.key for e in prof.key_averages()}
    assert "batchgen::fused_moe_silu" in names
    assert torch.equal(plain, traced)
