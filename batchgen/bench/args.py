"""Command-line arguments of `batchgen bench` (no torch import, so `batchgen --help` stays
fast)."""

from __future__ import annotations

MODES = ("hf_generate", "hf_generate_batch", "lockstep", "coalesce")


def add_arguments(p) -> None:
    p.add_argument("--quick", action="store_true", help="small workloads (minutes on 2 cores)")
    p.add_argument("--json", action="store_true", help="print the machine-readable record")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of {MODES}")
    p.add_argument("--workloads", default=None, help="comma-separated: rollouts,extraction,search")
    p.add_argument("--expert-coalesce-threshold", type=int, default=256)
    p.add_argument(
        "--rollouts-requests",
        type=int,
        default=None,
        help="requests in the rollouts workload (default 2048; 24 with --quick)",
    )
    p.add_argument(
        "--arch",
        default="mixtral",
        choices=["mixtral", "deepseek_v3"],
        help="benchmark model family, built offline on first use: Mixtral or DeepSeek-V3 "
        "(MLA), both 64 experts top-8, hidden 512, 4 layers",
    )
    p.add_argument("--model", default=None, help="checkpoint (overrides --arch)")
    p.add_argument(
        "--profile",
        action="store_true",
        help="run the BatchGen modes under torch.profiler and print their top operators by "
        "self time (adds profiler overhead to those modes' figures)",
    )
