"""No host synchronisation inside an eager step on the CUDA path, from the step's host lists to
its logits, through `ModelRunner.prepare` (staged as on CUDA) and the `StageExecutor`: the
decode context check runs on the host lists, the MoE statistics stay on the device until the
engine reads them after sampling, stage times are events read after sampling. Run on CPU with
the CUDA-path kernels (Triton under ``TRITON_INTERPRET=1``, grouped GEMMs in bf16), the guard of
tests/sync_guard.py raising on any host-syncing call from BatchGen code. What it cannot see:
syncs inside torch itself (on CPU ``_grouped_mm``'s fallback copies ``offs`` to the host)."""

from __future__ import annotations

import os

import pytest
import torch

from batchgen import SamplingParams
from batchgen.config import EngineConfig
from batchgen.engine.host_staging import HostStaging
from batchgen.engine.llm_engine import LLMEngine
from batchgen.engine.metrics import EngineMetrics, StageTimer
from batchgen.engine.model_runner import check_decode_context_lists
from batchgen.engine.prompt_logprobs import prompt_logit_positions
from sync_guard import HostSync, no_host_sync_from_batchgen

pytestmark = pytest.mark.timeout(300)
CPU = torch.device("cpu")


def _needs_triton():
    pytest.importorskip("triton")
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("neither CUDA nor TRITON_INTERPRET=1")


def _mixed_step(engine: LLMEngine):
    """Three requests prefilled and decoding, a fourth whose 12-token prompt is in its second
    chunk (8-token micro-batches): the next step mixes decode rows and a prefill chunk that
    reads cached context, over two micro-batches under ``coalesce``."""
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    for i, p in enumerate([[5, 6, 7], [1, 2, 3, 4, 5], [42]]):
        engine.add_request(f"r{i}", p, params)
    engine.step()
    engine.add_request("long", list(range(20, 32)), params)
    engine.step()  # decodes + the long prompt's first chunk
    sched = engine.schedule()
    assert any(e.num_new_tokens == 1 for e in sched.scheduled)
    assert any(e.num_new_tokens > 1 and e.seq.num_computed_tokens > 0 for e in sched.scheduled)
    for e in sched.scheduled:
        e.prompt_logits = prompt_logit_positions(e.seq, e.num_new_tokens)
    return sched


@pytest.mark.parametrize(
    "name, moe_path, dtype",
    [
        ("mixtral", "triton", "float32"),
        ("mixtral", "grouped_mm", "bfloat16"),
        ("deepseek_v3", "triton", "float32"),  # MLA's Triton decode, sigmoid group routing
    ],
)
def test_an_eager_step_through_the_model_runner_never_syncs(
    checkpoint_dir, monkeypatch, name, moe_path, dtype
):
    _needs_triton()
    monkeypatch.setenv("BATCHGEN_MOE_PATH", moe_path)
    monkeypatch.setenv("BATCHGEN_ATTENTION_BACKEND", "triton")
    # The CPU prefill attention kernel runs on CPU tensors only (never in a CUDA step) and
    # builds its span plan on the host; this test stands in for a device step, so prefill
    # takes SDPA as it would on CUDA (auto now runs the kernel in float32 on AVX-512 CPUs
    # without AMX too).
    monkeypatch.setenv("BATCHGEN_PREFILL_ATTENTION", "sdpa")
    config = EngineConfig(model=str(checkpoint_dir(name)), device="cpu", dtype=dtype,
                          max_num_batched_tokens=8)  # fmt: skip
    engine = LLMEngine(config)
    engine.runner.staging = HostStaging(CPU, staged=True, pin_memory=False)
    sched = _mixed_step(engine)
    # Unguarded first: the reference logits, and the staging buffers sized for this step
    # (a first use allocates, which is host work, not a sync). The rerun writes the same K/V.
    _, logits_ref, _ = engine.executor.execute(sched.scheduled)
    stats = engine.metrics.expert
    stats.flush()
    rows_before, calls_before = stats.rows, stats.num_moe_calls
    with monkeypatch.context() as patch:
        no_host_sync_from_batchgen(patch)
        sampling, logits, _ = engine.executor.execute(sched.scheduled)
        assert stats.rows == rows_before  # not read yet: pending on the device
    torch.testing.assert_close(logits, logits_ref, rtol=0, atol=0)
    stats.flush()  # what the engine does after sampling
    top_k = engine.model_config.num_experts_per_tok
    step_rows = sum(e.num_new_tokens for e in sched.scheduled) * top_k
    num_moe = sum(engine.model_config.layer_is_moe)
    assert stats.rows - rows_before == step_rows * num_moe
    assert stats.num_moe_calls - calls_before == num_moe  # one coalesced call per MoE layer
    assert len(sampling) == len(sched.scheduled)
    # The guard sees a sync where there is one: the kernels' own check on device tensors.
    from batchgen.kernels.paged_attention import check_decode_context

    with monkeypatch.context() as patch:
        no_host_sync_from_batchgen(patch)
        with pytest.raises(HostSync):
            check_decode_context(torch.zeros(1, 1, dtype=torch.long), torch.ones(1).long(), 16, 4)


