"""Whether this CPU's float32 GEMM (torch's ``F.linear``, MKL's sgemm on x86) gives a row the same
bits whatever the row count of the call and the thread count.

Intel CPUs: yes at the shapes the tests use, and some tests assert bit identity that rests on
it. AMD CPUs (measured on a Zen 4 EPYC, torch 2.13.0's MKL 2024.2, 2026-12-02): no. MKL runs a
different code path there, which picks its kernel by M and by threads: ``F.linear(x[:3], w)``
and ``F.linear(x, w)[:3]`` differed by up to 3.4e-5 at K = 512, N = 768 (1 ulp-scale), and
1 thread against 2 at M = 5, K = 24. Tests whose claim rests on that property are marked
``xfail`` where `fp32_gemm_bits_vary` is true, with this reason.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

REASON = (
    "this CPU's float32 GEMM (MKL sgemm; seen on AMD Zen 4) rounds a row differently by the "
    "call's row count or thread count, so bit identity across batch shapes does not hold "
    "(tests/gemm_probe.py)"
)


@functools.cache
def fp32_gemm_bits_vary() -> bool:
    """True when some probe shape gives a row other bits at another row or thread count."""
    gen = torch.Generator().manual_seed(0)
    threads = torch.get_num_threads()
    try:
        for k, n, m in [(32, 48, 3), (24, 32, 5), (512, 768, 3), (32, 48, 9)]:
            w = torch.randn(n, k, generator=gen)
            x = torch.randn(16, k, generator=gen)
            torch.set_num_threads(1)
            one = F.linear(x[:m], w)
            torch.set_num_threads(max(2, threads))
            two = F.linear(x[:m], w)
            full = F.linear(x, w)[:m]
            if not (torch.equal(one, two) and torch.equal(one, full)):
                return True
        return False
    finally:
        torch.set_num_threads(threads)
