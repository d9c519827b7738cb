"""`LLMEngine`: requests in, finished `RequestOutput`s out, one `step()` at a time.

    engine.add_request("r0", "Hello", SamplingParams(max_tokens=8))
    while engine.has_unfinished_requests():
        for out in engine.step(): ...

A step is: schedule -> run the model -> sample -> append tokens, detokenize, check stops.

Failure isolation, by layer (what each layer can tell apart):

* Sampling and post-processing are per request (its sampler rows, its token, its detokenizer,
  its output). An exception there fails that request alone, with ``RequestOutput.error`` set,
  and the step goes on without it: a batched sampler error is retried request by request
  (seeded generators rewound first, so the other requests draw exactly what they would have).
* The model forward is shared by every request scheduled in the step, and nothing tells which
  one made it raise, so an exception there fails the step's requests (``error`` set), not the
  engine: the requests not scheduled in that step, and later ones, run as usual. On an
  expert-parallel rank it propagates instead: the other ranks are inside the step's
  collectives, so the rank fails and the frontend reports it.
* What is left (the scheduler, the KV block bookkeeping) is the engine's own state; an
  exception there propagates from `LLMEngine.step`, since the engine cannot vouch for itself.
  `batchgen serve`'s engine thread then fails the requests in flight and keeps serving.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from batchgen.config import EngineConfig
from batchgen.engine.block_manager import KVCacheManager
from batchgen.engine import cuda_graphs
from batchgen.engine.cpu_threads import configure_cpu_threads
from batchgen.engine.engine_setup import (
    load_engine_model,
    resolve_device,
    resolve_max_model_len,
    served_model_name,
)
from batchgen.engine.engine_metrics_view import EngineMetricsView
from batchgen.engine.engine_requests import EngineRequests
from batchgen.engine.executor import StageExecutor
from batchgen.engine.host_allocator import tune_glibc_malloc
from batchgen.engine.input_processor import InputProcessor, eos_token_ids, load_tokenizer
from batchgen.engine.kv_sizing import num_kv_blocks
from batchgen.engine.metrics import EngineMetrics
from batchgen.engine.migration import import_kv
from batchgen.engine.model_runner import ModelRunner, kv_cache_bytes_per_token
from batchgen.engine.prompt_logprobs import prompt_logit_positions
from batchgen.engine.request_outputs import RequestOutputs
from batchgen.engine.sampler import Sampler
from batchgen.engine.scheduler import ScheduledSeq, Scheduler, SchedulerOutput
from batchgen.engine.sequence import Request
from batchgen.kernels.switches import check_kernel_switches
from batchgen.models.batch_invariant import check_batch_invariant_support
from batchgen.models.default_model import resolve_tokenizer
from batchgen.models.layers.kv_cache_dtype import resolve_kv_cache_dtype
from batchgen.models.layers.moe import SparseMoeBlock
from batchgen.models.layers.norm import RMSNorm
from batchgen.models.loader import resolve_dtype, resolve_model_path
from batchgen.models.model_config import ModelConfig
from batchgen.outputs import RequestMetrics, RequestOutput
from batchgen.sampling_params import SamplingParams
from batchgen.structured.manager import StructuredOutputManager

if TYPE_CHECKING:
    from batchgen.distributed.rank import RankContext

logger = logging.getLogger(__name__)


@dataclass
class EngineStats:
    """Cumulative counters (tokens, seconds)."""

    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    num_steps: int = 0
    step_seconds: float = 0.0
    num_preemptions: int = 0
    # Prefix caching (`batchgen.engine.prefix_cache.PrefixCacheStats`): tokens looked up,
    # tokens found cached, cached blocks evicted.
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    prefix_cache_evictions: int = 0


class LLMEngine(EngineRequests, RequestOutputs, EngineMetricsView):
    """The engine: owns the model, KV cache, scheduler, sampler and the request table.

    Raises ValueError on construction for invalid settings (unknown architecture, missing
    model, ``max_model_len`` above the model's limit, an unknown kernel name in
    ``BATCHGEN_CPU_KERNELS``).
    """

    def __init__(self, config: EngineConfig, rank: RankContext | None = None) -> None:
        from transformers import AutoConfig

        self.config = config
        if config.model is None:
            from batchgen.models.default_model import (
                DEFAULT_MODEL_NAME,
                RANDOM_WEIGHTS_NOTE,
                default_model_path,
            )

            config.model = default_model_path()
            self.model_name = f"batchgen/{DEFAULT_MODEL_NAME}"
            logger.warning(RANDOM_WEIGHTS_NOTE)
        else:
            self.model_name = served_model_name(config.model)
        self.model_name = config.served_model_name or self.model_name
        path = resolve_model_path(config.model)
        hf_config = AutoConfig.from_pretrained(path)
        self.model_config = cfg = ModelConfig.from_hf(hf_config)
        self.device = rank.device if rank is not None else resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device, cfg, config.batch_invariant)
        if config.batch_invariant:
            check_batch_invariant_support(self.device, self.dtype)
        # Refused here, before the weights load (an MLA model takes auto only).
        self.kv_cache_dtype = resolve_kv_cache_dtype(
            config.kv_cache_dtype, self.dtype, cfg.mla is not None
        )
        check_kernel_switches()  # a bad BATCHGEN_* kernel or path switch fails here, not mid-step
        if self.device.type == "cpu":
            configure_cpu_threads()
            tune_glibc_malloc()
        torch.manual_seed(config.seed)
        held = rank.held_experts(cfg) if rank is not None else None
        model = load_engine_model(path, cfg, self.device, self.dtype, held, config.batch_invariant)
        self.tokenizer = load_tokenizer(resolve_tokenizer(config.tokenizer, path))
        self.eos_token_ids = eos_token_ids(path, cfg)

        # An expert-parallel rank's MoE layers cannot run before its dispatcher is installed
        # (below): no profiling forward there.
        profiled = model if rank is None else None
        num_blocks = num_kv_blocks(
            config, cfg, self.dtype, self.device, profiled, self.kv_cache_dtype
        )
        capacity = num_blocks * config.block_size
        self.max_model_len = max_len = resolve_max_model_len(config.max_model_len, cfg, capacity)
        self.input_processor = InputProcessor(self.tokenizer, cfg.vocab_size, max_len)
        # A cache hit computes the rest of a prompt against cached K/V instead of inside its
        # chunk, which changes the last bits: the batch-invariant mode caches nothing.
        caching = config.enable_prefix_caching and not config.batch_invariant
        if config.enable_prefix_caching and config.batch_invariant:
            logger.info(
                "prefix caching across requests is off under batch_invariant: a cache hit "
                "changes how the rest of a prompt is computed, and so its last bits"
            )
        self.kv_cache = KVCacheManager(num_blocks, config.block_size, enable_caching=caching)
        self.kv_bytes_per_token = kv_cache_bytes_per_token(cfg, self.kv_cache_dtype)  # all layers
        graph_backend = cuda_graphs.graph_backend_for(self.device, config.enforce_eager)
        self.runner = ModelRunner(
            model,
            num_blocks,
            config.block_size,
            self.device,
            self.dtype,
            batch_invariant=config.batch_invariant,
            reserve_dummy_block=graph_backend is not None,
            kv_cache_dtype=self.kv_cache_dtype,
        )
        self.scheduler = Scheduler(
            self.kv_cache,
            config.max_running_seqs,
            config.step_token_budget,
            max_chunk_tokens=config.max_num_batched_tokens,
            enable_prefix_sharing=config.enable_prefix_sharing,
            aligned_chunks=config.batch_invariant,
        )
        self.metrics = EngineMetrics(tile_size=config.tile_size)
        # Kernel/path choices made once (a bad forced BATCHGEN_MOE_PATH fails now, not mid-step)
        for module in model.modules():
            if isinstance(module, SparseMoeBlock):
                module.stats = self.metrics.expert
                module.pin_expert_path(self.device, self.dtype)
            elif isinstance(module, RMSNorm):
                module.pin_kernel(self.device, self.dtype)
        # Under expert parallelism: the rank's dispatcher (and streamer) on every MoE layer.
        self.rank = rank
        self.expert_parallel = (
            rank.install(model, path, self.device, self.dtype) if rank is not None else None
        )
        self.executor = StageExecutor(
            self.runner,
            config.scheduler_policy,
            config.max_num_batched_tokens,
            config.expert_coalesce_threshold,
            self.metrics,
            expert_parallel=self.expert_parallel is not None,
        )
        self.executor.graph_runner = cuda_graphs.build_graph_runner(self, graph_backend)
        logger.info(
            "scheduler: %s, %d tokens per attention micro-batch, %d tokens and %d sequences "
            "per step",
            config.scheduler_policy,
            config.max_num_batched_tokens,
            config.step_token_budget,
            config.max_running_seqs,
        )
        self.sampler = Sampler(self.runner.staging)
        self.structured = StructuredOutputManager(
            self.tokenizer, cfg.vocab_size, self.eos_token_ids
        )
        # Requests whose grammar failed to compile, returned (with ``error``) by the next step.
        self._grammar_failed: dict[str, str] = {}
        self.requests: dict[str, Request] = {}
        self.stats = EngineStats()
        self._next_seq_id = 0
        self._arrivals = 0
        self.num_dummy_steps = 0
        self._prefix_cache_base: dict[str, int] = {}  # counters at the last `reset_metrics`
        if not config.enable_prefix_caching:
            logger.info("prefix caching across requests is off")

    # ---- requests ---------------------------------------------------------------------
    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        """See `InputProcessor.apply_chat_template`."""
        return self.input_processor.apply_chat_template(messages)

    # ---- the step ---------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one step; return the outputs of requests that finished in it, including those
        that failed in it (``error`` set; see the module docstring for what fails what)."""
        if not self.requests:
            return []
        sched = self.schedule()
        if sched.is_empty:
            failed = self.take_failed_outputs()
            if failed:  # the only news: requests whose grammar did not compile
                return failed
            raise RuntimeError("scheduler produced an empty step with unfinished requests")
        return self.execute(sched)

    def take_failed_outputs(self) -> list[RequestOutput]:
        """The outputs of requests that `schedule` failed before they ran (a structured-output
        grammar that did not compile), for a caller whose schedule came out empty; otherwise
        `execute` returns them with the step's."""
        return self._finished_outputs([], self._take_grammar_failures())

    def schedule(self) -> SchedulerOutput:
        """The first half of `step`: admission, chunking, preemption. (A data-parallel rank
        tells the other ranks its token counts between the two halves.)"""
        self._step_started = time.perf_counter()
        self._stage_before = dict(self.metrics.stage_seconds)
        if self.structured.waiting:
            self._admit_compiled()
        sched = self.scheduler.schedule()
        _note_first_scheduled(sched.scheduled)
        self.metrics.stage_seconds["scheduling"] += time.perf_counter() - self._step_started
        return sched

    def _admit_compiled(self) -> None:
        """Queue the requests whose grammar is now compiled; fail those whose grammar failed.
        When nothing else is queued, wait for the first grammar (a step is never empty)."""
        ready, failed = self.structured.take_ready(block=self.scheduler.num_unfinished == 0)
        for request in ready:
            self._queue(request)
        for request, reason in failed:
            self._fail_request(request, None, self._grammar_failed, reason)

    def _take_grammar_failures(self) -> dict[str, str]:
        failed, self._grammar_failed = self._grammar_failed, {}
        return failed

    def execute(self, sched: SchedulerOutput, local_prefill: bool = False) -> list[RequestOutput]:
        """The second half of `step`: run the model on ``sched`` (from `schedule`), sample,
        and return the requests that finished. ``local_prefill``: the prefill rows' experts run
        on this rank (``data_parallel_offload``, see `batchgen.distributed`)."""
        m = self.metrics
        t0, stage_before = self._step_started, self._stage_before
        for seq in sched.kv_imports:  # K/V shipped from another rank, into the new blocks
            runner = self.runner
            import_kv(runner.kv_caches, runner.block_size, seq.block_table, seq.kv_import)
            m.kv_imported_tokens += seq.kv_import.num_tokens
            seq.kv_import = None
        if sched.block_copies:
            self.runner.copy_blocks(sched.block_copies)
        m.shared_prefix_tokens += sched.num_shared_prefix_tokens
        for entry in sched.scheduled:
            entry.prompt_logits = prompt_logit_positions(entry.seq, entry.num_new_tokens)
        if local_prefill:
            self.expert_parallel.begin_streamed_step()
        try:
            if local_prefill:
                sampling, logits, prompt_rows = self.executor.execute(
                    sched.scheduled, local_prefill=True
                )
            else:
                sampling, logits, prompt_rows = self.executor.execute(sched.scheduled)
        except Exception as exc:
            if self.expert_parallel is not None:
                # The other ranks of the group are inside this step's collectives: failing the
                # step here would leave them out of step, so the rank fails (and is reported).
                raise
            return self._fail_step(sched.scheduled, exc)
        finally:
            if local_prefill:
                self.expert_parallel.end_streamed_step()
        decode_only, context = True, 0
        for entry in sched.scheduled:
            seq = entry.seq
            if entry.num_new_tokens == 1 and seq.num_output_tokens > 0:
                m.decode_tokens += 1
                context += seq.num_computed_tokens + 1
            else:
                m.prefill_tokens += entry.num_new_tokens
                decode_only = False
            if seq.num_output_tokens == 0:
                self.stats.num_prompt_tokens += entry.num_new_tokens
            start = seq.num_computed_tokens
            seq.num_computed_tokens += entry.num_new_tokens
            self.kv_cache.cache_full_blocks(seq, start)
        finished: list[Request] = []
        # request id -> why it failed in this step (or, for a grammar, before it)
        failed: dict[str, str] = self._take_grammar_failures()
        if prompt_rows:
            self._add_prompt_logprobs(prompt_rows, failed)
        if sampling:
            finished = self._sample_isolated(sampling, logits, failed)
        # Read what the step left on the device for the metrics, now that sampling has
        # waited for the stream (no sync inside the step for them).
        self.executor.flush_stage_times()
        m.expert.flush()
        self.scheduler.remove_finished()
        elapsed = time.perf_counter() - t0
        if decode_only:
            m.decode_only_tokens += len(sched.scheduled)
            m.decode_only_steps += 1
            m.decode_only_step_tokens[len(sched.scheduled)] += 1
            m.decode_only_seconds += elapsed
            m.decode_only_context_tokens += context
            for stage, seconds in m.stage_seconds.items():
                m.decode_only_stage_seconds[stage] += seconds - stage_before.get(stage, 0.0)
        m.num_steps += 1
        m.busy_seconds += elapsed
        m.generated_tokens += len(sampling)
        self.stats.num_steps += 1
        self.stats.step_seconds += elapsed
        self.stats.num_preemptions = self.scheduler.num_preemptions
        cache = self.kv_cache.prefix_cache
        if cache is not None:
            self.stats.prefix_cache_queries = cache.stats.queries
            self.stats.prefix_cache_hits = cache.stats.hits
            self.stats.prefix_cache_evictions = cache.stats.evictions
        return self._finished_outputs(finished, failed)

    def execute_dummy(self) -> None:
        """A step without tokens, for an expert-parallel rank whose peers have some: every MoE
        layer's dispatch and combine with zero rows (`StageExecutor.execute_dummy`)."""
        t0 = time.perf_counter()
        self.executor.execute_dummy()
        self.executor.flush_stage_times()  # the step's end: its collectives have run
        self.num_dummy_steps += 1
        self.metrics.busy_seconds += time.perf_counter() - t0




def _note_first_scheduled(scheduled: list[ScheduledSeq]) -> None:
    """Stamp `RequestMetrics.first_scheduled_time` (and ``time_in_queue``) of the requests
    that a step computes for the first time."""
    now = None
    for entry in scheduled:
        metrics = entry.seq.request.metrics
        if metrics.first_scheduled_time is None:
            now = now or time.time()
            metrics.first_scheduled_time = now
            metrics.time_in_queue = now - metrics.arrival_time
