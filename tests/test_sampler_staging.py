"""The sampler's per-row parameter tensors through `HostStaging` (`batchgen.engine.sampler`),
proven on CPU with staging forced on (pinning off, a stand-in for the CUDA event, as
tests/test_host_staging.py does): the staged buffers hold each row's temperature, top-k, top-p,
min-p, penalties, the random and penalised row indices and the penalties' token ids; seeded
draws are token-identical to the unstaged sampler; the sampling stages make no host sync and
no ``torch.tensor`` from host lists (tests/sync_guard.py); on CPU the engine does not stage
(no behaviour change). Pinned memory and CUDA events run only on a GPU (docs/gpu.md)."""

from __future__ import annotations

import pytest
import torch

from batchgen import SamplingParams
from batchgen.config import EngineConfig
from batchgen.engine.host_staging import HostStaging
from batchgen.engine.llm_engine import LLMEngine
from batchgen.engine.sampler import Sampler, SamplingRow, make_generator, token_counts
from sync_guard import HostSync, no_host_sync_from_batchgen
from test_host_staging import FakeEvent

pytestmark = pytest.mark.timeout(300)
CPU = torch.device("cpu")
V = 50

PARAMS = [
    SamplingParams(temperature=0.0),  # greedy: no parameter row
    SamplingParams(temperature=0.7, top_k=5, seed=3),
    SamplingParams(temperature=1.3, top_p=0.8, min_p=0.05, seed=4, repetition_penalty=1.2),
    SamplingParams(temperature=0.9, frequency_penalty=0.5, presence_penalty=0.25, seed=5),
    SamplingParams(temperature=0.0, repetition_penalty=1.5),  # greedy with a penalty
]
PROMPTS = [[1, 2], [3], [4, 4, 5], [], [6, 7, 7]]
OUTPUTS = [[8], [], [9, 9, 10], [11, 12, 11], [13]]


def _rows() -> list[SamplingRow]:
    """The batch above, each seeded row with a fresh generator (the same draws every call)."""
    return [
        SamplingRow(p, prompt, out, make_generator(p.seed, 0, "cpu") if p.seed else None)
        for p, prompt, out in zip(PARAMS, PROMPTS, OUTPUTS, strict=True)
    ]


def _staging() -> HostStaging:
    FakeEvent.made.clear()
    return HostStaging(CPU, staged=True, pin_memory=False, event_factory=FakeEvent)


def test_staged_sampler_is_token_identical_and_stages_every_row_parameter():
    logits = torch.randn(5, V, generator=torch.Generator().manual_seed(0))
    plain = Sampler()(logits, _rows())
    staging = _staging()
    staged = Sampler(staging)(logits, _rows())
    assert staged.sampled_token_ids == plain.sampled_token_ids
    assert staged.sampled_logprobs == plain.sampled_logprobs
    host = {field: slots[0].array for (field, _), slots in staging.slots.items()}
    # random rows 1, 2, 3 (greedy rows 0 and 4 draw nothing)
    assert host["sampler_random_rows"][:3].tolist() == [1, 2, 3]
    assert host["sampler_temperature"][:3].tolist() == pytest.approx([0.7, 1.3, 0.9])
    assert host["sampler_top_k"][:3].tolist() == [5, 0, 0]
    assert host["sampler_top_p"][:3].tolist() == pytest.approx([1.0, 0.8, 1.0])
    assert host["sampler_min_p"][:3].tolist() == pytest.approx([0.0, 0.05, 0.0])
    # penalised rows 2, 3, 4 and their penalties
    assert host["sampler_penalty_rows"][:3].tolist() == [2, 3, 4]
    assert host["sampler_repetition_penalty"][:3].tolist() == pytest.approx([1.2, 1.0, 1.5])
    assert host["sampler_frequency_penalty"][:3].tolist() == pytest.approx([0.0, 0.5, 0.0])
    assert host["sampler_presence_penalty"][:3].tolist() == pytest.approx([0.0, 0.25, 0.0])
    # the penalties' token counts: the flat ids and row lengths of prompts and outputs
    assert host["sampler_prompt_ids"][:6].tolist() == [4, 4, 5, 6, 7, 7]
    assert host["sampler_prompt_lengths"][:3].tolist() == [3, 0, 3]
    assert host["sampler_output_ids"][:7].tolist() == [9, 9, 10, 11, 12, 11, 13]
    assert host["sampler_output_lengths"][:3].tolist() == [3, 3, 1]
    dtypes = {field: dtype for field, dtype in staging.slots}
    assert dtypes["sampler_temperature"] == torch.float32
    assert dtypes["sampler_top_k"] == dtypes["sampler_random_rows"] == torch.long
    assert all(e.records == 1 for e in FakeEvent.made)  # one copy per field
    # A second step: the copies have completed, the slots are refilled (no new buffers).
    for e in FakeEvent.made:
        e.done = True
    allocations = staging.num_allocations
    Sampler(staging)(logits, _rows())
    assert staging.num_allocations == allocations


