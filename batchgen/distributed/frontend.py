"""The data-parallel frontend: one process that takes requests, hands each to a rank, and
collects the finished outputs. It has `LLMEngine`'s request methods (``add_request``, ``step``,
``abort_request``, ``has_unfinished_requests``, ``apply_chat_template``, ``get_metrics``), so
`LLM`, ``batchgen run`` and the bench drive it unchanged.

- **Assignment**: each request goes to the rank with the fewest estimated tokens in flight
  (prompt plus ``max_tokens``, times ``n``), as vLLM's and SGLang's data-parallel balancers
  assign at admission. Requests are tokenized and validated here once (`InputProcessor`); a
  rank gets token ids.
- **Ranks** are local processes it spawns (``data_parallel_size_local``, default all) and/or
  ranks started elsewhere (``python -m batchgen.distributed.launch`` or ``torchrun``) that
  connect to its listener at ``data_parallel_address:data_parallel_rpc_port`` with the key in
  ``$BATCHGEN_DP_AUTHKEY``.
- **Failure**: a rank whose connection closes or whose process exits is reported at once, one
  that is silent for ``distributed_timeout_s`` (it heartbeats every second, even mid-step) is
  reported as stuck; `RankFailedError` names it and every finished output has already been
  returned. The other ranks are stopped. Resuming (``batchgen run --resume``) re-runs only what
  did not finish; recovery without a restart belongs to the elastic path (not built yet).
"""

from __future__ import annotations

import itertools
import logging
import os
import queue
import signal
import subprocess
import threading
import time
import weakref
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, Listener, wait

from batchgen.config import EngineConfig, ParallelConfig
from batchgen.distributed import protocol as msg
from batchgen.distributed.launch import rank_command
from batchgen.engine.input_processor import InputProcessor, ProcessedPrompt, load_tokenizer
from batchgen.outputs import RequestOutput
from batchgen.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# How long `step` waits for a finished output before returning none.
STEP_WAIT_S = 0.5
# Requests buffered per rank before they are sent (they are also sent at every `step`).
SEND_BATCH = 64
CONNECT_TIMEOUT_S = 300.0
# A rank whose heartbeat (every second) is this late when another rank fails is named stuck.
STUCK_AFTER_S = 3 * msg.HEARTBEAT_S


class RankFailedError(RuntimeError):
    """A rank died, failed or went silent. ``ranks``: the ranks at fault."""

    def __init__(self, message: str, ranks: list[int]) -> None:
        super().__init__(message)
        self.ranks = ranks


@dataclass
class _Rank:
    rank: int
    conn: Connection
    host: str
    pid: int
    process: subprocess.Popen | None = None  # a rank this frontend started
    load: int = 0  # estimated tokens of its unfinished requests
    unfinished: int = 0
    last_seen: float = field(default_factory=time.monotonic)
    step_id: int = 0
    phase: str = "starting"
    pending: list = field(default_factory=list)
    counters: dict = field(default_factory=dict)  # from its last heartbeat


@dataclass
class _KVUsage:
    usage: float


def _silence(rank: _Rank, now: float) -> str:
    return (
        f"rank {rank.rank} (pid {rank.pid} on {rank.host}) silent for "
        f"{now - rank.last_seen:.0f} s (last seen at step {rank.step_id}, {rank.phase}): "
        "stuck or stopped"
    )


