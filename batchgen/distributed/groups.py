"""Process groups of one rank: the data path and the control path (DESIGN.md).

- ``world`` (default group): the data path, on the device's backend (gloo on CPU, NCCL on
  CUDA); ``ep_group``: this rank's expert-parallel group on the same backend, where dispatch and
  combine run.
- ``control``: a gloo group over the same expert-parallel group, with an explicit timeout, for
  the per-step control exchange, so a rank that dies or stalls fails the others' exchange with
  an error instead of hanging them (a dead rank hangs NCCL forever: vLLM RFC #39942). Ranks of
  different expert-parallel groups (replicas) never wait for each other.

No module-level state: everything a rank needs is in the `ProcessGroups` it is handed.
"""

from __future__ import annotations

import datetime
import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist

from batchgen.distributed.layout import ParallelLayout

logger = logging.getLogger(__name__)

# Start-up may wait for the slowest rank to load its weights (minutes for a large model).
INIT_TIMEOUT_S = 1800.0


@dataclass
class ProcessGroups:
    """A rank's groups and coordinates.

    Attributes:
        rank / world_size: global.
        layout: the rank grid.
        world: the default (data) group; ep_group: this rank's expert-parallel group and
            control: the same ranks on gloo with the control timeout (both None when experts
            are replicated: then ranks never synchronise per step).
    """

    rank: int
    world_size: int
    layout: ParallelLayout
    world: object
    ep_group: object | None
    control: object | None

    @property
    def ep_rank(self) -> int:
        return self.layout.ep_rank(self.rank)


def init_process_groups(
    rank: int,
    layout: ParallelLayout,
    init_method: str,
    device: torch.device,
    control_timeout_s: float,
    world_ranks: list[int] | None = None,
) -> ProcessGroups:
    """Join the job: the default group on the device's backend, and every expert-parallel
    group in it twice, on the device's backend and on gloo with ``control_timeout_s`` (all
    members create all groups, in the same order, as ``torch.distributed.new_group`` requires).

    Args:
        init_method: ``tcp://host:port`` (or ``env://`` under torchrun).
        control_timeout_s: timeout of control-group collectives.
        world_ranks: the global ranks this process's ``torch.distributed`` world holds, in
            order: its own expert-parallel group (`ParallelLayout.restart_group`), so that a
            group can be started again while the other groups run on (elastic recovery).
            None: one world of every rank (under torchrun, whose rendezvous is global).
    Raises:
        RuntimeError / DistNetworkError: the rendezvous failed or timed out.
    """
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    members = list(range(layout.world_size)) if world_ranks is None else list(world_ranks)
    if rank not in members:
        raise ValueError(f"rank {rank} is not in its world {members}")
    dist.init_process_group(
        backend,
        init_method=init_method,
        rank=members.index(rank),
        world_size=len(members),
        timeout=datetime.timedelta(seconds=INIT_TIMEOUT_S),
    )
    ep_group = control = None
    if layout.expert_parallel:
        timeout = datetime.timedelta(seconds=control_timeout_s)
        for ranks in layout.all_ep_groups():
            if not set(ranks) <= set(members):
                continue  # another world's group
            local = [members.index(r) for r in ranks]
            group = dist.new_group(local)
            gloo = dist.new_group(local, backend="gloo", timeout=timeout)
            if rank in ranks:
                ep_group, control = group, gloo
    logger.info(
        "rank %d of %d joined (%s data path; expert-parallel group %s)",
        rank,
        layout.world_size,
        backend,
        layout.ep_group_ranks(rank) if layout.expert_parallel else "none",
    )
    return ProcessGroups(rank, layout.world_size, layout, dist.group.WORLD, ep_group, control)


def destroy_process_groups() -> None:
    """Leave the job (safe to call when not initialised)."""
    if dist.is_initialized():
        dist.destroy_process_group()
