"""Choosing the all-to-all under dispatch and combine: `ShmAllToAll` (this host's shared
memory, `batchgen.distributed.shm_transport`) when every rank of the expert-parallel group can
use it, else `GlooAllToAll` (``all_to_all_single`` on the group's backend).

At start-up each rank first removes the all-to-all files that killed ranks left in
``/dev/shm`` (`sweep_stale_segments`), and shared memory is chosen only when ``/dev/shm`` has
room for every rank's two segments at the cap (`shm_room`: a container's 64 MiB ``/dev/shm``
gets gloo, rather than a segment that fails to grow mid-job).
"""

from __future__ import annotations

import logging
import os
import platform
import secrets

import torch
import torch.distributed as dist

from batchgen.distributed.shm_transport import (
    SHM_DIR,
    SEGMENT_MB_ENV,
    TRANSPORT_ENV,
    ShmAllToAll,
    _alive,
    _segment_cap,
    _Segment,
    shm_room,
    sweep_stale_segments,
)

logger = logging.getLogger(__name__)


class GlooAllToAll:
    """``all_to_all_single`` on a process group (gloo on CPU, NCCL on CUDA)."""

    name = "gloo"

    def __init__(self, group) -> None:
        self.group = group

    def all_to_all(self, recv, send, recv_counts: list[int], send_counts: list[int]) -> None:
        """``send [sum(send_counts), ...]`` rows grouped by destination -> ``recv``, rows grouped
        by source (same trailing shape and dtype)."""
        dist.all_to_all_single(recv, send, recv_counts, send_counts, group=self.group)

    def close(self) -> None:
        pass


def _wait_for_every_rank(data_group) -> None:
    """Return once every rank of ``data_group`` (the expert-parallel group on the device's
    backend, whose timeout is the rendezvous's, `groups.INIT_TIMEOUT_S`) has called this.

    The ranks reach the setup exchange after their own start-up work (loading weights, the
    KV cache's first touch: seconds per GiB where the OS backs it with huge pages in a VM), which
    can differ between them by more than the control group's timeout
    (``distributed_timeout_s``, seconds in tests and for fast hang detection), and that group
    runs the exchange (a barrier on it, even `monitored_barrier` with a longer timeout, still
    fails after the group's own). A rank that dies or hangs before it gets here is the
    frontend's to find (its connection closes, it stays silent, or its peers have reported
    `WAITING_FOR_PEERS` for too long: `RankMessages._loading_laggards`), and the frontend
    stops the ranks waiting here.
    """
    dist.barrier(group=data_group)


