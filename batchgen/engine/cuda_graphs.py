"""CUDA graphs for decode-only steps: capture the whole decode forward once per batch size,
then replay it, so that a decode step costs a few host-to-device copies and one graph launch
instead of thousands of kernel launches from Python.

The design is vLLM's (``CUDAGraphWrapper``, ``cudagraph_capture_sizes``) and SGLang's
(``CudaGraphRunner``), written here from their descriptions:

- Capture sizes: `EngineConfig.resolved_capture_sizes` (1, 2, 4, then multiples of 8 up to
  ``min(max_num_seqs, 512)``), less any above ``max_num_batched_tokens`` (such a batch is two
  attention micro-batches under ``coalesce``, which runs eager). Captured largest first, each
  after one eager warm-up run (Triton compiles there, lazily built tensors appear), into one
  memory pool shared by all sizes (a replay's activations reuse the same memory).
- Static inputs: ``input_ids``, ``positions``, ``slot_mapping`` ``[N]``, ``block_tables``
  ``[N, W]`` and ``kv_lens`` ``[N]`` (N the largest size, W = ``ceil(max_model_len /
  block_size)``). A step of n rows is padded to the next size s: the real rows are copied in,
  rows n..s are padding.
- Padding rows are harmless: token 0 at position 0, K/V (MLA: the latent and rope key) written
  to the reserved dummy block
  (`ModelRunner.dummy_block`, one extra KV block that no sequence owns), block table rows of
  that block, ``kv_len`` 1 (the softmax always has a key), and only the real rows' logits
  reach the sampler (``sample_indices``).
- Which steps replay: every row a one-token step (decode, or a one-token prompt chunk), no
  ``prompt_logprobs`` rows, at most the largest size (so one attention micro-batch) and the
  widest block table within W. Everything else runs eager: mixed prefill/decode steps, the
  coalesced multi-group steps, steps under expert parallelism (the dispatch collectives are not
  captured). `CUDAGraphRunner.num_graph_steps` / ``num_eager_steps`` count the share; the
  engine's metrics report it (``cuda_graph_step_share``).
- Host synchronisation: none between the static inputs and the logits on the CUDA kernels
  (Triton paged decode attention, or for MLA models (DeepSeek-V2/V3) the Triton MLA decode
  kernel on the paged latent cache; Triton MoE; ``tests/test_cuda_graphs.py`` checks both
  under ``TRITON_INTERPRET=1``). The decode context check runs on `ModelRunner.prepare`'s host
  lists, before any tensor is built. Expert row statistics (tile density) are taken from
  each MoE layer's ``topk_ids``, copied inside the graph into static buffers and counted on
  the device after the replay (`SparseMoeBlock.topk_sink`, `ExpertGemmStats.record_device`).

Graphs only ever run on CUDA and never under ``enforce_eager`` (`graph_backend_for`). The
backend is injectable: on CPU the tests use `RecordingGraphBackend`, which re-runs the captured
callable on the same static buffers at each replay, so that the plumbing (padding, stale
buffers, slicing) is proven without a GPU. No CUDA graph has been captured on a GPU yet
(docs/gpu.md).
"""

from __future__ import annotations

import bisect
import logging
import math
import time
from collections.abc import Callable
from contextlib import contextmanager
from typing import Protocol

import torch

from batchgen.engine.scheduler import ScheduledSeq
from batchgen.models.layers.attention import AttentionMetadata, DecodeBucket
from batchgen.models.layers.moe import SparseMoeBlock

logger = logging.getLogger(__name__)


class GraphBackend(Protocol):
    """Turns a callable into a replayable graph: ``capture(fn)`` returns ``replay()``, which
    re-issues the work ``fn`` did on the tensors ``fn`` used."""

    def capture(self, fn: Callable[[], None]) -> Callable[[], None]: ...


class CUDAGraphBackend:
    """`torch.cuda.graph` capture into one memory pool shared by every captured size."""

    def __init__(self) -> None:
        self.pool = torch.cuda.graph_pool_handle()

    def capture(self, fn: Callable[[], None]) -> Callable[[], None]:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            fn()
        return graph.replay


