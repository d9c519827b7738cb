"""The shared-memory all-to-all's rounds under nasty inputs, on 2 local ranks: segment caps
that differ between the ranks or are bad on one rank (refused at start-up, on every rank
alike), single rows larger than the cap and zero-width rows (gloo's result bit for bit), and a
peer that dies between two rounds of one all-to-all (an error naming it, no hang).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import time

import pytest
import torch
from dist_helpers import _entry, free_port, run_ranks
from test_shm_transport import _shm

CAP_ENV = "BATCHGEN_A2A_SHM_SEGMENT_MB"


def _caps_rank(rank, world, raws):
    os.environ[CAP_ENV] = raws[rank]
    try:
        _shm().close()
    except ValueError as exc:
        return str(exc)
    return "accepted"


@pytest.mark.timeout(120)
def test_caps_that_differ_between_ranks_are_refused_at_start_up_on_every_rank():
    """Before: each rank cut its all-to-alls into rounds of its own size, and the first op
    above the smaller cap failed with a byte-count mismatch ("a bug"), hours into a job; a bad
    value on one rank failed that rank only, after the others had set up."""
    got = run_ranks(_caps_rank, 2, ["64", "0.004"])
    for text in got:
        assert "BATCHGEN_A2A_SHM_SEGMENT_MB differs between the ranks" in text, got
        assert "rank 0: 67108864 bytes, rank 1: 4194 bytes" in text, got
    got = run_ranks(_caps_rank, 2, ["8", "lots"])
    assert all("rank 1 of the expert-parallel group" in g and "'lots'" in g for g in got), got
    assert run_ranks(_caps_rank, 2, ["8", "8.0"]) == ["accepted", "accepted"]


def _rows_rank(rank, world):
    """All-to-alls under a 4 KiB cap with rows of 3,000 and 10,000 bytes (one row to each
    peer per round, a segment above the cap to carry them), then zero-width rows."""
    import torch.distributed as dist

    os.environ[CAP_ENV] = str(4096 / (1 << 20))
    shm = _shm()
    g = torch.Generator().manual_seed(5 + rank)
    results = []
    for width, counts in [(3000, [3, 1]), (10_000, [0, 4]), (10_000, [2, 0])]:
        send_counts = counts if rank == 0 else counts[::-1]
        recv_counts = [0] * world
        exchanged = [None] * world
        dist.all_gather_object(exchanged, send_counts)
        recv_counts = [exchanged[s][rank] for s in range(world)]
        send = torch.randint(0, 256, (sum(send_counts), width), generator=g, dtype=torch.uint8)
        got = torch.empty(sum(recv_counts), width, dtype=torch.uint8)
        want = torch.empty_like(got)
        seq = shm.seq
        shm.all_to_all(got, send, recv_counts, send_counts)
        dist.all_to_all_single(want, send, recv_counts, send_counts)
        rounds = shm.seq - seq
        results.append((torch.equal(got, want), rounds))
    seq = shm.seq
    empty = torch.empty(5, 0)
    shm.all_to_all(torch.empty(5, 0), empty, [2, 3] if rank == 0 else [3, 2],
                   [2, 3] if rank == 0 else [3, 2])
    results.append((True, shm.seq - seq))
    biggest = max(seg.size for seg in shm.own if seg is not None)
    shm.close()
    return results, biggest


@pytest.mark.timeout(120)
def test_rows_larger_than_the_cap_and_zero_width_rows():
    for rank, (results, biggest) in enumerate(run_ranks(_rows_rank, 2)):
        assert [same for same, _ in results] == [True] * 4, f"rank {rank}: {results}"
        # one row of each pair per round: the largest count of any pair sets the rounds
        assert [rounds for _, rounds in results] == [3, 4, 2, 1], f"rank {rank}: {results}"
        assert biggest >= 10_000  # a row must fit, whatever the cap


def _die_rank(rank, world):
    """Rank 1 publishes the first round of a 3-round all-to-all, then dies; rank 0 reports the
    error it gets in the second round and how long it took."""
    os.environ[CAP_ENV] = str(4096 / (1 << 20))
    shm = _shm(timeout_s=60.0)
    send, recv = torch.ones(6, 4096, dtype=torch.uint8), torch.empty(6, 4096, dtype=torch.uint8)
    if rank == 1:
        first = shm._round

        def once_then_die(*args):
            out = first(*args)
            os._exit(3)
            return out

        shm._round = once_then_die
    t0 = time.monotonic()
    try:
        shm.all_to_all(recv, send, [3, 3], [3, 3])
    except RuntimeError as exc:
        return str(exc), time.monotonic() - t0
    return "no error", time.monotonic() - t0


@pytest.mark.timeout(120)
def test_a_peer_dying_between_rounds_is_named_at_once():
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_entry, args=(_die_rank, r, 2, port, results, ()), daemon=True)
        for r in range(2)
    ]
    try:
        for p in procs:
            p.start()
        deadline = time.monotonic() + 90
        while True:
            assert time.monotonic() < deadline, "rank 0 hung"
            try:
                rank, status, value = results.get(timeout=1.0)
            except queue.Empty:
                continue
            if rank == 0:
                break
        assert status == "ok", value
        message, seconds = value
        assert "rank 1" in message and "died before op 2" in message, message
        assert seconds < 5.0  # the liveness check, not the 60 s timeout
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(timeout=10)


def test_stale_segments_of_dead_processes_are_swept(tmp_path):
    """Files named with a dead creator's pid go; a live pid's, another format's, and an
    unrelated file stay."""
    import subprocess
    import sys

    from batchgen.distributed.shm_transport import sweep_stale_segments

    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()  # reaped: its pid is gone (reuse within this test is not a concern)
    dead, live = child.pid, os.getpid()
    names = {
        f"batchgen_a2a_0123456789abcdef_pid{dead}_r0_p1_g1": False,
        f"batchgen_a2a_0123456789abcdef_pid{dead}_header": False,
        f"batchgen_a2a_fedcba9876543210_pid{live}_r1_p0_g2": True,
        "batchgen_a2a_0123456789abcdef_r0_p1_g1": True,  # the old names: no pid, kept
        "something_else": True,
    }
    for name in names:
        (tmp_path / name).write_bytes(b"x" * 16)
    removed = sweep_stale_segments(str(tmp_path))
    assert sorted(removed) == sorted(n for n, keep in names.items() if not keep)
    assert sorted(os.listdir(tmp_path)) == sorted(n for n, keep in names.items() if keep)


def test_a_small_dev_shm_is_reported_before_any_segment_is_made(monkeypatch, tmp_path):
    """Docker's default 64 MiB /dev/shm cannot hold 2 ranks x 2 segments x 64 MiB: the reason
    names the sizes and the variable; a large enough one passes."""
    from batchgen.distributed import shm_transport

    class _Stat:
        f_frsize = 4096
        f_bavail = (64 << 20) // 4096

    monkeypatch.setattr(shm_transport.os, "statvfs", lambda _: _Stat)
    why = shm_transport.shm_room(2, 64 << 20, str(tmp_path))
    assert why is not None
    assert "64 MiB free" in why and "256 MiB" in why and "BATCHGEN_A2A_SHM_SEGMENT_MB" in why
    assert shm_transport.shm_room(2, 8 << 20, str(tmp_path)) is None  # 32 MiB fits


def _room_rank(rank, world, mode):
    import torch.distributed as dist

    from batchgen.distributed.transport import make_transport

    os.environ["BATCHGEN_A2A_TRANSPORT"] = mode
    os.environ["BATCHGEN_A2A_SHM_SEGMENT_MB"] = str(1 << 30)  # 1 PiB segments: no room
    try:
        t = make_transport(dist.group.WORLD, torch.device("cpu"), 30.0)
    except RuntimeError as exc:
        return str(exc)
    t.close()
    return t.name


@pytest.mark.timeout(120)
def test_no_room_in_dev_shm_means_gloo_or_a_clear_error():
    assert run_ranks(_room_rank, 2, "auto") == ["gloo", "gloo"]
    for message in run_ranks(_room_rank, 2, "shm"):
        assert "BATCHGEN_A2A_TRANSPORT=shm" in message and "MiB free" in message, message
