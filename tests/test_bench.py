"""`batchgen bench` end to end on a tiny checkpoint: the record's shape and its invariants."""

from __future__ import annotations

import dataclasses
import json

import pytest

from batchgen.bench.runner import format_table, run
from batchgen.bench.workloads import make_shared_docs, make_tree_search, make_workloads


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


def test_tree_search_children_extend_their_parents_prompt_and_output():
    tree = make_tree_search(512, quick=True)
    assert tree == make_tree_search(512, quick=True)  # deterministic
    assert [len(level) for level in tree.output_lens] == [2, 8, 32, 128]  # 2 trees, 4**d
    assert tree.num_requests == 170
    assert all(512 <= len(root) <= 1024 for root in tree.roots)
    assert all(16 <= n <= 32 for level in tree.output_lens for n in level)
    # A fake engine: node k's output is k's own tokens, so a wrong parent shows in the prompt.
    calls = []

    def generate(requests):
        calls.append(requests)
        start = sum(len(c) for c in calls[:-1])
        return [[(start + k) % 500 + 5] * r.output_len for k, r in enumerate(requests)]

    nodes = tree.run(generate)
    assert [len(c) for c in calls] == [2, 8, 32, 128]  # one generate per level
    assert len(nodes) == 170 and sum(len(out) for _, out in nodes) == tree.useful_tokens
    assert [r.prompt_token_ids for r, _ in nodes[:2]] == tree.roots
    assert [len(r.prompt_token_ids) for r, _ in nodes] == [
        n for level in tree.prompt_lens() for n in level
    ]
    assert sum(len(r.prompt_token_ids) for r, _ in nodes) == tree.prompt_tokens
    offset = [0, 2, 10, 42]  # first node of each level in ``nodes``
    for d in range(1, 4):
        for i in range(len(calls[d])):
            parent, parent_out = nodes[offset[d - 1] + i // 4]
            prompt = nodes[offset[d] + i][0].prompt_token_ids
            head = parent.prompt_token_ids + parent_out
            assert prompt[: len(head)] == head
            assert 4 <= len(prompt) - len(head) <= 16  # the branch's suffix
        # Siblings differ right after the shared head.
        for p in range(len(calls[d - 1])):
            kids = [
                tuple(r.prompt_token_ids)
                for r, _ in nodes[offset[d] + 4 * p : offset[d] + 4 * p + 4]
            ]
            assert len(set(kids)) == 4
    with pytest.raises(RuntimeError, match="tree-search level 0: generate returned"):
        tree.run(lambda requests: [[5] for _ in requests])


def _one_small_tree():
    """The quick workload's first tree with its root cut to 64 tokens and its outputs to 8
    (a fast engine run)."""
    tree = make_tree_search(512, quick=True)
    return dataclasses.replace(
        tree,
        roots=[tree.roots[0][:64]],
        suffixes=[level[: 4**d] for d, level in enumerate(tree.suffixes)],
        output_lens=[
            [min(n, 8) for n in level[: 4**d]] for d, level in enumerate(tree.output_lens)
        ],
    )


def test_tree_search_runs_with_the_prefix_cache_on_and_off(checkpoint_dir, monkeypatch):
    import batchgen.bench.runner as runner

    tree = _one_small_tree()
    assert tree.num_requests == 85
    monkeypatch.setattr(runner, "make_tree_search", lambda vocab_size, quick: tree)
    record = run(
        quick=True,
        device="cpu",
        modes=("hf_generate", "coalesce"),
        workloads=("tree-search",),
        model=str(checkpoint_dir("mixtral")),
    )
    w = record["workloads"]["tree-search"]
    assert "hf_generate" not in w  # its prompts come from the engine: BatchGen modes only
    assert w["requests"] == 85 and w["prompt_tokens"] == tree.prompt_tokens
    r = w["coalesce"]
    assert r["useful_tokens"] == tree.useful_tokens
    off = r["extra"]["without_prefix_caching"]
    assert off["same_greedy_tokens"]
    assert off["prefill_tokens"] == tree.prompt_tokens  # every prompt prefilled whole
    # With the cache a child finds every full block of its parent's prompt and output (the
    # parent computed all but its last output token), so it computes at most its suffix and
    # one block (16 positions) more; the root is computed whole.
    bound = len(tree.roots[0]) + sum(
        len(suffix) + 16 for level in tree.suffixes[1:] for suffix in level
    )
    assert r["extra"]["prefill_tokens"] <= bound < tree.prompt_tokens / 2
    assert r["extra"]["prefix_cache_hit_rate"] > 0.5
    assert "prefix caching tree-search/coalesce" in format_table(record)


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
    # The decode roofline of each BatchGen mode, from the bandwidth measured twice.
    assert record["read_gbps"] == max(record["read_gbps_measurements"]) > 0
    for mode in ("lockstep", "coalesce"):
        extra = w[mode]["extra"]
        roof = extra["decode_roofline"]
        assert roof["steps"] == extra["decode_only_steps"] > 0
        assert roof["decode_roofline_fraction"] == pytest.approx(
            roof["roofline_s"] / extra["decode_only_seconds"]
        )
        assert 0 < roof["decode_mfu_ceiling"] <= 1
        assert "weight_itemsize" not in extra and "kv_itemsize" not in extra
    table = format_table(record)
    assert f"memory read {record['read_gbps']:.1f} GB/s" in table
    assert "  roofline " in table and "decode MFU ceiling" in table
    assert "extraction" in table and "coalesce" in table
    # Both BatchGen modes ran LLM()'s defaults of their policy, and the table names them.
    from batchgen.config import EngineConfig

    for mode, seqs in (("lockstep", 256), ("coalesce", 1024)):
        c = EngineConfig(scheduler_policy=mode)
        assert c.max_running_seqs == seqs
        assert w[mode]["extra"]["engine_settings"] == {
            "scheduler_policy": mode,
            "max_num_batched_tokens": c.max_num_batched_tokens,
            "max_num_seqs": seqs,
            "max_step_tokens": c.step_token_budget,
            "expert_coalesce_threshold": c.expert_coalesce_threshold,
            "block_size": c.block_size,
            "kv_cache_dtype": "auto",
            "kv_cache_memory_gb": record["kv_cache_memory_gb"],
            "max_model_len": 4096,
        }
        assert (
            f"  {mode}: max_num_batched_tokens {c.max_num_batched_tokens}, max_num_seqs {seqs}, "
            f"{c.step_token_budget} tokens per step" in table
        )
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
    # The profiled steps that were decode-only, apart: no prompt's attention among them.
    extra = record["workloads"]["extraction"]["coalesce"]["extra"]
    decode = extra["profile_top_ops_decode_only"]
    assert decode and all("prefill" not in op["name"] for op in decode)
    every = {op["name"]: op for op in top}
    for op in decode:  # a subset of the profiled steps
        if op["name"] in every:
            assert op["calls"] <= every[op["name"]]["calls"], op["name"]
            assert op["self_s"] <= every[op["name"]]["self_s"] + 1e-9, op["name"]
    assert "profile of the decode-only steps, extraction/coalesce" in format_table(record)
    counts = extra["profiled_step_counts"]
    assert 1 <= counts["decode_only"] <= counts["all"]
    assert f"profile extraction/coalesce ({counts['all']} steps traced; " in format_table(record)


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


def test_distributed_bench_mode_records_its_engine_settings(checkpoint_dir):
    """`batchgen bench --data-parallel-size N` runs the engine's defaults too; each of its modes
    names them in the record, with --expert-coalesce-threshold in place of the default."""
    from transformers import AutoConfig

    from batchgen.bench.distributed import _run_mode
    from batchgen.config import EngineConfig

    path = str(checkpoint_dir("mixtral"))
    vocab = AutoConfig.from_pretrained(path).vocab_size
    workload = next(w for w in make_workloads(vocab, quick=True) if w.name == "extraction")
    default = EngineConfig(scheduler_policy="coalesce")
    for threshold, expected in ((3, 3), (None, default.expert_coalesce_threshold)):
        r = _run_mode(
            path, workload, "float32", {"expert_coalesce_threshold": threshold}, 0.25, {}
        )
        assert r["useful_tokens"] == workload.useful_tokens
        assert r["engine_settings"] == {
            "scheduler_policy": "coalesce",
            "max_num_batched_tokens": default.max_num_batched_tokens,
            "max_num_seqs": default.max_running_seqs,
            "max_step_tokens": default.step_token_budget,
            "expert_coalesce_threshold": expected,
            "block_size": default.block_size,
            "kv_cache_dtype": "auto",
            "kv_cache_memory_gb": 0.25,
            "max_model_len": 4096,
        }
