"""Host staging of the per-step inputs (`batchgen.engine.host_staging`), proven on CPU with
staging forced on (pinning off, a stand-in for the CUDA event): values, dtypes, views sized
to the step, geometric growth, a slot never refilled while its copy may be in flight, and the
engine token-identical with staging on. Pinned memory and CUDA events run only on a GPU."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from batchgen import SamplingParams
from batchgen.config import EngineConfig
from batchgen.engine.host_staging import HostStaging
from batchgen.engine.llm_engine import LLMEngine

pytestmark = pytest.mark.timeout(300)
CPU = torch.device("cpu")


class FakeEvent:
    """A CUDA event stand-in: ``record()`` marks a copy in flight until the test says it is
    done (``done = True``)."""

    made: list[FakeEvent] = []

    def __init__(self) -> None:
        self.done = True
        self.records = 0
        FakeEvent.made.append(self)

    def record(self) -> None:
        self.records += 1
        self.done = False

    def query(self) -> bool:
        return self.done


def test_unstaged_is_plain_torch_tensor_and_cuda_defaults():
    plain = HostStaging(CPU)
    assert not plain.staged and not plain.pin_memory and plain.event_factory is None
    t = plain.to_device("input_ids", [3, 1, 2])
    assert t.dtype == torch.long and t.tolist() == [3, 1, 2]
    table = plain.rows_to_device("block_tables", [[4], [5, 6]], width=3)
    assert table.tolist() == [[4, 0, 0], [5, 6, 0]]
    assert plain.rows_to_device("block_tables", [], width=2).shape == (0, 2)
    assert plain.slots == {} and plain.num_allocations == 0  # no buffers on CPU
    cuda = HostStaging(torch.device("cuda"))  # nothing allocated until the first use
    assert cuda.staged and cuda.pin_memory and cuda.event_factory is torch.cuda.Event


def test_staged_values_dtypes_views_and_geometric_growth():
    FakeEvent.made.clear()
    s = HostStaging(CPU, staged=True, pin_memory=False, event_factory=FakeEvent)
    a = s.to_device("positions", [7, 8, 9])
    assert a.tolist() == [7, 8, 9] and a.dtype == torch.long and a.shape == (3,)
    slot = s.slots[("positions", torch.long)][0]
    assert slot.host.numel() == 256 and a.data_ptr() != slot.host.data_ptr()  # a copy
    FakeEvent.made[-1].done = True  # the copy has completed
    b = s.to_device("positions", list(range(300)))  # grows: at least double, a power of two
    assert b.tolist() == list(range(300)) and a.tolist() == [7, 8, 9]
    slot = s.slots[("positions", torch.long)][0]
    assert len(s.slots[("positions", torch.long)]) == 1 and slot.host.numel() == 512
    FakeEvent.made[-1].done = True
    c = s.to_device("positions", [1])  # a smaller step reuses the slot: a view of 1
    assert c.tolist() == [1] and c.shape == (1,) and s.num_allocations == 2
    i32 = s.to_device("slot_mapping", [2**31 - 1, -5], dtype=torch.int32)
    assert i32.dtype == torch.int32 and i32.tolist() == [2**31 - 1, -5]
    empty = s.to_device("sample_indices", [])
    assert empty.shape == (0,) and empty.dtype == torch.long
    table = s.rows_to_device("block_tables", [[4], [5, 6], []], width=3, pad=9)
    assert table.tolist() == [[4, 9, 9], [5, 6, 9], [9, 9, 9]] and table.is_contiguous()
    with pytest.raises(ValueError, match="block_tables: a row is longer than the width 1"):
        s.rows_to_device("block_tables", [[1, 2]], width=1)
    with pytest.raises(ValueError, match="field"):
        s.to_device("", [1])
    with pytest.raises(ValueError, match="bfloat16"):
        s.to_device("x", [1], dtype=torch.bfloat16)


def test_a_slot_in_flight_is_never_refilled():
    FakeEvent.made.clear()
    s = HostStaging(CPU, staged=True, pin_memory=False, event_factory=FakeEvent)
    first = s.to_device("kv_lens", [1, 2])  # its copy is "in flight" (event not done)
    second = s.to_device("kv_lens", [3, 4, 5])  # a second micro-batch: a second slot
    slots = s.slots[("kv_lens", torch.long)]
    assert len(slots) == 2 and slots[0].array[:2].tolist() == [1, 2]  # not overwritten
    assert slots[1].array[:3].tolist() == [3, 4, 5]
    assert (first.tolist(), second.tolist()) == ([1, 2], [3, 4, 5])
    for event in FakeEvent.made:  # the step's sampled tokens were read: the stream drained
        event.done = True
    s.to_device("kv_lens", [6])
    assert len(slots) == 2 and slots[0].array[0] == 6 and slots[0].event.records == 2


def _greedy(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> dict:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    out = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                out[o.request_id] = list(o.outputs[0].token_ids)
    return out


@pytest.mark.parametrize("policy", ["coalesce", "lockstep"])
def test_engine_is_token_identical_with_staging_on(checkpoint_dir, policy):
    """Prefill chunks, decode buckets, several micro-batches per step (coalesce with 8-token
    micro-batches) and a shared prompt's block copy, all through the staged buffers."""
    path = checkpoint_dir("mixtral")
    prompts = [[5, 6, 7, 8, 9], [11, 12], [40] * 19, [3, 1, 4, 1, 5, 9, 2, 6], [7]]

    def engine() -> LLMEngine:
        config = EngineConfig(model=str(path), device="cpu", dtype="float32",
                              scheduler_policy=policy, max_num_batched_tokens=8)  # fmt: skip
        return LLMEngine(config)

    eager = _greedy(engine(), prompts, 9)
    staged = engine()
    staged.runner.staging = HostStaging(CPU, staged=True, pin_memory=False)
    got = _greedy(staged, prompts, 9)
    assert got == eager
    used = {field for field, _ in staged.runner.staging.slots}
    assert {"input_ids", "positions", "slot_mapping", "kv_slots", "block_tables", "kv_lens",
            "sample_indices"} <= used  # fmt: skip
    # n=2 samples share the prompt's partly filled last block: a KV block copy, staged too
    staged.add_request("n2", [1, 2, 3], SamplingParams(n=2, temperature=0.0, max_tokens=3))
    while staged.has_unfinished_requests():
        staged.step()
    assert ("copy_src", torch.long) in staged.runner.staging.slots


