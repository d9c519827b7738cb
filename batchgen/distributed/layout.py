"""Where every rank sits: the parallel layout and the expert placement table.

Layout (DESIGN.md, "phase-specific parallelism"): ``world_size`` ranks, each running attention
data-parallel on its own requests (its own scheduler and KV cache). The routed experts are
sharded over *expert-parallel groups* of ``expert_parallel_size`` consecutive ranks; each group
holds one full copy of the experts, and ``world_size / expert_parallel_size`` such groups are
independent replicas. The seed's cluster file writes the same layout as ``world_size =
data_parallel_size x expert_parallel_size`` (8 replicas x 16 = 128 ranks).

vLLM's spelling maps onto it: ``--data-parallel-size N`` is N attention ranks (``world_size``),
``--enable-expert-parallel`` makes all N one expert-parallel group (vLLM's EP size is DP x TP),
and our ``--expert-parallel-size E`` cuts them into N / E groups instead. `resolve_layout` is the
one place that turns flags into a `ParallelLayout`; a tensor-parallel dimension would be added
there.

`ExpertPlacement` maps logical experts to (owner rank in the group, local slot): contiguous
blocks, the first ``E % ep`` ranks holding one more (vLLM's linear placement). Load balancing
(redundant hot experts) and recovery change this table, at step boundaries, on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from batchgen.config import ParallelConfig


@dataclass(frozen=True)
class ParallelLayout:
    """The rank grid.

    Attributes:
        world_size: ranks; each runs attention on its own requests.
        expert_parallel_size: ranks per expert-parallel group (1: experts replicated).
    """

    world_size: int = 1
    expert_parallel_size: int = 1

    def __post_init__(self) -> None:
        if self.world_size < 1 or self.expert_parallel_size < 1:
            raise ValueError(
                f"world_size and expert_parallel_size must be >= 1, got {self.world_size} and "
                f"{self.expert_parallel_size}"
            )
        if self.world_size % self.expert_parallel_size:
            raise ValueError(
                f"expert_parallel_size={self.expert_parallel_size} must divide the number of "
                f"ranks (data_parallel_size={self.world_size})"
            )

    @property
    def num_expert_replicas(self) -> int:
        """Independent expert-parallel groups (the seed YAML's ``data_parallel_size``)."""
        return self.world_size // self.expert_parallel_size

    @property
    def expert_parallel(self) -> bool:
        return self.expert_parallel_size > 1

    def ep_group_ranks(self, rank: int) -> list[int]:
        """The global ranks of ``rank``'s expert-parallel group, in group-rank order."""
        start = rank // self.expert_parallel_size * self.expert_parallel_size
        return list(range(start, start + self.expert_parallel_size))

    def ep_rank(self, rank: int) -> int:
        """``rank``'s index inside its expert-parallel group."""
        return rank % self.expert_parallel_size

    def restart_group(self, rank: int) -> list[int]:
        """The ranks that fail and start again together with ``rank`` (elastic recovery), in
        order: its expert-parallel group, whose collectives break when one member dies; just
        ``rank`` when experts are replicated (nothing ties it to another rank). Each such group
        is its own ``torch.distributed`` world (`init_process_groups`)."""
        return self.ep_group_ranks(rank) if self.expert_parallel else [rank]

    def all_ep_groups(self) -> list[list[int]]:
        """Every expert-parallel group (the order every rank creates them in)."""
        ep = self.expert_parallel_size
        return [list(range(g * ep, (g + 1) * ep)) for g in range(self.num_expert_replicas)]


def resolve_layout(parallel: ParallelConfig) -> ParallelLayout:
    """`ParallelConfig` (vLLM's flags plus ours, already validated) -> `ParallelLayout`:
    ``data_parallel_size`` ranks in groups of ``resolved_expert_parallel_size``."""
    return ParallelLayout(parallel.data_parallel_size, parallel.resolved_expert_parallel_size)


def check_device_available(device: str) -> None:
    """Fail before any rank starts when ``device`` is "cuda" and this machine has none.

    Raises:
        ValueError: naming the setting and what to use instead.
    """
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            "device='cuda' but this machine has no usable CUDA device (torch.cuda.is_available() "
            "is False): use device 'auto' or 'cpu'"
        )


def check_local_devices(parallel: ParallelConfig, device: str) -> None:
    """Fail before anything starts when this machine would get more ranks than CUDA devices.

    Knowable only on CUDA (``device`` "cuda", or "auto" with CUDA available): CPU ranks share
    the machine's cores. The ranks started here are ``data_parallel_size_local``, default all.

    Raises:
        ValueError: more local ranks than visible CUDA devices, with both counts.
    """
    if device == "cpu" or not torch.cuda.is_available():
        return
    local = parallel.data_parallel_size_local
    ranks = parallel.data_parallel_size if local is None else local
    devices = torch.cuda.device_count()
    if ranks > devices:
        which = "data_parallel_size_local" if local is not None else "all of them by default"
        raise ValueError(
            f"{ranks} ranks would start on this machine ({which}) but it has {devices} visible "
            f"CUDA device(s), one per rank: set data_parallel_size_local <= {devices} and start "
            "the other ranks on other machines (docs/distributed.md)"
        )


class ExpertPlacement:
    """Logical expert -> (owner rank within the expert-parallel group, local slot).

    Args:
        num_experts: routed experts per MoE layer (E).
        ep_size: ranks in the group.

    Example: E = 7 on 2 ranks: rank 0 holds experts 0-3 (slots 0-3), rank 1 holds 4-6.
    """

    def __init__(self, num_experts: int, ep_size: int) -> None:
        if ep_size < 1 or num_experts < ep_size:
            raise ValueError(
                f"cannot place {num_experts} experts on {ep_size} expert-parallel ranks "
                "(every rank needs at least one expert)"
            )
        self.num_experts, self.ep_size = num_experts, ep_size
        base, extra = divmod(num_experts, ep_size)
        self.rank_experts: list[list[int]] = []
        start = 0
        for r in range(ep_size):
            count = base + (1 if r < extra else 0)
            self.rank_experts.append(list(range(start, start + count)))
            start += count
        owner = [r for r, experts in enumerate(self.rank_experts) for _ in experts]
        local = [i for experts in self.rank_experts for i in range(len(experts))]
        self.owner = torch.tensor(owner, dtype=torch.long)  # [E] owner rank of each expert
        self.local_slot = torch.tensor(local, dtype=torch.long)  # [E] slot on its owner

    def experts_of(self, ep_rank: int) -> list[int]:
        """Logical ids of the experts ``ep_rank`` holds, in slot order."""
        return self.rank_experts[ep_rank]
