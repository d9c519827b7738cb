"""Sampler: each processing step against hand-computed values, seeded independence from batch
mates, min_tokens, logprobs, and the empirical distribution of the draws."""

from __future__ import annotations

import math

import pytest
import torch

from batchgen.engine.sampler import (
    LOGPROB_FLOOR,
    Sampler,
    SamplingRow,
    apply_min_p,
    apply_min_tokens,
    apply_penalties,
    apply_top_k_top_p,
    make_generator,
    random_sample,
    token_counts,
)
from batchgen.sampling_params import SamplingParams

NEG_INF = float("-inf")
# V = 6; sorted by probability: token 1 (0.40), 3 (0.30), 4 (0.15), 2 (0.10), 0 (0.04), 5 (0.01).
PROBS = torch.tensor([0.04, 0.40, 0.10, 0.30, 0.15, 0.01])
LOGITS = PROBS.log()


def make_row(
    params: SamplingParams | None = None,
    prompt: list[int] | None = None,
    output: list[int] | None = None,
    generator: torch.Generator | None = None,
    block: list[int] | None = None,
) -> SamplingRow:
    return SamplingRow(
        params=params or SamplingParams(),
        prompt_token_ids=prompt or [],
        output_token_ids=output or [],
        generator=generator,
        min_tokens_block_ids=block or [],
    )


def kept(logits: torch.Tensor) -> list[list[int]]:
    """Per row, the sorted ids that were not masked to -inf."""
    return [torch.nonzero(torch.isfinite(row)).flatten().tolist() for row in logits]


# ---------------------------------------------------------------------------------------------
# processing steps, hand-computed


@pytest.mark.parametrize("force_sort", [False, True], ids=["topk-path", "sort-path"])
def test_top_k_mask(force_sort):
    logits = torch.tensor([1.0, 3.0, 2.0, 0.5, 3.0, -1.0]).repeat(6, 1)  # [6, 6]
    top_k = torch.tensor([1, 2, 3, 0, -1, 100])
    # The 2nd largest value ties with the 1st: both 3.0 are kept for k = 1 and 2 (vLLM ties).
    expected = [[1, 4], [1, 4], [1, 2, 4], list(range(6)), list(range(6)), list(range(6))]
    top_p = torch.tensor([1.0] * 5 + [0.999999]) if force_sort else None
    out = apply_top_k_top_p(logits.clone(), top_k, top_p)
    assert kept(out) == expected
    assert torch.equal(out[torch.isfinite(out)], logits[torch.isfinite(out)])


def test_top_p_mask():
    # Cumulative mass in rank order: 0.40, 0.70, 0.85, 0.95, 0.99, 1.00.
    top_p = torch.tensor([0.35, 0.6, 0.8, 0.97, 1.0, 1e-9])
    out = apply_top_k_top_p(LOGITS.repeat(6, 1), None, top_p)
    assert kept(out) == [[1], [1, 3], [1, 3, 4], [0, 1, 2, 3, 4], list(range(6)), [1]]


def test_top_p_applies_to_the_top_k_renormalised_distribution():
    # top_k = 4 keeps {1, 3, 4, 2} (mass 0.95); renormalised cumulative: 0.421, 0.737, 0.895.
    # top_p = 0.87 then keeps {1, 3, 4}; on the un-truncated distribution (0.85) it would keep 4.
    out = apply_top_k_top_p(LOGITS.repeat(2, 1), torch.tensor([4, 0]), torch.tensor([0.87, 0.87]))
    assert kept(out) == [[1, 3, 4], [1, 2, 3, 4]]


def test_min_p_mask():
    # max prob 0.40: min_p 0.5 -> threshold 0.2, 0.3 -> 0.12, 0.05 -> 0.02.
    min_p = torch.tensor([0.5, 0.3, 0.05, 0.0, 1.0])
    out = apply_min_p(LOGITS.repeat(5, 1), min_p)
    assert kept(out) == [[1, 3], [1, 3, 4], [0, 1, 2, 3, 4], list(range(6)), [1]]


