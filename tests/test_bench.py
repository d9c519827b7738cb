"""`batchgen bench` end to end on a tiny checkpoint: the record's shape and its invariants."""

from __future__ import annotations

import json

import pytest

from batchgen.bench.runner import format_table, run
from batchgen.bench.workloads import make_shared_docs, make_workloads


def test_workloads_follow_their_definitions():
    full = {w.name: w for w in make_workloads(512, quick=False)}
    assert set(full) == {"rollouts", "extraction", "search"}
    assert len(full["rollouts"].requests) == 4096
    assert len(make_workloads(512, quick=False, rollouts_requests=7)[0].requests) == 7
    for r in full["rollouts"].requests:
        assert 32 <= len(r.prompt_token_ids) <= 1024 and 16 <= r.output_len <= 512
    for r in full["extraction"].requests:
        assert 512 <= len(r.prompt_token_ids) <= 2048 and 16 <= r.output_len <= 64
    for quick, prompts in ((True, 48), (False, 64)):
        search = {w.name: w for w in make_workloads(512, quick=quick)}["search"]
        assert len(search.requests) == prompts and all(r.n == 16 for r in search.requests)
        # More sequences than one attention micro-batch (512 tokens) can decode at once.
        assert prompts * 16 > 512
    assert (
        make_workloads(512, quick=True)[0].requests == make_workloads(512, quick=True)[0].requests
    )  # deterministic
    with pytest.raises(ValueError, match="rollouts_requests must be >= 1, got 0"):
        make_workloads(512, quick=True, rollouts_requests=0)


def test_shared_docs_workload_runs_with_the_prefix_cache_on_and_off(checkpoint_dir):
    docs = make_shared_docs(512, quick=True)
    assert len(docs.requests) == 2 * 16
    assert all(16 <= r.output_len <= 64 for r in docs.requests)
    first, same_doc, next_doc = (docs.requests[i].prompt_token_ids for i in (0, 15, 16))
    shared = next(i for i, (a, b) in enumerate(zip(first, same_doc)) if a != b)
    assert 1000 <= shared <= 2000  # a 1,000-2,000-token document, then the question
    assert next_doc[:shared] != first[:shared]
    assert make_shared_docs(512, quick=True) == docs  # deterministic
    record = run(
        quick=True,
        device="cpu",
        modes=("coalesce",),
        workloads=("shared-docs",),
        model=str(checkpoint_dir("mixtral")),
    )
    r = record["workloads"]["shared-docs"]["coalesce"]
    off = r["extra"]["without_prefix_caching"]
    assert off["same_greedy_tokens"]
    # Each document is prefilled once with the cache, 16 times without.
    assert r["extra"]["prefill_tokens"] < off["prefill_tokens"] / 4
    assert r["extra"]["prefix_cache_hit_rate"] > 0.8
    assert "prefix caching shared-docs/coalesce" in format_table(record)


def test_bench_record_on_a_tiny_model(checkpoint_dir, capsys):
    record = run(
        quick=True,
        device="cpu",
        modes=("hf_generate", "lockstep", "coalesce"),
        workloads=("extraction",),
        model=str(checkpoint_dir("mixtral")),
        progress=True,
    )
    # One tqdm bar per mode on stderr, over the workload's useful tokens, each completed.
    err = capsys.readouterr().err
    total = record["workloads"]["extraction"]["useful_tokens"]
    sample = record["workloads"]["extraction"]["hf_generate"]["useful_tokens"]
    for mode, tokens in (("hf_generate", sample), ("lockstep", total), ("coalesce", total)):
        assert f"extraction/{mode}: 100%" in err and f"{tokens}/{tokens}" in err, mode
    json.dumps(record)  # machine-readable
    assert record["peak_gflops"] > 0 and record["dtype"] == "float32"
    w = record["workloads"]["extraction"]
    for mode in ("hf_generate", "lockstep", "coalesce"):
        r = w[mode]
        assert r["useful_tokens"] == w["useful_tokens"]
        assert r["tokens_per_s"] > 0 and 0 < r["mfu"] < 1
    for mode in ("lockstep", "coalesce"):
        assert 0 < w[mode]["tile_density"] <= 1
    assert w["hf_generate"]["tile_density"] is None
    table = format_table(record)
    assert "extraction" in table and "coalesce" in table
    for term in ("x hf_gen   ", "tile dens  ", "rows/GEMM  ", "MFU        ", "dec MFU    "):
        assert f"\n{term}" in table, term
    # The quick extraction workload (8 requests) fits hf_generate's sample whole: no mark.
    w = record["workloads"]["extraction"]
    assert w["hf_generate"]["extra"]["sampled_requests"] == w["requests"] == 8
    rows = {line.split()[1] for line in table.splitlines() if line.startswith("extraction")}
    assert rows == {"hf_generate", "lockstep", "coalesce"} and "\n*" not in table
    # A row that ran on part of its workload is marked, and the legend says on how much.
    w["requests"] = 40
    table = format_table(record)
    rows = {line.split()[1] for line in table.splitlines() if line.startswith("extraction")}
    assert rows == {"hf_generate*", "lockstep", "coalesce"}
    assert "sample's rate: extraction/hf_generate 8 of 40 requests" in table


