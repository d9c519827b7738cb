"""The cluster file (``batchgen_cluster:``): the seed file as written, errors that name the key,
``--config`` against the same flags, overrides, ``batchgen config check``, and one small job on
two ranks through ``batchgen run --config``."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_distributed_launch import _batch, _texts

from batchgen.cluster_config import (
    ClusterConfigError,
    load_cluster_config,
    schema_keys,
    schema_markdown,
)
from batchgen.config import EngineConfig, ParallelConfig
from batchgen.config_fields import SECTIONS
from batchgen.entrypoints import cli, cli_flags
from batchgen.entrypoints.llm import make_configs

REPO = Path(__file__).resolve().parents[1]
SEED = REPO / "examples/cluster.yaml"
LOCAL = REPO / "examples/cluster-local.yaml"
BIN = Path(sys.executable).parent

# The file, character for character.
SEED_TEXT = """batchgen_cluster:
  model: 'deepseek-ai/DeepSeek-V3'
  world_size: 128
  parallelism:
    prefill_strategy: 'data_parallel_offload'
    decode_strategy: 'dp_attention_ep_moe'
    expert_parallel_size: 16
    data_parallel_size: 8
  coroutine_scheduler:
    max_active_coroutines: 4096
    expert_coalesce_threshold: 32
    straggler_rebalance_interval_steps: 10
  checkpoint_service:
    enable_elastic_recovery: true
    snapshot_storage_uri: 's3://ai-models-checkpoints/deepseek-v3/'