def test_staged_token_counts_equal_the_plain_ones():
    ids = [[2, 2, 0], [], [5], [1, 5, 5, 5]]
    staged = token_counts(ids, 6, CPU, _staging(), "counts")
    assert torch.equal(staged, token_counts(ids, 6, CPU))
    assert staged.tolist() == [[1, 0, 2, 0, 0, 0], [0] * 6, [0, 0, 0, 0, 0, 1],
                               [0, 1, 0, 0, 0, 3]]  # fmt: skip
    assert token_counts([[], []], 6, CPU, _staging()).tolist() == [[0] * 6] * 2


def test_the_sampling_stages_make_no_host_sync_when_staged(monkeypatch):
    """Penalties, temperature, top-k/top-p, min-p and the seeded draws: from the rows to the
    sampled ids on the device, no ``torch.tensor`` from host lists and no sync (the
    ``tolist`` that ends a step reads the result after; the unstaged sampler is caught)."""
    logits = torch.randn(5, V, generator=torch.Generator().manual_seed(1))
    greedy = [p.is_greedy for p in PARAMS]
    penalised = [b for b, p in enumerate(PARAMS) if p.has_penalties]

    def stages(sampler: Sampler) -> torch.Tensor:
        processed = logits.clone()
        rows = _rows()
        sampler._apply_penalties(processed, rows, penalised)
        return sampler._sample(processed, rows, greedy)

    expected = stages(Sampler())
    staged = Sampler(_staging())
    stages(staged)  # unguarded first: a first use allocates the host buffers (host work)
    for e in FakeEvent.made:
        e.done = True
    with monkeypatch.context() as patch:
        no_host_sync_from_batchgen(patch)
        got = stages(staged)
        with pytest.raises(HostSync, match="torch.tensor"):
            stages(Sampler())
    assert torch.equal(got, expected)


def test_cpu_engine_does_not_stage_and_a_staging_elsewhere_is_not_used():
    assert Sampler().staging is None
    cpu = Sampler(HostStaging(CPU))  # the engine's CPU staging: plain torch.tensor
    logits = torch.randn(5, V, generator=torch.Generator().manual_seed(2))
    assert cpu(logits, _rows()).sampled_token_ids == Sampler()(logits, _rows()).sampled_token_ids
    assert cpu.staging.slots == {}
    cuda = HostStaging(torch.device("cuda"))  # logits on CPU: not staged through it
    assert Sampler(cuda)(logits, _rows()).sampled_token_ids == (
        Sampler()(logits, _rows()).sampled_token_ids
    )
    assert cuda.slots == {}


def test_engine_with_staged_sampler_is_token_identical(checkpoint_dir):
    """Seeded random sampling with every parameter through an engine whose runner and
    sampler stage (on CUDA they share the runner's `HostStaging`)."""
    path = checkpoint_dir("mixtral")
    params = [
        SamplingParams(temperature=0.8, top_k=8, top_p=0.9, seed=11, max_tokens=6,
                       ignore_eos=True),
        SamplingParams(temperature=1.1, min_p=0.02, repetition_penalty=1.3, seed=12,
                       frequency_penalty=0.4, presence_penalty=0.2, max_tokens=5,
                       ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
    ]  # fmt: skip
    prompts = [[5, 6, 7], [11, 12], [40] * 9]

    def run(staged: bool) -> dict[str, list[int]]:
        engine = LLMEngine(EngineConfig(model=str(path), device="cpu", dtype="float32"))
        assert engine.sampler.staging is engine.runner.staging and not engine.runner.staging.staged
        if staged:
            engine.runner.staging = _staging()
            engine.sampler.staging = engine.runner.staging
        for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
            engine.add_request(f"r{i}", p, sp)
        out = {}
        while engine.has_unfinished_requests():
            for e in FakeEvent.made:  # each step's sampled tokens were read: copies done
                e.done = True
            for o in engine.step():
                if o.finished:
                    out[o.request_id] = list(o.outputs[0].token_ids)
        if staged:
            used = {field for field, _ in engine.runner.staging.slots}
            assert {"sampler_temperature", "sampler_top_k", "sampler_top_p", "sampler_min_p",
                    "sampler_repetition_penalty", "sampler_random_rows",
                    "input_ids"} <= used  # fmt: skip
        return out

    assert run(True) == run(False)


def test_top_k_top_p_with_host_bounds_equals_the_device_read():
    """The sampler passes ``max_top_k`` / ``any_top_p`` from the rows' parameters; the masks
    equal those found by reading the tensors (the None default)."""
    from batchgen.engine.sampling_ops import apply_top_k_top_p

    g = torch.Generator().manual_seed(3)
    logits = torch.randn(4, V, generator=g)
    top_k = torch.tensor([0, 7, 3, V])  # 0 and V: off
    top_p = torch.tensor([1.0, 0.9, 1.0, 0.5])
    for k, p, max_k, any_p in ((top_k, None, 7, None), (top_k, top_p, 7, True),
                               (None, top_p, None, True), (torch.tensor([0, V, 0, 0]), None, 0,
                                                           None)):  # fmt: skip
        want = apply_top_k_top_p(logits.clone(), k, p)
        got = apply_top_k_top_p(logits.clone(), k, p, max_k, any_p)
        assert torch.equal(got, want)
    assert torch.isinf(apply_top_k_top_p(logits.clone(), top_k, None, 7)).sum(-1).tolist() == [
        0, V - 7, V - 3, 0]  # fmt: skip
