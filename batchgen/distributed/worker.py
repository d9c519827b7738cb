"""The rank entry point: connect to the frontend, join the process groups, build the engine on
this rank's experts, and loop.

One loop iteration (expert-parallel group):

    take the frontend's messages (requests, aborts, metrics, shutdown)
    sched = engine.schedule()                  # this rank's tokens, maybe none
    plan = control.exchange(step, tokens, ...) # the same table on every rank of the group
    if plan.any_tokens: engine.execute(sched) or engine.execute_dummy()
    send finished outputs

Ranks with replicated experts (pure data parallelism) never wait for each other: they step
whenever they have work. Either way a rank leaves only when told to (`Shutdown`) and, in an
expert-parallel group, when every rank of the group is leaving with no work left.

Started by the frontend (local processes), by ``python -m batchgen.distributed.launch``, by
``torchrun`` (one rank per process, from ``RANK`` / ``WORLD_SIZE`` / ``MASTER_ADDR``) or as a
Ray actor (`batchgen.distributed.ray_executor`), always through `rank_main`.
"""

from __future__ import annotations

import logging
import os
import pickle
import socket
import sys
import time
import traceback

import torch

from batchgen.distributed import protocol as msg
from batchgen.distributed.rank_link import (  # noqa: F401  (RankLaunch: re-exported)
    Link,
    RankLaunch,
    RankStartError,
    connect,
    free_port,
)
from batchgen.outputs import RequestOutput

logger = logging.getLogger(__name__)

# An idle rank (no work anywhere in its group) waits this long for a message per iteration.
IDLE_POLL_S = 0.02


def rank_main(launch: RankLaunch) -> int:
    """Run one rank until the frontend says stop; returns the process exit code (0 done, 1
    failed, 2 could not join, 130 interrupted)."""
    _setup_logging(launch.rank)
    try:
        conn = connect(launch)
    except RankStartError as exc:
        logger.error("%s", exc)
        return 2
    except KeyboardInterrupt:
        return 130
    link = Link(conn, launch.rank)
    try:
        link.send(
            msg.Hello(
                launch.rank,
                os.getpid(),
                socket.gethostname(),
                launch.torchrun,
                free_port(),
                launch.node_id,
            )
        )
        setup: msg.Setup = conn.recv()
        link.start_heartbeat()
        return RankLoop(launch, setup, link).run()
    except (EOFError, ConnectionError, BrokenPipeError):
        logger.warning("rank %d: the frontend went away; exiting", launch.rank)
        return 1
    except KeyboardInterrupt:  # Ctrl-C reaches the whole process group; the frontend reports
        logger.info("rank %d: interrupted", launch.rank)
        return 130
    except BaseException as exc:
        text = "".join(traceback.format_exception(exc)[-6:])
        first = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        logger.error("rank %d failed: %s", launch.rank, first)
        logger.debug("rank %d traceback:\n%s", launch.rank, text)
        try:
            link.send(msg.Failed(launch.rank, f"{first}\n{text}"))
        except OSError:
            pass
        return 1
    finally:
        link.stop()
        from batchgen.distributed.groups import destroy_process_groups

        destroy_process_groups()
        conn.close()  # the frontend waits for this at shutdown


def _setup_logging(rank: int) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        logging.Formatter(
            f"%(asctime)s %(levelname)s [rank {rank}] %(name)s: %(message)s", "%H:%M:%S"
        )
    )
    root = logging.getLogger("batchgen")
    if not root.handlers:
        root.addHandler(handler)
    root.setLevel(os.environ.get("BATCHGEN_LOG_LEVEL", "INFO").upper())


