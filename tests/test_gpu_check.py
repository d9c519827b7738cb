"""`benchmarks/gpu_check.sh --dry-run`: every stage of the prepared device run, on CPU with tiny
sizes (about a minute on 2 idle cores), leaves a summary naming each stage with its status, and
the stages pass here; and the oracle tests' device/dtype switch reads its variables strictly."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import OracleTarget, read_oracle_target

ROOT = Path(__file__).resolve().parents[1]
STAGES = ("env", "install", "oracle_fp32", "oracle_bf16", "bench", "graphs", "kernels", "triton")


def test_dry_run_summary_lists_every_stage_ok(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path), PYTHON=sys.executable)
    env.pop("BATCHGEN_TEST_DEVICE", None)
    env.pop("BATCHGEN_TEST_DTYPE", None)
    proc = subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), "--dry-run"],
        env=env, capture_output=True, text=True, timeout=400,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = (tmp_path / "summary.md").read_text()
    assert "DRY RUN" in summary
    for stage in STAGES:
        row = re.search(rf"^\| {stage} \| ([^|]+) \|", summary, re.M)
        assert row, f"stage {stage} missing from summary.md"
        assert row.group(1).strip() == "ok", (stage, (tmp_path / "log.txt").read_text()[-3000:])
    # The files the `run` tool brings back (at most 8), with real content.
    names = {p.name for p in tmp_path.iterdir()}
    assert names <= {"summary.md", "log.txt", "stages.tsv", "junit-fp32.xml", "junit-bf16.xml",
                     "bench.json", "bench.txt", "kernels.json"}, names
    assert "3 tests, 0 failures, 0 errors" in summary  # fp32 and bf16 oracle subsets
    bench = json.loads((tmp_path / "bench.json").read_text())
    rollouts = bench["workloads"]["rollouts"]
    assert rollouts["lockstep"]["tokens_per_s"] > 0 and rollouts["coalesce"]["tokens_per_s"] > 0
    assert "coalesce / lockstep: rollouts" in summary
    # The graphs stage ran the CPU stand-in backend end to end: same tokens, steps replayed.
    assert re.search(r"steps replayed [1-9]\d*%; tokens equal: True; runner built: True", summary)
    kernels = json.loads((tmp_path / "kernels.json").read_text())
    assert [r["rows_per_expert"] for r in kernels["moe"]["rows"]] == [1, 4, 16]
    assert all(r["tflops"] > 0 for r in kernels["matmul"] + kernels["moe"]["rows"])
    assert kernels["attention"]["rows"][0]["gbs"] > 0
    # The forced alternatives (on CUDA: grouped_mm / triton, torch / triton) are timed too.
    assert [r["rows_per_expert"] for r in kernels["moe"]["forced"]["reference"]["rows"]] == [
        1, 4, 16
    ]
    assert kernels["attention"]["forced"]["torch"]["rows"][0]["gbs"] > 0
    assert re.search(r"^    \d+ passed", summary, re.M), summary  # the Triton tests' count


def test_balanced_routing_gives_every_expert_the_same_rows():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import torch
    from gpu_kernels import balanced_routing

    for rows, experts, top_k in [(1, 8, 2), (3, 128, 8), (512, 128, 8), (5, 6, 6)]:
        num_tokens, weights, ids = balanced_routing(rows, experts, top_k, "cpu")
        counts = torch.bincount(ids.reshape(-1), minlength=experts)
        assert counts.min() >= rows and counts.max() <= rows + top_k
        if (rows * experts) % top_k == 0:
            assert (counts == rows).all()
        assert all(len(set(r)) == top_k for r in ids.tolist())  # distinct experts per token
        assert torch.allclose(weights.sum(-1), torch.ones(num_tokens))


def test_oracle_target_reads_its_variables():
    assert read_oracle_target({}) == OracleTarget("cpu", None)
    t = read_oracle_target({"BATCHGEN_TEST_DEVICE": "cuda", "BATCHGEN_TEST_DTYPE": "bfloat16"})
    assert t.llm_kwargs("float32") == {"device": "cuda", "dtype": "bfloat16"} and t.bf16
    assert OracleTarget().llm_kwargs() == {"device": "cpu"}
    with pytest.raises(ValueError, match="BATCHGEN_TEST_DEVICE"):
        read_oracle_target({"BATCHGEN_TEST_DEVICE": "gpu"})
    with pytest.raises(ValueError, match="BATCHGEN_TEST_DTYPE"):
        read_oracle_target({"BATCHGEN_TEST_DTYPE": "fp16"})
