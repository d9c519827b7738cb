"""Names for the C++ kernels' time in torch.profiler traces, at no cost when nothing records.

The kernels are ctypes calls, no torch ops, so a trace shows their time only inside a
``record_function`` scope (`benchmarks/peers/trace_summary.py` and ``batchgen bench --profile``
read those names). A scope costs about 10 us even when no profiler runs (it enters through a
torch op: ``profiler::_record_function_enter_new``), against about 1 us for the check below;
two kernel calls per layer made that several percent of a small model's decode step.
"""

from __future__ import annotations

import contextlib

import torch
from torch.profiler import record_function

_NO_SCOPE = contextlib.nullcontext()


def kernel_scope(name: str) -> contextlib.AbstractContextManager:
    """``record_function(name)`` while torch.profiler records, else a reusable no-op context.

    Args:
        name: the operator name the trace shows, e.g. ``"batchgen::fused_moe_silu"``.
    """
    if torch.autograd._profiler_enabled():
        return record_function(name)
    return _NO_SCOPE
