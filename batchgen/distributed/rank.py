"""What turns an `LLMEngine` into one rank of a data-parallel / expert-parallel job.

`RankContext` is handed to ``LLMEngine(config, rank=...)``: the engine loads only the rank's
experts (`held_experts`) and `install` puts an `ExpertParallelMoE` on every MoE layer, sharing
one dispatcher (and, for ``data_parallel_offload``, one `ExpertWeightStreamer`). The returned
`ExpertParallelRuntime` decides per step whether the prefill rows run here with streamed experts
(`should_stream`) and reports the rank's traffic and memory.

The rule for streaming (``prefill_stream_min_tokens``, default from `break_even_tokens`): a step
streams when dispatching its prefill tokens would move at least as many bytes as streaming the
experts this rank lacks, layer for layer: ``P * K * H * 2 * (W - 1) / W`` activation bytes (out
and back, the share that leaves the rank) against ``E_s * 3 * I * H`` weight bytes, the same
element size assumed for both.
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import torch
import torch.distributed as dist

from batchgen.config import ParallelConfig
from batchgen.distributed.all_to_all import AllToAllDispatcher, CommStats
from batchgen.distributed.deepep_dispatcher import DeepEPDispatcher, resolve_ep_dispatcher
from batchgen.distributed.ep_moe import ExpertParallelMoE
from batchgen.distributed.groups import ProcessGroups
from batchgen.distributed.layout import ExpertPlacement
from batchgen.distributed.protocol import WAITING_FOR_PEERS
from batchgen.distributed.transport import make_transport
from batchgen.distributed.weight_stream import ExpertWeightStreamer
from batchgen.models.decoder import CausalLM
from batchgen.models.model_config import ModelConfig

logger = logging.getLogger(__name__)

T = TypeVar("T")

# A folder: each rank writes the (enter, exit) times of its collectives there when it stops
# (``a2a_trace_rank<R>.json``; `benchmarks/a2a_trace.py` splits them into compute, waiting for
# the peer, and transfer).
A2A_TRACE_ENV = "BATCHGEN_A2A_TRACE"


def break_even_tokens(cfg: ModelConfig, ep_size: int) -> int:
    """Prefill tokens per step above which streaming moves fewer bytes than dispatching (see
    the module docstring): ``ceil(E_s * 3 * I * W / (2 * K * (W - 1)))``."""
    streamed = cfg.num_local_experts - cfg.num_local_experts // ep_size
    per_token = 2 * cfg.num_experts_per_tok * (ep_size - 1) / ep_size
    return max(1, math.ceil(streamed * 3 * cfg.moe_intermediate_size / per_token))


def pad_dispatch_rows(top_k: int, ep_size: int) -> bool:
    """Whether a dispatch sends every token to every rank (skipping the count exchange, see
    `AllToAllDispatcher.dispatch`): when, with uniform routing, a token has an expert on a
    given other rank with probability ``1 - (1 - 1/W)^K >= 0.8`` (top-8 on 2 ranks: 0.996,
    on 4: 0.90; on 8: 0.66, not padded), so padding adds at most a quarter to the bytes."""
    return 1 - (1 - 1 / ep_size) ** top_k >= 0.8


@dataclass
class RankContext:
    """One rank's coordinates and settings: its `ProcessGroups`, the job's `ParallelConfig`
    and the device it computes on (``cuda:<local rank>`` on GPUs). ``set_phase`` (optional)
    tells the frontend, through the heartbeat, what the rank is doing while it loads: it is
    `WAITING_FOR_PEERS` while this rank waits for the ranks of its expert-parallel group
    (`wait_for_peers`; `RankMessages` names a peer that lags too long)."""

    groups: ProcessGroups
    parallel: ParallelConfig
    device: torch.device
    set_phase: Callable[[str], None] | None = None

    @property
    def expert_parallel(self) -> bool:
        return self.groups.layout.expert_parallel

    def wait_for_peers(self, collective: Callable[[], T]) -> T:
        """Run ``collective``, a start-up collective that returns once every rank of the
        expert-parallel group has reached it, reporting `WAITING_FOR_PEERS` meanwhile (and
        ``loading`` after); returns what it returns."""
        if self.set_phase is not None:
            self.set_phase(WAITING_FOR_PEERS)
        out = collective()
        if self.set_phase is not None:
            self.set_phase("loading")
        return out

    def wait_for_group(self) -> None:
        """Return once every rank of the expert-parallel group has finished its start (a
        barrier on the data-path group, whose timeout is the rendezvous's), so that the
        group's first control exchange, whose timeout is ``distributed_timeout_s``, never
        waits for a rank still starting: a rank's work after the all-to-all's setup (its
        executor, CUDA graphs, the weight updates of a rank started again) may take longer
        than that on one rank, or hang there. A no-op when experts are replicated."""
        if self.groups.ep_group is not None:
            self.wait_for_peers(lambda: dist.barrier(group=self.groups.ep_group))

    def placement(self, cfg: ModelConfig) -> ExpertPlacement | None:
        if not self.expert_parallel or not cfg.num_local_experts:
            return None
        return ExpertPlacement(cfg.num_local_experts, self.groups.layout.expert_parallel_size)

    def held_experts(self, cfg: ModelConfig) -> list[int] | None:
        """The logical experts this rank loads (None: all of them)."""
        placement = self.placement(cfg)
        return None if placement is None else placement.experts_of(self.groups.ep_rank)

    def install(
        self,
        model: CausalLM,
        path: Path,
        device: torch.device,
        dtype: torch.dtype,
    ) -> ExpertParallelRuntime | None:
        """Put expert parallelism on ``model``'s MoE layers (None when experts are replicated
        or the model is dense)."""
        cfg = model.config
        placement = self.placement(cfg)
        if placement is None:
            return None
        ep_rank = self.groups.ep_rank
        stats = CommStats(trace=[] if os.environ.get(A2A_TRACE_ENV) else None)
        kind, why = resolve_ep_dispatcher(device, dtype, placement.ep_size)
        if kind == "deepep":
            dispatcher = DeepEPDispatcher(self.groups.ep_group, placement, cfg.hidden_size, stats)
        else:
            transport = self.wait_for_peers(  # its first collective waits for every peer
                lambda: make_transport(
                    self.groups.ep_group,
                    device,
                    self.parallel.distributed_timeout_s,
                    setup_group=self.groups.control,
                )
            )
            dispatcher = AllToAllDispatcher(self.groups.ep_group, placement, stats, transport)
            dispatcher.pad_rows = pad_dispatch_rows(cfg.num_experts_per_tok, placement.ep_size)
        logger.info("rank %d: expert-parallel dispatcher %s (%s)", self.groups.rank, kind, why)
        moe_layers = [i for i, moe in enumerate(cfg.layer_is_moe) if moe]
        streamer = None
        if self.parallel.prefill_strategy == "data_parallel_offload":
            held = set(placement.experts_of(ep_rank))
            probe = torch.empty(1, cfg.hidden_size, dtype=dtype, device=device)
            streamer = ExpertWeightStreamer(
                path,
                cfg,
                [e for e in range(cfg.num_local_experts) if e not in held],
                moe_layers,
                dtype,
                device,
                packed=model.layers[moe_layers[0]].mlp.uses_kernel(probe),
                num_slots=self.parallel.stream_buffer_layers,
            )
        for layer in moe_layers:
            block = model.layers[layer].mlp
            block.expert_parallel = ExpertParallelMoE(
                layer, dispatcher, placement, ep_rank, streamer
            )
        threshold = self.parallel.prefill_stream_min_tokens or break_even_tokens(
            cfg, placement.ep_size
        )
        runtime = ExpertParallelRuntime(
            placement, ep_rank, dispatcher, streamer, threshold, model.routed_expert_bytes()
        )
        logger.info(
            "rank %d: experts %s of %d (%.1f MiB routed-expert weights); all-to-all over %s; "
            "prefill %s%s",
            self.groups.rank,
            _ranges(placement.experts_of(ep_rank)),
            cfg.num_local_experts,
            runtime.resident_expert_bytes / (1 << 20),
            dispatcher.transport.name,
            self.parallel.prefill_strategy,
            f" (streams from {threshold} prefill tokens per step)" if streamer else "",
        )
        return runtime


def _ranges(ids: list[int]) -> str:
    return f"{ids[0]}-{ids[-1]}" if len(ids) > 1 else str(ids[0])


@dataclass
class ExpertParallelRuntime:
    """A rank's expert-parallel state: placement, dispatcher, optional streamer.

    Attributes:
        stream_min_tokens: prefill tokens per step from which the step streams.
        resident_expert_bytes: routed-expert parameter bytes held by this rank.
        control_seconds: time in the per-step control exchange while this rank had work: it
            waits there for the slowest rank of its group (set by the rank loop).
    """

    placement: ExpertPlacement
    ep_rank: int
    dispatcher: AllToAllDispatcher | DeepEPDispatcher
    streamer: ExpertWeightStreamer | None
    stream_min_tokens: int
    resident_expert_bytes: int
    control_seconds: float = 0.0  # in the per-step control exchange while this rank had work

    def set_step_tokens(self, tokens: list[int]) -> None:
        """Every rank's tokens in this step, from the control exchange (group-rank order)."""
        self.dispatcher.step_tokens = tokens

    def should_stream(self, prefill_tokens: int) -> bool:
        return self.streamer is not None and prefill_tokens >= self.stream_min_tokens

    def begin_streamed_step(self) -> None:
        self.streamer.begin_step()

    def end_streamed_step(self) -> None:
        """Release whatever a failed step left queued (a finished step left nothing)."""
        self.streamer.abort_step()

    def metrics(self) -> dict:
        comm = self.dispatcher.stats
        out = {
            "all_to_all_bytes": comm.bytes_sent,
            "all_to_all_seconds": comm.seconds,
            "all_to_all_wait_seconds": comm.wait_seconds,
            "control_seconds": self.control_seconds,
            "all_to_all_calls": comm.num_calls,
            "all_to_all_transport": self.dispatcher.transport.name,
            "resident_expert_bytes": self.resident_expert_bytes,
            "held_experts": len(self.placement.experts_of(self.ep_rank)),
        }
        if self.streamer is not None:
            s = self.streamer.stats
            out.update(
                streamed_bytes=s.bytes_streamed,
                streamed_layers=s.layers_streamed,
                stream_copy_seconds=s.copy_seconds,
                stream_wait_seconds=s.wait_seconds,
                stream_hidden_share=s.hidden_share,
                stream_buffer_peak_bytes=s.peak_buffer_bytes,
                stream_min_tokens=self.stream_min_tokens,
            )
        return out

    def write_trace(self, rank: int) -> None:
        """Write the collectives' times to ``$BATCHGEN_A2A_TRACE/a2a_trace_rank<rank>.json``
        (nothing when tracing is off)."""
        trace, folder = self.dispatcher.stats.trace, os.environ.get(A2A_TRACE_ENV)
        if trace is None or not folder:
            return
        path = Path(folder) / f"a2a_trace_rank{rank}.json"
        path.write_text(json.dumps({"rank": rank, "ep_rank": self.ep_rank, "trace": trace}))
        logger.info("rank %d: %d collective times written to %s", rank, len(trace), path)

    def close(self) -> None:
        self.dispatcher.transport.close()
        if self.streamer is not None:
            self.streamer.close()