def test_token_counts():
    counts = token_counts([[2, 2, 0], [], [5]], 6, "cpu")
    assert counts.tolist() == [[1, 0, 2, 0, 0, 0], [0] * 6, [0, 0, 0, 0, 0, 1]]


@pytest.mark.parametrize(
    ("repetition", "frequency", "presence", "expected"),
    [
        # prompt {0, 1}, output [2, 2, 3]: repetition hits 0..3, frequency/presence only 2, 3.
        (2.0, 0.0, 0.0, [1.0, -2.0, 0.25, -1.0, 1.0, 3.0]),
        (1.0, 0.5, 0.0, [2.0, -1.0, -0.5, -1.0, 1.0, 3.0]),
        (1.0, 0.0, 0.25, [2.0, -1.0, 0.25, -0.75, 1.0, 3.0]),
        (1.0, 0.5, 0.25, [2.0, -1.0, -0.75, -1.25, 1.0, 3.0]),
        (2.0, 0.5, 0.25, [1.0, -2.0, -1.0, -1.75, 1.0, 3.0]),
        (1.0, -0.5, -1.0, [2.0, -1.0, 2.5, 1.0, 1.0, 3.0]),
    ],
)
def test_penalties(repetition, frequency, presence, expected):
    logits = torch.tensor([[2.0, -1.0, 0.5, -0.5, 1.0, 3.0]])
    out = apply_penalties(
        logits,
        token_counts([[0, 1]], 6, "cpu") > 0,
        token_counts([[2, 2, 3]], 6, "cpu"),
        torch.tensor([repetition]),
        torch.tensor([frequency]),
        torch.tensor([presence]),
    )
    assert out.tolist() == [expected]


def test_apply_min_tokens_blocks_several_ids_and_ignores_out_of_range():
    out = apply_min_tokens(torch.zeros(2, 4), [[0, 3, 9, -1], []])
    assert kept(out) == [[1, 2], [0, 1, 2, 3]]


# ---------------------------------------------------------------------------------------------
# the Sampler


def test_greedy_is_argmax_and_input_untouched():
    torch.manual_seed(0)
    logits = torch.randn(8, 50, dtype=torch.bfloat16)
    before = logits.clone()
    out = Sampler()(logits, [make_row(SamplingParams(temperature=0.0))] * 8)
    assert out.sampled_token_ids == logits.float().argmax(-1).tolist()
    assert torch.equal(logits, before)
    expected_lp = logits.float().log_softmax(-1).gather(1, logits.float().argmax(-1, True))
    assert out.sampled_logprobs == pytest.approx(expected_lp.squeeze(1).tolist(), abs=1e-6)
    assert out.top_logprobs == [None] * 8


def test_greedy_rows_unchanged_by_random_batch_mates():
    torch.manual_seed(1)
    logits = torch.randn(5, 40)
    greedy = [make_row(SamplingParams(temperature=0.0))] * 4
    fast = Sampler()(logits[:4], greedy).sampled_token_ids
    mixed = Sampler()(logits, [*greedy, make_row(SamplingParams(top_p=0.5))]).sampled_token_ids
    assert fast == mixed[:4] == logits[:4].argmax(-1).tolist()


def test_greedy_uses_penalised_logits():
    logits = torch.tensor([[2.0, 1.0, 0.5, 3.0, -1.0, 0.0]])
    params = SamplingParams(temperature=0.0, repetition_penalty=10.0)
    # Tokens 3 (prompt) and 0 (output) drop to 0.3 and 0.2, so token 1 wins.
    out = Sampler()(logits, [make_row(params, prompt=[3], output=[0])])
    assert out.sampled_token_ids == [1]


def test_presence_penalty_ignores_prompt_tokens():
    logits = torch.tensor([[2.0, 1.9, 0.0]])
    params = SamplingParams(temperature=0.0, presence_penalty=0.5)
    assert Sampler()(logits, [make_row(params, prompt=[0, 0, 0])]).sampled_token_ids == [0]
    assert Sampler()(logits, [make_row(params, output=[0])]).sampled_token_ids == [1]


def _step_logits(step: int, vocab: int = 64) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 + step)
    return 2.0 * torch.randn(vocab, generator=gen)  # [V]