class RecordingGraphBackend:
    """A CPU stand-in for `CUDAGraphBackend`: capture records ``fn``, replay re-runs it on the
    same static buffers (so a stale buffer or a wrong slice shows as wrong tokens).

    Attributes:
        captured: the recorded callables, in capture order; num_replays: replays so far.
    """

    def __init__(self) -> None:
        self.captured: list[Callable[[], None]] = []
        self.num_replays = 0

    def capture(self, fn: Callable[[], None]) -> Callable[[], None]:
        self.captured.append(fn)

        def replay() -> None:
            self.num_replays += 1
            fn()

        return replay


def graph_backend_for(device: torch.device, enforce_eager: bool) -> GraphBackend | None:
    """The graph backend for an engine on ``device``: `CUDAGraphBackend` on CUDA unless
    ``enforce_eager``, else None (CPU never captures)."""
    if enforce_eager or device.type != "cuda":
        return None
    return CUDAGraphBackend()


@contextmanager
def _topk_sinks(model: torch.nn.Module, sinks: dict[int, Callable[[torch.Tensor], None]]):
    """Route each MoE block's ``topk_ids`` to ``sinks[layer]`` instead of its ``stats`` hook
    (which would count the padding rows, at every replay) while the block runs inside a
    graph."""
    blocks = [(i, layer.mlp) for i, layer in enumerate(model.layers)]
    blocks = [(i, b) for i, b in blocks if isinstance(b, SparseMoeBlock)]
    saved = [(b, b.stats, b.topk_sink) for _, b in blocks]
    for i, b in blocks:
        b.stats, b.topk_sink = None, sinks.get(i)
    try:
        yield
    finally:
        for b, stats, sink in saved:
            b.stats, b.topk_sink = stats, sink


