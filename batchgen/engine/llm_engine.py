"""`LLMEngine`: requests in, finished `RequestOutput`s out, one `step()` at a time.

    engine.add_request("r0", "Hello", SamplingParams(max_tokens=8))
    while engine.has_unfinished_requests():
        for out in engine.step(): ...

A step is: schedule -> run the model -> sample -> append tokens, detokenize, check stops.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from batchgen.config import EngineConfig
from batchgen.engine.block_manager import KVCacheManager
from batchgen.engine.cpu_threads import configure_cpu_threads
from batchgen.engine.detokenizer import IncrementalDetokenizer
from batchgen.engine.executor import StageExecutor
from batchgen.engine.host_allocator import tune_glibc_malloc
from batchgen.engine.input_processor import (
    InputProcessor,
    ProcessedPrompt,
    eos_token_ids,
    load_tokenizer,
)
from batchgen.engine.metrics import EngineMetrics
from batchgen.engine.model_runner import ModelRunner, kv_cache_bytes_per_token
from batchgen.engine.sampler import Sampler, SamplerOutput, SamplingRow, make_generator
from batchgen.engine.scheduler import ScheduledSeq, Scheduler
from batchgen.engine.sequence import Request, SequenceCoroutine
from batchgen.kernels.cpu_build import kernels_enabled
from batchgen.models.layers.moe import SparseMoeBlock
from batchgen.models.loader import load_model, resolve_dtype, resolve_model_path
from batchgen.models.model_config import ModelConfig
from batchgen.outputs import CompletionOutput, Logprob, RequestOutput
from batchgen.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

_GiB = 1 << 30
DEFAULT_CPU_KV_CACHE_GB = 1.0


def resolve_device(device: str) -> torch.device:
    """ "auto" -> cuda when available, else cpu. Raises ValueError for cuda without CUDA."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' was requested but CUDA is not available; use 'cpu'")
    return torch.device(device)


@dataclass
class EngineStats:
    """Cumulative counters (tokens, seconds)."""

    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    num_steps: int = 0
    step_seconds: float = 0.0
    num_preemptions: int = 0


