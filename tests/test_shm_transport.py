"""The shared-memory all-to-all (`batchgen.distributed.shm_transport`) on 2 and 3 local ranks:
bit for bit what gloo's ``all_to_all_single`` returns for the same inputs (skewed and zero
split sizes, several dtypes, segments that must grow), dispatch / combine over it exact against
one process, the automatic choice and ``BATCHGEN_A2A_TRANSPORT=gloo``, and a peer that dies or
never arrives: an error naming it within the timeout, no hang.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import time

import pytest
import torch
from dist_helpers import _entry, free_port, run_ranks
from test_ep_dispatch import CASES, H, _case, _rowwise_expert


def _shm(timeout_s: float = 60.0):
    import torch.distributed as dist

    from batchgen.distributed.transport import make_transport

    os.environ["BATCHGEN_A2A_TRANSPORT"] = "shm"  # shared memory or an error
    return make_transport(dist.group.WORLD, torch.device("cpu"), timeout_s)


def _splits(g: torch.Generator, world: int, op: int) -> torch.Tensor:
    """``[W, W]`` rows sent from rank s to rank d at op ``op``: zeros, skew, and growth (the
    last ops need segments above the 1 MiB first size)."""
    counts = torch.randint(0, 40, (world, world), generator=g)
    counts[torch.rand(world, world, generator=g) < 0.3] = 0
    if op % 4 == 1:
        counts[:, 0] *= 8  # everyone to rank 0
    if op >= 8:
        counts = counts.clamp(min=20) * 1000 * (op - 7)  # grow: MiBs per rank
    return counts


def _exact_rank(rank, world, ops, cap_mb=None):
    import torch.distributed as dist

    if cap_mb is not None:
        os.environ["BATCHGEN_A2A_SHM_SEGMENT_MB"] = str(cap_mb)
    shm = _shm()
    g = torch.Generator().manual_seed(11)
    dtypes = [torch.float32, torch.bfloat16, torch.int64, torch.uint8, torch.float16]
    mismatches, sizes = [], []
    for op in range(ops):
        counts = _splits(g, world, op)
        dtype = dtypes[op % len(dtypes)]
        send_counts, recv_counts = counts[rank].tolist(), counts[:, rank].tolist()
        width = 1 + op % 5
        send = torch.empty(sum(send_counts), width, dtype=dtype)  # plain strides, even empty
        send.copy_(torch.randn(sum(send_counts), width) * 100)
        got = torch.empty(sum(recv_counts), width, dtype=dtype)
        want = torch.empty_like(got)
        wire = (lambda t: t.view(torch.uint8)) if dtype.is_floating_point else (lambda t: t)
        shm.all_to_all(wire(got), wire(send), recv_counts, send_counts)
        dist.all_to_all_single(wire(want), wire(send), recv_counts, send_counts)
        if not torch.equal(got.view(torch.uint8), want.view(torch.uint8)):
            mismatches.append(op)
        sizes.append(send.numel() * send.element_size())
    grown = [seg.size for seg in shm.own if seg is not None]
    shm.close()
    leftover = [f for f in os.listdir("/dev/shm") if f.startswith(shm.prefix.split("/")[-1])]
    return mismatches, max(sizes), grown, leftover


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 3])
def test_shm_all_to_all_is_gloo_bit_for_bit(world):
    results = run_ranks(_exact_rank, world, 12)
    for rank, (mismatches, biggest, grown, leftover) in enumerate(results):
        assert mismatches == [], f"rank {rank}: ops {mismatches} differ from gloo"
        assert biggest > 1 << 20 and max(grown) >= biggest  # the segments grew past 1 MiB
        assert leftover == [], f"rank {rank} left files in /dev/shm: {leftover}"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 3])
def test_shm_all_to_all_in_rounds_under_the_segment_cap(world):
    """A cap of 4 KiB (about 0.004 MiB) splits every op above it into rounds (the largest op
    here sends about 170 KB from a rank, dozens of rounds); the result is still gloo's bit for bit, no
    segment grows past the cap, and the ranks agree on the rounds even when one of them needs
    none beyond the first (zero and skewed splits)."""
    cap_mb = 4096 / (1 << 20)
    results = run_ranks(_exact_rank, world, 9, cap_mb)
    for rank, (mismatches, biggest, grown, leftover) in enumerate(results):
        assert mismatches == [], f"rank {rank}: ops {mismatches} differ from gloo"
        assert biggest > 40 * 4096  # ops far above the cap
        assert max(grown) <= 4096, f"rank {rank}: segments {grown} above the 4 KiB cap"
        assert leftover == [], f"rank {rank} left files in /dev/shm: {leftover}"


def _cap_rank(rank, world, raw):
    os.environ["BATCHGEN_A2A_SHM_SEGMENT_MB"] = raw
    try:
        _shm().close()
    except ValueError as exc:
        return str(exc)
    return "accepted"


@pytest.mark.timeout(120)
def test_a_bad_segment_cap_is_refused_naming_the_variable():
    got = run_ranks(_cap_rank, 2, "lots")
    assert all("BATCHGEN_A2A_SHM_SEGMENT_MB must be a number of MiB, got 'lots'" in g for g in got)
    got = run_ranks(_cap_rank, 2, "0.001")
    assert all("at least 4096 bytes" in g for g in got), got


def _dispatch_rank(rank, world, seed, num_tokens, num_experts, top_k, skew, pad):
    import torch.distributed as dist

    from batchgen.distributed.all_to_all import AllToAllDispatcher, sum_slots
    from batchgen.distributed.layout import ExpertPlacement

    placement = ExpertPlacement(num_experts, world)
    d = AllToAllDispatcher(dist.group.WORLD, placement, transport=_shm())
    if pad:
        d.pad_rows, d.step_tokens = True, num_tokens
    outs = []
    for step in range(3):  # several layers: both parities of the segments
        hidden, ids, weights = _case(seed + step, rank, num_tokens, num_experts, top_k, skew)
        recv = d.dispatch(hidden, ids, weights)
        y = _rowwise_expert(recv.hidden.double(), recv.expert_ids, recv.weights)
        out = d.combine(y, recv.handle)
        flat = _rowwise_expert(
            hidden.repeat_interleave(top_k, 0), ids.reshape(-1), weights.reshape(-1)
        ).view(-1, top_k, H)
        want = sum_slots(flat) if flat.shape[0] else torch.zeros(0, H, dtype=torch.float64)
        outs.append((out.shape == want.shape, torch.equal(out.to(want.dtype), want)))
    d.transport.close()
    return d.transport.name, outs


@pytest.mark.timeout(300)
@pytest.mark.parametrize("pad", [False, True], ids=["counted", "padded"])
@pytest.mark.parametrize(
    "name",
    [
        "10_experts_on_3_ranks_top8",
        "all_tokens_to_rank0_experts",
        "a_rank_with_zero_tokens",
        "no_tokens_anywhere",
    ],
)
def test_dispatch_combine_over_shm_exact(name, pad):
    world, tokens, experts, top_k, skew = CASES[name]
    results = run_ranks(_dispatch_rank, world, 3, tokens, experts, top_k, skew, pad)
    for rank, (transport, outs) in enumerate(results):
        assert transport == "shm"
        assert all(shape_ok and equal for shape_ok, equal in outs), f"rank {rank}: {outs}"


def _choice_rank(rank, world, mode):
    import torch.distributed as dist

    from batchgen.distributed.transport import make_transport

    if mode is None:
        os.environ.pop("BATCHGEN_A2A_TRANSPORT", None)
    else:
        os.environ["BATCHGEN_A2A_TRANSPORT"] = mode
    t = make_transport(dist.group.WORLD, torch.device("cpu"), 30.0)
    name = t.name
    t.close()
    return name


@pytest.mark.timeout(120)
def test_transport_choice():
    assert run_ranks(_choice_rank, 2, None) == ["shm", "shm"]  # one host: shared memory
    assert run_ranks(_choice_rank, 2, "gloo") == ["gloo", "gloo"]
    with pytest.raises(AssertionError, match="must be auto, gloo or shm"):
        run_ranks(_choice_rank, 2, "tcp")


def _fault_rank(rank, world, fault, timeout_s):
    """Rank 1 does one op, then dies (``die``) or sleeps past the timeout (``stall``); rank 0
    runs a second op and reports the error it gets and how long it took."""
    shm = _shm(timeout_s)
    one = torch.ones(world, 4)
    out = torch.empty(world, 4)
    shm.all_to_all(out, one, [1] * world, [1] * world)
    if rank == 1:
        if fault == "die":
            os._exit(3)
        time.sleep(timeout_s + 30)
        return None
    t0 = time.monotonic()
    try:
        shm.all_to_all(out, one, [1] * world, [1] * world)
    except RuntimeError as exc:
        return str(exc), time.monotonic() - t0
    return "no error", time.monotonic() - t0


def _run_fault(fault: str, timeout_s: float):
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_entry,
            args=(_fault_rank, r, 2, port, results, (fault, timeout_s)),
            daemon=True,
        )
        for r in range(2)
    ]
    try:
        for p in procs:
            p.start()
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                rank, status, value = results.get(timeout=1.0)
            except queue.Empty:
                continue
            if rank == 0:
                assert status == "ok", value
                return value
        raise AssertionError("rank 0 hung")
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(timeout=10)


@pytest.mark.timeout(180)
def test_a_dead_peer_is_named_at_once():
    message, seconds = _run_fault("die", timeout_s=60.0)
    assert "rank 1" in message and "died" in message, message
    assert seconds < 5.0  # found by the liveness check, not the 60 s timeout


@pytest.mark.timeout(180)
def test_a_peer_that_never_arrives_times_out():
    message, seconds = _run_fault("stall", timeout_s=2.0)
    assert "rank 1" in message and "within 2 s" in message, message
    assert 2.0 <= seconds < 6.0
