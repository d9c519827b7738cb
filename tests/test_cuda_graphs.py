"""CUDA graphs for decode-only steps (`batchgen.engine.cuda_graphs`), proven on CPU as far as a
CPU can: the padding is harmless bit for bit, the runner's plumbing (static buffers, padding,
slicing) is token-identical to the eager engine through `RecordingGraphBackend` (which re-runs
the captured callable at every replay), the decode forward on the CUDA-path kernels (Triton
under ``TRITON_INTERPRET=1``) makes no host synchronisation from BatchGen code, and CPU or
``enforce_eager`` never build a runner. Nothing here captures a real CUDA graph: that needs a
GPU (docs/gpu.md)."""

from __future__ import annotations

import pytest
import torch

from batchgen import LLM, SamplingParams
from batchgen.config import EngineConfig, default_capture_sizes
from batchgen.engine import cuda_graphs
from batchgen.engine.cuda_graphs import RecordingGraphBackend
from batchgen.engine.llm_engine import LLMEngine
from batchgen.engine.prompt_logprobs import prompt_logit_positions
from batchgen.models.layers.attention_backend import decode_attention_backend, mla_decode_backend
from batchgen.models.layers.expert_path import expert_path
from batchgen.models.layers.moe import SparseMoeBlock
from batchgen.models.layers.moe_sort import sort_by_expert
from gemm_probe import REASON, fp32_gemm_bits_vary
from sync_guard import HostSync, no_host_sync_from_batchgen

pytestmark = pytest.mark.timeout(300)


def _needs_triton() -> None:
    pytest.importorskip("triton")
    import os

    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("neither CUDA nor TRITON_INTERPRET=1")


def _recording(monkeypatch) -> list[RecordingGraphBackend]:
    """Make every engine built afterwards capture with a `RecordingGraphBackend` (unless
    ``enforce_eager``), as a CUDA engine would with `CUDAGraphBackend`; returns the backends."""
    made: list[RecordingGraphBackend] = []

    def backend_for(device, enforce_eager):
        if enforce_eager:
            return None
        made.append(RecordingGraphBackend())
        return made[-1]

    monkeypatch.setattr(cuda_graphs, "graph_backend_for", backend_for)
    return made


def _engine(path, **kwargs) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(path), device="cpu", dtype="float32", **kwargs))


def _run(engine: LLMEngine, waves: list[list[tuple[list[int], int]]]) -> dict[str, list[int]]:
    """Add each wave of ``(prompt ids, max_tokens)`` requests after the previous wave's first
    two steps (sequences join while others decode, and finish at different steps); returns
    the greedy tokens per request."""
    out: dict[str, list[int]] = {}
    pending = list(waves)
    step = 0
    while pending or engine.has_unfinished_requests():
        if pending and step % 3 == 0:
            for i, (prompt, max_tokens) in enumerate(pending.pop(0)):
                params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
                engine.add_request(f"w{step}-{i}", prompt, params)
        for o in engine.step():
            if o.finished:
                out[o.request_id] = list(o.outputs[0].token_ids)
        step += 1
    return out


WAVES = [
    [([5, 6, 7, 8, 9], 9), ([11, 12], 4), ([40] * 19, 12)],  # 19 tokens: past one 16-block
    [([3, 1, 4, 1, 5, 9, 2, 6], 7), ([100, 200], 11)],
    [([7], 6), ([8, 8, 8], 5), ([9, 10, 11, 12, 13, 14], 8), ([1, 2, 3], 3), ([50, 51], 10)],
]


def test_default_capture_sizes_are_vllms_and_validated():
    assert default_capture_sizes(20) == [1, 2, 4, 8, 16]
    assert default_capture_sizes(1024) == [1, 2, 4, *range(8, 513, 8)]
    assert default_capture_sizes(3) == [1, 2]
    assert EngineConfig(max_num_seqs=10).resolved_capture_sizes == [1, 2, 4, 8]
    assert EngineConfig(cudagraph_capture_sizes=[8, 2, 2]).resolved_capture_sizes == [2, 8]
    assert EngineConfig().enforce_eager is False
    for bad in ([], [0], [1.5], "1,2"):
        with pytest.raises(ValueError, match="cudagraph_capture_sizes"):
            EngineConfig(cudagraph_capture_sizes=bad)
    with pytest.raises(ValueError, match="enforce_eager"):
        EngineConfig(enforce_eager="yes")