class RankLoop:
    """Builds the rank's engine and runs its loop (see the module docstring)."""

    def __init__(self, launch: RankLaunch, setup: msg.Setup, link: Link) -> None:
        from batchgen.distributed.control import StepControl
        from batchgen.distributed.groups import init_process_groups
        from batchgen.distributed.layout import resolve_layout
        from batchgen.distributed.rank import RankContext
        from batchgen.distributed.rank_weights import apply_update
        from batchgen.engine.engine_setup import resolve_device
        from batchgen.engine.llm_engine import LLMEngine

        self.rank, self.link, self.launch = launch.rank, link, launch
        from batchgen.engine.cpu_threads import configure_cpu_threads

        configure_cpu_threads(launch.local_world_size)  # the machine's CPUs split among ranks
        device = resolve_device(setup.engine.device)
        if device.type == "cuda":
            index = launch.local_rank if launch.cuda_device is None else launch.cuda_device
            device = torch.device("cuda", index)
        layout = resolve_layout(setup.parallel)
        # The rendezvous waits for every rank of the world: a rank that hangs before it (a
        # device that does not initialise) is named by the frontend, as one that hangs later.
        link.set_phase(msg.WAITING_FOR_PEERS)
        groups = init_process_groups(
            launch.rank,
            layout,
            setup.init_method,
            device,
            setup.parallel.distributed_timeout_s,
            setup.world_ranks,
        )
        link.set_phase("loading")
        context = RankContext(groups, setup.parallel, device, link.set_phase)
        self.engine = LLMEngine(setup.engine, context)
        for update in setup.weight_updates:  # a rank started again runs the current weights
            apply_update(self.engine, update)
        # Ranks step together only when the model has collectives (sharded experts).
        self.control = (
            StepControl(groups.control, layout.ep_group_ranks(launch.rank))
            if groups.control is not None and self.engine.expert_parallel is not None
            else None
        )
        if self.control is not None:
            context.wait_for_group()  # the first control exchange must not wait for a peer
        self.shutdown = False
        self.rebalance_interval = setup.parallel.straggler_rebalance_interval_steps
        ep = self.engine.expert_parallel
        held = len(ep.placement.experts_of(ep.ep_rank)) if ep is not None else None
        logger.info(
            "rank %d ready on %s with %d threads", self.rank, device, torch.get_num_threads()
        )
        link.counters = self._counters
        link.send(msg.Ready(self.rank, self.engine.max_model_len, held))

    def _counters(self) -> dict:
        """Live figures for the heartbeat (read from another thread: plain ints and floats)."""
        engine = self.engine
        expert = engine.metrics.expert
        return {
            "num_prompt_tokens": engine.stats.num_prompt_tokens,
            "num_generated_tokens": engine.stats.num_generated_tokens,
            "num_preemptions": engine.stats.num_preemptions,
            "prefix_cache_queries": engine.stats.prefix_cache_queries,
            "prefix_cache_hits": engine.stats.prefix_cache_hits,
            "prefix_cache_evictions": engine.stats.prefix_cache_evictions,
            "kv_cache_usage": engine.kv_cache.usage,
            "num_running": len(engine.scheduler.running),
            "num_waiting": len(engine.scheduler.waiting),
            "expert_rows": expert.rows,
            "expert_tile_rows": expert.tile_rows,
        }

    # ---- messages from the frontend ------------------------------------------------------
    def _take_messages(self, wait_s: float) -> None:
        conn = self.link.conn
        if not conn.poll(wait_s):
            return
        while conn.poll(0):
            self._handle(conn.recv())

    def _handle(self, message) -> None:
        engine = self.engine
        if isinstance(message, msg.AddRequests):
            failed = []
            for request_id, processed, params, arrival_time, resume in message.requests:
                try:
                    engine.add_processed_request(
                        request_id, processed, params, arrival_time=arrival_time, resume=resume
                    )
                except ValueError as exc:
                    failed.append(_failed_output(request_id, processed, str(exc)))
            if failed:
                self._send_outputs(failed)
        elif isinstance(message, msg.Abort):
            for request_id in message.request_ids:
                engine.abort_request(request_id)
        elif isinstance(message, msg.Release):
            states = {}
            ship = set(message.ship_kv)
            for request_id in message.request_ids:
                state = engine.release_request(request_id, ship_kv=request_id in ship)
                if state is not None:
                    states[request_id] = state
            size = len(pickle.dumps(states, protocol=pickle.HIGHEST_PROTOCOL))
            self.link.send(msg.Released(self.rank, message.token, states, size))
        elif isinstance(message, msg.GetMetrics):
            snapshot = engine.get_metrics()
            snapshot["rank"] = self.rank
            snapshot["host"] = socket.gethostname()
            if self.launch.node_id is not None:
                snapshot["node_id"] = self.launch.node_id
            self.link.send(msg.Metrics(self.rank, message.token, snapshot))
        elif isinstance(message, msg.ResetMetrics):
            engine.reset_metrics()
        elif isinstance(message, (msg.UpdateWeights, msg.ResetPrefixCache)):
            from batchgen.distributed.rank_weights import answer

            self.link.send(answer(engine, self.rank, message))
        elif isinstance(message, msg.Shutdown):
            self.shutdown = True
        else:
            raise RuntimeError(f"unexpected message from the frontend: {type(message).__name__}")

    def _send_outputs(self, outputs: list[RequestOutput]) -> None:
        self.link.send(msg.Outputs(self.rank, outputs, self.engine.get_num_unfinished_requests()))

    def _report_load(self, step_id: int) -> None:
        """Every ``straggler_rebalance_interval_steps`` steps, while this rank has requests,
        tell the frontend its load (`batchgen.distributed.rebalance`)."""
        engine = self.engine
        if (
            self.rebalance_interval is None
            or step_id % self.rebalance_interval
            or not engine.has_unfinished_requests()
        ):
            return
        free = engine.kv_cache.num_free_blocks * engine.config.block_size
        m = engine.metrics
        rate = (m.prefill_tokens + m.decode_tokens) / m.busy_seconds if m.busy_seconds else 0.0
        self.link.send(
            msg.Load(
                self.rank, step_id, engine.load_report(), free, engine.kv_bytes_per_token, rate
            )
        )

    # ---- the loop ------------------------------------------------------------------------
    def run(self) -> int:
        self.link.phase = "running"
        if self.control is None:
            self._run_independent()
        else:
            self._run_in_step()
        ep = self.engine.expert_parallel
        if ep is not None:
            m = ep.metrics()
            streamed = (
                f"; streamed {m['streamed_bytes'] / 2**20:.0f} MiB of experts in "
                f"{m['streamed_layers']} layers ({m['stream_hidden_share'] or 0:.2f} of the copy "
                "time hidden)"
                if "streamed_bytes" in m
                else ""
            )
            ep.write_trace(self.rank)
            ep.close()
            logger.info(
                "rank %d: done; all-to-all %.0f MiB sent in %.1f s%s",
                self.rank,
                m["all_to_all_bytes"] / 2**20,
                m["all_to_all_seconds"],
                streamed,
            )
        else:
            logger.info("rank %d: done", self.rank)
        return 0

    def _run_independent(self) -> None:
        """Replicated experts: no collectives in the model, so no per-step exchange."""
        engine = self.engine
        while not self.shutdown:
            self._take_messages(0 if engine.has_unfinished_requests() else IDLE_POLL_S * 5)
            if engine.has_unfinished_requests():
                self.link.step_id += 1
                outputs = engine.step()
                if outputs:
                    self._send_outputs(outputs)
                self._report_load(self.link.step_id)

    def _run_in_step(self) -> None:
        engine, ep = self.engine, self.engine.expert_parallel
        idle = True
        step_id = 0
        while True:
            self._take_messages(IDLE_POLL_S if idle else 0)
            has_work = engine.has_unfinished_requests()
            sched = engine.schedule() if has_work else None
            tokens = sched.num_batched_tokens if sched is not None else 0
            if has_work and not tokens:
                failed = engine.take_failed_outputs()  # a grammar that did not compile
                if not failed:
                    raise RuntimeError(
                        "the scheduler produced an empty step with unfinished requests"
                    )
                self._send_outputs(failed)
                has_work = engine.has_unfinished_requests()
            prefill = (
                sum(e.num_new_tokens for e in sched.scheduled if e.num_new_tokens > 1)
                if sched is not None
                else 0
            )
            self.link.phase = "control exchange"
            t0 = time.perf_counter()
            plan = self.control.exchange(step_id, tokens, prefill, has_work, self.shutdown)
            if ep is not None and has_work:  # time spent waiting for the group (load imbalance)
                ep.control_seconds += time.perf_counter() - t0
            self.link.step_id = step_id = step_id + 1
            if plan.done:
                return
            idle = not plan.any_work
            if not plan.any_tokens:
                continue
            if ep is not None:
                ep.set_step_tokens(plan.num_tokens)
            self.link.phase = "step"
            if tokens:
                stream = ep is not None and ep.should_stream(prefill)
                outputs = engine.execute(sched, local_prefill=stream)
                if outputs:
                    self._send_outputs(outputs)
            else:
                engine.execute_dummy()
            self._report_load(step_id)


def _failed_output(request_id, processed, error: str) -> RequestOutput:
    return RequestOutput(
        request_id,
        processed.prompt,
        list(processed.prompt_token_ids),
        [],
        finished=True,
        error=error,
    )