class CUDAGraphRunner:
    """Runs decode-only steps by replaying a graph per padded batch size (module docstring).

    Args:
        runner: the engine's `ModelRunner`; it must reserve a dummy KV block
            (``reserve_dummy_block=True``) and decode in place (one decode bucket per step:
            the CPU kernel or the Triton kernel; for MLA the Triton MLA kernel outside
            ``batch_invariant``; not a torch gather path).
        capture_sizes: batch sizes to capture (`EngineConfig.resolved_capture_sizes`).
        max_num_batched_tokens: sizes above it are dropped (two micro-batches under coalesce).
        max_model_len: bounds the static block table width.
        backend: the `GraphBackend`.
        expert_stats: the engine's `ExpertGemmStats` (or None): receives each replayed step's
            real rows per expert, per MoE layer.
    Raises:
        ValueError: no dummy block, a decode path that is not in place, or no size left.
    """

    def __init__(
        self,
        runner,
        capture_sizes: list[int],
        max_num_batched_tokens: int,
        max_model_len: int,
        backend: GraphBackend,
        expert_stats=None,
    ) -> None:
        if runner.dummy_block is None:
            raise ValueError("CUDA graphs need a ModelRunner with reserve_dummy_block=True")
        if not runner.decode_in_place:
            raise ValueError(
                "CUDA graphs need decode attention that reads the cache in place (one bucket "
                "per step): not the torch paths (BATCHGEN_ATTENTION_BACKEND=torch, MLA off CUDA "
                "without BATCHGEN_ATTENTION_BACKEND=triton, MLA under batch_invariant)"
            )
        self.sizes = sorted({n for n in capture_sizes if 1 <= n <= max_num_batched_tokens})
        if not self.sizes:
            raise ValueError(
                f"no cudagraph_capture_sizes {capture_sizes} within max_num_batched_tokens="
                f"{max_num_batched_tokens}"
            )
        self.runner, self.model, self.backend = runner, runner.model, backend
        self.expert_stats = expert_stats
        bs, dev, n = runner.block_size, runner.device, self.sizes[-1]
        self.width = math.ceil(max_model_len / bs)
        self.num_cache_blocks = runner.kv_caches[0][0].shape[0] // bs
        self.dummy_slot = runner.dummy_block * bs
        long = dict(dtype=torch.long, device=dev)
        self.input_ids = torch.zeros(n, **long)  # [N]
        self.positions = torch.zeros(n, **long)  # [N]
        self.slot_mapping = torch.full((n,), self.dummy_slot, **long)  # [N]
        self.block_tables = torch.full((n, self.width), runner.dummy_block, **long)  # [N, W]
        self.kv_lens = torch.ones(n, **long)  # [N]
        cfg = self.model.config
        self.moe_layers = [i for i, moe in enumerate(cfg.layer_is_moe) if moe]
        self.num_experts, top_k = cfg.num_local_experts, cfg.num_experts_per_tok
        self.topk_ids = {i: torch.zeros(n, top_k, **long) for i in self.moe_layers}  # [N, A]
        self._replay: dict[int, Callable[[], None]] = {}
        self._logits: dict[int, torch.Tensor] = {}  # size -> [size, V] float32, the output
        self.num_graph_steps = 0
        self.num_eager_steps = 0
        self._eager_reasons: set[str] = set()

    def padded_size(self, num_rows: int) -> int | None:
        """The smallest capture size >= ``num_rows`` (None above the largest)."""
        i = bisect.bisect_left(self.sizes, num_rows)
        return self.sizes[i] if i < len(self.sizes) else None

    def _forward(self, size: int) -> Callable[[], None]:
        """The decode forward over the first ``size`` rows of the static buffers, writing
        ``self._logits[size]`` ``[size, V]`` float32."""
        meta = AttentionMetadata(
            positions=self.positions[:size],
            slot_mapping=self.slot_mapping[:size],
            num_decode_tokens=size,
            block_size=self.runner.block_size,
            decode_backend=self.runner.decode_backend,
        )
        bucket = DecodeBucket(0, size, self.block_tables[:size], self.kv_lens[:size])
        bucket.checked_num_blocks = self.num_cache_blocks  # `execute` checks the real rows
        meta.decode_buckets.append(bucket)
        sinks = {
            i: (lambda ids, buf=buf: buf[:size].copy_(ids)) for i, buf in self.topk_ids.items()
        }
        model, kv = self.model, self.runner.kv_caches

        def forward() -> None:
            meta.rope_cache.clear()  # cos/sin are recomputed from the static positions
            with _topk_sinks(model, sinks):
                h = model.embed(self.input_ids[:size])  # [size, H]
                for layer in range(model.num_layers):
                    h = model.attention_stage(layer, h, meta, kv[layer])
                    h = model.ffn_stage(layer, h)
                self._logits[size] = model.compute_logits(h)  # [size, V]

        return forward

    @torch.inference_mode()
    def capture(self, sizes: list[int] | None = None) -> None:
        """Warm up and capture ``sizes`` (default every size), largest first. Logs the time
        and the device memory the graphs took: the drop in free memory
        (`torch.cuda.mem_get_info`, vLLM's measure, the pool's reserved segments included) and
        the growth of allocated tensors. (`batchgen.engine.memory_profile` captures the two
        largest alone on a temporary runner, before the KV cache is sized, to estimate it.)"""
        sizes = self.sizes if sizes is None else sorted(sizes)
        dev = self.runner.device
        cuda = dev.type == "cuda"
        if cuda:
            torch.cuda.synchronize(dev)
            free0, alloc0 = torch.cuda.mem_get_info(dev)[0], torch.cuda.memory_allocated(dev)
        t0 = time.perf_counter()
        for size in reversed(sizes):
            forward = self._forward(size)
            forward()  # warm-up (Triton compiles here): writes only the dummy block
            if cuda:
                torch.cuda.synchronize(dev)
            self._replay[size] = self.backend.capture(forward)
        free_mib = alloc_mib = 0.0
        if cuda:
            torch.cuda.synchronize(dev)
            free_mib = (free0 - torch.cuda.mem_get_info(dev)[0]) / 2**20
            alloc_mib = (torch.cuda.memory_allocated(dev) - alloc0) / 2**20
        logger.info(
            "captured %d decode graphs (batch sizes %d..%d) in %.1f s: %.0f MiB of device memory "
            "(%.0f MiB in live tensors)",
            len(sizes), sizes[0], sizes[-1], time.perf_counter() - t0, free_mib,
            alloc_mib,
        )  # fmt: skip

    def can_run(self, scheduled: list[ScheduledSeq]) -> bool:
        """Whether a step of these entries replays a graph: one token each, no
        ``prompt_logprobs`` rows, at most the largest capture size."""
        return 0 < len(scheduled) <= self.sizes[-1] and all(
            e.num_new_tokens == 1 and not e.prompt_logits for e in scheduled
        )

    @torch.inference_mode()
    def execute(
        self, scheduled: list[ScheduledSeq]
    ) -> tuple[list[ScheduledSeq], torch.Tensor, list] | None:
        """Run a step by replay, or return None (the caller runs it eager; counted).

        Returns what `StageExecutor.execute` returns: the entries that sample (row order), their
        logits ``[B, V]`` float32 (rows of the graph's output, valid until the next replay of
        any size: the pool is shared), and no prompt rows.
        Raises:
            ValueError: a block table that does not cover its context or holds a block outside
            the cache (`ModelRunner.prepare`, `check_decode_context_lists`).
        """
        if not self._replay:
            raise RuntimeError("CUDAGraphRunner.capture() must run before execute()")
        if not self.can_run(scheduled):
            self._eager("mixed prefill/decode, prompt logprobs or more rows than the largest "
                        f"capture size ({self.sizes[-1]})")  # fmt: skip
            return None
        input_ids, meta, ordered, sample_indices = self.runner.prepare(scheduled)
        (bucket,) = meta.decode_buckets  # decode in place: one bucket
        n, width = len(ordered), bucket.block_tables.shape[1]
        if width > self.width:
            self._eager(f"a block table wider than max_model_len's {self.width} blocks")
            return None
        size = self.padded_size(n)  # `prepare` checked the rows' contexts on its host lists
        self.input_ids[:n].copy_(input_ids)
        self.input_ids[n:size].zero_()
        self.positions[:n].copy_(meta.positions)
        self.positions[n:size].zero_()
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.slot_mapping[n:size].fill_(self.dummy_slot)
        self.block_tables[:n, :width].copy_(bucket.block_tables)
        self.block_tables[:n, width:].fill_(self.runner.dummy_block)
        self.block_tables[n:size].fill_(self.runner.dummy_block)
        self.kv_lens[:n].copy_(bucket.kv_lens)
        self.kv_lens[n:size].fill_(1)
        self._replay[size]()
        self.num_graph_steps += 1
        if self.expert_stats is not None:
            self._record_expert_rows(n)
        sampling = [e for e in ordered if e.samples_next_token]
        return sampling, self._logits[size].index_select(0, sample_indices), []

    def _eager(self, reason: str) -> None:
        """Count a step left to the eager path; the first of each reason is logged (INFO)."""
        self.num_eager_steps += 1
        if reason not in self._eager_reasons:
            self._eager_reasons.add(reason)
            logger.info("CUDA graphs: a step runs eager (%s); the share of steps replayed is "
                        "get_metrics()['cuda_graph_step_share']", reason)  # fmt: skip

    def _record_expert_rows(self, num_rows: int) -> None:
        """Rows per expert of the real rows (padding excluded), one record per MoE layer, as
        the eager paths record them (on the device: `ExpertGemmStats.record_device`)."""
        if not self.moe_layers:
            return
        ids = torch.stack([self.topk_ids[i][:num_rows] for i in self.moe_layers])  # [L, n, A]
        counts = torch.zeros(len(self.moe_layers), self.num_experts, dtype=torch.long,
                             device=ids.device)  # fmt: skip
        counts.scatter_add_(1, ids.flatten(1), torch.ones_like(ids.flatten(1)))  # [L, E]
        self.expert_stats.record_device(counts)


