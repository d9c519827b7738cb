"""Run a function on N local gloo ranks (spawned processes) with a hard timeout; every process
is killed and joined before returning, whatever happens."""

from __future__ import annotations

import multiprocessing as mp
import queue
import socket
import time
import traceback


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(target, rank, world_size, port, results, args):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size
        )
        results.put((rank, "ok", target(rank, world_size, *args)))
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(target, world_size: int, *args, timeout: float = 240.0) -> list:
    """``target(rank, world_size, *args)`` on ``world_size`` gloo ranks; returns the results in
    rank order. Raises AssertionError with the failing rank's traceback, or on timeout."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_entry, args=(target, r, world_size, port, results, args), daemon=True)
        for r in range(world_size)
    ]
    out: dict[int, object] = {}
    try:
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        while len(out) < world_size:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"ranks timed out after {timeout} s; finished: {sorted(out)}")
            try:
                rank, status, value = results.get(timeout=min(left, 1.0))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                if dead and len(out) < world_size:
                    time.sleep(0.5)  # let a traceback arrive first
                    if results.empty():
                        raise AssertionError(f"ranks {dead} died without a result") from None
                continue
            if status != "ok":
                raise AssertionError(f"rank {rank} failed:\n{value}")
            out[rank] = value
        return [out[r] for r in range(world_size)]
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(timeout=10)
