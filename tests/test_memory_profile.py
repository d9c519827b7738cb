"""The profiling step that sizes the KV cache on a GPU (batchgen/engine/memory_profile.py), on
CPU: the dummy step really runs through the model (every token of one step's budget, and a
decode step's logits), and the budget arithmetic is vLLM's, with the device's counters faked
(`FakeMemory`). The CUDA counters themselves (`DeviceMemory`) run only on a GPU."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig

from batchgen.config import EngineConfig
from batchgen.engine import kv_sizing, memory_profile
from batchgen.engine.memory_profile import (
    SAMPLER_COPIES,
    dummy_prompt_lengths,
    profile_step_peak_bytes,
    profiled_kv_budget_bytes,
)
from batchgen.models.loader import load_model
from batchgen.models.model_config import ModelConfig

GiB = 1 << 30


class FakeMemory:
    """Counters of a pretend device: ``allocated`` before the step, ``peak`` after it."""

    def __init__(self, allocated: int, peak: int, free: int, total: int) -> None:
        self._allocated, self._peak, self._free_total = allocated, peak, (free, total)
        self.resets = 0

    def reset_peak(self) -> None:
        self.resets += 1

    def allocated(self) -> int:
        return self._allocated

    def peak(self) -> int:
        return self._peak

    def free_total(self) -> tuple[int, int]:
        return self._free_total


@pytest.fixture(scope="module")
def mixtral(checkpoint_dir):
    path = checkpoint_dir("mixtral")
    cfg = ModelConfig.from_hf(AutoConfig.from_pretrained(path))
    return load_model(path, cfg, torch.device("cpu"), torch.float32, None), cfg


def test_dummy_prompts_fill_one_step_in_chunks_within_the_model_positions(mixtral):
    _, cfg = mixtral
    c = EngineConfig(max_num_batched_tokens=64, max_num_seqs=100)
    assert c.step_token_budget == 512  # coalesce: 8 micro-batches
    assert dummy_prompt_lengths(c, cfg) == [64] * 8
    c = EngineConfig(max_num_batched_tokens=64, max_num_seqs=100, max_step_tokens=150)
    assert dummy_prompt_lengths(c, cfg) == [64, 64, 22]
    c = EngineConfig(max_num_batched_tokens=64, max_num_seqs=2)
    assert dummy_prompt_lengths(c, cfg) == [64, 64]  # at most max_num_seqs prompts
    c = EngineConfig(max_num_batched_tokens=64, max_num_seqs=100, max_model_len=40)
    assert dummy_prompt_lengths(c, cfg) == [40] * 12 + [32]  # 512 tokens, none past 40
    c = EngineConfig(max_num_batched_tokens=64, scheduler_policy="lockstep")
    assert dummy_prompt_lengths(c, cfg) == [64]


def test_the_profiling_step_runs_every_token_and_the_decode_logits(mixtral, monkeypatch):
    model, cfg = mixtral
    c = EngineConfig(max_num_batched_tokens=64, max_num_seqs=24, max_step_tokens=150)
    embedded, logits_rows = [], []
    embed, compute_logits = model.embed, model.compute_logits

    def spy_embed(ids):
        embedded.append(ids.shape[0])
        return embed(ids)

    def spy_logits(h):
        logits_rows.append(h.shape[0])
        out = compute_logits(h)
        assert torch.isfinite(out).all()
        return out

    monkeypatch.setattr(model, "embed", spy_embed)
    monkeypatch.setattr(model, "compute_logits", spy_logits)
    memory = FakeMemory(allocated=5 * GiB, peak=7 * GiB, free=0, total=0)
    peak = profile_step_peak_bytes(model, c, cfg, torch.device("cpu"), torch.float32, memory)
    assert peak == 2 * GiB and memory.resets == 1
    assert sum(embedded) == 150  # the whole step: 64 + 64 + 22 tokens
    assert logits_rows == [3, 24]  # the step's samples (one per prompt), then max_num_seqs


def test_the_profiling_step_runs_the_engines_kv_cache_dtype(mixtral, monkeypatch):
    """Under kv_cache_dtype the engine's attention quantises K/V on the write and reads a
    narrower cache (other temporaries, and on CUDA the torch decode path instead of Triton's):
    the profiling step and the CUDA graph estimate build their runner with the engine's
    cache dtype, so the peak they measure is the engine's."""
    from batchgen.engine import model_runner

    model, cfg = mixtral
    dtypes = []
    init = model_runner.ModelRunner.__init__

    def spy(self, *args, **kwargs):
        init(self, *args, **kwargs)
        dtypes.append(self.kv_caches[0][0].dtype)

    monkeypatch.setattr(model_runner.ModelRunner, "__init__", spy)
    memory = FakeMemory(allocated=5 * GiB, peak=7 * GiB, free=0, total=0)
    for kv, want in (("fp8", torch.float8_e4m3fn), ("bfloat16", torch.bfloat16)):
        c = EngineConfig(max_num_batched_tokens=64, max_num_seqs=4, kv_cache_dtype=kv)
        profile_step_peak_bytes(model, c, cfg, torch.device("cpu"), torch.float32, memory)
        assert dtypes.pop() == want


def test_budget_is_vllms_formula(mixtral):
    model, cfg = mixtral
    c = EngineConfig(max_num_batched_tokens=64, max_num_seqs=24, gpu_memory_utilization=0.9)
    memory = FakeMemory(allocated=10 * GiB, peak=13 * GiB, free=60 * GiB, total=80 * GiB)
    budget = profiled_kv_budget_bytes(
        model, c, cfg, torch.device("cpu"), torch.float32, memory=memory
    )
    sampler = SAMPLER_COPIES * 24 * cfg.vocab_size * 4
    # 0.9 x 80 GiB, less the 20 GiB in use, less the step's 3 GiB peak, less the sampler's.
    assert budget == int(80 * GiB * 0.9) - 20 * GiB - 3 * GiB - sampler


def test_num_kv_blocks_on_cuda_takes_the_profiled_budget(mixtral, monkeypatch):
    model, cfg = mixtral
    c = EngineConfig(block_size=16)
    calls = []

    def fake_budget(m, config, model_cfg, device, dtype):
        calls.append(m)
        return 100 * 16 * kv_sizing.kv_cache_bytes_per_token(cfg, dtype) + 5

    monkeypatch.setattr(memory_profile, "profiled_kv_budget_bytes", fake_budget)
    cuda = torch.device("cuda")
    assert kv_sizing.num_kv_blocks(c, cfg, torch.float32, cuda, model) == 100
    assert calls == [model]
    # A budget with no room: the error names the knobs.
    monkeypatch.setattr(memory_profile, "profiled_kv_budget_bytes", lambda *a: -GiB)
    with pytest.raises(ValueError, match="gpu_memory_utilization.*max_num_batched_tokens"):
        kv_sizing.num_kv_blocks(c, cfg, torch.float32, cuda, model)
    # On CPU nothing is profiled: the CPU default budget.
    monkeypatch.setattr(memory_profile, "profiled_kv_budget_bytes", None)
    blocks = kv_sizing.num_kv_blocks(c, cfg, torch.float32, torch.device("cpu"), model)
    per_block = 16 * kv_sizing.kv_cache_bytes_per_token(cfg, torch.float32)
    assert blocks == int(kv_sizing.DEFAULT_CPU_KV_CACHE_GB * GiB // per_block)


class GraphMemory(FakeMemory):
    """A pretend device whose free memory drops by the next of ``costs`` at each capture
    (`CostlyBackend`), and comes back when the estimate's graphs are gone."""

    def __init__(self, free: int, total: int, costs: list[int]) -> None:
        super().__init__(allocated=0, peak=0, free=free, total=total)
        self.free0, self.costs, self.held = free, list(costs), 0

    def free_total(self) -> tuple[int, int]:
        return self.free0 - self.held, self._free_total[1]


def _costly_backend(memory: GraphMemory):
    from batchgen.engine.cuda_graphs import RecordingGraphBackend

    class CostlyBackend(RecordingGraphBackend):
        def capture(self, fn):
            memory.held += memory.costs.pop(0)
            return super().capture(fn)

    return CostlyBackend()


def test_cuda_graph_memory_is_vllms_two_graph_estimate_and_leaves_the_kv_budget(
    mixtral, caplog
):
    from batchgen.engine.memory_profile import MIN_GRAPH_BYTES, estimate_cuda_graph_bytes

    model, cfg = mixtral
    MiB = 1 << 20
    c = EngineConfig(max_num_batched_tokens=64, max_num_seqs=24, gpu_memory_utilization=0.9)
    sizes = [s for s in c.resolved_capture_sizes if s <= 64]
    assert sizes == [1, 2, 4, 8, 16, 24]
    memory = GraphMemory(free=60 * GiB, total=80 * GiB, costs=[300 * MiB, 8 * MiB])
    backend = _costly_backend(memory)
    cpu = torch.device("cpu")
    estimate, how = estimate_cuda_graph_bytes(model, c, cfg, cpu, torch.float32, memory, backend)
    # the largest graph's 300 MiB, then the second's 8 MiB for each of the 5 other sizes
    assert estimate == 300 * MiB + 8 * MiB * 5
    assert len(backend.captured) == 2 and "24, 16" in how
    with torch.inference_mode():  # the captured decode forwards run (the temporary runner)
        for fn in backend.captured:
            fn()
    # A second graph that seems free still counts vLLM's 1 MiB floor.
    memory = GraphMemory(free=60 * GiB, total=80 * GiB, costs=[300 * MiB, 0])
    estimate, _ = estimate_cuda_graph_bytes(
        model, c, cfg, cpu, torch.float32, memory, _costly_backend(memory)
    )
    assert estimate == 300 * MiB + MIN_GRAPH_BYTES * 5
    # No backend (enforce_eager, CPU): nothing counted, nothing captured.
    assert estimate_cuda_graph_bytes(model, c, cfg, cpu, torch.float32, memory, None)[0] == 0
    # The budget: vLLM's formula less the estimate, logged at start.
    memory = GraphMemory(free=60 * GiB, total=80 * GiB, costs=[300 * MiB, 8 * MiB])
    memory._allocated, memory._peak = 10 * GiB, 13 * GiB
    with caplog.at_level("INFO", logger="batchgen.engine.llm_engine"):
        budget = profiled_kv_budget_bytes(model, c, cfg, cpu, torch.float32, memory=memory,
                                          graph_backend=_costly_backend(memory))  # fmt: skip
    sampler = SAMPLER_COPIES * 24 * cfg.vocab_size * 4
    graphs = 300 * MiB + 8 * MiB * 5
    assert budget == int(80 * GiB * 0.9) - 20 * GiB - 3 * GiB - sampler - graphs
    assert "CUDA graphs 0.33 GiB (6 sizes, from capturing 24, 16: 300 MiB + 8 MiB x 5)" in (
        caplog.text
    )
    # enforce_eager: the default backend is none, so the budget is the plain formula.
    eager = EngineConfig(max_num_batched_tokens=64, max_num_seqs=24, enforce_eager=True)
    memory = FakeMemory(allocated=10 * GiB, peak=13 * GiB, free=60 * GiB, total=80 * GiB)
    budget = profiled_kv_budget_bytes(model, eager, cfg, cpu, torch.float32, memory=memory)
    assert budget == int(80 * GiB * 0.9) - 20 * GiB - 3 * GiB - sampler


def test_cuda_graph_estimate_is_zero_where_no_graph_would_be_built(mixtral, monkeypatch):
    from batchgen.engine.cuda_graphs import RecordingGraphBackend
    from batchgen.engine.memory_profile import estimate_cuda_graph_bytes

    model, cfg = mixtral
    c = EngineConfig(max_num_batched_tokens=64)
    memory = FakeMemory(allocated=0, peak=0, free=GiB, total=GiB)
    monkeypatch.setenv("BATCHGEN_ATTENTION_BACKEND", "torch")  # not in place: no graphs
    backend = RecordingGraphBackend()
    got = estimate_cuda_graph_bytes(model, c, cfg, torch.device("cpu"), torch.float32, memory,
                                    backend)  # fmt: skip
    assert got[0] == 0 and "in place" in got[1] and backend.captured == []

    class Failing(RecordingGraphBackend):
        def capture(self, fn):
            raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.delenv("BATCHGEN_ATTENTION_BACKEND")
    got = estimate_cuda_graph_bytes(model, c, cfg, torch.device("cpu"), torch.float32, memory,
                                    Failing())  # fmt: skip
    assert got == (0, "capture failed")


def test_cuda_graph_estimate_counts_mla_engines_on_the_triton_decode(checkpoint_dir, monkeypatch):
    """DeepSeek-V3 (MLA) captures where its decode attention is the Triton kernel on the paged
    latent cache (``TRITON_INTERPRET=1`` on CPU), so the estimate counts its graphs; on the
    torch MLA path or under ``batch_invariant`` (one bucket per row) no graph is built and
    nothing is counted."""
    import os

    from batchgen.engine.memory_profile import estimate_cuda_graph_bytes

    pytest.importorskip("triton")
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("neither CUDA nor TRITON_INTERPRET=1")
    path = checkpoint_dir("deepseek_v3")
    cfg = ModelConfig.from_hf(AutoConfig.from_pretrained(path))
    assert cfg.mla is not None
    model = load_model(path, cfg, torch.device("cpu"), torch.float32, None)
    MiB, cpu = 1 << 20, torch.device("cpu")
    c = EngineConfig(max_num_batched_tokens=64, max_num_seqs=8)
    assert c.resolved_capture_sizes == [1, 2, 4, 8]
    monkeypatch.setenv("BATCHGEN_ATTENTION_BACKEND", "triton")
    memory = GraphMemory(free=60 * GiB, total=80 * GiB, costs=[200 * MiB, 4 * MiB])
    backend = _costly_backend(memory)
    estimate, how = estimate_cuda_graph_bytes(model, c, cfg, cpu, torch.float32, memory, backend)
    assert estimate == 200 * MiB + 4 * MiB * 3
    assert len(backend.captured) == 2 and "8, 4" in how
    with torch.inference_mode():  # the captured MLA decode forwards run
        for fn in backend.captured:
            fn()
    invariant = EngineConfig(max_num_batched_tokens=64, max_num_seqs=8, batch_invariant=True)
    memory = GraphMemory(free=60 * GiB, total=80 * GiB, costs=[200 * MiB, 4 * MiB])
    got = estimate_cuda_graph_bytes(model, invariant, cfg, cpu, torch.float32, memory,
                                    _costly_backend(memory))  # fmt: skip
    assert got[0] == 0 and "in place" in got[1]
    monkeypatch.setenv("BATCHGEN_ATTENTION_BACKEND", "torch")
    memory = GraphMemory(free=60 * GiB, total=80 * GiB, costs=[200 * MiB, 4 * MiB])
    got = estimate_cuda_graph_bytes(model, c, cfg, cpu, torch.float32, memory,
                                    _costly_backend(memory))  # fmt: skip
    assert got[0] == 0 and "in place" in got[1]