def build_graph_runner(engine, backend: GraphBackend | None) -> CUDAGraphRunner | None:
    """The `CUDAGraphRunner` of an `LLMEngine` whose runner, executor and metrics are built,
    captured, or None (logged): no ``backend`` (CPU, or ``enforce_eager``: `graph_backend_for`),
    expert parallelism, a decode attention path that is not in place (a torch path:
    ``BATCHGEN_ATTENTION_BACKEND=torch``, MLA without the Triton kernel or under
    ``batch_invariant``), or a capture that raised (logged as a WARNING with
    its traceback: the engine then runs eager; capture has never run on a GPU, docs/gpu.md)."""
    if backend is None:
        return None
    runner, config = engine.runner, engine.config
    reason = None
    if engine.expert_parallel is not None:
        reason = "expert parallelism (its dispatch / combine collectives are not captured)"
    elif not runner.decode_in_place:
        reason = "decode attention does not read the cache in place (a torch path)"
    if reason is not None:
        logger.info("CUDA graphs off: %s; every step runs eager", reason)
        return None
    graphs = CUDAGraphRunner(
        runner,
        config.resolved_capture_sizes,
        config.max_num_batched_tokens,
        engine.max_model_len,
        backend,
        engine.metrics.expert,
    )
    try:
        graphs.capture()
    except Exception:  # never yet run on a GPU: keep the engine usable, say so loudly
        logger.warning(
            "CUDA graph capture failed; every step runs eager (--enforce-eager skips the attempt)",
            exc_info=True,
        )
        return None
    return graphs