def _describe_exit(process: subprocess.Popen | None) -> str:
    code = None if process is None else process.poll()
    if code is None:
        return "its connection closed"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


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
        self.tokenizer = load_tokenizer(config.tokenizer or path)
        self.requests: dict[str, tuple[int, int]] = {}  # request id -> (rank, load estimate)
        self._ranks: list[_Rank] = []
        self._failure: RankFailedError | None = None
        self._closed = False
        self._metrics_token = itertools.count()
        self._metrics: dict[tuple[int, int], dict] = {}
        self._finished: list[RequestOutput] = []
        self._started = time.perf_counter()
        self._listener, self._authkey = self._listen()
        self._finalizer = weakref.finalize(self, DPEngineClient._kill, [], self._listener)
        try:
            self._start_ranks()
        except BaseException:
            self.shutdown()
            raise
        self.max_model_len = min(r.max_model_len for r in self._ready)
        self.input_processor = InputProcessor(
            self.tokenizer, self.model_config.vocab_size, self.max_model_len
        )
        logger.info(
            "data-parallel frontend: %d ranks (%d expert-parallel groups of %d)",
            parallel.data_parallel_size,
            parallel.data_parallel_size // parallel.resolved_expert_parallel_size,
            parallel.resolved_expert_parallel_size,
        )

    # ---- start-up ------------------------------------------------------------------------
    def _num_local(self) -> int:
        p = self.parallel
        return (
            p.data_parallel_size
            if p.data_parallel_size_local is None
            else (p.data_parallel_size_local)
        )

    def _listen(self) -> tuple[Listener, bytes]:
        p = self.parallel
        external = self._num_local() < p.data_parallel_size
        if external:
            key = os.environ.get(msg.AUTHKEY_ENV)
            if not key:
                raise ValueError(
                    f"ranks started on other machines need a shared key: set ${msg.AUTHKEY_ENV} "
                    "to the same secret for the frontend and every `batchgen.distributed."
                    "launch` / torchrun process"
                )
            authkey = key.encode()
            address = p.data_parallel_address
        else:
            authkey, address = os.urandom(16).hex().encode(), "127.0.0.1"
        listener = Listener((address, p.data_parallel_rpc_port or 0), authkey=authkey)
        return listener, authkey

    def _start_ranks(self) -> None:
        p = self.parallel
        world, local = p.data_parallel_size, self._num_local()
        address, port = self._listener.address
        env = dict(os.environ, **{msg.AUTHKEY_ENV: self._authkey.decode()})
        processes = {}
        for r in range(local):
            # A fresh interpreter per rank (not multiprocessing's spawn, which re-imports the
            # user's main module); the key travels in the environment, not the command line.
            processes[r] = subprocess.Popen(
                rank_command(r, r, local, "127.0.0.1", port), env=env, stdin=subprocess.DEVNULL
            )
        self._finalizer.detach()
        self._finalizer = weakref.finalize(
            self, DPEngineClient._kill, list(processes.values()), self._listener
        )
        if local < world:
            logger.info(
                "waiting for %d ranks from other machines at %s:%d", world - local, address, port
            )
        hellos = self._accept(world, processes)
        init_method = self._init_method(hellos)
        for rank in self._ranks:
            rank.conn.send(msg.Setup(self.config, p, init_method))
        self._ready = self._wait_ready()

    def _accept(self, world: int, processes: dict) -> dict[int, tuple[msg.Hello, str]]:
        """Accept ``world`` ranks (in a thread: `Listener.accept` has no timeout), watching the
        local processes meanwhile."""
        arrived: queue.Queue = queue.Queue()

        def accept_all():
            while True:
                try:
                    conn = self._listener.accept()
                except (OSError, EOFError):
                    return  # listener closed
                except Exception as exc:  # a client with a wrong key
                    logger.warning("refused a rank connection: %s", exc)
                    continue
                peer = self._listener.last_accepted
                arrived.put((conn, peer[0] if isinstance(peer, tuple) else "127.0.0.1"))

        threading.Thread(target=accept_all, name="batchgen-accept", daemon=True).start()
        hellos: dict[int, tuple[msg.Hello, str]] = {}
        deadline = time.monotonic() + CONNECT_TIMEOUT_S
        while len(hellos) < world:
            for r, proc in processes.items():
                if r not in hellos and proc.poll() is not None:
                    raise RankFailedError(
                        f"rank {r} (pid {proc.pid}) {_describe_exit(proc)} before connecting",
                        [r],
                    )
            if time.monotonic() > deadline:
                missing = sorted(set(range(world)) - set(hellos))
                raise RankFailedError(
                    f"ranks {missing} did not connect within {CONNECT_TIMEOUT_S:.0f} s", missing
                )
            try:
                conn, peer = arrived.get(timeout=0.2)
            except queue.Empty:
                continue
            if not conn.poll(30):
                conn.close()
                continue
            hello = conn.recv()
            if not isinstance(hello, msg.Hello) or not 0 <= hello.rank < world:
                conn.close()
                continue
            if hello.rank in hellos:
                conn.close()
                raise RankFailedError(f"two processes claim rank {hello.rank}", [hello.rank])
            hellos[hello.rank] = (hello, peer)
            self._ranks.append(
                _Rank(hello.rank, conn, hello.host, hello.pid, processes.get(hello.rank))
            )
        self._ranks.sort(key=lambda r: r.rank)
        return hellos

    @staticmethod
    def _init_method(hellos: dict[int, tuple[msg.Hello, str]]) -> str:
        """``env://`` when torchrun started every rank, else rank 0's machine and port."""
        torchrun = {h.torchrun for h, _ in hellos.values()}
        if torchrun == {True}:
            return "env://"
        if True in torchrun:
            raise ValueError("ranks started by torchrun and by other means cannot be mixed")
        hello, peer = hellos[0]
        return f"tcp://{peer}:{hello.store_port}"

    def _wait_ready(self) -> list[msg.Ready]:
        ready: dict[int, msg.Ready] = {}
        while len(ready) < len(self._ranks):
            for rank, message in self._receive(timeout=1.0):
                if isinstance(message, msg.Ready):
                    ready[rank.rank] = message
        return [ready[r] for r in sorted(ready)]

    # ---- messages from ranks -------------------------------------------------------------
    def _receive(self, timeout: float) -> list[tuple[_Rank, object]]:
        """Messages that arrive within ``timeout`` seconds (all that are ready once one is).

        Raises:
            RankFailedError: a rank's connection closed or its process exited, a rank sent
                `Failed`, or a rank was silent for ``distributed_timeout_s``.
        """
        if self._failure is not None:
            raise self._failure
        by_conn = {r.conn: r for r in self._ranks}
        ready = wait(list(by_conn), timeout)  # a dead rank's connection reads as EOF
        got: list[tuple[_Rank, object]] = []
        broken: list[_Rank] = []
        failed: list[tuple[_Rank, str]] = []
        for obj in ready:
            rank = by_conn[obj]
            try:
                while rank.conn.poll(0):
                    got.append((rank, rank.conn.recv()))
            except (EOFError, OSError):
                broken.append(rank)
        now = time.monotonic()
        for rank, message in got:
            rank.last_seen = now
            if isinstance(message, msg.Heartbeat):
                rank.step_id, rank.phase = message.step_id, message.phase
                rank.counters = message.counters
            elif isinstance(message, msg.Failed):
                failed.append((rank, message.message))
        if broken or failed:
            self._fail(broken, failed)
        silent = [r for r in self._ranks if now - r.last_seen > self.parallel.distributed_timeout_s]
        if silent:
            self._fail_silent(silent, now)
        return [(r, m) for r, m in got if not isinstance(m, (msg.Heartbeat, msg.Failed))]

    def _fail(self, broken: list[_Rank], failed: list[tuple[_Rank, str]]) -> None:
        """Report the ranks at fault. A rank that dies or stalls takes its peers' collectives
        down with it, so their `Failed` reports arrive too: wait a moment for the deaths to
        show, then name the dead first, then ranks whose heartbeats stopped (stuck), then the
        ranks that failed on their own."""
        time.sleep(0.5)
        reported = {r.rank for r, _ in failed}  # these exit by themselves after reporting
        for rank in self._ranks:
            if rank.process is not None and rank.process.poll() is not None:
                if rank not in broken:
                    broken.append(rank)
        dead = sorted(
            {r.rank: r for r in broken if r.rank not in reported}.values(), key=lambda r: r.rank
        )
        parts = [
            f"rank {r.rank} (pid {r.pid} on {r.host}) died: {_describe_exit(r.process)}"
            for r in dead
        ]
        now = time.monotonic()
        culprit_ids = {r.rank for r in dead}
        stuck = [
            r
            for r in self._ranks
            if r.rank not in culprit_ids and now - r.last_seen > STUCK_AFTER_S
        ]
        parts += [_silence(r, now) for r in stuck]
        culprit_ids |= {r.rank for r in stuck}
        for rank, text in failed:
            if rank.rank not in culprit_ids:
                first = text.strip().splitlines()[0] if text.strip() else "unknown error"
                parts.append(f"rank {rank.rank} failed: {first}")
        culprits = sorted(culprit_ids) or [r.rank for r, _ in failed]
        self._failure = RankFailedError("; ".join(parts), culprits)
        self.shutdown()
        raise self._failure

    def _fail_silent(self, silent: list[_Rank], now: float) -> None:
        parts = [_silence(r, now) for r in silent]
        self._failure = RankFailedError("; ".join(parts), [r.rank for r in silent])
        self.shutdown()
        raise self._failure

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
        if self._failure is not None:
            raise self._failure
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
    ) -> None:
        """Queue an already validated prompt on the least-loaded rank, or on
        ``data_parallel_rank`` (vLLM's argument) when given; it is sent at the next `step` or
        once `SEND_BATCH` requests wait for that rank.

        Raises:
            ValueError: a duplicate ``request_id``, or a ``data_parallel_rank`` outside
                ``[0, data_parallel_size)``.
            RankFailedError: after a rank failure.
        """
        if self._failure is not None:
            raise self._failure
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
        rank.pending.append((request_id, processed, params))
        self.requests[request_id] = (rank.rank, load)
        if len(rank.pending) >= SEND_BATCH:
            self._flush(rank)

    def _flush(self, rank: _Rank) -> None:
        if rank.pending:
            rank.conn.send(msg.AddRequests(rank.pending))
            rank.pending = []

    def abort_request(self, request_id: str) -> None:
        """Drop a request (unknown ids and a failed job are ignored)."""
        entry = self.requests.pop(request_id, None)
        if entry is None or self._failure is not None or self._closed:
            return
        rank = self._ranks[entry[0]]
        rank.load -= entry[1]
        before = len(rank.pending)
        rank.pending = [p for p in rank.pending if p[0] != request_id]
        if len(rank.pending) == before:
            try:
                rank.conn.send(msg.Abort([request_id]))
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
        """
        for rank in self._ranks:
            self._flush(rank)
        deadline = time.monotonic() + STEP_WAIT_S
        while not self._finished and self.requests:
            self._dispatch(self._receive(max(0.0, deadline - time.monotonic())))
            if time.monotonic() >= deadline:
                break
        finished, self._finished = self._finished, []
        return finished

    def _dispatch(self, messages: list[tuple[_Rank, object]]) -> None:
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
        """Every rank's `LLMEngine.get_metrics` (``ranks``) plus job totals: tokens summed,
        tokens/s over the frontend's wall time since start or `reset_metrics`, tile density
        over all ranks' expert GEMMs."""
        token = next(self._metrics_token)
        for rank in self._ranks:
            rank.conn.send(msg.GetMetrics(token))
        keys = [(token, r.rank) for r in self._ranks]
        while any(k not in self._metrics for k in keys):
            self._dispatch(self._receive(1.0))
        ranks = [self._metrics.pop(k) for k in keys]
        return aggregate_metrics(ranks, time.perf_counter() - self._started)

    def _poll(self) -> None:
        """Take what the ranks sent meanwhile (heartbeats, outputs for the next `step`) without
        waiting; a failure is left for `step` to raise."""
        if self._failure is None and not self._closed:
            try:
                self._dispatch(self._receive(0))
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
        for rank in self._ranks:
            rank.conn.send(msg.ResetMetrics())
        self._started = time.perf_counter()

    # ---- shutdown ------------------------------------------------------------------------
    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the ranks (politely, then by force) and close the listener. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for rank in self._ranks:
            try:
                rank.conn.send(msg.Shutdown())
            except OSError:
                pass
        deadline = time.monotonic() + (timeout if self._failure is None else 2.0)
        for rank in self._ranks:  # a rank closes its connection when it leaves
            try:
                while time.monotonic() < deadline and rank.conn.poll(
                    max(0.0, deadline - time.monotonic())
                ):
                    rank.conn.recv()
            except (EOFError, OSError):
                pass
        for rank in self._ranks:
            if rank.process is not None:
                try:
                    rank.process.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
        self._finalizer()  # kills what is left, closes the listener
        for rank in self._ranks:
            rank.conn.close()

    @staticmethod
    def _kill(processes: list[subprocess.Popen], listener: Listener) -> None:
        for proc in processes:
            if proc.poll() is None:
                proc.kill()
        for proc in processes:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                pass
        try:
            listener.close()
        except OSError:
            pass


def aggregate_metrics(ranks: list[dict], wall_seconds: float) -> dict:
    """Job totals over per-rank metric snapshots (see `DPEngineClient.get_metrics`)."""
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
    wall = wall_seconds or 1e-12
    return {
        **total,
        "data_parallel_size": len(ranks),
        "wall_seconds": wall_seconds,
        "generated_tokens_per_s": total["generated_tokens"] / wall,
        "total_tokens_per_s": (total["prefill_tokens"] + total["decode_tokens"]) / wall,
        "tile_density": rows / tile_rows if tile_rows else None,
        "mean_rows_per_expert_gemm": rows / total["num_expert_gemms"]
        if total["num_expert_gemms"]
        else 0.0,
        "peak_memory_bytes": max(s["peak_memory_bytes"] for s in ranks),
        "ranks": ranks,
    }