def _run_seeded(seeded: SamplingParams, mates: list[SamplingParams], steps: int) -> list[int]:
    """Generate `steps` tokens for one seeded row, placed among `mates` at a rotating index."""
    sampler = Sampler()
    generator = make_generator(seeded.seed, 0, "cpu")
    mate_gens = [make_generator(p.seed, 1, "cpu") if p.seed is not None else None for p in mates]
    outputs: list[int] = []
    for step in range(steps):
        pos = step % (len(mates) + 1)
        rows = [
            make_row(p, prompt=[1, 2], output=[step % 7], generator=g, block=[0, 1])
            for p, g in zip(mates, mate_gens)
        ]
        rows.insert(pos, make_row(seeded, prompt=[1, 2], output=list(outputs), generator=generator))
        logits = [torch.randn(64) for _ in mates]
        logits.insert(pos, _step_logits(step))
        outputs.append(sampler(torch.stack(logits), rows).sampled_token_ids[pos])  # [B, V]
    return outputs


def test_seeded_row_is_independent_of_batch_mates():
    seeded = SamplingParams(temperature=1.3, top_k=30, top_p=0.95, repetition_penalty=1.2, seed=7)
    alone = _run_seeded(seeded, [], steps=40)
    mates = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=2.0, top_k=3, min_p=0.2, seed=11),
        SamplingParams(top_p=1e-9, frequency_penalty=1.0, presence_penalty=-1.0),
        SamplingParams(temperature=0.5, seed=7, min_tokens=5),
    ]
    torch.manual_seed(123)
    in_batch = _run_seeded(seeded, mates, steps=40)
    torch.manual_seed(456)
    in_batch_other_rng = _run_seeded(seeded, mates[::-1], steps=40)
    assert alone == in_batch == in_batch_other_rng
    assert len(set(alone)) > 10  # really sampled, not collapsed to one token


def test_samples_of_one_request_differ_and_reproduce():
    logits = torch.zeros(4, 1000)  # uniform: 4 samples of one request, one step each
    rows = [
        make_row(SamplingParams(seed=5), generator=make_generator(5, i, "cpu")) for i in range(4)
    ]
    first = [Sampler()(logits, rows).sampled_token_ids for _ in range(10)]
    rows = [
        make_row(SamplingParams(seed=5), generator=make_generator(5, i, "cpu")) for i in range(4)
    ]
    second = [Sampler()(logits, rows).sampled_token_ids for _ in range(10)]
    assert first == second
    per_sample = [tuple(step[i] for step in first) for i in range(4)]
    assert len(set(per_sample)) == 4


def test_make_generator_streams():
    def draw(seed: int, index: int) -> torch.Tensor:
        return torch.rand(8, generator=make_generator(seed, index, "cpu"))

    assert torch.equal(draw(3, 2), draw(3, 2))
    assert not torch.equal(draw(0, 1), draw(1, 0))  # unlike seed + index
    assert not torch.equal(draw(3, 0), draw(3, 1))
    assert torch.equal(draw(-1, 0), draw(2**64 - 1, 0))  # seeds are taken mod 2**64


def test_unseeded_rows_follow_the_global_rng():
    logits = torch.zeros(16, 500)
    rows = [make_row(SamplingParams(temperature=0.9)) for _ in range(16)]
    torch.manual_seed(9)
    first = Sampler()(logits, rows).sampled_token_ids
    torch.manual_seed(9)
    assert Sampler()(logits, rows).sampled_token_ids == first
    assert len(set(first)) > 8


def test_top_k_larger_than_vocab_and_top_k_off_in_one_row():
    logits = torch.zeros(2000, 6)
    rows = [make_row(SamplingParams(top_k=1000 if b % 2 else 0)) for b in range(2000)]
    rows[0] = make_row(SamplingParams(top_k=2))
    logits[0] = torch.tensor([0.0, 5.0, 0.0, 4.0, 0.0, 0.0])
    torch.manual_seed(0)
    out = Sampler()(logits, rows).sampled_token_ids
    assert out[0] in (1, 3)
    assert set(out[1:]) == set(range(6))