class LLMEngine:
    """The engine: owns the model, KV cache, scheduler, sampler and the request table.

    Raises ValueError on construction for invalid settings (unknown architecture, missing
    model, ``max_model_len`` above the model's limit, an unknown kernel name in
    ``BATCHGEN_CPU_KERNELS``).
    """

    def __init__(self, config: EngineConfig) -> None:
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
            self.model_name = config.model
        path = resolve_model_path(config.model)
        hf_config = AutoConfig.from_pretrained(path)
        self.model_config = cfg = ModelConfig.from_hf(hf_config)
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device, cfg)
        if self.device.type == "cpu":
            configure_cpu_threads()
            tune_glibc_malloc()
            kernels_enabled()  # a bad BATCHGEN_CPU_KERNELS fails here, not mid-step
        torch.manual_seed(config.seed)
        t0 = time.perf_counter()
        model = load_model(path, cfg, self.device, self.dtype)
        logger.info(
            "loaded %s (%s) on %s in %.1f s",
            path,
            cfg.architecture,
            self.device,
            time.perf_counter() - t0,
        )
        self.tokenizer = load_tokenizer(config.tokenizer or path)
        self.eos_token_ids = eos_token_ids(path, cfg)

        num_blocks = self._num_kv_blocks(cfg)
        capacity = num_blocks * config.block_size
        max_len = config.max_model_len or cfg.max_position_embeddings
        if config.max_model_len and config.max_model_len > cfg.max_position_embeddings:
            raise ValueError(
                f"max_model_len={config.max_model_len} exceeds the model's "
                f"max_position_embeddings={cfg.max_position_embeddings}"
            )
        if max_len > capacity:
            logger.warning(
                "max_model_len %d capped to the KV cache capacity of %d tokens", max_len, capacity
            )
            max_len = capacity
        self.max_model_len = max_len
        self.input_processor = InputProcessor(self.tokenizer, cfg.vocab_size, max_len)
        self.kv_cache = KVCacheManager(num_blocks, config.block_size)
        self.runner = ModelRunner(model, num_blocks, config.block_size, self.device, self.dtype)
        self.scheduler = Scheduler(
            self.kv_cache,
            config.max_running_seqs,
            config.step_token_budget,
            max_chunk_tokens=config.max_num_batched_tokens,
            enable_prefix_sharing=config.enable_prefix_sharing,
        )
        self.metrics = EngineMetrics(tile_size=config.tile_size)
        for module in model.modules():
            if isinstance(module, SparseMoeBlock):
                module.stats = self.metrics.expert
        self.executor = StageExecutor(
            self.runner,
            config.scheduler_policy,
            config.max_num_batched_tokens,
            config.expert_coalesce_threshold,
            self.metrics,
        )
        logger.info(
            "scheduler: %s, %d tokens per attention micro-batch, %d tokens and %d sequences "
            "per step",
            config.scheduler_policy,
            config.max_num_batched_tokens,
            config.step_token_budget,
            config.max_running_seqs,
        )
        self.sampler = Sampler()
        self.requests: dict[str, Request] = {}
        self.stats = EngineStats()
        self._next_seq_id = 0
        self._arrivals = 0

    # ---- set-up helpers ---------------------------------------------------------------
    def _num_kv_blocks(self, cfg: ModelConfig) -> int:
        c = self.config
        per_block = kv_cache_bytes_per_token(cfg, self.dtype) * c.block_size
        if c.num_gpu_blocks_override is not None:
            num_blocks = c.num_gpu_blocks_override
        else:
            if c.kv_cache_memory_gb is not None:
                budget = c.kv_cache_memory_gb * _GiB
            elif self.device.type == "cuda":
                free, total = torch.cuda.mem_get_info(self.device)
                budget = (
                    total * c.gpu_memory_utilization
                    - (total - free)
                    - (self._activation_reserve_bytes(cfg))
                )
            else:
                budget = DEFAULT_CPU_KV_CACHE_GB * _GiB
            num_blocks = int(budget // per_block)
        if num_blocks < 1:
            raise ValueError(
                f"the KV cache budget holds no block of {c.block_size} tokens "
                f"({per_block} bytes); raise kv_cache_memory_gb or gpu_memory_utilization"
            )
        logger.info(
            "KV cache: %d blocks x %d tokens = %d tokens, %.1f MiB (%d bytes/token)",
            num_blocks,
            c.block_size,
            num_blocks * c.block_size,
            num_blocks * per_block / (1 << 20),
            per_block // c.block_size,
        )
        return num_blocks

    def _activation_reserve_bytes(self, cfg: ModelConfig) -> int:
        """Device memory kept free for one step's activations (bytes): a float32 upper estimate
        per batched token (residual, QKV, attention output, MLP/expert intermediates for every
        selected expert) plus the sampler's copies of ``max_running_seqs`` rows of logits, plus
        1 GiB of slack for the allocator and kernels' workspaces. An estimate, not a profile."""
        c = self.config
        experts = max(cfg.num_experts_per_tok, 1)
        per_token = 4 * (
            16 * cfg.hidden_size + experts * (4 * cfg.intermediate_size + 2 * cfg.hidden_size)
        )
        logits = 4 * 4 * min(c.max_running_seqs, c.max_num_batched_tokens) * cfg.vocab_size
        return c.max_num_batched_tokens * per_token + logits + _GiB

    # ---- requests ---------------------------------------------------------------------
    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        """See `InputProcessor.apply_chat_template`."""
        return self.input_processor.apply_chat_template(messages)

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int] | dict,
        params: SamplingParams | None = None,
        *,
        max_tokens_must_fit: bool = False,
    ) -> None:
        """Queue a request.

        Args:
            max_tokens_must_fit: reject a request whose prompt plus ``max_tokens`` exceeds
                ``max_model_len`` (the OpenAI API's behaviour, used by the batch and HTTP
                paths); by default such a request runs and ends with ``finish_reason="length"``
                at ``max_model_len`` (vLLM's offline behaviour).

        Raises:
            ValueError: duplicate ``request_id``, empty prompt, prompt of ``max_model_len``
                tokens or more, token ids outside the vocabulary, text that cannot be
                tokenized, or (with ``max_tokens_must_fit``) a completion that cannot fit.
                Nothing is queued then.
        """
        params = params or SamplingParams()
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        processed = self.input_processor.process(
            prompt, params, max_tokens_must_fit=max_tokens_must_fit
        )
        self.add_processed_request(request_id, processed, params)

    def add_processed_request(
        self,
        request_id: str,
        processed: ProcessedPrompt,
        params: SamplingParams,
        *,
        arrival_time: float | None = None,
    ) -> None:
        """Queue a request whose prompt `InputProcessor.process` has already validated (the
        data-parallel ranks get requests this way from the frontend).

        Args:
            arrival_time: when the request arrived (``time.time()`` seconds), for
                `RequestMetrics`; default now.
        Raises:
            ValueError: duplicate ``request_id``.
        """
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        text, ids = processed.prompt, processed.prompt_token_ids
        request = Request(request_id, text, ids, params, self._arrivals)
        if arrival_time is not None:
            request.metrics.arrival_time = arrival_time
        self._arrivals += 1
        for i in range(params.n):
            seq = SequenceCoroutine(self._next_seq_id, request, i)
            self._next_seq_id += 1
            if params.seed is not None:
                seq.generator = make_generator(params.seed, i, self.device)
            seq.detokenizer = IncrementalDetokenizer(
                self.tokenizer,
                ids,
                skip_special_tokens=params.skip_special_tokens,
                stop=params.stop,
                include_stop_str_in_output=params.include_stop_str_in_output,
                min_tokens=params.min_tokens,
            )
            if params.logprobs is not None:
                seq.logprobs = []
            request.seqs.append(seq)
            self.scheduler.add(seq)
        self.requests[request_id] = request

    def abort_request(self, request_id: str) -> None:
        """Drop a request (no output is returned for it). Unknown ids are ignored."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return
        for seq in request.seqs:
            if not seq.is_finished:
                seq.finish_reason = "abort"
                self.scheduler.finish(seq)
        self.scheduler.remove_finished()

    def get_metrics(self) -> dict:
        """Run metrics since start (or `reset_metrics`): tokens/s, expert GEMMs, tile density,
        stage time shares, peak memory, preemptions. See `batchgen.engine.metrics`."""
        snap = self.metrics.snapshot(self.device)
        snap["num_preemptions"] = self.scheduler.num_preemptions
        snap["scheduler_policy"] = self.config.scheduler_policy
        snap["coalescer_holds"] = self.executor.coalescer.num_holds
        return snap

    def reset_metrics(self) -> None:
        self.metrics.reset()
        for module in self.runner.model.modules():
            if isinstance(module, SparseMoeBlock):
                module.stats = self.metrics.expert

    def get_partial_texts(self, request_id: str) -> dict[int, str] | None:
        """Text generated so far by each sample (``{index: text}``) of an unfinished request,
        for streaming; None when the request is unknown or already returned. The text never
        ends in an incomplete UTF-8 character, but a stop string may still cut its tail."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        return {seq.index: seq.detokenizer.output_text for seq in request.seqs}

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    # ---- the step ---------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one step; return the outputs of requests that finished in it."""
        if not self.requests:
            return []
        m = self.metrics
        t0 = time.perf_counter()
        stage_before = dict(m.stage_seconds)
        sched = self.scheduler.schedule()
        if sched.is_empty:
            raise RuntimeError("scheduler produced an empty step with unfinished requests")
        _note_first_scheduled(sched.scheduled)
        m.stage_seconds["scheduling"] += time.perf_counter() - t0
        if sched.block_copies:
            self.runner.copy_blocks(sched.block_copies)
        m.shared_prefix_tokens += sched.num_shared_prefix_tokens
        sampling, logits = self.executor.execute(sched.scheduled)
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
            seq.num_computed_tokens += entry.num_new_tokens
        finished: list[Request] = []
        if sampling:
            t1 = time.perf_counter()
            seqs = [e.seq for e in sampling]
            rows = [self._sampling_row(s) for s in seqs]
            out = self.sampler(logits, rows)
            m.stage_seconds["sampling"] += time.perf_counter() - t1
            for i, seq in enumerate(seqs):
                self._append_token(seq, out, i)
                if seq.is_finished and seq.request.is_finished:
                    finished.append(seq.request)
        self.scheduler.remove_finished()
        elapsed = time.perf_counter() - t0
        if decode_only:
            m.decode_only_tokens += len(sched.scheduled)
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
        results = []
        for request in finished:
            del self.requests[request.request_id]
            results.append(self._make_output(request))
        return results

    def _sampling_row(self, seq: SequenceCoroutine) -> SamplingRow:
        p = seq.params
        block = list(p.stop_token_ids) + ([] if p.ignore_eos else sorted(self.eos_token_ids))
        return SamplingRow(p, seq.prompt_token_ids, seq.output_token_ids, seq.generator, block)

    def _append_token(self, seq: SequenceCoroutine, out: SamplerOutput, row: int) -> None:
        token = out.sampled_token_ids[row]
        p = seq.params
        seq.output_token_ids.append(token)
        metrics = seq.request.metrics
        metrics.last_token_time = time.time()
        if metrics.first_token_time is None:
            metrics.first_token_time = metrics.last_token_time
        self.stats.num_generated_tokens += 1
        seq.cumulative_logprob += out.sampled_logprobs[row]
        top = out.top_logprobs[row]
        if seq.logprobs is not None and top is not None:
            seq.logprobs.append(
                {t: Logprob(lp, rank, self.tokenizer.decode([t])) for t, lp, rank in top}
            )
        n_out = seq.num_output_tokens
        can_stop = n_out >= p.min_tokens
        if can_stop and not p.ignore_eos and token in self.eos_token_ids:
            self._finish(seq, "stop", None)
            return
        if can_stop and token in p.stop_token_ids:
            self._finish(seq, "stop", token)
            return
        matched = seq.detokenizer.add_tokens([token])  # no stop-string match below min_tokens
        if matched is not None:
            self._finish(seq, "stop", matched)
            return
        if (p.max_tokens is not None and n_out >= p.max_tokens) or (
            seq.num_tokens >= self.max_model_len
        ):
            self._finish(seq, "length", None)

    def _finish(self, seq: SequenceCoroutine, reason: str, stop_reason: int | str | None) -> None:
        seq.finish_reason = reason
        seq.stop_reason = stop_reason
        self.scheduler.finish(seq)

    def _make_output(self, request: Request) -> RequestOutput:
        outputs = []
        for seq in request.seqs:
            want_lp = request.params.logprobs is not None
            outputs.append(
                CompletionOutput(
                    index=seq.index,
                    text=seq.detokenizer.finalize(),
                    token_ids=list(seq.output_token_ids),
                    cumulative_logprob=seq.cumulative_logprob if want_lp else None,
                    logprobs=seq.logprobs,
                    finish_reason=seq.finish_reason,
                    stop_reason=seq.stop_reason,
                )
            )
        metrics = request.metrics
        metrics.finished_time = time.time()
        return RequestOutput(
            request.request_id,
            request.prompt,
            request.prompt_token_ids,
            outputs,
            finished=True,
            metrics=metrics,
        )


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