def test_graph_replay_with_staging_is_token_identical(checkpoint_dir, monkeypatch):
    """On CUDA the graph runner's `prepare` stages too: the CPU stand-in backend replays
    staged steps (decode-only, padded) and gives the eager engine's tokens."""
    from batchgen.engine import cuda_graphs
    from batchgen.engine.cuda_graphs import RecordingGraphBackend

    path = checkpoint_dir("mixtral")
    prompts = [[5, 6, 7, 8, 9], [11, 12], [40] * 19]

    def engine(graphs: bool) -> LLMEngine:
        config = EngineConfig(model=str(path), device="cpu", dtype="float32",
                              cudagraph_capture_sizes=[1, 2, 4])  # fmt: skip
        if graphs:
            monkeypatch.setattr(cuda_graphs, "graph_backend_for",
                                lambda device, eager: RecordingGraphBackend())  # fmt: skip
        built = LLMEngine(config)
        built.runner.staging = HostStaging(CPU, staged=True, pin_memory=False)
        return built

    eager = _greedy(engine(False), prompts, 8)
    staged = engine(True)
    graphs = staged.executor.graph_runner
    assert graphs is not None
    assert _greedy(staged, prompts, 8) == eager
    assert graphs.num_graph_steps >= 5


def test_array_to_device_unstaged_and_staged():
    plain = HostStaging(CPU)
    a = np.arange(6, dtype=np.int64).reshape(2, 3)
    t = plain.array_to_device("block_tables", a[:, :2])  # a strided view: copied contiguous
    assert t.dtype == torch.long and t.tolist() == [[0, 1], [3, 4]] and t.is_contiguous()
    assert plain.slots == {}
    s = HostStaging(CPU, staged=True, pin_memory=False, event_factory=FakeEvent)
    t = s.array_to_device("block_tables", a[:, 1:])
    assert t.tolist() == [[1, 2], [4, 5]] and t.shape == (2, 2) and t.is_contiguous()
    i32 = s.array_to_device("kv_lens", np.array([3, 9], dtype=np.int32))
    assert i32.dtype == torch.int32 and i32.tolist() == [3, 9]
    assert s.array_to_device("kv_lens", np.zeros(0, dtype=np.int64)).shape == (0,)
    with pytest.raises(ValueError, match="positions: int64 or int32"):
        s.array_to_device("positions", np.zeros(2, dtype=np.float32))