def test_the_host_context_check_names_the_field():
    check_decode_context_lists([[0, 3], [1]], [2, 1], 4)
    with pytest.raises(ValueError, match="block_tables: decode row 1 needs 2 blocks.*has 1"):
        check_decode_context_lists([[0], [1]], [1, 2], 4)
    with pytest.raises(ValueError, match=r"block_tables: decode row 0 .* outside \[0, 4\)"):
        check_decode_context_lists([[4]], [1], 4)
    with pytest.raises(ValueError, match="outside"):
        check_decode_context_lists([[-1]], [1], 4)


def test_a_bad_block_table_fails_in_prepare_before_any_tensor(checkpoint_dir):
    engine = LLMEngine(EngineConfig(model=str(checkpoint_dir("mixtral")), device="cpu",
                                    dtype="float32"))  # fmt: skip
    engine.add_request("a", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=4))
    engine.step()
    sched = engine.schedule()
    (entry,) = sched.scheduled
    entry.seq.block_table[0] = engine.runner.kv_caches[0][0].shape[0]  # one past the cache
    engine.runner.staging = HostStaging(CPU, staged=True, pin_memory=False)
    with pytest.raises(ValueError, match="block_tables: decode row 0"):
        engine.runner.prepare(sched.scheduled)
    assert engine.runner.staging.slots == {}  # nothing staged


class FakeTimingEvent:
    """A CUDA timing event stand-in: ``record()`` stamps a pretend stream clock (ms)."""

    clock_ms = 0.0

    def __init__(self) -> None:
        self.at = None
        self.synced = False

    def record(self) -> None:
        self.at = FakeTimingEvent.clock_ms

    def synchronize(self) -> None:
        self.synced = True

    def elapsed_time(self, end: FakeTimingEvent) -> float:
        return end.at - self.at


def test_stage_timer_reads_events_only_at_flush():
    metrics = EngineMetrics()
    timer = StageTimer(metrics, torch.device("cuda"), event_factory=FakeTimingEvent)
    FakeTimingEvent.clock_ms = 10.0
    t0 = timer.start()
    FakeTimingEvent.clock_ms = 35.0
    timer.stop("attention", t0)
    t1 = timer.start()
    FakeTimingEvent.clock_ms = 40.0
    timer.stop("moe", t1)
    assert metrics.stage_seconds == {}  # nothing read inside the step
    timer.flush()
    assert metrics.stage_seconds == pytest.approx({"attention": 0.025, "moe": 0.005})
    assert timer.pending == [] and timer.event_factory is FakeTimingEvent
    cpu = StageTimer(metrics, CPU)
    assert cpu.event_factory is None
    cpu.stop("lm_head", cpu.start())
    assert metrics.stage_seconds["lm_head"] >= 0.0 and cpu.pending == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch's sync debug mode: needs CUDA")
def test_steps_on_cuda_make_no_sync_before_their_logits(checkpoint_dir):
    """The device run (`benchmarks/gpu_check.sh`, graphs stage): torch's own detector
    (``torch.cuda.set_sync_debug_mode("error")``: ``.item()``, ``nonzero``, blocking copies,
    syncs inside torch included) around an eager mixed step and a replayed decode step, from
    `ModelRunner.prepare` (pinned staging) to the logits, on the engine's default CUDA paths
    in float32 (Triton paged decode attention, Triton MoE)."""
    config = EngineConfig(model=str(checkpoint_dir("mixtral")), device="cuda", dtype="float32",
                          max_num_batched_tokens=8, cudagraph_capture_sizes=[1, 2, 4])  # fmt: skip
    engine = LLMEngine(config)
    assert engine.runner.staging.staged and engine.runner.staging.pin_memory
    sched = _mixed_step(engine)
    graphs = engine.executor.graph_runner
    assert graphs is not None and not graphs.can_run(sched.scheduled)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        _, logits, _ = engine.executor.execute(sched.scheduled)  # eager
    finally:
        torch.cuda.set_sync_debug_mode("default")
    engine.execute(sched)  # sample, advance
    while True:  # until a decode-only step (the long prompt's last chunk is done)
        sched = engine.schedule()
        if graphs.can_run(sched.scheduled):
            break
        engine.execute(sched)
    for e in sched.scheduled:
        e.prompt_logits = prompt_logit_positions(e.seq, e.num_new_tokens)
    torch.cuda.synchronize()
    replays = graphs.num_graph_steps
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = engine.executor.execute(sched.scheduled)  # replayed
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert out is not None and graphs.num_graph_steps == replays + 1
    assert torch.isfinite(logits).all() and torch.isfinite(out[1]).all()
