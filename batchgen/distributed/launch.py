"""One entry point for every rank: ``python -m batchgen.distributed.launch``.

Three ways in, one `rank_main`:

- the frontend starts its local ranks as ``python -m batchgen.distributed.launch --rank R``
  (fresh interpreters: the user's script is never re-imported, unlike multiprocessing's spawn);
- ``torchrun --nproc-per-node N [--nnodes ...] -m batchgen.distributed.launch
  --data-parallel-address HOST --data-parallel-rpc-port PORT``: one rank per process, rank and
  rendezvous from torchrun's environment (``RANK``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
  ``MASTER_ADDR``, ``MASTER_PORT``);
- ``python -m batchgen.distributed.launch --data-parallel-address HOST --data-parallel-rpc-port
  PORT --data-parallel-size-local N --data-parallel-start-rank R`` on another machine (vLLM's
  ``--headless`` ranks): starts ranks R .. R+N-1 here.

The frontend (``batchgen run ... --data-parallel-size W --data-parallel-size-local L
--data-parallel-address HOST --data-parallel-rpc-port PORT``) listens at HOST:PORT; every rank
connects there with the shared secret in ``$BATCHGEN_DP_AUTHKEY`` and gets its settings from
it, so these commands take no engine flags.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
from collections.abc import Sequence

# The secret shared by the frontend and its ranks (the connection's HMAC key).
AUTHKEY_ENV = "BATCHGEN_DP_AUTHKEY"


def rank_command(rank: int, local_rank: int, local_world_size: int, address: str, port: int):
    """The command line that starts one rank process."""
    return [
        sys.executable,
        "-m",
        "batchgen.distributed.launch",
        "--rank",
        str(rank),
        "--local-rank",
        str(local_rank),
        "--local-world-size",
        str(local_world_size),
        "--data-parallel-address",
        address,
        "--data-parallel-rpc-port",
        str(port),
        "--parent-pid",  # the rank gives up waiting for a frontend whose starter is gone
        str(os.getpid()),
    ]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m batchgen.distributed.launch",
        description="Start BatchGen ranks that join a frontend (`batchgen run|serve|bench "
        "--data-parallel-size W --data-parallel-size-local L ...`) at its address and port. "
        f"The frontend and the ranks share a secret in ${AUTHKEY_ENV}.",
    )
    parser.add_argument("--data-parallel-address", required=True, metavar="HOST")
    parser.add_argument("--data-parallel-rpc-port", required=True, type=int, metavar="PORT")
    parser.add_argument(
        "--data-parallel-size-local",
        type=int,
        default=1,
        metavar="N",
        help="ranks to start on this machine (default: 1; ignored under torchrun)",
    )
    parser.add_argument(
        "--data-parallel-start-rank",
        type=int,
        default=0,
        metavar="R",
        help="global rank of the first of them (default: 0; ignored under torchrun)",
    )
    parser.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--local-rank", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--local-world-size", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--parent-pid", type=int, default=None, help=argparse.SUPPRESS)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from batchgen.engine.cpu_threads import set_openmp_wait_policy

    set_openmp_wait_policy()  # before torch loads libgomp (the worker imports torch)
    from batchgen.distributed.worker import RankLaunch, rank_main

    key = os.environ.get(AUTHKEY_ENV)
    if not key:
        print(
            f"batchgen launch: error: set ${AUTHKEY_ENV} to the frontend's secret", file=sys.stderr
        )
        return 2
    address, port = args.data_parallel_address, args.data_parallel_rpc_port
    if "RANK" in os.environ and "MASTER_ADDR" in os.environ:  # torchrun
        launch = RankLaunch(
            int(os.environ["RANK"]),
            int(os.environ.get("LOCAL_RANK", 0)),
            int(os.environ.get("LOCAL_WORLD_SIZE", 1)),
            address,
            port,
            key.encode(),
            torchrun=True,
        )
        return rank_main(launch)
    if args.rank is not None:
        launch = RankLaunch(
            args.rank,
            args.local_rank,
            args.local_world_size,
            address,
            port,
            key.encode(),
            parent_pid=args.parent_pid,
        )
        return rank_main(launch)
    n, start = args.data_parallel_size_local, args.data_parallel_start_rank
    if n < 1 or start < 0:
        print(
            "batchgen launch: error: need --data-parallel-size-local >= 1 and "
            "--data-parallel-start-rank >= 0",
            file=sys.stderr,
        )
        return 2
    procs = [subprocess.Popen(rank_command(start + i, i, n, address, port)) for i in range(n)]

    def forward(signum, _frame):
        for p in procs:
            p.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    codes = [p.wait() for p in procs]
    return next((c for c in codes if c), 0)


if __name__ == "__main__":
    sys.exit(main())
