"""Command-line arguments of `batchgen bench` (no torch import, so `batchgen --help` stays
fast).

With ``--config FILE`` the bench takes from the cluster file what it can use (the model, dtype,
device, expert_coalesce_threshold, kv_cache_dtype and the parallel settings of `PARALLEL_FLAGS`); flags given
override the file, and the file's other settings are named in a warning: the bench runs the
engine's default settings, what a user who changes nothing gets (docs/bench.md).
"""

from __future__ import annotations

import argparse
import logging

logger = logging.getLogger(__name__)

MODES = ("hf_generate", "hf_generate_batch", "lockstep", "coalesce")
# The workloads of a run without --workloads (shared-docs and tree-search run only when named).
DEFAULT_WORKLOADS = ("rollouts", "extraction", "search", "extraction-json")
# Settings a cluster file can give the bench, and their defaults when neither it nor a flag does.
BENCH_DEFAULTS = {
    "model": None,
    "dtype": "float32",
    "device": "auto",
    "expert_coalesce_threshold": None,  # the engine's default (EngineConfig)
    "kv_cache_dtype": None,  # the engine's default, auto
}


def add_arguments(p) -> None:
    p.add_argument("--quick", action="store_true", help="small workloads (minutes on 2 cores)")
    p.add_argument("--json", action="store_true", help="print the machine-readable record")
    p.add_argument("--no-progress", action="store_true", help="no progress bars on stderr")
    dtypes = ["float32", "bfloat16", "float16"]
    p.add_argument("--dtype", default=argparse.SUPPRESS, choices=dtypes, help="default: float32")
    p.add_argument(
        "--device",
        default=argparse.SUPPRESS,
        choices=["auto", "cpu", "cuda"],
        help=f"default: {BENCH_DEFAULTS['device']} (cuda when there is one)",
    )
    p.add_argument(
        "--modes",
        default=",".join(MODES),
        help=f"comma-separated subset of {', '.join(MODES)} (default: all four)",
    )
    p.add_argument(
        "--workloads",
        default=None,
        help="comma-separated, of: rollouts, extraction, search, extraction-json (structured "
        "outputs: constrained against unconstrained; needs lockstep or coalesce among the modes), "
        "shared-docs (16 questions per document, the BatchGen modes with the prefix cache on and "
        "off), tree-search (branching 4, depth 3, each level extending its parent's prompt and "
        "output, run level by level; the BatchGen modes with the prefix cache on and off) "
        f"(default: {','.join(DEFAULT_WORKLOADS)}: shared-docs and tree-search run only when "
        "named)",
    )
    p.add_argument(
        "--expert-coalesce-threshold",
        type=int,
        default=argparse.SUPPRESS,
        help="coalesce: mean rows per expert below which an MoE stage waits for the step's "
        "other micro-batches (default: the engine's, as every other engine setting of the "
        "bench: what LLM() and batchgen run use)",
    )
    from batchgen.config import KV_CACHE_DTYPES

    p.add_argument(
        "--kv-cache-dtype",
        default=argparse.SUPPRESS,
        choices=KV_CACHE_DTYPES,
        help="the BatchGen modes' KV cache dtype (default: the engine's, auto: the model's "
        "dtype; docs/performance.md, 'KV cache dtype')",
    )
    p.add_argument(
        "--rollouts-requests",
        type=int,
        default=None,
        help="requests in the rollouts workload (default 4096; 24 with --quick)",
    )
    p.add_argument(
        "--arch",
        default="mixtral",
        choices=["mixtral", "deepseek_v3"],
        help="benchmark model family, built offline on first use: Mixtral or DeepSeek-V3 "
        "(MLA), both 64 experts top-8, hidden 512, 4 layers (default: mixtral)",
    )
    p.add_argument(
        "--model",
        default=argparse.SUPPRESS,
        help="checkpoint (overrides --arch and --config's; default: the --arch model)",
    )
    from batchgen.config import ParallelConfig
    from batchgen.entrypoints.cli_flags import add_cluster_file_argument, add_config_flags

    add_cluster_file_argument(p)

    add_config_flags(
        p.add_argument_group(
            "parallel options",
            "With --data-parallel-size N > 1 the bench compares one process ('single') with N "
            "local ranks ('dp') on rollouts and extraction (batchgen/bench/distributed.py).",
        ),
        ParallelConfig,
    )
    p.add_argument(
        "--profile",
        action="store_true",
        help="run the BatchGen modes under torch.profiler and print their top operators by "
        "self time (adds profiler overhead to those modes' figures)",
    )


def resolve_settings(args) -> None:
    """Set the bench's settings on ``args``: the flags given, else the ``--config`` file's, else
    `BENCH_DEFAULTS` (a ``model`` naming the default model becomes its checkpoint directory);
    log a warning naming what the file or the flags set that the bench does not use.

    Raises:
        batchgen.cluster_config.ClusterConfigError: an invalid cluster file.
    """
    from batchgen.bench.distributed import PARALLEL_FLAGS
    from batchgen.config import ParallelConfig

    used = {*BENCH_DEFAULTS, *PARALLEL_FLAGS}
    ignored = [f"--{n.replace('_', '-')}" for n in ParallelConfig.field_names() if n not in used]
    ignored = [flag for flag in ignored if hasattr(args, flag[2:].replace("-", "_"))]
    args.from_config_file = {}  # setting name -> its key in the --config file, for errors
    if getattr(args, "config", None):
        from batchgen.cluster_config import load_cluster_config, schema_keys

        paths = {k.name: k.path for k in schema_keys()}
        for name, value in load_cluster_config(args.config).kwargs.items():
            if name not in used or (name == "dtype" and value == "auto"):
                ignored.append(paths[name])
            elif not hasattr(args, name):
                setattr(args, name, value)
                args.from_config_file[name] = paths[name]
    for name, value in BENCH_DEFAULTS.items():
        if not hasattr(args, name):
            setattr(args, name, value)
    from batchgen.models.default_model import default_model_path, names_default_model

    if args.model is not None and names_default_model(args.model):
        args.model = default_model_path()  # the bench runs a checkpoint directory
    if ignored:
        logger.warning(
            "batchgen bench runs the engine's default settings (docs/bench.md) and does not use: %s",
            ", ".join(ignored),
        )