def test_cli_flags_and_cluster_yaml_carry_both_settings(tmp_path, checkpoint_dir):
    import argparse

    from batchgen.cluster_config import load_cluster_config
    from batchgen.entrypoints.cli_flags import add_engine_arguments

    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    args = parser.parse_args(["--enforce-eager", "--cudagraph-capture-sizes", "1", "2", "8"])
    assert (args.enforce_eager, args.cudagraph_capture_sizes) == (True, [1, 2, 8])
    yaml = tmp_path / "c.yaml"
    yaml.write_text(
        f"batchgen_cluster:\n  model: '{checkpoint_dir('mixtral')}'\n  engine:\n"
        "    enforce_eager: true\n    cudagraph_capture_sizes: [1, 4]\n"
    )
    engine = load_cluster_config(yaml).engine
    assert (engine.enforce_eager, engine.cudagraph_capture_sizes) == (True, [1, 4])


def test_cpu_and_enforce_eager_never_build_a_runner(checkpoint_dir, monkeypatch):
    assert cuda_graphs.graph_backend_for(torch.device("cpu"), False) is None
    assert cuda_graphs.graph_backend_for(torch.device("cuda"), True) is None
    path = checkpoint_dir("mixtral")
    engine = _engine(path)  # CPU, the real `graph_backend_for`
    assert engine.executor.graph_runner is None and engine.runner.dummy_block is None
    made = _recording(monkeypatch)
    engine = _engine(path, enforce_eager=True)
    assert engine.executor.graph_runner is None and engine.runner.dummy_block is None
    llm = LLM(model=str(path), device="cpu", dtype="float32", enforce_eager=True)
    assert llm.llm_engine.executor.graph_runner is None
    assert made == []


@pytest.mark.parametrize(
    "name, policy",
    [
        ("mixtral", "coalesce"),
        ("mixtral", "lockstep"),
        ("qwen2_moe", "coalesce"),  # shared experts behind a gate
        ("mistral_sliding", "coalesce"),  # dense (no MoE layer), a sliding window of 8
    ],
)
def test_graph_replay_is_token_identical_to_eager(checkpoint_dir, monkeypatch, name, policy):
    path = checkpoint_dir(name)
    eager = _run(_engine(path, scheduler_policy=policy), WAVES)
    made = _recording(monkeypatch)
    # Sizes 1, 2, 4: a 3-row step pads to 4, a 5-row step runs eager (above the largest).
    engine = _engine(path, scheduler_policy=policy, cudagraph_capture_sizes=[1, 2, 4])
    graphs = engine.executor.graph_runner
    assert graphs is not None and graphs.sizes == [1, 2, 4]
    assert len(made[0].captured) == 3
    got = _run(engine, WAVES)
    assert got == eager
    assert graphs.num_graph_steps >= 5 and graphs.num_eager_steps >= 3  # both kinds ran
    assert made[0].num_replays == graphs.num_graph_steps
    m = engine.get_metrics()
    assert m["cuda_graph_step_share"] == pytest.approx(graphs.num_graph_steps / m["num_steps"])
    # Expert rows of replayed steps are recorded without the padding: the same totals as eager.
    eager_engine = _engine(path, scheduler_policy=policy)
    _run(eager_engine, WAVES)
    assert engine.metrics.expert.rows == eager_engine.metrics.expert.rows


def _decode_step(engine: LLMEngine, prompts: list[list[int]]):
    """Prefill ``prompts`` (one step), then schedule the next step (decode-only)."""
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=8))
    engine.step()
    sched = engine.schedule()
    assert all(e.num_new_tokens == 1 for e in sched.scheduled)
    for e in sched.scheduled:
        e.prompt_logits = prompt_logit_positions(e.seq, e.num_new_tokens)
    return sched