def test_without_sampled_logprobs_the_same_tokens_and_no_logsumexp(monkeypatch):
    torch.manual_seed(0)
    logits = torch.randn(6, 40)
    rows = [make_row(SamplingParams(temperature=0.0)) for _ in range(3)]
    hot = SamplingParams(temperature=0.8, top_k=5)
    rows += [make_row(hot, generator=torch.Generator().manual_seed(5)) for _ in range(3)]
    full = Sampler()(logits, rows)
    calls = []
    real = torch.Tensor.logsumexp
    monkeypatch.setattr(torch.Tensor, "logsumexp", lambda *a, **k: calls.append(1) or real(*a, **k))
    for row in rows[3:]:  # replay the same draws
        row.generator.manual_seed(5)
    lean = Sampler()(logits, rows, sampled_logprobs=False)
    assert lean.sampled_token_ids == full.sampled_token_ids
    assert lean.sampled_logprobs is None and lean.top_logprobs == [None] * 6
    assert calls == []
    # A row that asks for logprobs still gets its top list (the caller then asks for all).
    rows[0] = make_row(SamplingParams(temperature=0.0, logprobs=1))
    mixed = Sampler()(logits[:1], rows[:1], sampled_logprobs=False)
    assert mixed.sampled_logprobs is None
    assert mixed.top_logprobs[0][0][0] == full.sampled_token_ids[0]


def test_tiny_top_p_behaves_greedily():
    torch.manual_seed(2)
    logits = torch.randn(64, 100)
    rows = [make_row(SamplingParams(top_p=1e-9, temperature=1.5)) for _ in range(64)]
    out = Sampler()(logits, rows)
    assert out.sampled_token_ids == logits.argmax(-1).tolist()
    assert all(math.isfinite(lp) for lp in out.sampled_logprobs)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_min_tokens_blocks_two_eos_ids(temperature):
    vocab, eos = 8, [0, 5]
    logits = torch.zeros(300, vocab)
    logits[:, eos] = 10.0  # EOS would win almost every draw
    params = SamplingParams(temperature=temperature, min_tokens=3, seed=1)
    rows = [
        make_row(params, output=[7] * (b % 4), generator=make_generator(1, b, "cpu"), block=eos)
        for b in range(300)
    ]
    out = Sampler()(logits, rows).sampled_token_ids
    blocked = [tok for b, tok in enumerate(out) if b % 4 < 3]
    allowed = [tok for b, tok in enumerate(out) if b % 4 == 3]
    assert not set(blocked) & set(eos)
    assert len(set(blocked)) == (1 if temperature == 0.0 else 6)
    assert set(allowed) <= set(eos)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_row_with_everything_masked_falls_back_to_raw_argmax(temperature):
    logits = torch.tensor([[0.5, 2.0, -1.0, 1.0], [0.0, 0.0, 9.0, 0.0]])
    params = SamplingParams(temperature=temperature, min_tokens=1)
    rows = [make_row(params, block=[0, 1, 2, 3]), make_row(SamplingParams(temperature=0.0))]
    out = Sampler()(logits, rows)
    assert out.sampled_token_ids == [1, 2]
    assert all(math.isfinite(lp) for lp in out.sampled_logprobs)


def test_top_logprobs_content_and_sampled_rank():
    logits = torch.tensor([[2.0, 1.0, 0.5, 3.0, -1.0, 0.0]])
    raw_lp = logits.log_softmax(-1)[0].tolist()

    def run(logprobs: int | None):
        # Penalised greedy picks token 1, rank 3 in the raw distribution (3, 0, 1, ...).
        params = SamplingParams(temperature=0.0, repetition_penalty=10.0, logprobs=logprobs)
        return Sampler()(logits, [make_row(params, prompt=[3], output=[0])])

    out = run(2)
    assert out.sampled_token_ids == [1]
    assert out.sampled_logprobs == pytest.approx([raw_lp[1]])
    assert [(t, r) for t, _, r in out.top_logprobs[0]] == [(3, 1), (0, 2), (1, 3)]
    assert [lp for _, lp, _ in out.top_logprobs[0]] == pytest.approx([raw_lp[i] for i in (3, 0, 1)])
    assert [(t, r) for t, _, r in run(0).top_logprobs[0]] == [(1, 3)]
    assert [(t, r) for t, _, r in run(3).top_logprobs[0]] == [(3, 1), (0, 2), (1, 3)]
    assert [(t, r) for t, _, r in run(5).top_logprobs[0]] == [
        (3, 1),
        (0, 2),
        (1, 3),
        (2, 4),
        (5, 5),
    ]
    assert run(None).top_logprobs == [None]


