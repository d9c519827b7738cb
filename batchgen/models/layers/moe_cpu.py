"""The CPU's torch expert path (`fused_experts_per_expert`): per-expert gathers into a
``(token, slot)`` float32 buffer, optionally split over worker threads, summed in slot order
(`sum_slots`) so that it equals `batchgen.models.layers.moe.fused_experts_reference` bit for bit.

Shape legend: T = num_tokens, H = hidden_size, E = num_experts, A = num_experts_per_tok (top-k),
I = moe_intermediate_size.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.nn.functional as F

from batchgen.models.layers.moe_sort import route_rows, sum_slots

# Expert-parallel across CPU cores: below this many rows per expert on average, each expert's
# GEMMs run single-threaded and the experts are split over `torch.get_num_threads()` worker
# threads (see `fused_experts_per_expert`).
CORE_PARALLEL_MAX_MEAN_ROWS = 512
_pool: ThreadPoolExecutor | None = None
_pool_workers = 0
_pool_lock = threading.Lock()


def _expert_pool(workers: int) -> ThreadPoolExecutor:
    """The process's expert worker pool, grown to at least ``workers`` threads."""
    global _pool, _pool_workers
    with _pool_lock:
        if _pool is None or _pool_workers < workers:
            _pool = ThreadPoolExecutor(workers, thread_name_prefix="batchgen-experts")
            _pool_workers = workers
        return _pool


def _split_by_rows(starts: list[int], parts: int) -> list[tuple[int, int]]:
    """Cut experts ``0..E-1`` (rows ``starts[e]:starts[e+1]``) into ``parts`` contiguous
    ranges of about equal rows."""
    num_experts, total = len(starts) - 1, starts[-1]
    bounds, e = [0], 0
    for k in range(1, parts):
        while e < num_experts and starts[e] < total * k / parts:
            e += 1
        bounds.append(e)
    bounds.append(num_experts)
    return [(bounds[k], bounds[k + 1]) for k in range(parts)]


def fused_experts_per_expert(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    act=F.silu,
    stats=None,
    num_workers: int = 1,
    out_dtype: torch.dtype | None = None,
    linear=F.linear,
) -> torch.Tensor:
    """Expert computation without whole-batch sorted intermediates (the CPU path).

    Same arguments, result and GEMMs as `fused_experts_reference` (one GEMM chain per
    non-empty expert over the rows routed to it), but each expert gathers its own rows and
    writes its weighted float32 output to the rows' ``(token, slot)`` places of a ``[T*A, H]``
    buffer, summed over the slots at the end in slot order (`sum_slots`), so the result is
    the reference's bit for bit whatever the worker split. The reference also materialises
    ``[T*A, H]`` sorted inputs and outputs; above glibc's 32 MiB mmap threshold (4,096 tokens
    x top-8 x hidden 512 in fp32 = 64 MiB) each was a fresh page run on every call: with
    per-expert gathers into a ``[T, H]`` accumulator this path ran 1.32x faster at 4,096
    tokens on the bench model and the same at <= 2,048 (measured before the slot-order sum).

    With ``num_workers`` > 1 the experts are cut into that many ranges of about equal rows, each
    run on a worker thread with single-threaded GEMMs into its own accumulator, summed at the
    end in range order. MKL's two-thread GEMM barely beats one thread at a few rows (measured
    on the bench model's 512x512 expert GEMMs with cold weights: 245 vs 265 us at 4 rows), so
    two experts at once on two cores is faster: the bench MoE layer took 18.0 vs 28.6 ms at 24
    tokens (3 rows per expert) and 30.2 vs 37.7 ms at 128 tokens. With the host allocator tuned
    (`batchgen.engine.host_allocator`) it also wins at larger batches: 55.9 vs 73.2 ms at 512
    tokens, 73.8 vs 99.5 ms at 1,024, 126 vs 138 ms at 2,048, and loses slightly at 4,096 (252
    vs 246 ms), hence `CORE_PARALLEL_MAX_MEAN_ROWS`. End to end, 24 sequences decoding on the
    bench model ran 1.10-1.17x faster (decode-only 186-200 vs 169-171 tokens/s, two rounds in
    one process). ``torch.set_num_threads(1)`` is in force for the whole process during the
    call and restored after.

    ``linear``: the GEMM, ``(x [m, K], w [N, K]) -> [m, N]`` (`invariant_linear` in the
    batch-invariant mode).

    Before the slot-order sum, the top-k sums ran in expert order per worker: results then
    depended on the thread count in the last bits (and in bf16 that changed tokens), and
    differed from an expert-parallel rank's.
    """
    num_tokens, top_k = topk_ids.shape
    order, counts, token_idx = route_rows(topk_ids, w13.shape[0], stats)
    weights = topk_weights.reshape(-1).index_select(0, order)  # [T*A] float32, sorted
    starts = [0]
    for m in counts:
        starts.append(starts[-1] + m)

    # [T*A, H] float32 in (token, slot) order; every place is written once (a token meets an
    # expert at most once), by one worker.
    pairs = torch.empty(num_tokens * top_k, x.shape[1], dtype=torch.float32, device=x.device)

    def run(lo: int, hi: int) -> None:
        for expert in range(lo, hi):
            start, end = starts[expert], starts[expert + 1]
            if start == end:
                continue
            rows = token_idx[start:end]  # [m]
            gate, up = linear(x.index_select(0, rows), w13[expert]).chunk(2, dim=-1)  # [m, I]
            y = linear(act(gate) * up, w2[expert]).float()  # [m, H]
            pairs.index_copy_(0, order[start:end], y.mul_(weights[start:end, None]))

    def result() -> torch.Tensor:
        return sum_slots(pairs.view(num_tokens, top_k, x.shape[1])).to(out_dtype or x.dtype)

    if num_workers <= 1:
        run(0, len(counts))
        return result()
    ranges = _split_by_rows(starts, num_workers)
    # Grad and inference modes are per thread: the workers take the caller's.
    grad, inference = torch.is_grad_enabled(), torch.is_inference_mode_enabled()

    def run_in_caller_mode(lo: int, hi: int) -> torch.Tensor:
        with torch.inference_mode(inference), torch.set_grad_enabled(grad):
            return run(lo, hi)

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        pool = _expert_pool(num_workers)
        futures = [pool.submit(run_in_caller_mode, lo, hi) for lo, hi in ranges]
        for f in futures:
            f.result()
    finally:
        torch.set_num_threads(threads)
    return result()


def cpu_expert_workers(num_tokens: int, top_k: int, num_experts: int) -> int:
    """Worker threads for `fused_experts_per_expert`: ``torch.get_num_threads()`` when the
    experts get fewer than `CORE_PARALLEL_MAX_MEAN_ROWS` rows on average, else 1."""
    if num_tokens * top_k >= CORE_PARALLEL_MAX_MEAN_ROWS * num_experts:
        return 1
    return max(1, torch.get_num_threads())


