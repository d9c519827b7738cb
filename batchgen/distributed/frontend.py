"""The data-parallel frontend: one process that takes requests, hands each to a rank, and
collects the finished outputs. It has `LLMEngine`'s request methods (``add_request``, ``step``,
``abort_request``, ``has_unfinished_requests``, ``apply_chat_template``, ``get_metrics``), so
`LLM`, ``batchgen run`` and the bench drive it unchanged.

- **Assignment**: each request goes to the rank with the fewest estimated tokens in flight
  (prompt plus ``max_tokens``, times ``n``), as vLLM's and SGLang's data-parallel balancers
  assign at admission. Requests are tokenized and validated here once (`InputProcessor`); a
  rank gets token ids.
- **Ranks** (`RankSet`) are local processes it starts (``data_parallel_size_local``, default
  all) and/or ranks started elsewhere (``python -m batchgen.distributed.launch`` or
  ``torchrun``) that connect to its listener at ``data_parallel_address:data_parallel_rpc_port``
  with the key in ``$BATCHGEN_DP_AUTHKEY``; or, with ``distributed_executor_backend='ray'``,
  Ray actors (`batchgen.distributed.ray_executor`), this process being Ray's driver.
- **Failure**: `RankFailedError` names the dead, stuck or failed rank (see `RankSet`); every
  finished output has already been returned, and the other ranks are stopped. Resuming
  (``batchgen run --resume``) re-runs only what did not finish; recovery without a restart
  belongs to the elastic path (not built yet).
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass

from batchgen.config import EngineConfig, ParallelConfig
from batchgen.distributed import protocol as msg
from batchgen.distributed.layout import ExpertPlacement
from batchgen.distributed.rank_set import RankFailedError, RankHandle, RankSet
from batchgen.engine.input_processor import InputProcessor, ProcessedPrompt, load_tokenizer
from batchgen.outputs import RequestOutput
from batchgen.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# How long `step` waits for a finished output before returning none.
STEP_WAIT_S = 0.5
# Requests buffered per rank before they are sent (they are also sent at every `step`).
SEND_BATCH = 64

__all__ = ["DPEngineClient", "RankFailedError", "aggregate_metrics"]


@dataclass
class _KVUsage:
    usage: float


class DPEngineClient:
    """Runs requests on ``parallel.data_parallel_size`` ranks (see the module docstring).

    Args:
        config: the engine settings every rank uses (``model`` None: the default model).
        parallel: the layout and launch settings.

    Raises:
        ValueError: bad settings, or ranks expected from elsewhere without
            ``$BATCHGEN_DP_AUTHKEY``.
        RankFailedError: a rank failed while starting.
    """

    def __init__(self, config: EngineConfig, parallel: ParallelConfig) -> None:
        from transformers import AutoConfig

        from batchgen.engine.llm_engine import served_model_name
        from batchgen.models.loader import resolve_model_path
        from batchgen.models.model_config import ModelConfig

        self.config, self.parallel = config, parallel
        if config.model is None:
            from batchgen.models.default_model import DEFAULT_MODEL_NAME, default_model_path

            config.model = str(default_model_path())
            self.model_name = f"batchgen/{DEFAULT_MODEL_NAME}"
        else:
            self.model_name = served_model_name(config.model)
        self.model_name = config.served_model_name or self.model_name
        path = resolve_model_path(config.model)
        config.model = str(path)
        self.model_config = ModelConfig.from_hf(AutoConfig.from_pretrained(path))
        ep = parallel.resolved_expert_parallel_size
        if ep > 1 and self.model_config.is_moe:  # fail here, not in every rank after loading
            ExpertPlacement(self.model_config.num_local_experts, ep)
        self.tokenizer = load_tokenizer(config.tokenizer or path)
        self.requests: dict[str, tuple[int, int]] = {}  # request id -> (rank, load estimate)
        self._metrics_token = itertools.count()
        self._metrics: dict[tuple[int, int], dict] = {}
        self._finished: list[RequestOutput] = []
        self._started = time.perf_counter()
        self.rank_set = RankSet(config, parallel)
        self._ranks = self.rank_set.ranks
        self.max_model_len = self.rank_set.max_model_len
        self.input_processor = InputProcessor(
            self.tokenizer, self.model_config.vocab_size, self.max_model_len
        )
        if parallel.resolved_expert_parallel_size > 1 and not any(self.model_config.layer_is_moe):
            logger.warning(
                "%s has no MoE layers: expert parallelism has no effect, the ranks run "
                "data-parallel only",
                self.model_config.architecture,
            )
        logger.info(
            "data-parallel frontend: %d ranks (expert-parallel groups: %d of %d ranks)",
            parallel.data_parallel_size,
            parallel.data_parallel_size // parallel.resolved_expert_parallel_size,
            parallel.resolved_expert_parallel_size,
        )

    # ---- requests ------------------------------------------------------------------------
    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        return self.input_processor.apply_chat_template(messages)

    def add_request(
        self,
        request_id: str,
        prompt,
        params: SamplingParams | None = None,
        *,
        max_tokens_must_fit: bool = False,
        data_parallel_rank: int | None = None,
    ) -> None:
        """Validate and tokenize here (`InputProcessor`), then `add_processed_request`.
        Raises like `LLMEngine.add_request`, and `RankFailedError` after a rank failure."""
        self._check_open()
        params = params or SamplingParams()
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        processed = self.input_processor.process(
            prompt, params, max_tokens_must_fit=max_tokens_must_fit
        )
        self.add_processed_request(request_id, processed, params, data_parallel_rank)

    def add_processed_request(
        self,
        request_id: str,
        processed: ProcessedPrompt,
        params: SamplingParams,
        data_parallel_rank: int | None = None,
        *,
        arrival_time: float | None = None,
    ) -> None:
        """Queue an already validated prompt on the least-loaded rank, or on
        ``data_parallel_rank`` (vLLM's argument) when given; it is sent at the next `step` or
        once `SEND_BATCH` requests wait for that rank. ``arrival_time`` (``time.time()``, default
        now) travels with it, so the rank's `RequestMetrics` count from the real arrival.

        Raises:
            ValueError: a duplicate ``request_id``, or a ``data_parallel_rank`` outside
                ``[0, data_parallel_size)``.
            RankFailedError: after a rank failure.
        """
        self._check_open()
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if data_parallel_rank is None:
            rank = min(self._ranks, key=lambda r: (r.load, r.rank))
        elif (
            isinstance(data_parallel_rank, int)
            and not isinstance(data_parallel_rank, bool)
            and 0 <= data_parallel_rank < len(self._ranks)
        ):
            rank = self._ranks[data_parallel_rank]
        else:
            raise ValueError(
                f"data_parallel_rank must be in [0, {len(self._ranks)}), got {data_parallel_rank!r}"
            )
        prompt_len = len(processed.prompt_token_ids)
        budget = params.max_tokens or (self.max_model_len - prompt_len)
        load = params.n * (prompt_len + min(budget, self.max_model_len - prompt_len))
        rank.load += load
        arrival = time.time() if arrival_time is None else arrival_time
        rank.pending.append((request_id, processed, params, arrival))
        self.requests[request_id] = (rank.rank, load)
        if len(rank.pending) >= SEND_BATCH:
            self._flush(rank)

    def _check_open(self) -> None:
        if self.rank_set.failure is not None:
            raise self.rank_set.failure
        if self.rank_set.closed:
            raise RuntimeError("this engine was shut down (LLM.shutdown); create a new LLM")

    def _flush(self, rank: RankHandle) -> None:
        if rank.pending:
            self.rank_set.send(rank, msg.AddRequests(rank.pending))
            rank.pending = []

    def abort_request(self, request_id: str) -> None:
        """Drop a request (unknown ids and a failed job are ignored)."""
        entry = self.requests.pop(request_id, None)
        if entry is None or self.rank_set.failure is not None or self.rank_set.closed:
            return
        rank = self._ranks[entry[0]]
        rank.load -= entry[1]
        before = len(rank.pending)
        rank.pending = [p for p in rank.pending if p[0] != request_id]
        if len(rank.pending) == before:
            try:
                self.rank_set.send(rank, msg.Abort([request_id]))
            except OSError:
                pass

    def has_unfinished_requests(self) -> bool:
        """True while a request runs or its finished output waits to be returned by `step`."""
        return bool(self.requests or self._finished)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests) + len(self._finished)

    def step(self) -> list[RequestOutput]:
        """Send queued requests, then return the outputs that finished (waiting up to
        `STEP_WAIT_S` for the first).

        Raises:
            RankFailedError: see `_receive`; outputs that arrived before are not lost: they
                were returned by earlier calls.
            RuntimeError: after `shutdown`.
        """
        self._check_open()
        for rank in self._ranks:
            self._flush(rank)
        deadline = time.monotonic() + STEP_WAIT_S
        while not self._finished and self.requests:
            self._dispatch(self.rank_set.receive(max(0.0, deadline - time.monotonic())))
            if time.monotonic() >= deadline:
                break
        finished, self._finished = self._finished, []
        return finished

    def _dispatch(self, messages: list[tuple[RankHandle, object]]) -> None:
        """File finished outputs for `step` and metrics for `get_metrics`."""
        for rank, message in messages:
            if isinstance(message, msg.Outputs):
                rank.unfinished = message.num_unfinished
                for out in message.outputs:
                    entry = self.requests.pop(out.request_id, None)
                    if entry is not None:  # else aborted meanwhile
                        rank.load -= entry[1]
                        self._finished.append(out)
            elif isinstance(message, msg.Metrics):
                self._metrics[(message.token, rank.rank)] = message.snapshot

    # ---- metrics -------------------------------------------------------------------------
    def get_metrics(self) -> dict:
        """Every rank's `LLMEngine.get_metrics` (``ranks``) plus job totals (`aggregate_metrics`:
        tokens summed, rates over the busiest rank's busy time, tile density over all ranks'
        expert GEMMs)."""
        token = next(self._metrics_token)
        self.rank_set.broadcast(msg.GetMetrics(token))
        keys = [(token, r.rank) for r in self._ranks]
        while any(k not in self._metrics for k in keys):
            self._dispatch(self.rank_set.receive(1.0))
        ranks = [self._metrics.pop(k) for k in keys]
        return aggregate_metrics(ranks, time.perf_counter() - self._started)

    def _poll(self) -> None:
        """Take what the ranks sent meanwhile (heartbeats, outputs for the next `step`) without
        waiting; a failure is left for `step` to raise."""
        if self.rank_set.failure is None and not self.rank_set.closed:
            try:
                self._dispatch(self.rank_set.receive(0))
            except RankFailedError:
                pass

    @property
    def stats(self):
        """`EngineStats` summed over the ranks' last heartbeats (at most a second old)."""
        from batchgen.engine.llm_engine import EngineStats

        self._poll()

        def total(key: str) -> int:
            return sum(r.counters.get(key, 0) for r in self._ranks)

        return EngineStats(
            num_prompt_tokens=total("num_prompt_tokens"),
            num_generated_tokens=total("num_generated_tokens"),
            num_preemptions=total("num_preemptions"),
        )

    @property
    def kv_cache(self) -> _KVUsage:
        """``.usage``: the mean KV cache use over the ranks (last heartbeats)."""
        self._poll()
        usages = [r.counters.get("kv_cache_usage", 0.0) for r in self._ranks]
        return _KVUsage(sum(usages) / len(usages) if usages else 0.0)

    def live_metrics(self) -> dict:
        """Figures from the ranks' last heartbeats, without a round trip (the service reads
        these every second): ``tile_density`` over all ranks, ``num_running``,
        ``num_waiting``."""
        self._poll()
        rows = sum(r.counters.get("expert_rows", 0) for r in self._ranks)
        tile_rows = sum(r.counters.get("expert_tile_rows", 0) for r in self._ranks)
        return {
            "tile_density": rows / tile_rows if tile_rows else None,
            "num_running": sum(r.counters.get("num_running", 0) for r in self._ranks),
            "num_waiting": sum(r.counters.get("num_waiting", 0) for r in self._ranks),
        }

    def get_partial_texts(self, request_id: str) -> None:
        """Streaming text is not relayed from the ranks yet: None (a streamed response then
        carries the whole text in its last chunk)."""
        return None

    def reset_metrics(self) -> None:
        self.rank_set.broadcast(msg.ResetMetrics())
        self._started = time.perf_counter()

    # ---- shutdown ------------------------------------------------------------------------
    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the ranks (politely, then by force). Idempotent."""
        self.rank_set.shutdown(timeout)


def aggregate_metrics(ranks: list[dict], wall_seconds: float) -> dict:
    """Job totals over per-rank metric snapshots (see `DPEngineClient.get_metrics`).

    Token counts are summed. Rates divide by the busiest rank's ``busy_seconds`` (time inside
    engine steps; ranks step side by side), as one process divides by its own: so the figures
    compare with `LLMEngine.get_metrics`. ``stage_time_share`` is the busy-time-weighted mean
    over ranks; ``wall_seconds`` is the time since start or the last `reset_metrics`.
    """
    total = {
        key: sum(s.get(key, 0) for s in ranks)
        for key in (
            "prefill_tokens",
            "decode_tokens",
            "generated_tokens",
            "num_steps",
            "num_preemptions",
            "num_expert_gemms",
            "routed_expert_bytes",
            "all_to_all_bytes",
            "streamed_bytes",
            "dummy_steps",
        )
    }
    rows = sum(s["mean_rows_per_expert_gemm"] * s["num_expert_gemms"] for s in ranks)
    tile_rows = sum(
        s["mean_rows_per_expert_gemm"] * s["num_expert_gemms"] / s["tile_density"]
        for s in ranks
        if s.get("tile_density")
    )
    busy = max(s["busy_seconds"] for s in ranks) or 1e-12
    weights = [s["busy_seconds"] for s in ranks]
    shares: dict[str, float] = {}
    for s, weight in zip(ranks, weights, strict=True):
        for stage, share in s["stage_time_share"].items():
            shares[stage] = shares.get(stage, 0.0) + share * weight / (sum(weights) or 1e-12)
    return {
        **total,
        "data_parallel_size": len(ranks),
        "busy_seconds": busy,
        "wall_seconds": wall_seconds,
        "prefill_tokens_per_s": total["prefill_tokens"] / busy,
        "decode_tokens_per_s": total["decode_tokens"] / busy,
        "generated_tokens_per_s": total["generated_tokens"] / busy,
        "total_tokens_per_s": (total["prefill_tokens"] + total["decode_tokens"]) / busy,
        "stage_time_share": shares,
        "tile_density": rows / tile_rows if tile_rows else None,
        "mean_rows_per_expert_gemm": rows / total["num_expert_gemms"]
        if total["num_expert_gemms"]
        else 0.0,
        "peak_memory_bytes": max(s["peak_memory_bytes"] for s in ranks),
        "ranks": ranks,
    }
