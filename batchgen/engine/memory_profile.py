"""The profiling forward that sizes the KV cache on a GPU (vLLM's method).

vLLM's ``Worker.determine_available_memory`` runs one dummy forward at the largest step the
scheduler can build (``profile_run``), reads the allocator's peak, and gives the KV cache what
is left under ``gpu_memory_utilization``:

    kv_budget = total * gpu_memory_utilization - (total - free) - peak_activation
                - cuda_graph_memory

where ``total - free`` (after the profile's tensors are freed and the allocator's cache
emptied) is what the device already holds (weights, the CUDA context, other processes) and
``peak_activation`` is the largest number of bytes the step allocated above what was allocated
before it. `profile_step_peak_bytes` runs that step here: dummy prompts of
``max_num_batched_tokens`` tokens (fewer where the model's positions end) adding up to one
step's token budget (``step_token_budget``: under ``coalesce`` the FFN stage of a layer takes
every micro-batch's rows at once, so the whole step is profiled, not one micro-batch), through
`StageExecutor.execute` and ``compute_logits`` on a temporary KV cache just large enough for
them, then ``compute_logits`` over ``max_num_seqs`` rows (a decode step's logits, ``[B, V]``
float32). The sampler's working copies of those logits (softmax, sort for top-p, a gather:
about three more ``[B, V]`` float32 tensors) are not run here and are added as
`sampler_reserve_bytes`. ``cuda_graph_memory`` is vLLM's estimate from capturing the two
largest decode graphs before the KV cache exists (`estimate_cuda_graph_bytes`); the graphs
themselves are captured after the KV cache is allocated (`batchgen.engine.cuda_graphs`).

On CPU the KV cache is sized from ``kv_cache_memory_gb`` and nothing here runs. The device's
counters are behind `DeviceMemory`, so the arithmetic and the dummy step are tested on CPU
with a fake (tests/test_memory_profile.py); the CUDA counters themselves run only on a GPU.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

from batchgen.config import EngineConfig
from batchgen.engine.metrics import EngineMetrics
from batchgen.models.model_config import ModelConfig

logger = logging.getLogger("batchgen.engine.llm_engine")  # the engine's start-up log lines

SAMPLER_COPIES = 3  # float32 [B, V] tensors the sampler makes beside the logits
_DEFAULT = object()  # `profiled_kv_budget_bytes`'s graph backend: `graph_backend_for`'s


@dataclass
class DeviceMemory:
    """The caching allocator's counters for one CUDA device (``torch.cuda``), in bytes.

    A stand-in with the same four methods serves tests on CPU."""

    device: torch.device

    def reset_peak(self) -> None:
        """Start a new peak: ``torch.cuda.reset_peak_memory_stats``."""
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)

    def allocated(self) -> int:
        """Bytes held by live tensors now (``torch.cuda.memory_allocated``)."""
        return torch.cuda.memory_allocated(self.device)

    def peak(self) -> int:
        """The most bytes held by live tensors since `reset_peak` (``max_memory_allocated``)."""
        torch.cuda.synchronize(self.device)
        return torch.cuda.max_memory_allocated(self.device)

    def free_total(self) -> tuple[int, int]:
        """``(free, total)`` bytes of the device after the allocator returns its cached blocks
        (``torch.cuda.empty_cache``, then ``torch.cuda.mem_get_info``): memory other processes
        and the CUDA context hold counts as used."""
        torch.cuda.empty_cache()
        return torch.cuda.mem_get_info(self.device)


def dummy_prompt_lengths(c: EngineConfig, cfg: ModelConfig) -> list[int]:
    """Prompt lengths (tokens) of the profiling step: chunks of ``max_num_batched_tokens``,
    each at most the model's ``max_position_embeddings`` (and ``max_model_len`` when set),
    adding up to ``step_token_budget``, at most ``max_num_seqs`` of them."""
    longest = min(c.max_num_batched_tokens, cfg.max_position_embeddings)
    if c.max_model_len:
        longest = min(longest, c.max_model_len)
    longest = max(1, longest)
    total = c.step_token_budget
    count = min(math.ceil(total / longest), c.max_running_seqs)
    lengths = [longest] * count
    lengths[-1] = max(1, min(longest, total - longest * (count - 1)))
    return lengths


def sampler_reserve_bytes(c: EngineConfig, cfg: ModelConfig) -> int:
    """Bytes kept for the sampler's working copies of a decode step's logits:
    `SAMPLER_COPIES` x ``max_num_seqs`` x vocab x 4 (float32)."""
    return SAMPLER_COPIES * c.max_running_seqs * cfg.vocab_size * 4


@torch.inference_mode()
def profile_step_peak_bytes(
    model: torch.nn.Module,
    c: EngineConfig,
    cfg: ModelConfig,
    device: torch.device,
    dtype: torch.dtype,
    memory,
) -> int:
    """Run the largest step (module docstring) once on dummy prompts and return the peak bytes
    it allocated above what was allocated before it (``memory``: `DeviceMemory` or a stand-in).

    The temporary KV cache (``sum(ceil(len / block_size))`` blocks) is part of the measured
    peak, a slight over-estimate (a few MiB per 2,048 tokens for most models) kept on the safe
    side. Token ids are 0 (any id in the vocabulary allocates the same)."""
    from batchgen.engine.executor import StageExecutor
    from batchgen.engine.model_runner import ModelRunner
    from batchgen.engine.scheduler import ScheduledSeq
    from batchgen.engine.sequence import Request, SequenceCoroutine
    from batchgen.sampling_params import SamplingParams

    bs = c.block_size
    lengths = dummy_prompt_lengths(c, cfg)
    params = SamplingParams(max_tokens=1)
    scheduled, next_block = [], 0
    memory.reset_peak()
    before = memory.allocated()
    num_blocks = sum(-(-n // bs) for n in lengths)
    runner = ModelRunner(
        model, num_blocks, bs, device, dtype, kv_cache_dtype=_cache_dtype(c, cfg, dtype)
    )
    for i, n in enumerate(lengths):
        request = Request(f"profile-{i}", None, [0] * n, params, arrival_index=i)
        seq = SequenceCoroutine(i, request, 0)
        blocks = -(-n // bs)
        seq.block_table = list(range(next_block, next_block + blocks))
        next_block += blocks
        request.seqs.append(seq)
        scheduled.append(ScheduledSeq(seq, n))
    executor = StageExecutor(
        runner,
        c.scheduler_policy,
        c.max_num_batched_tokens,
        c.expert_coalesce_threshold,
        EngineMetrics(tile_size=c.tile_size),
    )
    executor.execute(scheduled)
    rows = torch.zeros(c.max_running_seqs, cfg.hidden_size, dtype=dtype, device=device)
    model.compute_logits(rows)  # a decode step's [max_num_seqs, V] logits
    peak = max(0, memory.peak() - before)
    del runner, executor, scheduled, rows
    return peak


def _cache_dtype(c: EngineConfig, cfg: ModelConfig, dtype: torch.dtype) -> torch.dtype:
    """The engine's KV cache dtype (``kv_cache_dtype`` under a model of ``dtype``): the
    profiling runners use it, since a narrower cache runs another attention path (quantised
    writes; on CUDA the torch decode path, `decode_attention_backend`)."""
    from batchgen.models.layers.kv_cache_dtype import resolve_kv_cache_dtype

    return resolve_kv_cache_dtype(c.kv_cache_dtype, dtype, cfg.mla is not None)


GRAPH_SAMPLES = 2  # graphs captured to estimate the memory of all of them (vLLM's two)
MIN_GRAPH_BYTES = 1 << 20  # floor of the per-graph increment (vLLM's 1 MiB)


@torch.inference_mode()
def estimate_cuda_graph_bytes(
    model: torch.nn.Module,
    c: EngineConfig,
    cfg: ModelConfig,
    device: torch.device,
    dtype: torch.dtype,
    memory,
    backend,
) -> tuple[int, str]:
    """Device memory the decode CUDA graphs will take, estimated before the KV cache is sized.

    vLLM's method (``GPUModelRunner.profile_cudagraph_memory``, on by default since v0.21.0,
    ``VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS``; before it, vLLM captured after allocating
    the KV cache and left the graphs to the headroom under ``gpu_memory_utilization``):
    capture the first `GRAPH_SAMPLES` graphs in capture order (the largest batch sizes) on a
    temporary runner with a one-block KV cache, measure the drop in free device memory over
    each (``memory.free_total()``, after the allocator's cache is emptied), and take
    ``first + max(second, 1 MiB) x (N - 1)`` for N capture sizes. The first graph's share
    holds the pool's activations (every later, smaller graph reuses them) and the static
    buffers; each further graph adds its own nodes. An over-estimate where later graphs reuse
    more of the pool than the second did (vLLM issue #45178): on the safe side.

    Args:
        model, c, cfg, device, dtype: as `profile_step_peak_bytes`; memory: `DeviceMemory`
            or a stand-in; backend: the `GraphBackend` (None: no graphs, ``enforce_eager``).
    Returns:
        ``(bytes, how)``: the estimate and a phrase for the start-up log (why 0, or which
        sizes were captured).
    """
    from batchgen.engine.cuda_graphs import CUDAGraphRunner
    from batchgen.engine.model_runner import ModelRunner

    if backend is None:
        return 0, "no CUDA graphs (enforce_eager or not CUDA)"
    free_before = memory.free_total()[0]
    # As the engine's runner: batch_invariant keeps MLA's decode in buckets (no graphs).
    runner = ModelRunner(model, 1, c.block_size, device, dtype, c.batch_invariant,
                         reserve_dummy_block=True,
                         kv_cache_dtype=_cache_dtype(c, cfg, dtype))  # fmt: skip
    max_len = c.max_model_len or cfg.max_position_embeddings
    try:
        graphs = CUDAGraphRunner(
            runner, c.resolved_capture_sizes, c.max_num_batched_tokens, max_len, backend
        )
    except ValueError as exc:  # no graphs will be built either (`build_graph_runner`)
        return 0, f"no CUDA graphs ({exc})"
    n = len(graphs.sizes)
    sampled = list(reversed(graphs.sizes))[:GRAPH_SAMPLES]
    samples = []
    try:
        for size in sampled:
            graphs.capture([size])
            free = memory.free_total()[0]
            samples.append(max(0, free_before - free))
            free_before = free
    except Exception as exc:  # the engine's own capture will fail too, and run eager
        logger.warning("CUDA graph memory estimate: capture failed (%s); counted as 0", exc)
        return 0, "capture failed"
    finally:
        del graphs, runner
    per_graph = max(samples[1], MIN_GRAPH_BYTES) if len(samples) > 1 else 0
    estimate = samples[0] + per_graph * (n - 1)
    how = (
        f"{n} sizes, from capturing {', '.join(map(str, sampled))}: "
        f"{samples[0] / (1 << 20):.0f} MiB + {per_graph / (1 << 20):.0f} MiB x {n - 1}"
    )
    return estimate, how


def profiled_kv_budget_bytes(
    model: torch.nn.Module,
    c: EngineConfig,
    cfg: ModelConfig,
    device: torch.device,
    dtype: torch.dtype,
    memory=None,
    graph_backend=_DEFAULT,
) -> int:
    """The KV cache budget in bytes under ``gpu_memory_utilization`` (module docstring's
    formula, less the CUDA graphs' estimated memory, `estimate_cuda_graph_bytes`), after one
    profiling step; may be zero or negative (the caller names the remedy).

    Args:
        memory: default `DeviceMemory` of ``device``.
        graph_backend: the `GraphBackend` to estimate the graphs with; default
            `batchgen.engine.cuda_graphs.graph_backend_for` (None under ``enforce_eager``: no
            graphs, nothing counted).
    """
    from batchgen.engine import cuda_graphs

    memory = memory or DeviceMemory(device)
    if graph_backend is _DEFAULT:
        graph_backend = cuda_graphs.graph_backend_for(device, c.enforce_eager)
    peak = profile_step_peak_bytes(model, c, cfg, device, dtype, memory)
    free, total = memory.free_total()
    reserve = sampler_reserve_bytes(c, cfg)
    graph_bytes, how = estimate_cuda_graph_bytes(model, c, cfg, device, dtype, memory,
                                                 graph_backend)  # fmt: skip
    used = total - free
    budget = int(total * c.gpu_memory_utilization) - used - peak - reserve - graph_bytes
    logger.info(
        "memory profile: %.2f GiB total, %.2f GiB in use after loading, step peak %.2f GiB "
        "(%d tokens), sampler reserve %.2f GiB, CUDA graphs %.2f GiB (%s) -> KV cache "
        "%.2f GiB at gpu_memory_utilization %.2f",
        total / (1 << 30), used / (1 << 30), peak / (1 << 30), c.step_token_budget,
        reserve / (1 << 30), graph_bytes / (1 << 30), how, budget / (1 << 30),
        c.gpu_memory_utilization,
    )  # fmt: skip
    return budget