"""

SEED_FLAGS = [
    "--model",
    "deepseek-ai/DeepSeek-V3",
    "--data-parallel-size",
    "128",
    "--expert-parallel-size",
    "16",
    "--prefill-strategy",
    "data_parallel_offload",
    "--decode-strategy",
    "dp_attention_ep_moe",
    "--max-active-coroutines",
    "4096",
    "--expert-coalesce-threshold",
    "32",
    "--straggler-rebalance-interval-steps",
    "10",
    "--enable-elastic-recovery",
    "--snapshot-storage-uri",
    "s3://ai-models-checkpoints/deepseek-v3/",
]


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "cluster.yaml"
    path.write_text(text)
    return path


def _configs(argv: list[str]) -> tuple[EngineConfig, ParallelConfig]:
    """The settings `batchgen run ARGV` would start the engine with (no engine started)."""
    from batchgen.config_fields import GIVEN_AS

    args = cli.build_parser().parse_args(["run", "-i", "in.jsonl", "-o", "out.jsonl", *argv])
    token = GIVEN_AS.set("flag")  # as `batchgen` names settings in messages
    try:
        return make_configs(**cli.engine_kwargs(args))
    finally:
        GIVEN_AS.reset(token)


# ---- the seed file


def test_the_example_is_the_seed_file_verbatim():
    lines = SEED.read_text().splitlines(keepends=True)
    assert "".join(line for line in lines if not line.startswith("#")) == SEED_TEXT


def test_the_seed_file_is_8_replicas_of_16_rank_expert_parallel_groups():
    cluster = load_cluster_config(SEED)
    layout = cluster.layout
    assert (layout.world_size, layout.num_expert_replicas, layout.expert_parallel_size) == (
        128,
        8,
        16,
    )
    groups = layout.all_ep_groups()
    assert groups == [list(range(16 * g, 16 * g + 16)) for g in range(8)]
    assert layout.ep_group_ranks(37) == list(range(32, 48)) and layout.ep_rank(37) == 5
    # In flag terms: 128 ranks in groups of 16 (vLLM's --data-parallel-size counts ranks).
    assert cluster.parallel == ParallelConfig(
        data_parallel_size=128,
        expert_parallel_size=16,
        prefill_strategy="data_parallel_offload",
        decode_strategy="dp_attention_ep_moe",
        straggler_rebalance_interval_steps=10,
        enable_elastic_recovery=True,
        snapshot_storage_uri="s3://ai-models-checkpoints/deepseek-v3/",
    )
    assert cluster.engine == EngineConfig(
        model="deepseek-ai/DeepSeek-V3", max_active_coroutines=4096, expert_coalesce_threshold=32
    )
    assert cluster.engine.max_running_seqs == 4096
    assert cluster.flags() == SEED_FLAGS


def test_every_seed_setting_is_acted_on():
    # straggler rebalancing by the frontend (test_rebalance.py), snapshot_storage_uri by
    # `batchgen run` (test_snapshot_store.py), elastic recovery (test_elastic_recovery.py)
    assert load_cluster_config(SEED).parallel.ineffective_settings() == []
    one_rank = ParallelConfig(straggler_rebalance_interval_steps=10).ineffective_settings()
    assert one_rank == [
        "straggler_rebalance_interval_steps has no effect with one rank (data_parallel_size=1)"
    ]


@pytest.mark.parametrize(
    "text, world, replicas, ep",
    [
        ("  world_size: 4\n  parallelism:\n    data_parallel_size: 2\n", 4, 2, 2),
        ("  world_size: 4\n  parallelism:\n    expert_parallel_size: 4\n", 4, 1, 4),
        ("  parallelism:\n    data_parallel_size: 2\n    expert_parallel_size: 2\n", 4, 2, 2),
        ("  parallelism:\n    data_parallel_size: 3\n", 3, 3, 1),  # replicated experts
        ("  world_size: 2\n  parallelism:\n    enable_expert_parallel: true\n", 2, 1, 2),
        ("  world_size: 1\n", 1, 1, 1),
    ],
)
def test_two_sizes_give_the_third(tmp_path, text, world, replicas, ep):
    layout = load_cluster_config(_write(tmp_path, f"batchgen_cluster:\n  model: m\n{text}")).layout
    assert (layout.world_size, layout.num_expert_replicas, layout.expert_parallel_size) == (
        world,
        replicas,
        ep,
    )


# ---- bad files: each error names the file, line and key


def _seed(old: str, new: str) -> str:
    assert old in SEED_TEXT
    return SEED_TEXT.replace(old, new)


BAD_FILES = {
    "unknown nested key": (
        _seed("expert_parallel_size: 16", "expert_paralel_size: 16"),
        [
            "cluster.yaml:7: batchgen_cluster.parallelism.expert_paralel_size: unknown key; "
            "did you mean 'expert_parallel_size'? allowed: data_parallel_size, "
            "enable_expert_parallel, expert_parallel_size,"
        ],
    ),
    "unknown top-level key": (
        _seed("world_size: 128", "wold_size: 128"),
        ["cluster.yaml:3: batchgen_cluster.wold_size: unknown key; did you mean 'world_size'?"],
    ),
    "unknown section": (
        _seed("coroutine_scheduler:", "coroutine_sched:"),
        [
            "cluster.yaml:9: batchgen_cluster.coroutine_sched: unknown key; did you mean "
            "'coroutine_scheduler'?"
        ],
    ),
    "unknown root-level sibling": (
        SEED_TEXT + "extra: 1\n",
        ["cluster.yaml:16: extra: unknown key; the only root key is `batchgen_cluster`"],
    ),
    "wrong type": (
        _seed("max_active_coroutines: 4096", "max_active_coroutines: '4096'"),
        [
            "cluster.yaml:10: batchgen_cluster.coroutine_scheduler.max_active_coroutines: "
            "expected an integer or null, got '4096' (a string)"
        ],
    ),
    "wrong type of a flag": (
        _seed("enable_elastic_recovery: true", "enable_elastic_recovery: 1"),
        [
            "batchgen_cluster.checkpoint_service.enable_elastic_recovery: expected true or false, "
            "got 1 (an integer)"
        ],
    ),
    "two errors at once": (
        _seed("world_size: 128", "world_size: 12.8").replace("data_parallel_size", "dp"),
        [
            "2 errors",
            "batchgen_cluster.world_size: expected an integer or null, got 12.8",
            "batchgen_cluster.parallelism.dp: unknown key",
        ],
    ),
    "a key that is not a string": (
        "batchgen_cluster:\n  model: m\n  engine:\n    1: x\n",
        ["cluster.yaml:4: batchgen_cluster.engine: a key must be a string, got 1 (an integer)"],
    ),
    "a top-level key that is not a string": (
        "batchgen_cluster:\n  model: m\n  3: x\n",
        ["cluster.yaml:3: batchgen_cluster: a key must be a string, got 3 (an integer)"],
    ),
    "a root key that is not a string": (
        "batchgen_cluster:\n  model: m\n3: x\n",
        ["cluster.yaml:3: 3: unknown key; the only root key is `batchgen_cluster`"],
    ),
    "every bad value of the stage at once": (
        "batchgen_cluster:\n  model: m\n  engine:\n    block_size: 0\n    tile_size: 0\n"
        "  parallelism:\n    stream_buffer_layers: 0\n",
        [
            "3 errors",
            "cluster.yaml:4: batchgen_cluster.engine.block_size: must be an integer >= 1, got 0\n",
            "cluster.yaml:5: batchgen_cluster.engine.tile_size: must be an integer >= 1, got 0\n",
            "cluster.yaml:7: batchgen_cluster.parallelism.stream_buffer_layers: must be an "
            "integer >= 1, got 0",
        ],
    ),
    "an infinite timeout": (
        "batchgen_cluster:\n  model: m\n  parallelism:\n    distributed_timeout_s: .inf\n",
        [
            "cluster.yaml:4: batchgen_cluster.parallelism.distributed_timeout_s: must be a number "
            "> 0 and finite (seconds), got inf"
        ],
    ),
    "section not a mapping": (
        "batchgen_cluster:\n  model: m\n  parallelism: 8\n",
        [
            "cluster.yaml:3: batchgen_cluster.parallelism: expected a mapping of settings, got an "
            "integer"
        ],
    ),
    "world size against the product": (
        _seed("world_size: 128", "world_size: 100"),
        [
            "cluster.yaml:3: batchgen_cluster.world_size: 100 does not match "
            "parallelism.data_parallel_size x parallelism.expert_parallel_size = 8 x 16 = 128"
        ],
    ),
    "world size not a multiple of the replicas": (
        _seed("world_size: 128", "world_size: 100").replace("    expert_parallel_size: 16\n", ""),
        [
            "batchgen_cluster.world_size: 100 is not a multiple of parallelism."
            "data_parallel_size = 8: 100 / 8 = 12.5 ranks per expert-parallel group"
        ],
    ),
    "world size not a multiple of the group": (
        _seed("world_size: 128", "world_size: 40").replace("    data_parallel_size: 8\n", ""),
        [
            "batchgen_cluster.world_size: 40 is not a multiple of parallelism.expert_parallel_size "
            "= 16: 40 / 16 = 2.5 replicas"
        ],
    ),
    "zero size": (
        _seed("expert_parallel_size: 16", "expert_parallel_size: 0"),
        ["cluster.yaml:7: batchgen_cluster.parallelism.expert_parallel_size: must be >= 1, got 0"],
    ),
    "more local ranks than ranks": (
        _seed("data_parallel_size: 8", "data_parallel_size: 8\n    data_parallel_size_local: 200"),
        [
            "batchgen_cluster.parallelism.data_parallel_size_local: 200 is more than the job's 128 "
            "ranks"
        ],
    ),
    "a value the dataclass refuses": (
        _seed("expert_coalesce_threshold: 32", "expert_coalesce_threshold: 0"),
        [
            "cluster.yaml:11: batchgen_cluster.coroutine_scheduler.expert_coalesce_threshold: must "
            "be an integer >= 1, got 0"
        ],
    ),
    "a choice the dataclass refuses": (
        _seed("'dp_attention_ep_moe'", "'pipeline'"),
        ["cluster.yaml:6: batchgen_cluster.parallelism.decode_strategy: must be one of"],
    ),
    "a malformed URI": (
        _seed("'s3://ai", "'s3:/ai"),
        ["batchgen_cluster.checkpoint_service.snapshot_storage_uri: must be a URI"],
    ),
    "missing model": (
        _seed("  model: 'deepseek-ai/DeepSeek-V3'\n", ""),
        ["cluster.yaml:1: batchgen_cluster: missing `model`: the cluster file must name the model"],
    ),
    "null model": (
        _seed("'deepseek-ai/DeepSeek-V3'", ""),
        ["cluster.yaml:2: batchgen_cluster.model: empty: the cluster file must name the model"],
    ),
    "not a mapping": ("- model: m\n", ["cluster.yaml: the file must be a mapping, got a list"]),
    "root not a mapping": ("batchgen_cluster: m\n", ["batchgen_cluster: expected a mapping"]),
    "missing root": (
        SEED_TEXT.replace("batchgen_cluster:", "batchgen_clusters:"),
        ["no root key `batchgen_cluster:` ('batchgen_clusters' misspelled?)"],
    ),
    "empty file": ("", ["cluster.yaml: the file is empty; it needs the root key"]),
    "only comments": ("# nothing yet\n", ["the file is empty"]),
    "YAML syntax error": (
        _seed("world_size: 128", "world_size: [128"),
        [
            "cluster.yaml:4:14: YAML syntax error: expected ',' or ']', but got ':' (while parsing "
            "a flow sequence, line 3)"
        ],
    ),
    "YAML indentation error": (
        _seed("    expert_parallel_size: 16", "   expert_parallel_size: 16"),
        ["cluster.yaml:7:", "YAML syntax error"],
    ),
    "duplicate key": (
        _seed(
            "    data_parallel_size: 8\n", "    data_parallel_size: 8\n    data_parallel_size: 4\n"
        ),
        [
            "cluster.yaml:9: batchgen_cluster.parallelism.data_parallel_size: duplicate key (first "
            "on line 8)"
        ],
    ),
}


@pytest.mark.parametrize("name", list(BAD_FILES))
def test_a_bad_file_is_a_clear_error(tmp_path, name):
    text, expected = BAD_FILES[name]
    with pytest.raises(ClusterConfigError) as info:
        load_cluster_config(_write(tmp_path, text))
    message = str(info.value)
    for part in expected:
        assert part in message, message
    assert isinstance(info.value, ValueError) and info.value.errors


def _billion_laughs() -> str:
    """About 500 bytes that expand to 8**10 values: anchors &l0..&l9, 8 aliases each."""
    lines = ["batchgen_cluster:", "  model: m", "  l0: &l0 [x, x, x, x, x, x, x, x]"]
    lines += [f"  l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 8)}]" for i in range(1, 10)]
    return "\n".join(lines) + "\n  engine: *l9\n"


@pytest.mark.timeout(20)
def test_aliases_that_expand_too_far_are_refused_without_expanding_them(tmp_path):
    import resource
    import time

    path = _write(tmp_path, _billion_laughs())
    rss, start = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, time.monotonic()
    with pytest.raises(ClusterConfigError) as info:
        load_cluster_config(path)
    assert time.monotonic() - start < 2
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss < 100_000  # KiB
    assert info.value.errors == [  # line 7: &l4, 8**5 values
        f"{path}:7: YAML anchors and aliases expand to more than 10000 values; a cluster file "
        "needs a few dozen: write the settings out"
    ]
    # an anchor used within bounds is fine
    ok = "batchgen_cluster:\n  model: m\n  engine: &e {block_size: 32}\n"
    assert load_cluster_config(_write(tmp_path, ok)).engine.block_size == 32


@pytest.mark.parametrize(
    "text, line",
    [
        ("batchgen_cluster: &a {model: M, engine: *a}\n", 1),
        ("batchgen_cluster:\n  model: m\n  engine: &e\n    - *e\n", 3),
    ],
)
def test_a_recursive_anchor_is_a_clean_error(tmp_path, text, line):
    path = _write(tmp_path, text)
    with pytest.raises(ClusterConfigError) as info:
        load_cluster_config(path)
    assert info.value.errors == [
        f"{path}:{line}: the YAML anchor on line {line} contains an alias of itself (a recursive "
        "value); a cluster file cannot be recursive"
    ]


def test_config_check_refuses_a_yaml_bomb_with_exit_2(tmp_path, capsys):
    path = _write(tmp_path, "batchgen_cluster: &a {model: M, engine: *a}\n")
    assert cli.main(["config", "check", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"batchgen config: error: {path}:1: the YAML anchor on line 1")
    assert "Traceback" not in err


def test_sizes_are_bounded(tmp_path):
    path = _write(tmp_path, "batchgen_cluster:\n  model: m\n  world_size: 10000000\n")
    with pytest.raises(ClusterConfigError) as info:
        load_cluster_config(path)
    assert info.value.errors == [
        f"{path}:3: batchgen_cluster.world_size: 10000000 is more than 65536 ranks, the most a "
        "job may have"
    ]
    product = "batchgen_cluster:\n  model: m\n  parallelism:\n    data_parallel_size: 4096\n"
    path = _write(tmp_path, product + "    expert_parallel_size: 32\n")
    with pytest.raises(ClusterConfigError) as info:
        load_cluster_config(path)
    assert info.value.errors == [
        f"{path}:4: batchgen_cluster.parallelism.data_parallel_size: 4096 replicas x parallelism."
        "expert_parallel_size 32 = 131072 ranks is more than 65536, the most a job may have"
    ]
    with pytest.raises(ValueError, match="data_parallel_size must be an integer >= 1 and at most"):
        ParallelConfig(data_parallel_size=65537)
    assert (
        load_cluster_config(
            _write(tmp_path, "batchgen_cluster:\n  model: m\n  world_size: 65536\n")
        ).layout.world_size
        == 65536
    )


def test_config_check_summarises_many_replicas(tmp_path):
    from batchgen.entrypoints.config_check import report

    text = "batchgen_cluster:\n  model: m/m\n  world_size: 65536\n  parallelism:\n"
    cluster = load_cluster_config(_write(tmp_path, text + "    expert_parallel_size: 16\n"))
    lines = report(cluster)
    replicas = [line for line in lines if line.startswith("  ")]
    assert replicas == [
        "  replica 0: ranks 0-15",
        "  replica 1: ranks 16-31",
        "  replica 2: ranks 32-47",
        "  ... replicas 3-4093: ranks 48-65503, 16 per replica",
        "  replica 4094: ranks 65504-65519",
        "  replica 4095: ranks 65520-65535",
    ]
    assert len(lines) < 20


def test_a_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(ClusterConfigError, match="cannot read the cluster file"):
        load_cluster_config(tmp_path / "nope.yaml")


# ---- --config against flags, and overrides


def test_config_and_the_same_flags_give_the_same_settings():
    from_file = _configs(["--config", str(SEED)])
    assert from_file == _configs(SEED_FLAGS)
    assert from_file == (load_cluster_config(SEED).engine, load_cluster_config(SEED).parallel)


def test_every_section_of_the_local_example_against_flags(checkpoint_dir):
    cluster = load_cluster_config(LOCAL)
    assert {k.section for k in schema_keys() if k.name in cluster.kwargs} == {"", *SECTIONS}
    assert _configs(["--config", str(LOCAL)]) == _configs(cluster.flags())
    assert cluster.layout.world_size == 2 and cluster.layout.expert_parallel_size == 2


def test_a_flag_overrides_just_its_key():
    engine, parallel = _configs(["--config", str(SEED)])
    e2, p2 = _configs(["--config", str(SEED), "--max-active-coroutines", "8", "--model", "m"])
    assert e2 == dataclasses.replace(engine, max_active_coroutines=8, model="m")
    assert p2 == parallel
    # A flag keeps the flag's meaning: --data-parallel-size counts ranks (2 groups of 16).
    e3, p3 = _configs(["--config", str(SEED), "--data-parallel-size", "32"])
    assert e3 == engine and p3 == dataclasses.replace(parallel, data_parallel_size=32)
    _, p4 = _configs(["--config", str(SEED), "--no-enable-elastic-recovery"])
    assert p4 == dataclasses.replace(parallel, enable_elastic_recovery=False)


def test_llm_arguments_override_the_file():
    engine, parallel = make_configs("m", config=SEED, max_active_coroutines=8, tile_size=128)
    assert engine.model == "m" and engine.max_active_coroutines == 8 and engine.tile_size == 128
    assert engine.expert_coalesce_threshold == 32 and parallel.expert_parallel_size == 16
    assert make_configs(config=SEED)[0].model == "deepseek-ai/DeepSeek-V3"


@pytest.mark.parametrize("example", [LOCAL, SEED])
def test_a_flag_of_either_name_overrides_the_files_running_limit(example):
    # Both examples set coroutine_scheduler.max_active_coroutines; max_num_seqs is the same
    # limit by vLLM's name, and a flag or argument of either name replaces the file's value.
    engine, _ = _configs(["--config", str(example), "--max-num-seqs", "512"])
    assert (engine.max_num_seqs, engine.max_active_coroutines, engine.max_running_seqs) == (
        512,
        None,
        512,
    )
    engine, _ = make_configs(config=example, max_num_seqs=32)
    assert (engine.max_num_seqs, engine.max_active_coroutines, engine.max_running_seqs) == (
        32,
        None,
        32,
    )
    engine, _ = _configs(["--config", str(example), "--max-active-coroutines", "7"])
    assert (engine.max_num_seqs, engine.max_running_seqs) == (None, 7)


def test_batchgen_run_config_with_max_num_seqs_reaches_the_ranks(tmp_path, monkeypatch, capsys):
    import batchgen.distributed.frontend as frontend

    seen = []

    def ranks(engine, parallel):  # where the ranks would start
        seen.append((engine, parallel))
        raise KeyboardInterrupt

    monkeypatch.setattr(frontend, "DPEngineClient", ranks)
    src = tmp_path / "in.jsonl"
    src.write_text('{"custom_id": "a", "prompt": "x"}\n')  # an empty input loads no engine
    argv = ["run", "-i", str(src), "-o", str(tmp_path / "out.jsonl"), "--config", str(LOCAL)]
    assert cli.main([*argv, "--max-num-seqs", "512"]) == 130  # not 2: no error
    [(engine, parallel)] = seen
    assert engine.max_running_seqs == 512 and parallel.data_parallel_size == 2
    err = capsys.readouterr().err
    assert (
        "INFO batchgen.entrypoints.llm: --max-num-seqs 512 overrides batchgen_cluster."
        f"coroutine_scheduler.max_active_coroutines: 256 at {LOCAL}:27\n"
    ) in err


def test_both_names_at_one_level_conflict_and_the_error_says_where(tmp_path):
    with pytest.raises(ClusterConfigError) as info:
        _configs(["--config", str(LOCAL), "--max-num-seqs", "3", "--max-active-coroutines", "4"])
    assert str(info.value) == (
        "max_num_seqs=3 and max_active_coroutines=4 name the same limit (sequences running at "
        "once): give one of them, or both equal (max_num_seqs from --max-num-seqs 3; "
        "max_active_coroutines from --max-active-coroutines 4)"
    )
    both = "batchgen_cluster:\n  model: m\n  coroutine_scheduler:\n"
    both += "    max_num_seqs: 5\n    max_active_coroutines: 6\n"
    path = _write(tmp_path, both)
    with pytest.raises(ClusterConfigError) as info:
        load_cluster_config(path)
    assert info.value.errors == [
        f"{path}:4: batchgen_cluster.coroutine_scheduler.max_num_seqs: max_num_seqs=5 and "
        "max_active_coroutines=6 name the same limit (sequences running at once): give one of "
        "them, or both equal (max_active_coroutines: "
        "batchgen_cluster.coroutine_scheduler.max_active_coroutines (line 5))"
    ]


def test_a_flag_contradicting_the_file_names_the_files_key():
    with pytest.raises(ClusterConfigError) as info:
        _configs(["--config", str(LOCAL), "--data-parallel-size", "3"])
    assert str(info.value) == (
        "expert_parallel_size=2 must divide data_parallel_size=3 (expert_parallel_size from "
        f"batchgen_cluster.parallelism.expert_parallel_size: 2 at {LOCAL}:21; "
        "data_parallel_size from --data-parallel-size 3)"
    )
    with pytest.raises(ClusterConfigError, match=r"data_parallel_size from data_parallel_size=3\)"):
        make_configs(config=LOCAL, data_parallel_size=3)


def test_settings_that_replace_keys_of_the_file_are_logged(monkeypatch, caplog):
    import logging

    import batchgen.distributed.frontend as frontend
    from batchgen import LLM
    from batchgen.config_fields import GIVEN_AS

    monkeypatch.setattr(frontend, "DPEngineClient", lambda engine, parallel: parallel)
    token = GIVEN_AS.set("flag")  # as on the command line
    try:
        with caplog.at_level(logging.INFO, logger="batchgen"):
            llm = LLM(config=LOCAL, data_parallel_size=4, max_num_seqs=512)
    finally:
        GIVEN_AS.reset(token)
    assert llm.llm_engine.data_parallel_size == 4  # 2 replicas of the file's 2-rank groups
    notes = [r.getMessage() for r in caplog.records if "overrides" in r.getMessage()]
    assert notes == [
        f"--data-parallel-size 4 overrides batchgen_cluster.world_size: 2 at {LOCAL}:13, "
        f"batchgen_cluster.parallelism.data_parallel_size: 1 at {LOCAL}:20",
        "--max-num-seqs 512 overrides batchgen_cluster.coroutine_scheduler."
        f"max_active_coroutines: 256 at {LOCAL}:27",
    ]
    assert all(r.levelname == "INFO" for r in caplog.records if "overrides" in r.getMessage())


def test_no_enable_expert_parallel_turns_the_files_expert_parallelism_off():
    from batchgen.distributed.layout import resolve_layout
    from batchgen.entrypoints.llm import _resolve_configs

    _, parallel = _configs(["--config", str(LOCAL), "--no-enable-expert-parallel"])
    assert (parallel.data_parallel_size, parallel.resolved_expert_parallel_size) == (2, 1)
    assert parallel.resolved_decode_strategy == "data_parallel"
    assert resolve_layout(parallel).num_expert_replicas == 2
    _, _, notes = _resolve_configs(None, LOCAL, {"enable_expert_parallel": False})
    assert notes == [
        "enable_expert_parallel=False overrides batchgen_cluster.parallelism."
        f"expert_parallel_size: 2 at {LOCAL}:21, batchgen_cluster.parallelism.decode_strategy: "
        f"'dp_attention_ep_moe' at {LOCAL}:23: the experts are replicated on every rank"
    ]
    # an explicit size given with it still shards (the flags' own meaning)
    flags = ["--no-enable-expert-parallel", "--expert-parallel-size", "2"]
    _, p2 = _configs(["--config", str(LOCAL), *flags])
    assert p2.resolved_expert_parallel_size == 2
    # the seed's data_parallel_offload needs expert parallelism: an error naming both
    with pytest.raises(ClusterConfigError) as info:
        _configs(["--config", str(SEED), "--no-enable-expert-parallel"])
    message = str(info.value)
    assert message.startswith("prefill_strategy='data_parallel_offload' streams the experts")
    assert message.endswith(
        "(prefill_strategy from batchgen_cluster.parallelism.prefill_strategy: "
        f"'data_parallel_offload' at {SEED}:8; enable_expert_parallel from "
        "--no-enable-expert-parallel)"
    )


def test_a_bad_file_stops_batchgen_run_before_the_engine(tmp_path, capsys):
    bad = _write(tmp_path, _seed("expert_parallel_size: 16", "expert_paralel_size: 16"))
    src = tmp_path / "in.jsonl"
    src.write_text("")
    argv = ["run", "-i", str(src), "-o", str(tmp_path / "out.jsonl"), "--config", str(bad)]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"batchgen run: error: {bad}:7: batchgen_cluster.parallelism.")
    assert "did you mean 'expert_parallel_size'?" in err and "Traceback" not in err


def test_serve_passes_the_file_and_the_flags_given(tmp_path, monkeypatch):
    import batchgen.service.server as server

    calls = []
    monkeypatch.setattr(cli_flags, "start_engine", lambda kwargs: calls.append(kwargs))
    monkeypatch.setattr(server, "run_server", lambda *args, **kwargs: None)
    state = ["--state-dir", str(tmp_path)]
    assert cli.main(["serve", "--config", str(SEED), *state]) == 0
    assert cli.main(["serve", "m", "--config", str(SEED), "--max-num-seqs", "9", *state]) == 0
    assert calls == [
        {"config": str(SEED)},
        {"config": str(SEED), "model": "m", "max_num_seqs": 9},
    ]


def test_bench_takes_what_it_can_from_the_file(caplog):
    from batchgen.bench.args import resolve_settings

    args = cli.build_parser().parse_args(["bench", "--config", str(SEED), "--dtype", "bfloat16"])
    resolve_settings(args)
    assert (args.model, args.dtype, args.device, args.expert_coalesce_threshold) == (
        "deepseek-ai/DeepSeek-V3",
        "bfloat16",  # the flag over the file
        "auto",
        32,
    )
    assert (args.data_parallel_size, args.expert_parallel_size) == (128, 16)
    assert "coroutine_scheduler.max_active_coroutines" in caplog.text
    plain = cli.build_parser().parse_args(["bench"])
    resolve_settings(plain)
    assert (plain.model, plain.dtype, plain.expert_coalesce_threshold) == (None, "float32", None)


# ---- the schema


def test_every_field_is_one_key_and_the_docs_table_is_current():
    keys = schema_keys()
    names = [k.name for k in keys if k.owner is not None]
    assert sorted(names) == sorted(EngineConfig.field_names() + ParallelConfig.field_names())
    assert {k.section for k in keys} <= {"", *SECTIONS}
    assert len({k.path for k in keys}) == len(keys)
    docs = (REPO / "docs/cluster-config.md").read_text()
    assert schema_markdown() in docs, "regenerate the table: batchgen config schema"
    # `model` is optional as a flag (the embedded model) and required in the file: one story.
    row = next(r for r in schema_markdown().splitlines() if r.startswith("| `model` |"))
    assert row == (
        "| `model` | `--model` | see meaning | HF model directory or hub id (default: the "
        "embedded random-weights model, also named batchgen/default-mixtral-v1; required in the "
        "cluster YAML) |"
    )


# ---- batchgen config check


def test_config_check_prints_the_seed_layout_without_the_model():
    r = subprocess.run(
        [str(BIN / "batchgen"), "config", "check", str(SEED)],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, HF_HUB_OFFLINE="1"),
    )
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "world size: 128 ranks = 8 replicas (data_parallel_size) x 16 ranks per" in out
    assert "  replica 0: ranks 0-15\n" in out and "  replica 7: ranks 112-127\n" in out
    assert "not in this machine's Hugging Face cache: layout only" in out
    assert "experts per rank: not shown" in out
    assert "warning:" not in out  # every setting of the seed is acted on
    assert "the same as flags: --model deepseek-ai/DeepSeek-V3 --data-parallel-size 128" in out


def test_config_check_says_where_the_ranks_start(tmp_path, monkeypatch):
    """Before: "ranks started on this machine: all 128" on a 2-CPU machine, and the same under
    Ray (which places the ranks itself)."""
    import torch

    import batchgen.engine.cpu_threads as cpu_threads
    from batchgen.entrypoints.config_check import report

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(cpu_threads, "available_cpus", lambda: 2)

    def started(text: str) -> str:
        lines = report(load_cluster_config(_write(tmp_path, text)))
        (line,) = [x for x in lines if x.startswith("ranks started on this machine: ")]
        return line.removeprefix("ranks started on this machine: ")

    assert started(SEED_TEXT) == (
        "all 128, as processes sharing this machine's 2 CPUs (128 > 2); for a job across "
        "machines set parallelism.data_parallel_size_local to this machine's ranks "
        "(docs/distributed.md)"
    )
    local = "    data_parallel_size: 8\n    data_parallel_size_local: {}\n"
    assert started(_seed("    data_parallel_size: 8\n", local.format(16))) == (
        "16 of 128 (data_parallel_size_local); the other 112 connect from other machines "
        "(python -m batchgen.distributed.launch, or torchrun)"
    )
    assert started(_seed("    data_parallel_size: 8\n", local.format(0))).startswith(
        "0 of 128 (data_parallel_size_local); the other 128 connect"
    )
    ray = "    data_parallel_size: 8\n    distributed_executor_backend: 'ray'\n"
    assert started(_seed("    data_parallel_size: 8\n", ray)) == (
        "none as processes: Ray places all 128 ranks as actors on its cluster"
    )
    two = "batchgen_cluster:\n  model: 'deepseek-ai/DeepSeek-V3'\n  world_size: 2\n"
    assert started(two) == "all 2"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # devices checked instead
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert started(two) == "all 2"


def test_config_check_exits_2_with_the_errors(tmp_path):
    bad = _write(tmp_path, _seed("world_size: 128", "world_size: 100"))
    r = subprocess.run(
        [str(BIN / "batchgen"), "config", "check", str(bad)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2 and r.stdout == ""
    assert "8 x 16 = 128" in r.stderr and r.stderr.startswith("batchgen config: error: ")


def test_config_check_places_the_experts_of_a_local_model(tmp_path, checkpoint_dir):
    from batchgen.entrypoints.config_check import report

    model = checkpoint_dir("mixtral")  # 4 experts
    text = f"batchgen_cluster:\n  model: '{model}'\n  world_size: 4\n  parallelism:\n"
    lines = report(load_cluster_config(_write(tmp_path, text + "    expert_parallel_size: 2\n")))
    assert "model: " + str(model) + " (local directory)" in lines
    assert "  expert-parallel rank 0 (ranks 0, 2): experts 0-1 (2)" in lines
    assert "  expert-parallel rank 1 (ranks 1, 3): experts 2-3 (2)" in lines
    with pytest.raises(ValueError, match="cannot place 4 experts on 8 expert-parallel ranks"):
        text8 = text.replace("world_size: 4", "world_size: 8") + "    expert_parallel_size: 8\n"
        report(load_cluster_config(_write(tmp_path, text8)))
    missing = _write(tmp_path, "batchgen_cluster:\n  model: /no/such/dir\n")
    with pytest.raises(ValueError, match="batchgen_cluster.model: model directory '/no/such/dir'"):
        report(load_cluster_config(missing))


def test_config_check_refuses_a_narrower_kv_cache_for_an_mla_model(tmp_path, checkpoint_dir):
    """An MLA model (DeepSeek-V2/V3) takes only kv_cache_dtype auto (the engine refuses the
    rest at start): `config check` reads the local config.json and says so before a job starts,
    instead of printing 'valid'."""
    from batchgen.entrypoints.config_check import report

    model = checkpoint_dir("deepseek_v2")
    text = f"batchgen_cluster:\n  model: '{model}'\n  engine:\n"
    for kv in ("fp8", "fp8_e5m2"):
        cfg = load_cluster_config(_write(tmp_path, text + f"    kv_cache_dtype: {kv}\n"))
        with pytest.raises(
            ValueError,
            match=rf"engine.kv_cache_dtype: kv_cache_dtype={kv!r} is not supported for MLA",
        ):
            report(cfg)
    with pytest.raises(ValueError, match="not supported for MLA"):  # float32 model, bf16 cache
        both = "    dtype: float32\n    kv_cache_dtype: bfloat16\n"
        report(load_cluster_config(_write(tmp_path, text + both)))
    # the model's own dtype by name is auto; under dtype auto it depends on the machine
    same = "    dtype: bfloat16\n    kv_cache_dtype: bfloat16\n"
    assert report(load_cluster_config(_write(tmp_path, text + same)))[0].endswith(": valid")
    lines = report(load_cluster_config(_write(tmp_path, text + "    kv_cache_dtype: bfloat16\n")))
    assert any(line.startswith("warning: batchgen_cluster.engine.kv_cache_dtype") for line in lines)
    plain = checkpoint_dir("mixtral")  # not MLA: every narrower format is valid
    fp8 = f"batchgen_cluster:\n  model: '{plain}'\n  engine:\n    kv_cache_dtype: fp8\n"
    assert report(load_cluster_config(_write(tmp_path, fp8)))[0].endswith(": valid")
    f16 = fp8.replace("kv_cache_dtype: fp8", "dtype: float16\n    kv_cache_dtype: bfloat16")
    with pytest.raises(ValueError, match="'bfloat16' under a float16 model stores no fewer"):
        report(load_cluster_config(_write(tmp_path, f16)))


def test_a_missing_model_directory_says_how_to_make_it(tmp_path, capsys):
    tiny = tmp_path / "batchgen-tiny-mixtral"  # the local example's model, not built yet
    text = LOCAL.read_text().replace("/tmp/batchgen-tiny-mixtral", str(tiny))
    path = _write(tmp_path, text)
    assert cli.main(["config", "check", str(path)]) == 2
    assert capsys.readouterr().err == (
        f"batchgen config: error: {path}: batchgen_cluster.model: model directory '{tiny}' does "
        f"not exist; write it with `batchgen make-model --arch mixtral --out {tiny}`\n"
    )
    other = _write(tmp_path, "batchgen_cluster:\n  model: /no/such/dir\n")
    assert cli.main(["config", "check", str(other)]) == 2
    assert capsys.readouterr().err.endswith(
        "model directory '/no/such/dir' does not exist; give an HF checkpoint directory, or "
        "write a tiny random-weight one with `batchgen make-model --arch mixtral --out DIR`\n"
    )


def test_more_local_ranks_than_cuda_devices_fail_before_loading(monkeypatch):
    import torch

    from batchgen.distributed.layout import check_local_devices

    parallel = load_cluster_config(SEED).parallel
    check_local_devices(parallel, "auto")  # no CUDA here: not knowable, no error
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    with pytest.raises(ValueError, match=r"128 ranks would start on this machine .* has 8 visible"):
        check_local_devices(parallel, "auto")
    check_local_devices(dataclasses.replace(parallel, data_parallel_size_local=8), "auto")
    check_local_devices(parallel, "cpu")


def test_cuda_without_cuda_fails_in_the_frontend_and_warns_in_config_check(tmp_path, monkeypatch):
    import torch

    import batchgen.distributed.frontend as frontend
    from batchgen import LLM
    from batchgen.entrypoints.config_check import report

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    started = []
    monkeypatch.setattr(frontend, "DPEngineClient", lambda *args: started.append(args))
    text = "batchgen_cluster:\n  model: m/m\n  world_size: 4\n  engine:\n    device: cuda\n"
    path = _write(tmp_path, text)
    with pytest.raises(ClusterConfigError) as info:
        LLM(config=path)
    assert str(info.value) == (
        "device='cuda' but this machine has no usable CUDA device (torch.cuda.is_available() is "
        "False): use device 'auto' or 'cpu' (device from batchgen_cluster.engine.device: 'cuda' "
        f"at {path}:5)"
    )
    assert started == []  # no rank started
    with pytest.raises(ValueError, match="^device='cuda' but this machine has no usable CUDA"):
        LLM("m/m", device="cuda", data_parallel_size=4)
    assert started == []
    lines = report(load_cluster_config(path))  # exit 0: the job may run elsewhere
    assert (
        "warning: batchgen_cluster.engine.device is 'cuda' but this machine has no usable CUDA "
        "device: the job cannot start here (fine if it runs on another machine)"
    ) in lines


def test_a_group_larger_than_the_experts_fails_before_any_rank_starts(checkpoint_dir):
    from batchgen import LLM

    model = str(checkpoint_dir("mixtral"))  # 4 experts
    with pytest.raises(ValueError, match="cannot place 4 experts on 8 expert-parallel ranks"):
        LLM(model, data_parallel_size=8, enable_expert_parallel=True)


# ---- one small job, every section set, two ranks


@pytest.mark.timeout(400)
def test_batchgen_run_with_the_local_example_on_two_ranks(checkpoint_dir, tmp_path):
    model = str(checkpoint_dir("mixtral"))
    src, out, one = tmp_path / "in.jsonl", tmp_path / "out.jsonl", tmp_path / "one.jsonl"
    _batch(src)
    env = dict(os.environ, BATCHGEN_LOG_LEVEL="INFO")
    run = [str(BIN / "batchgen"), "run", "--no-progress", "-i", str(src)]
    r = subprocess.run(
        # The file's model is a path of the user's; the flag overrides it, and one setting more.
        [
            *run,
            "-o",
            str(out),
            "--config",
            str(LOCAL),
            "--model",
            model,
            "--max-num-batched-tokens",
            "64",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "2 ranks (expert-parallel groups: 1 of 2 ranks)" in r.stderr
    assert "experts 0-1 of 4" in r.stderr and "experts 2-3 of 4" in r.stderr
    # The file's max_active_coroutines (256 per rank) and the flag's 64-token micro-batches.
    assert "64 tokens per attention micro-batch" in r.stderr
    assert "and 256 sequences per step" in r.stderr
    assert "not acted on" not in r.stderr and "has no effect" not in r.stderr
    subprocess.run(
        [*run, "-o", str(one), "--model", model], check=True, capture_output=True, timeout=240
    )
    texts = _texts(out)
    assert len(texts) == 9 and texts == _texts(one)  # greedy: token-identical to one process