def test_bench_profile_names_the_top_operators(checkpoint_dir):
    record = run(
        quick=True,
        device="cpu",
        modes=("coalesce",),
        workloads=("extraction",),
        model=str(checkpoint_dir("mixtral")),
        profile=True,
    )
    top = record["workloads"]["extraction"]["coalesce"]["extra"]["profile_top_ops"]
    assert 1 <= len(top) <= 12
    assert all(op["self_s"] > 0 and 0 < op["share"] <= 1 and op["calls"] >= 1 for op in top)
    assert sum(op["share"] for op in top) <= 1.0 + 1e-9
    assert [op["self_s"] for op in top] == sorted((op["self_s"] for op in top), reverse=True)
    assert any(op["name"] == "aten::mm" for op in top)  # the expert and projection GEMMs
    assert "profile extraction/coalesce" in format_table(record)


def test_sequence_flops_counts_a_shared_prompt_once(checkpoint_dir):
    from transformers import AutoConfig

    from batchgen.bench.flops import active_params_per_token, attention_flops, sequence_flops
    from batchgen.models.model_config import ModelConfig

    cfg = ModelConfig.from_hf(AutoConfig.from_pretrained(checkpoint_dir("mixtral")))
    per_token = 2 * active_params_per_token(cfg)

    def token(pos: int) -> int:  # the token at `pos` attends pos + 1 positions
        return per_token + attention_flops(cfg, pos + 1)

    prompt, out = 37, 11
    assert sequence_flops(cfg, prompt, out) == sum(token(i) for i in range(prompt + out))
    assert sequence_flops(cfg, prompt, out, n=4) == sum(token(i) for i in range(prompt)) + 4 * sum(
        token(i) for i in range(prompt, prompt + out)
    )


def test_bench_runs_the_deepseek_v3_family(tmp_path):
    from batchgen.models.make_model import make_model

    # `make-model --arch deepseek_v3` (MLA, grouped sigmoid routing, a dense first layer).
    path = make_model("deepseek_v3", tmp_path / "ds3", seed=0)
    record = run(
        quick=True,
        device="cpu",
        modes=("hf_generate", "hf_generate_batch", "coalesce"),
        workloads=("extraction",),
        model=str(path),
    )
    w = record["workloads"]["extraction"]
    # transformers' generate_batch fails on the MLA cache (5.x) without raising: the bench
    # must report the failure, not a rate for tokens that were never generated.
    batch = w["hf_generate_batch"]
    if "error" in batch:
        assert "generate_batch" in batch["error"] and batch["tokens_per_s"] is None
        assert "failed: " in format_table(record)
    else:
        assert 0 < batch["mfu"] < 1
    assert w["coalesce"]["useful_tokens"] == w["useful_tokens"]
    assert 0 < w["coalesce"]["mfu"] < 1 and 0 < w["coalesce"]["tile_density"] <= 1
    assert len(record["peak_gflops_measurements"]) == 2
    assert record["peak_gflops"] == max(record["peak_gflops_measurements"])


def test_bench_model_arch_is_checked():
    import pytest

    from batchgen.bench.runner import BENCH_MODELS, bench_model_path

    assert set(BENCH_MODELS) == {"mixtral", "deepseek_v3"}
    with pytest.raises(ValueError, match="deepseek_v3"):
        bench_model_path("gpt2")


def test_psutil_is_installed_with_batchgen():
    """transformers logs errors on import without psutil; it comes with BatchGen."""
    import importlib.metadata

    requires = importlib.metadata.requires("batchgen")
    assert any(r.replace(" ", "").startswith("psutil>=") for r in requires), requires
    import psutil

    assert psutil.cpu_count() >= 1


def test_extraction_json_compares_constrained_with_unconstrained(checkpoint_dir):
    from batchgen.bench.runner import format_table
    from batchgen.bench.structured import SCHEMAS, make_extraction_json, run_extraction_json

    requests = make_extraction_json(512, quick=True)
    assert len(requests) == 16 and {id(s) for _, s in requests} == {id(s) for s in SCHEMAS}
    assert all(5 <= len(s["properties"]) <= 10 for s in SCHEMAS)
    entry = run_extraction_json(
        str(checkpoint_dir("mixtral")),
        True,
        "coalesce",
        dict(device="cpu", kv_cache_memory_gb=0.1, max_model_len=1024),
        512,
    )
    assert entry["requests"] == 16 and entry["stop_share"] >= 0.5  # greedy digits may run on
    assert entry["valid_share_of_stopped"] == 1.0
    c, u = entry["constrained"], entry["unconstrained"]
    assert c["stage_time_share"]["grammar_mask"] > 0 == u["stage_time_share"]["grammar_mask"]
    assert entry["ratio"] == pytest.approx(u["seconds"] / c["seconds"])
    record = {
        "peak_gflops": 1.0,
        "dtype": "float32",
        "device": "cpu",
        "torch_threads": 2,
        "max_num_batched_tokens": 512,
        "expert_coalesce_threshold": 1,
        "workloads": {},
        "structured": {"extraction-json": entry},
    }
    table = format_table(record)
    assert "extraction-json (16 requests, coalesce" in table and "grammar_mask" in table