def test_logprobs_are_of_the_raw_distribution_and_per_row():
    torch.manual_seed(3)
    logits = torch.randn(3, 30)
    rows = [
        make_row(SamplingParams(temperature=0.3, top_k=5, logprobs=4)),
        make_row(SamplingParams(logprobs=None)),
        make_row(SamplingParams(temperature=0.0, logprobs=1)),
    ]
    out = Sampler()(logits, rows)
    raw_lp = logits.log_softmax(-1)
    for b, tok in enumerate(out.sampled_token_ids):
        assert out.sampled_logprobs[b] == pytest.approx(raw_lp[b, tok].item(), abs=1e-6)
    top4 = raw_lp[0].topk(4)
    assert [t for t, _, _ in out.top_logprobs[0][:4]] == top4.indices.tolist()
    assert [lp for _, lp, _ in out.top_logprobs[0][:4]] == pytest.approx(top4.values.tolist())
    assert out.top_logprobs[1] is None
    assert out.top_logprobs[2] == [(out.sampled_token_ids[2], out.sampled_logprobs[2], 1)]


def test_greedy_logprobs_finite_with_masked_vocab():
    logits = torch.tensor([[1.0, NEG_INF, 0.0, NEG_INF]])
    out = Sampler()(logits, [make_row(SamplingParams(temperature=0.0, logprobs=4))])
    assert out.sampled_token_ids == [0]
    lps = [lp for _, lp, _ in out.top_logprobs[0]]
    assert all(math.isfinite(lp) for lp in [*lps, *out.sampled_logprobs])
    assert lps[2:] == [LOGPROB_FLOOR, LOGPROB_FLOOR]


def test_shape_mismatch_is_rejected():
    with pytest.raises(ValueError, match="logits must be"):
        Sampler()(torch.zeros(2, 5), [make_row()])


def test_random_sample_uses_each_rows_generator():
    probs = torch.full((3, 50), 1.0 / 50)
    gens = [make_generator(4, 0, "cpu"), None, make_generator(4, 0, "cpu")]
    out = random_sample(probs, gens).tolist()
    assert out[0] == out[2]


# ---------------------------------------------------------------------------------------------
# empirical distribution (20k draws as one batch of rows)

P4 = torch.tensor([0.1, 0.2, 0.3, 0.4])


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({}, P4),
        ({"temperature": 2.0}, torch.softmax(P4.log() / 2.0, -1)),
        ({"top_k": 2}, torch.tensor([0.0, 0.0, 3 / 7, 4 / 7])),
        ({"top_p": 0.6}, torch.tensor([0.0, 0.0, 3 / 7, 4 / 7])),
        ({"top_p": 0.75}, torch.tensor([0.0, 2 / 9, 3 / 9, 4 / 9])),
        ({"min_p": 0.6}, torch.tensor([0.0, 0.0, 3 / 7, 4 / 7])),
    ],
)
def test_empirical_frequencies_match(kwargs, expected):
    n = 20_000
    torch.manual_seed(0)
    out = Sampler()(P4.log().repeat(n, 1), [make_row(SamplingParams(**kwargs))] * n)
    freq = torch.bincount(torch.tensor(out.sampled_token_ids), minlength=4) / n
    assert torch.allclose(freq, expected, atol=0.02), (freq, expected)


def test_empirical_frequencies_match_with_seeded_rows():
    n = 20_000
    rows = [
        make_row(SamplingParams(seed=42), generator=make_generator(42, i, "cpu")) for i in range(n)
    ]
    out = Sampler()(P4.log().repeat(n, 1), rows)
    freq = torch.bincount(torch.tensor(out.sampled_token_ids), minlength=4) / n
    assert torch.allclose(freq, P4, atol=0.02), freq
