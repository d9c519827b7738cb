"""Raw gloo bandwidth between two local ranks, to set beside the dispatch + combine figures of
`ep_layer_costs.py` (which include packing and unpacking on one core):

    python benchmarks/gloo_all_to_all.py

Times ``all_to_all_single`` and a ``send``/``recv`` pair of the same bytes (8 MB and 0.8 MB
per rank, uint8 and float32), one thread per rank, and prints MB/s of the half that leaves a
rank.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _rank(rank: int, port: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    for dtype, n in (
        (torch.uint8, 8_000_000),
        (torch.float32, 2_000_000),
        (torch.uint8, 800_000),
        (torch.float32, 200_000),
    ):
        x = torch.ones(n, dtype=dtype)
        out = torch.empty_like(x)
        for _ in range(2):
            dist.all_to_all_single(out, x)
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(10):
            dist.all_to_all_single(out, x)
        a2a = (time.perf_counter() - t0) / 10
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(10):
            if rank == 0:
                dist.send(x[: n // 2], 1)
                dist.recv(out[: n // 2], 1)
            else:
                dist.recv(out[: n // 2], 0)
                dist.send(x[: n // 2], 0)
        pair = (time.perf_counter() - t0) / 10
        if rank == 0:
            half = x.numel() * x.element_size() / 2
            print(
                f"{str(dtype):>14} {2 * half / 1e6:5.1f} MB: all_to_all {a2a * 1e3:6.2f} ms "
                f"({half / a2a / 1e6:5.0f} MB/s leaving a rank); send/recv {pair * 1e3:6.2f} ms "
                f"({half / pair / 1e6:5.0f} MB/s)",
                flush=True,
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    mp.spawn(_rank, args=(free,), nprocs=2)
