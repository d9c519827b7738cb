"""The one rank entry point started three ways: by torchrun, by ``python -m
batchgen.distributed.launch`` on "another machine" (mixed with a local rank), and the settings
that decide the layout."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from dist_helpers import free_port

from batchgen.config import ParallelConfig
from batchgen.distributed.layout import ExpertPlacement, ParallelLayout, resolve_layout

BIN = Path(sys.executable).parent


def _batch(path: Path) -> None:
    lines = [
        json.dumps(
            {
                "custom_id": f"r{i}",
                "method": "POST",
                "url": "/v1/completions",
                "body": {"prompt": "hello " * (i + 1), "max_tokens": 5 + i, "temperature": 0},
            }
        )
        for i in range(8)
    ]
    lines.insert(2, "not json")
    path.write_text("\n".join(lines) + "\n")


def _texts(path: Path) -> dict:
    out = {}
    for line in path.read_text().splitlines():
        d = json.loads(line)
        out[d["custom_id"]] = (
            d["response"]["status_code"],
            d["response"]["body"].get("choices", [{}])[0].get("text"),
        )
    return out


def _frontend_and_ranks(tmp_path, model, local: int, rank_cmd: list[str]) -> tuple:
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _batch(src)
    port = free_port()
    env = dict(os.environ, BATCHGEN_DP_AUTHKEY="test-secret", BATCHGEN_LOG_LEVEL="WARNING")
    front = subprocess.Popen(
        [
            str(BIN / "batchgen"),
            "run",
            "--no-progress",
            "-i",
            str(src),
            "-o",
            str(out),
            "--model",
            model,
            "--data-parallel-size",
            "2",
            "--enable-expert-parallel",
            "--data-parallel-size-local",
            str(local),
            "--data-parallel-rpc-port",
            str(port),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    ranks = subprocess.Popen(
        [*rank_cmd, "--data-parallel-address", "127.0.0.1", "--data-parallel-rpc-port", str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    try:
        _, front_err = front.communicate(timeout=240)
        rank_out, _ = ranks.communicate(timeout=60)
    finally:
        for p in (front, ranks):
            if p.poll() is None:
                p.kill()
    one = tmp_path / "one.jsonl"
    subprocess.run(
        [
            str(BIN / "batchgen"),
            "run",
            "--no-progress",
            "-i",
            str(src),
            "-o",
            str(one),
            "--model",
            model,
        ],
        check=True,
        capture_output=True,
        timeout=240,
    )
    return front.returncode, front_err, ranks.returncode, rank_out, _texts(out), _texts(one)


@pytest.mark.timeout(400)
def test_torchrun_ranks_join_a_frontend(checkpoint_dir, tmp_path):
    cmd = [
        str(BIN / "torchrun"),
        "--nproc-per-node",
        "2",
        "--master-port",
        str(free_port()),
        "-m",
        "batchgen.distributed.launch",
    ]
    code, err, rcode, rout, got, want = _frontend_and_ranks(
        tmp_path, str(checkpoint_dir("mixtral")), 0, cmd
    )
    assert code == 0, err
    assert rcode == 0, rout[-3000:]
    assert got == want and len(got) == 9


@pytest.mark.timeout(400)
def test_headless_rank_from_another_machine_joins_a_local_one(checkpoint_dir, tmp_path):
    cmd = [
        sys.executable,
        "-m",
        "batchgen.distributed.launch",
        "--data-parallel-size-local",
        "1",
        "--data-parallel-start-rank",
        "1",
    ]
    code, err, rcode, rout, got, want = _frontend_and_ranks(
        tmp_path, str(checkpoint_dir("qwen2_moe")), 1, cmd
    )
    assert code == 0, err
    assert rcode == 0, rout[-3000:]
    assert got == want and len(got) == 9


def test_external_ranks_need_the_shared_key(checkpoint_dir, monkeypatch):
    from batchgen import LLM

    monkeypatch.delenv("BATCHGEN_DP_AUTHKEY", raising=False)
    with pytest.raises(ValueError, match="BATCHGEN_DP_AUTHKEY"):
        LLM(str(checkpoint_dir("mixtral")), data_parallel_size=2, data_parallel_size_local=0)


def test_launch_without_key_fails_clearly():
    env = {k: v for k, v in os.environ.items() if k != "BATCHGEN_DP_AUTHKEY"}
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "batchgen.distributed.launch",
            "--data-parallel-address",
            "127.0.0.1",
            "--data-parallel-rpc-port",
            "1",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert r.returncode == 2 and "BATCHGEN_DP_AUTHKEY" in r.stderr


@pytest.mark.parametrize(
    "kwargs, world, ep",
    [
        (dict(data_parallel_size=4), 4, 1),
        (dict(data_parallel_size=4, enable_expert_parallel=True), 4, 4),  # vLLM's spelling
        (dict(data_parallel_size=4, expert_parallel_size=2), 4, 2),  # 2 replicas of EP 2
        (dict(data_parallel_size=2, decode_strategy="dp_attention_ep_moe"), 2, 2),
    ],
)
def test_layout_resolution(kwargs, world, ep):
    layout = resolve_layout(ParallelConfig(**kwargs))
    assert (layout.world_size, layout.expert_parallel_size) == (world, ep)
    assert layout.num_expert_replicas == world // ep


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(data_parallel_size=0), "data_parallel_size must be an integer >= 1"),
        (dict(data_parallel_size=3, expert_parallel_size=2), "must divide data_parallel_size=3"),
        (dict(prefill_strategy="pipelined"), "prefill_strategy must be one of"),
        (dict(decode_strategy="x"), "decode_strategy must be one of"),
        (
            dict(
                data_parallel_size=2, enable_expert_parallel=True, decode_strategy="data_parallel"
            ),
            "contradicts",
        ),
        (dict(prefill_strategy="data_parallel_offload"), "needs expert parallelism"),
        (
            dict(data_parallel_size=2, expert_parallel_size=1, enable_expert_parallel=True),
            "expert_parallel_size=1 replicates the experts, which contradicts",
        ),
        (dict(stream_buffer_layers=0), "stream_buffer_layers must be an integer >= 1"),
        (dict(distributed_timeout_s=0), "distributed_timeout_s must be a number > 0"),
        (dict(data_parallel_size=2, data_parallel_size_local=3), "data_parallel_size_local"),
        (dict(data_parallel_rpc_port=70000), "data_parallel_rpc_port must be in"),
    ],
)
def test_parallel_config_errors_name_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ParallelConfig(**kwargs)


def test_expert_placement_tables():
    p = ExpertPlacement(7, 2)
    assert p.experts_of(0) == [0, 1, 2, 3] and p.experts_of(1) == [4, 5, 6]
    assert p.owner.tolist() == [0, 0, 0, 0, 1, 1, 1]
    assert p.local_slot.tolist() == [0, 1, 2, 3, 0, 1, 2]
    assert [len(ExpertPlacement(10, 3).experts_of(r)) for r in range(3)] == [4, 3, 3]
    with pytest.raises(ValueError, match="every rank needs at least one expert"):
        ExpertPlacement(2, 3)
    assert ParallelLayout(6, 3).ep_group_ranks(4) == [3, 4, 5]
    assert ParallelLayout(6, 3).all_ep_groups() == [[0, 1, 2], [3, 4, 5]]


def test_cli_help_maps_vllm_flags():
    r = subprocess.run([str(BIN / "batchgen"), "run", "--help"], capture_output=True, text=True)
    assert "--data-parallel-size" in r.stdout and "--enable-expert-parallel" in r.stdout
    assert "one expert-parallel group of N ranks here too" in " ".join(r.stdout.split())


@pytest.mark.timeout(120)
def test_a_rank_with_another_key_is_told_which_variable_to_set(tmp_path):
    from multiprocessing.connection import Listener

    with Listener(("127.0.0.1", 0), authkey=b"the-frontends-key") as listener:
        port = listener.address[1]
        import threading

        def refuse():
            try:
                listener.accept()
            except Exception:
                pass

        threading.Thread(target=refuse, daemon=True).start()
        env = dict(os.environ, BATCHGEN_DP_AUTHKEY="another-key")
        r = subprocess.run(
            [
                sys.executable,
                "-m",
                "batchgen.distributed.launch",
                "--data-parallel-address",
                "127.0.0.1",
                "--data-parallel-rpc-port",
                str(port),
                "--rank",
                "0",
            ],
            capture_output=True,
            text=True,
            env=env,
            timeout=100,
        )
    assert r.returncode == 2
    assert "refused rank 0's key: set $BATCHGEN_DP_AUTHKEY" in r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.timeout(120)
def test_a_rank_whose_starter_died_stops_waiting(tmp_path):
    """A rank started by a frontend that exited before listening gives up at once instead of
    waiting CONNECT_TIMEOUT_S for it."""
    env = dict(os.environ, BATCHGEN_DP_AUTHKEY="k")
    t0 = time.monotonic()
    # Run the rank as a child of a shell that exits right away: its parent pid changes.
    script = (
        f"{sys.executable} -m batchgen.distributed.launch --data-parallel-address 127.0.0.1 "
        f"--data-parallel-rpc-port {free_port()} --rank 0 --parent-pid $$ "
        f"> /dev/null 2> {tmp_path / 'rank.err'} & sleep 2"
    )
    subprocess.run(["bash", "-c", script], env=env, timeout=60)
    deadline = time.monotonic() + 60
    err = tmp_path / "rank.err"
    while time.monotonic() < deadline and "exited before its frontend" not in err.read_text():
        time.sleep(0.5)
    text = err.read_text()
    assert "the process that started it" in text and "exited before its frontend" in text
    assert time.monotonic() - t0 < 60


def test_settings_without_effect_are_named():
    assert ParallelConfig(enable_expert_parallel=True).ineffective_settings() == [
        "enable_expert_parallel has no effect with one rank (data_parallel_size=1)"
    ]
    notes = ParallelConfig(
        data_parallel_size=2, enable_expert_parallel=True, stream_buffer_layers=3
    ).ineffective_settings()
    assert notes == [
        "stream_buffer_layers has no effect without prefill_strategy='data_parallel_offload'"
    ]
    assert "data_parallel_rpc_port has no effect with one rank (data_parallel_size=1)" in (
        ParallelConfig(data_parallel_rpc_port=1234).ineffective_settings()
    )
    assert ParallelConfig(data_parallel_size=2).ineffective_settings() == []


def test_vllm_short_flag_for_data_parallel_size():
    from batchgen.entrypoints.cli import build_parser, engine_kwargs

    args = build_parser().parse_args(["run", "-i", "x", "-o", "y", "-dp", "2"])
    assert engine_kwargs(args)["data_parallel_size"] == 2