def make_transport(group, device: torch.device, timeout_s: float, setup_group=None):
    """The all-to-all for an expert-parallel ``group``: `ShmAllToAll` when every rank is on this
    host and can share memory (module docstring), else `GlooAllToAll` on ``group``.

    A collective over ``group`` (every rank must call it). ``$BATCHGEN_A2A_TRANSPORT``:
    ``gloo`` forces gloo, ``shm`` makes shared memory required (RuntimeError when it cannot be
    used), ``auto`` or unset chooses.

    Args:
        group: the expert-parallel process group (gloo; the setup exchange runs on it).
        device: the device the data lives on (shared memory is for ``cpu`` only).
        timeout_s: a peer's longest wait (``distributed_timeout_s``).
        setup_group: the same ranks on gloo for the setup exchange (the control group, whose
            timeout bounds it); None: ``group``.
    Raises:
        ValueError: an unknown ``$BATCHGEN_A2A_TRANSPORT``; with shared memory chosen, a bad
            ``$BATCHGEN_A2A_SHM_SEGMENT_MB`` on any rank, or values that differ between the
            ranks (on every rank alike: `_agreed_cap`).
    """
    mode = os.environ.get(TRANSPORT_ENV, "auto").lower()
    if mode not in ("auto", "gloo", "shm"):
        raise ValueError(f"${TRANSPORT_ENV} must be auto, gloo or shm, got {mode!r}")
    if mode == "gloo":
        return GlooAllToAll(group)
    data_group, group = group, setup_group if setup_group is not None else group
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    ok = device.type == "cpu" and platform.machine().lower() in ("x86_64", "amd64")
    ok = ok and dist.get_backend(data_group) == "gloo" and os.path.isdir(SHM_DIR)
    try:
        cap: int | str = _segment_cap(None)
    except ValueError as exc:
        cap = str(exc)
    why = None
    if ok:
        swept = sweep_stale_segments()
        if swept:
            shown = ", ".join(swept[:4]) + (" ..." if len(swept) > 4 else "")
            logger.info("removed %d all-to-all file(s) of dead processes from %s: %s",
                        len(swept), SHM_DIR, shown)
        why = shm_room(world, cap) if isinstance(cap, int) else None
        if why is not None:
            logger.info("no shared-memory all-to-all: %s", why)
            ok = False
    _wait_for_every_rank(data_group)
    token = [(secrets.token_hex(8), os.getpid()) if rank == 0 else None]
    dist.broadcast_object_list(token, src=dist.get_global_rank(group, 0), group=group)
    prefix = f"{SHM_DIR}/batchgen_a2a_{token[0][0]}"
    header_path = f"{prefix}_pid{token[0][1]}_header"
    size = ShmAllToAll.header_bytes(world)
    header = None
    if rank == 0 and ok:
        try:
            header = _Segment(header_path, size, create=True)
        except (OSError, RuntimeError) as exc:
            logger.info("no shared-memory all-to-all: %s", exc)
            ok = False
    dist.barrier(group=group)
    if rank != 0 and ok:
        try:
            header = _Segment(header_path, 0, create=False)
            ok = header.size == size
        except OSError:
            ok = False
    info = [None] * world
    dist.all_gather_object(info, (ok, os.getpid(), cap, why), group=group)
    pids = [pid for _, pid, _, _ in info]
    ok = all(flag for flag, _, _, _ in info) and all(_alive(p) for p in pids)
    agreed = [None] * world
    dist.all_gather_object(agreed, ok, group=group)  # every rank saw every pid
    if rank == 0 and header is not None:
        os.unlink(header_path)  # every rank has mapped it (or gave up)
    if all(agreed):
        try:
            cap = _agreed_cap([c for _, _, c, _ in info])
        except ValueError:
            header.close()
            raise
        return ShmAllToAll(prefix, rank, world, pids, header, timeout_s, cap)
    if header is not None:
        header.close()
    if mode == "shm":
        reasons = "; ".join(sorted({w for _, _, _, w in info if w}))
        raise RuntimeError(
            f"${TRANSPORT_ENV}=shm but the expert-parallel group cannot share memory here "
            + (f"({reasons})" if reasons else "(ranks on several hosts, not x86-64, not on the "
               "CPU, or no /dev/shm)")
        )
    return GlooAllToAll(data_group)


def _agreed_cap(caps: list[int | str]) -> int:
    """The segment cap every rank of the group uses (``caps``: each rank's `_segment_cap`, in
    group rank order, or its error message).

    The ranks must agree: each cuts an all-to-all into rounds of ``cap // (W x row bytes)``
    rows per pair, so with different caps they would send and expect different rows in a
    round (found only at the first op above the smaller cap, as a size mismatch); checked
    here, at start-up, on every rank alike.

    Raises:
        ValueError: a rank's ``$BATCHGEN_A2A_SHM_SEGMENT_MB`` is bad, or the ranks' caps
            differ (each rank's value is named).
    """
    for r, cap in enumerate(caps):
        if isinstance(cap, str):
            raise ValueError(f"rank {r} of the expert-parallel group: {cap}")
    if len(set(caps)) > 1:
        values = ", ".join(f"rank {r}: {c} bytes" for r, c in enumerate(caps))
        raise ValueError(
            f"${SEGMENT_MB_ENV} differs between the ranks of the expert-parallel group "
            f"({values}); set the same value for every rank"
        )
    return caps[0]