@pytest.mark.parametrize(
    "name",
    [
        # GQA's claim is bit for bit, which rests on the float32 GEMM's row-count invariance
        pytest.param(
            "mixtral", marks=pytest.mark.xfail(fp32_gemm_bits_vary(), reason=REASON, strict=False)
        ),
        "deepseek_v3",
    ],
)
def test_padded_step_is_bit_identical_and_the_dummy_block_absorbs_padding(
    checkpoint_dir, monkeypatch, name
):
    """Padding rows change no real row's logits or cache entry, and write their K/V (MLA: their
    latent and rope key) to the dummy block's first slot only. DeepSeek-V3 on the Triton MLA
    decode kernel (``TRITON_INTERPRET=1`` on CPU), the only MLA path that captures, equals the
    eager step to float32 rounding, not bit for bit: its absorbed einsums (``W_UK``, ``W_UV``)
    are batched GEMMs over the heads with the rows as M, and CPU ``bmm`` rounds M = 3 and M = 8
    differently (about 1e-6; a NaN read from the dummy block would still fail)."""
    if name.startswith("deepseek"):
        _needs_triton()
        monkeypatch.setenv("BATCHGEN_ATTENTION_BACKEND", "triton")
    _recording(monkeypatch)
    engine = _engine(checkpoint_dir(name), cudagraph_capture_sizes=[8])
    graphs = engine.executor.graph_runner
    sched = _decode_step(engine, [[5, 6, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15,
                                                16, 17], [42]])  # fmt: skip
    caches = engine.runner.kv_caches
    before = [tuple(c.clone() for c in layer) for layer in caches]
    engine.executor.graph_runner = None
    sampling_eager, logits_eager, _ = engine.executor.execute(sched.scheduled)  # 3 rows
    after_eager = [tuple(c.clone() for c in layer) for layer in caches]
    bs, dummy = engine.runner.block_size, engine.runner.dummy_block
    for layer, saved in zip(caches, before, strict=True):
        for c, s in zip(layer, saved, strict=True):
            c.copy_(s)
            c[dummy * bs :] = float("nan")  # a padding write lands here; a stray read would show
    sampling, logits, prompt_rows = graphs.execute(sched.scheduled)  # padded to 8
    assert [e.seq for e in sampling] == [e.seq for e in sampling_eager] and prompt_rows == []
    assert logits.shape == logits_eager.shape == (3, engine.model_config.vocab_size)
    mla = engine.model_config.mla is not None
    exact = dict(rtol=1e-5, atol=1e-5) if mla else dict(rtol=0, atol=0)  # docstring: MLA bmm
    torch.testing.assert_close(logits, logits_eager, **exact)  # GQA: bit for bit
    real = slice(0, dummy * bs)
    for layer, eager_layer in zip(caches, after_eager, strict=True):
        for c, e in zip(layer, eager_layer, strict=True):
            # the real sequences' caches as the eager step
            torch.testing.assert_close(c[real], e[real], **exact)
            assert not c[dummy * bs].isnan().any()  # the padding rows' K/V landed in slot 0
            assert c[dummy * bs + 1 :].isnan().all()  # and nowhere else


def test_steps_the_runner_declines_run_eager(checkpoint_dir, monkeypatch):
    _recording(monkeypatch)
    engine = _engine(checkpoint_dir("mixtral"), cudagraph_capture_sizes=[1, 2])
    graphs = engine.executor.graph_runner
    engine.add_request("a", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=4))
    sched = engine.schedule()  # a 3-token prefill
    assert not graphs.can_run(sched.scheduled)
    engine.execute(sched)
    assert graphs.num_eager_steps == 1 and graphs.num_graph_steps == 0
    engine.step()  # a one-row decode
    assert graphs.num_graph_steps == 1


