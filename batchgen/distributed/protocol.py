"""Messages between the frontend and its ranks.

They travel as pickles over `multiprocessing.connection` sockets authenticated with a shared
key (HMAC challenge on connect, Python's stdlib), local or across machines alike:

    rank -> frontend: Hello, Ready, Outputs, Metrics, Heartbeat, Failed, Load, Released, Reply
    frontend -> rank: Setup, AddRequests, Abort, GetMetrics, ResetMetrics, Shutdown, Release,
                      UpdateWeights, ResetPrefixCache

A rank sends `Hello` on connecting, gets `Setup` (the engine and parallel settings and where
the ranks meet for ``torch.distributed``), answers `Ready` once its engine is built, then
streams `Outputs` as requests finish and a `Heartbeat` every `HEARTBEAT_S` seconds. With
straggler rebalancing it also sends `Load` every ``straggler_rebalance_interval_steps`` steps,
and answers `Release` with `Released` (`batchgen.distributed.rebalance`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from batchgen.config import EngineConfig, ParallelConfig
from batchgen.distributed.launch import AUTHKEY_ENV  # noqa: F401  (re-exported)
from batchgen.engine.input_processor import ProcessedPrompt
from batchgen.engine.migration import RequestState
from batchgen.outputs import RequestOutput
from batchgen.sampling_params import SamplingParams

HEARTBEAT_S = 1.0
# A starting rank's `Heartbeat.phase` while it waits for the other ranks of its
# expert-parallel group: at the rendezvous, the all-to-all's setup and the end of its start
# (`RankContext.wait_for_peers`), so that the frontend can tell the rank that holds them up
# (`RankMessages._loading_laggards`). Each wait begins with a heartbeat of this phase after
# one of another (`RankHandle.waits` counts them).
WAITING_FOR_PEERS = "waiting for peers"


@dataclass
class Hello:
    """A rank connected. ``store_port``: a free port on its machine (rank 0's hosts the
    ``torch.distributed`` rendezvous unless ``torchrun`` already set one up). ``node_id``: its
    Ray node (hex), when it runs as a Ray actor."""

    rank: int
    pid: int
    host: str
    torchrun: bool
    store_port: int
    node_id: str | None = None


@dataclass
class UpdateWeights:
    """Replace weights in place (`batchgen.engine.weight_update.update_weights`), answered by
    `Reply` with the checkpoint names copied. Exactly one of ``path`` (a safetensors checkpoint
    directory every rank can read) and ``data`` (tensors serialised by `safetensors.torch.save`:
    portable across machines, unlike pickled tensors)."""

    token: int
    path: str | None = None
    data: bytes | None = None


@dataclass
class ResetPrefixCache:
    """Drop the rank's cached prefixes; answered by `Reply` with True, or False while the rank
    holds requests."""

    token: int


@dataclass
class Reply:
    """The answer to `UpdateWeights` or `ResetPrefixCache` ``token``: ``result``, or
    ``error`` (the message) and ``error_type`` (the exception's class name) when it raised."""

    rank: int
    token: int
    result: object = None
    error: str | None = None
    error_type: str | None = None


@dataclass
class Setup:
    """A rank's settings, and where it meets the ranks of its ``torch.distributed`` world:
    ``init_method`` (``tcp://host:port`` of the world's first rank, or ``env://``) and
    ``world_ranks`` (the global ranks of that world: the rank's expert-parallel group, or None
    for one world of every rank, under torchrun). ``weight_updates``: the `UpdateWeights`
    made since the job started, applied in order once the engine is built and before `Ready`
    (so a rank started again after a failure runs the current weights)."""

    engine: EngineConfig
    parallel: ParallelConfig
    init_method: str
    world_ranks: list[int] | None = None
    weight_updates: list[UpdateWeights] = field(default_factory=list)


@dataclass
class Ready:
    rank: int
    max_model_len: int
    held_experts: int | None


@dataclass
class AddRequests:
    """``(request_id, prompt, params, arrival_time, resume)`` each (``time.time()`` seconds;
    ``resume``: the progress of a request moved from another rank, or None)."""

    requests: list[tuple[str, ProcessedPrompt, SamplingParams, float, RequestState | None]]


@dataclass
class Release:
    """Take these requests out of the rank (straggler rebalancing); answered by `Released`.
    ``ship_kv``: the ids among them whose computed K/V travel with their state (the others
    are recomputed where they land)."""

    token: int
    request_ids: list[str]
    ship_kv: list[str] = field(default_factory=list)


@dataclass
class Released:
    """The answer to `Release` ``token``: the progress of each request released; a requested
    id missing here had finished (its output was sent before) or was aborted.
    ``state_bytes``: the pickled size of ``states`` (what the move ships)."""

    rank: int
    token: int
    states: dict[str, RequestState]
    state_bytes: int = 0


@dataclass
class Load:
    """A rank's load for straggler rebalancing, sent every
    ``straggler_rebalance_interval_steps`` steps while it has requests: per unfinished request
    ``(request_id, remaining_tokens, computed_tokens, running)`` (`LLMEngine.load_report`),
    its free KV cache tokens, the bytes of one token's K/V over all layers, and the tokens it
    computes per busy second so far (prefill and decode; 0.0 before its first step)."""

    rank: int
    step_id: int
    requests: list[tuple[str, int, int, bool]]
    free_kv_tokens: int
    kv_bytes_per_token: int = 0
    tokens_per_s: float = 0.0


@dataclass
class Abort:
    request_ids: list[str]


@dataclass
class GetMetrics:
    token: int


@dataclass
class ResetMetrics:
    pass


@dataclass
class Shutdown:
    pass


@dataclass
class Outputs:
    """Finished requests; ``num_unfinished``: requests the rank still holds."""

    rank: int
    outputs: list[RequestOutput] = field(default_factory=list)
    num_unfinished: int = 0


@dataclass
class Metrics:
    rank: int
    token: int
    snapshot: dict


@dataclass
class Heartbeat:
    """Sent every `HEARTBEAT_S`; ``counters``: the rank's live figures (`rank_counters`)."""

    rank: int
    step_id: int
    phase: str
    counters: dict = field(default_factory=dict)


@dataclass
class Failed:
    """The rank's loop raised; ``message`` names the cause (the traceback's last lines)."""

    rank: int
    message: str
