"""The data-parallel frontend: one process that takes requests, hands each to a rank, and
collects the finished outputs. It has `LLMEngine`'s request methods (``add_request``, ``step``,
``abort_request``, ``has_unfinished_requests``, ``apply_chat_template``, ``get_metrics``), so
`LLM`, ``batchgen run`` and the bench drive it unchanged.

- **Assignment**: each request goes to the ready rank with the fewest estimated tokens in
  flight (prompt plus ``max_tokens``, times ``n``), as vLLM's and SGLang's data-parallel
  balancers assign at admission; a rank started again after a failure is chosen only once it
  is ready (or when no rank is). Requests are tokenized and validated here once
  (`InputProcessor`); a rank gets token ids.
- **Ranks** (`RankSet`) are local processes it starts (``data_parallel_size_local``, default
  all) and/or ranks started elsewhere (``python -m batchgen.distributed.launch`` or
  ``torchrun``) that connect to its listener at ``data_parallel_address:data_parallel_rpc_port``
  with the key in ``$BATCHGEN_DP_AUTHKEY``; or, with ``distributed_executor_backend='ray'``,
  Ray actors (`batchgen.distributed.ray_executor`), this process being Ray's driver.
- **Failure**: `RankFailedError` names the dead, stuck or failed rank (see `RankSet`); every
  finished output has already been returned, and the other ranks are stopped. Resuming
  (``batchgen run --resume``) re-runs only what did not finish.
- **Elastic recovery** (``enable_elastic_recovery``): when a rank dies or goes silent (not when
  it raises an error, which a restart would repeat), the frontend stops the ranks of its
  *restart group* (its expert-parallel group, whose collectives broke with it; the rank alone
  when experts are replicated), starts that group again (the same ranks, so the same experts)
  and re-queues the requests the group held, up to `MAX_RECOVERIES` times per engine
  (`ElasticRecovery`). The other groups run on with their requests: each restart group is its
  own ``torch.distributed`` world, and the frontend does not wait for the new ranks: the
  re-queued requests, and new ones, go to the ready ranks while the new ones load (only a
  request pinned to a new rank waits in its ``pending``, `RankSet.replace`); a new rank takes
  new work once it is ready (and the rebalancer's moves, if on). Finished outputs were
  returned before (or arrived with the failure, and are taken first) and are never run
  again; a re-queued request starts over, and greedy or seeded requests get the same tokens
  (a request's tokens do not depend on its rank). Only ranks this frontend starts itself
  can be restarted (not ``torchrun`` or headless ones): a group that cannot start again, or
  that fails once the budget is spent, is retired for good while another group is left
  (`ElasticRecovery.plan`: its requests go to the others, requests pinned to it fail one by
  one); the job fails when none is. A rank that dies while it starts
  (before connecting, or while loading the model) is one more failure within the same
  budget: a replacement's group is started again alone, a rank of the first start (or of a
  restart of every rank) restarts every rank; a rank that exits with an error while starting
  (a bad model, a missing package) ends the job at once.
- **Straggler rebalancing** (``straggler_rebalance_interval_steps``): the ranks report their
  load every so many steps, and the frontend moves requests from the most loaded rank to the
  least loaded one while the job runs (`batchgen.distributed.rebalance`: the rule, and how
  started requests continue elsewhere). ``load_balance_method='round_robin'`` assigns
  requests in turn instead of by load (SGLang's option), e.g. to create skew.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass

from batchgen.config import EngineConfig, ParallelConfig
from batchgen.distributed import protocol as msg
from batchgen.distributed.frontend_metrics import FrontendMetrics
from batchgen.distributed.frontend_recovery import FrontendRecovery, locked, retired_rank_error
from batchgen.distributed.frontend_weights import FrontendWeights
from batchgen.distributed.layout import ExpertPlacement
from batchgen.distributed.metrics import aggregate_metrics
from batchgen.distributed.rank_set import RankFailedError, RankHandle, RankSet
from batchgen.distributed.rebalance import Rebalancer
from batchgen.distributed.recovery import MAX_RECOVERIES, ElasticRecovery  # noqa: F401
from batchgen.engine.input_processor import InputProcessor, ProcessedPrompt, load_tokenizer
from batchgen.engine.migration import RequestState
from batchgen.models.default_model import resolve_tokenizer
from batchgen.outputs import RequestOutput
from batchgen.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# How long `step` waits for a finished output before returning none.
STEP_WAIT_S = 0.5
# Requests buffered per rank before they are sent (they are also sent at every `step`).
SEND_BATCH = 64

__all__ = ["DPEngineClient", "RankFailedError", "aggregate_metrics"]


@dataclass
class _Request:
    """An unfinished request as the frontend keeps it: where it runs, its estimated tokens, and
    what it takes to send it again after a recovery. ``remaining`` / ``computed``: its rank's
    last `Load` report (before one: the estimate, nothing computed); ``moving``: a `Release`
    for it is in flight."""

    rank: int
    load: int
    processed: ProcessedPrompt
    params: SamplingParams
    arrival: float
    pinned: int | None  # the caller's data_parallel_rank
    remaining: int = 0
    computed: int = 0
    moving: bool = False

    def reset(self) -> None:
        """Back to admission: the request starts over (after a recovery)."""
        self.remaining, self.computed, self.moving = self.load, 0, False


class DPEngineClient(FrontendMetrics, FrontendRecovery, FrontendWeights):
    """Runs requests on ``parallel.data_parallel_size`` ranks (see the module docstring).

    Args:
        config: the engine settings every rank uses (``model`` None: the default model).
        parallel: the layout and launch settings.

    Raises:
        ValueError: bad settings, or ranks expected from elsewhere without
            ``$BATCHGEN_DP_AUTHKEY``.
        RankFailedError: a rank failed while starting (after `MAX_RECOVERIES` restarts, with
            elastic recovery, if it died rather than raised).
    """

    def __init__(self, config: EngineConfig, parallel: ParallelConfig) -> None:
        from transformers import AutoConfig

        from batchgen.engine.engine_setup import served_model_name
        from batchgen.models.loader import resolve_model_path
        from batchgen.models.model_config import ModelConfig

        self.config, self.parallel = config, parallel
        if config.model is None:
            from batchgen.models.default_model import (
                DEFAULT_MODEL_NAME,
                RANDOM_WEIGHTS_NOTE,
                default_model_path,
            )

            config.model = str(default_model_path())
            self.model_name = f"batchgen/{DEFAULT_MODEL_NAME}"
            logger.warning(RANDOM_WEIGHTS_NOTE)  # as `LLMEngine`; the ranks get the path
        else:
            self.model_name = served_model_name(config.model)
        self.model_name = config.served_model_name or self.model_name
        path = resolve_model_path(config.model)
        config.model = str(path)
        self.model_config = ModelConfig.from_hf(AutoConfig.from_pretrained(path))
        ep = parallel.resolved_expert_parallel_size
        if ep > 1 and self.model_config.is_moe:  # fail here, not in every rank after loading
            ExpertPlacement(self.model_config.num_local_experts, ep)
        self.tokenizer = load_tokenizer(resolve_tokenizer(config.tokenizer, path))
        self.requests: dict[str, _Request] = {}  # unfinished, in arrival order
        self._answer_token = itertools.count()
        self._answers: dict[tuple[int, int], object] = {}
        self._finished: list[RequestOutput] = []
        self._started = time.perf_counter()
        self.recovery = ElasticRecovery(parallel)
        lockstep = parallel.resolved_expert_parallel_size if self.model_config.is_moe else 1
        self.rebalancer = Rebalancer(self, lockstep)
        self._round_robin = itertools.count()
        self._fatal: RankFailedError | None = None  # a failure recovery did not outlive
        self.rank_set = self._start_ranks()
        if self.recovery.recovering:  # the first start failed and was retried
            self.recovery.end(len(self.rank_set.ranks))
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

    @locked
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

    @locked
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
                ``[0, data_parallel_size)`` or retired for good by elastic recovery.
            RankFailedError: after a rank failure.
        """
        self._check_open()
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if data_parallel_rank is not None and not (
            isinstance(data_parallel_rank, int)
            and not isinstance(data_parallel_rank, bool)
            and 0 <= data_parallel_rank < len(self._ranks)
        ):
            raise ValueError(
                f"data_parallel_rank must be in [0, {len(self._ranks)}), got {data_parallel_rank!r}"
            )
        if data_parallel_rank is not None and self._ranks[data_parallel_rank].retired:
            raise ValueError(retired_rank_error(data_parallel_rank, "it could not start again"))
        prompt_len = len(processed.prompt_token_ids)
        budget = params.max_tokens or (self.max_model_len - prompt_len)
        load = params.n * (prompt_len + min(budget, self.max_model_len - prompt_len))
        arrival = time.time() if arrival_time is None else arrival_time
        request = _Request(-1, load, processed, params, arrival, data_parallel_rank)
        request.reset()
        self._assign(request_id, request)

    def _assign(
        self,
        request_id: str,
        request: _Request,
        dst: int | None = None,
        resume: RequestState | None = None,
    ) -> None:
        """Queue ``request`` on ``dst`` (a rebalancing move, with its progress ``resume``), else
        its pinned rank, else by ``load_balance_method`` among the ready ranks (`_choosable`):
        the least-loaded one (estimated tokens in flight) or the next in turn
        (``round_robin``)."""
        if dst is not None:
            rank = self._ranks[dst]
        elif request.pinned is not None:
            rank = self._ranks[request.pinned]
        elif self.parallel.load_balance_method == "round_robin":
            choosable = self._choosable()
            rank = choosable[next(self._round_robin) % len(choosable)]
        else:
            rank = min(self._choosable(), key=lambda r: (r.load, r.rank))
        request.rank = rank.rank
        rank.load += request.load
        rank.pending.append(
            (request_id, request.processed, request.params, request.arrival, resume)
        )
        self.requests[request_id] = request
        if len(rank.pending) >= SEND_BATCH:
            self._flush(rank)

    def _choosable(self) -> list[RankHandle]:
        """The ranks a request may be assigned to: the ready ones, or, when every rank is
        started again and still joining, all of them; never a rank retired for good. A
        replacement loads for seconds to minutes, so a request queued on it (a re-queued one above all, since it holds none)
        would wait for its start while a ready rank could run it; once ready it takes new
        work, and the rebalancer's moves (`Rebalancer.plan`)."""
        left = [r for r in self._ranks if not r.retired]
        return [r for r in left if not r.joining] or left

    def _check_open(self) -> None:
        if self._fatal is not None:
            raise self._fatal
        if self.rank_set.failure is not None:
            self._recover(self.rank_set.failure)
        if self.rank_set.closed:
            raise RuntimeError("this engine was shut down (LLM.shutdown); create a new LLM")

    def _flush(self, rank: RankHandle) -> None:
        """Send what is queued for ``rank`` (kept while it is started again after a failure
        and not ready yet)."""
        if rank.pending and not rank.joining and not rank.retired:
            self.rank_set.send(rank, msg.AddRequests(rank.pending))
            rank.pending = []

    @locked
    def abort_request(self, request_id: str) -> None:
        """Drop a request (unknown ids and a failed job are ignored). Also while a failure
        waits for recovery: a request on a rank that runs on is aborted there, one on a
        stopped rank is simply not re-queued."""
        entry = self.requests.pop(request_id, None)
        if entry is None or self.rank_set.closed:
            return
        rank = self._ranks[entry.rank]
        rank.load -= entry.load
        before = len(rank.pending)
        rank.pending = [p for p in rank.pending if p[0] != request_id]
        if len(rank.pending) == before and not rank.retired and not rank.joining:
            try:
                self.rank_set.send(rank, msg.Abort([request_id]))
            except (OSError, RuntimeError):
                pass

    @locked
    def has_unfinished_requests(self) -> bool:
        """True while a request runs or its finished output waits to be returned by `step`."""
        return bool(self.requests or self._finished)

    @locked
    def get_num_unfinished_requests(self) -> int:
        return len(self.requests) + len(self._finished)

    @locked
    def step(self) -> list[RequestOutput]:
        """Send queued requests, then return the outputs that finished (waiting up to
        `STEP_WAIT_S` for the first).

        A failure that ends the job (recovery off, or nothing left to run on) is raised only
        once every output finished before it has been returned: outputs that arrived together
        with the failure, or failed requests pinned to a rank retired for good, come back from
        this call and the failure from the next one (none if no request is left).

        Raises:
            RankFailedError: see `RankSet.receive` and `_recover`, when no finished output is
                left to return; every later call raises it again.
            RuntimeError: after `shutdown`.
        """
        try:
            self._check_open()
            for rank in self._ranks:
                self._flush(rank)
            deadline = time.monotonic() + STEP_WAIT_S
            while not self._finished and self.requests:
                self._dispatch(self.rank_set.receive(max(0.0, deadline - time.monotonic())))
                if time.monotonic() >= deadline:
                    break
        except RankFailedError as failure:
            if self._fatal is None:
                try:
                    self._recover(failure)  # raises (and records ``_fatal``) unless they run
                except RankFailedError:
                    pass
            if self._fatal is not None and not self._finished:
                raise self._fatal
        finished, self._finished = self._finished, []
        return finished

    def _dispatch(self, messages: list[tuple[RankHandle, object]]) -> None:
        """File finished outputs for `step` and metrics for `get_metrics`."""
        self._check_recovered()
        for rank, message in messages:
            if isinstance(message, msg.Outputs):
                rank.unfinished = message.num_unfinished
                for out in message.outputs:
                    entry = self.requests.pop(out.request_id, None)
                    if entry is not None:  # else aborted meanwhile
                        rank.load -= entry.load
                        self._finished.append(out)
                        rank.done_tokens += len(out.prompt_token_ids or ()) + sum(
                            len(c.token_ids) for c in out.outputs
                        )
            elif isinstance(message, msg.Metrics):
                self._answers[(message.token, rank.rank)] = message.snapshot
            elif isinstance(message, msg.Reply):
                self._answers[(message.token, rank.rank)] = message
            elif isinstance(message, msg.Load):
                self.rebalancer.note_load(rank, message)
            elif isinstance(message, msg.Released):
                self.rebalancer.land(rank, message)

    # ---- metrics -------------------------------------------------------------------------
    # ---- shutdown ------------------------------------------------------------------------
    @locked
    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the ranks (politely, then by force). Idempotent."""
        self.rank_set.shutdown(timeout)