@pytest.mark.parametrize(
    "name, moe_path, dtype",
    [
        ("mixtral", "triton", "float32"),
        ("mixtral", "grouped_mm", "bfloat16"),
        ("deepseek_v3", "triton", "float32"),  # MLA's Triton decode, sigmoid group routing
    ],
)
def test_decode_forward_on_the_cuda_kernels_never_syncs_with_the_host(
    checkpoint_dir, monkeypatch, name, moe_path, dtype
):
    """The captured region (embed .. logits) on the CUDA paths: Triton paged decode attention
    (GQA) or the Triton MLA decode kernel on the latent cache (DeepSeek-V3), and the Triton MoE
    or the grouped GEMMs (bf16; on CPU torch's ``_grouped_mm`` fallback copies ``offs`` to the
    host inside torch, which CUDA's CUTLASS kernel does not: only BatchGen's own calls are
    checked)."""
    _needs_triton()
    monkeypatch.setenv("BATCHGEN_MOE_PATH", moe_path)
    monkeypatch.setenv("BATCHGEN_ATTENTION_BACKEND", "triton")
    _recording(monkeypatch)
    path = checkpoint_dir(name)
    engine = LLMEngine(EngineConfig(model=str(path), device="cpu", dtype=dtype,
                                    cudagraph_capture_sizes=[4]))  # fmt: skip
    torch_dtype = getattr(torch, dtype)
    graphs = engine.executor.graph_runner
    assert engine.runner.decode_in_place and graphs is not None
    assert decode_attention_backend(torch.device("cpu"), torch_dtype) == "triton"
    if engine.model_config.mla is not None:
        assert mla_decode_backend(torch.device("cpu"), torch_dtype) == "triton"
    block = next(m.mlp for m in engine.runner.model.layers if isinstance(m.mlp, SparseMoeBlock))
    x = torch.zeros(2, block.w13_weight.shape[2], dtype=torch_dtype)
    assert expert_path(x.device, x.dtype, batch_invariant=False, cpu_kernel=block.uses_kernel(x),
                       hidden_size=x.shape[1], intermediate_size=block.w2_weight.shape[2],
                       num_experts=block.w13_weight.shape[0]) == moe_path  # fmt: skip
    sched = _decode_step(engine, [[5, 6, 7], [1, 2, 3, 4, 5], [42]])
    engine.executor.graph_runner = None
    _, logits_eager, _ = engine.executor.execute(sched.scheduled)
    # the replay re-writes the same K/V at the same slots: the eager step's cache is its input
    graphs.execute(sched.scheduled)  # fills the static buffers (its check syncs: outside)
    with monkeypatch.context() as patch:
        no_host_sync_from_batchgen(patch)
        graphs._replay[4]()  # the captured region: embed .. logits
    torch.testing.assert_close(graphs._logits[4][:3], logits_eager)  # same kernels, same rows
    # The guard does catch what the region must not do: rows per expert as a Python list
    # (`sort_by_expert`, the host paths'), and host arrays made tensors (`prepare` on CPU,
    # where it does not stage: `torch.from_numpy` of its numpy rows since the vectorised
    # `_DecodeRows`, `torch.tensor` before). The eager MoE statistics hook stays on the device now.
    assert block.stats is engine.metrics.expert
    with monkeypatch.context() as patch:
        no_host_sync_from_batchgen(patch)
        with pytest.raises(HostSync, match=r"torch\.(tensor|as_tensor|from_numpy)"):
            graphs.execute(sched.scheduled)
        with pytest.raises(HostSync, match="tolist"):
            sort_by_expert(torch.zeros(2, 2, dtype=torch.long), 4)
        block.experts(x, torch.ones(2, 2) / 2, torch.zeros(2, 2, dtype=torch.long))


def test_sizes_above_one_micro_batch_are_dropped_and_such_steps_run_eager(
    checkpoint_dir, monkeypatch
):
    _recording(monkeypatch)
    path = checkpoint_dir("mixtral")
    config = dict(max_num_batched_tokens=2, cudagraph_capture_sizes=[1, 2, 4])
    engine = _engine(path, **config)  # coalesce: a 3-row decode step is two micro-batches
    graphs = engine.executor.graph_runner
    assert graphs.sizes == [1, 2]
    waves = [[([5, 6], 6), ([7], 6), ([8, 9], 6)]]
    assert _run(engine, waves) == _run(_engine(path, max_num_batched_tokens=2), waves)
    assert graphs.num_eager_steps > 0


def test_no_runner_without_in_place_decode_or_with_a_failed_capture(
    checkpoint_dir, monkeypatch, caplog
):
    _recording(monkeypatch)
    path = checkpoint_dir("mixtral")
    monkeypatch.setenv("BATCHGEN_ATTENTION_BACKEND", "torch")
    with caplog.at_level("INFO", logger="batchgen.engine.cuda_graphs"):
        engine = _engine(path)
    assert engine.executor.graph_runner is None
    assert "CUDA graphs off: decode attention does not read the cache in place" in caplog.text
    with pytest.raises(ValueError, match="in place"):
        cuda_graphs.CUDAGraphRunner(engine.runner, [1], 16, 64, RecordingGraphBackend())
    monkeypatch.delenv("BATCHGEN_ATTENTION_BACKEND")
    eager = _engine(path, enforce_eager=True)
    with pytest.raises(ValueError, match="reserve_dummy_block"):
        cuda_graphs.CUDAGraphRunner(eager.runner, [1], 16, 64, RecordingGraphBackend())

    class Failing(RecordingGraphBackend):
        def capture(self, fn):
            raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(cuda_graphs, "graph_backend_for", lambda device, eager: Failing())
    with caplog.at_level("WARNING", logger="batchgen.engine.cuda_graphs"):
        engine = _engine(path)
    assert engine.executor.graph_runner is None and "CUDA graph capture failed" in caplog.text
    waves = [[([5, 6], 4)]]
    assert _run(engine, waves) == _run(eager, waves)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="captures real CUDA graphs: needs CUDA")
@pytest.mark.parametrize("name", ["mixtral", "deepseek_v3"])  # GQA; MLA on its Triton kernel
def test_cuda_graphs_on_cuda_are_token_identical_to_enforce_eager(checkpoint_dir, name):
    """The device run (`benchmarks/gpu_check.sh`, graphs stage): real `torch.cuda.graph`
    capture and replay in float32, against the same engine with ``enforce_eager``."""
    path = checkpoint_dir(name)
    kwargs = dict(
        model=str(path), device="cuda", dtype="float32", cudagraph_capture_sizes=[1, 2, 4]
    )
    graphs_engine = LLMEngine(EngineConfig(**kwargs))
    graphs = graphs_engine.executor.graph_runner
    assert graphs is not None and isinstance(graphs.backend, cuda_graphs.CUDAGraphBackend)
    eager = _run(LLMEngine(EngineConfig(enforce_eager=True, **kwargs)), WAVES)
    assert _run(graphs_engine, WAVES) == eager
    assert graphs.num_graph_steps >= 5


@pytest.mark.parametrize("name", ["deepseek_v3", "deepseek_v2"])
def test_mla_graph_replay_is_token_identical_to_eager(checkpoint_dir, monkeypatch, name):
    """MLA decode steps (DeepSeek-V2/V3) replay like GQA ones when the decode attention is the
    Triton MLA kernel reading the paged latent cache in place (``TRITON_INTERPRET=1`` on CPU):
    padding rows write their latents and rope keys to the dummy block, and the tokens equal
    the eager engine's over waves of varying batch sizes (1..5 rows, sizes 1, 2, 4 captured)."""
    _needs_triton()
    monkeypatch.setenv("BATCHGEN_ATTENTION_BACKEND", "triton")
    path = checkpoint_dir(name)
    eager = _run(_engine(path), WAVES)
    made = _recording(monkeypatch)
    engine = _engine(path, cudagraph_capture_sizes=[1, 2, 4])
    assert engine.runner.decode_in_place and engine.model_config.mla is not None
    graphs = engine.executor.graph_runner
    assert graphs is not None and graphs.sizes == [1, 2, 4]
    assert len(made[0].captured) == 3
    got = _run(engine, WAVES)
    assert got == eager
    assert graphs.num_graph_steps >= 5 and graphs.num_eager_steps >= 3
    assert made[0].num_replays == graphs.num_graph_steps
