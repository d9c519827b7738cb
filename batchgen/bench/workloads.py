"""Benchmark workloads, scaled to a 2-core CPU from the seed paper's (DESIGN.md):

- ``rollouts``: prompts 32-1024 tokens, outputs 16-512 tokens, both log-uniform (RL rollouts);
  `ROLLOUTS_REQUESTS` requests (24 with prompts and outputs a quarter as long in quick mode).
  RL rollout batches are large, and the count decides how full an expert GEMM can be: a
  decode step carries one token per running sequence, so 128 requests cap experts at 16 rows
  (top-8 of 64) however the executor batches, and the log-uniform tail leaves a few sequences
  decoding alone for hundreds of steps at the end of any run. That drain tail costs about the
  same tile waste whatever the request count, so a larger batch amortises it: a simulation of
  the scheduler with uniform routing (it matched the measured tile density within 0.012 at 512
  and 2,048 requests) gives 0.85 at 2,048 requests and 0.92 at 4,096.
- ``extraction``: prompts 512-2048 tokens, outputs 16-64 tokens (document extraction).
- ``search``: 64 prompts with ``n`` = 16 samples each, outputs 16-512 tokens (48 prompts and
  outputs 16-24 in quick mode) (test-time search).
- ``shared-docs`` (only when named, `make_shared_docs`): documents of 1,000-2,000 tokens with
  16 questions each (16-64 tokens), outputs 16-64 tokens: every prompt is a document followed by
  a question, grouped by document (extraction with many questions per document; what the prefix
  cache is for). 8 documents, 2 in quick mode.

Every request ignores EOS, so every mode does exactly the same useful work: ``output_len``
tokens per sample. Prompts are random token ids (the model has random weights anyway).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass


@dataclass(frozen=True)
class BenchRequest:
    prompt_token_ids: list[int]
    output_len: int
    n: int = 1


@dataclass(frozen=True)
class Workload:
    name: str
    requests: list[BenchRequest]

    @property
    def useful_tokens(self) -> int:
        """Generated tokens every mode must produce (outputs times samples)."""
        return sum(r.output_len * r.n for r in self.requests)

    @property
    def prompt_tokens(self) -> int:
        return sum(len(r.prompt_token_ids) for r in self.requests)


def _log_uniform(rng: random.Random, low: int, high: int) -> int:
    return int(round(math.exp(rng.uniform(math.log(low), math.log(high)))))


def _prompt(rng: random.Random, length: int, vocab_size: int) -> list[int]:
    # Ids from 5 up: clear of the tokenizer's special tokens.
    return [1] + [rng.randrange(5, vocab_size) for _ in range(length - 1)]


ROLLOUTS_REQUESTS = 4096
QUICK_ROLLOUTS_REQUESTS = 24


def make_workloads(
    vocab_size: int, quick: bool, seed: int = 0, rollouts_requests: int | None = None
) -> list[Workload]:
    """The three workloads; ``quick`` shrinks counts and lengths so that every mode of every
    workload finishes in about a minute on 2 CPU cores. ``rollouts_requests`` overrides the
    rollouts request count (`ROLLOUTS_REQUESTS`, `QUICK_ROLLOUTS_REQUESTS`)."""
    if rollouts_requests is not None and rollouts_requests < 1:
        raise ValueError(f"rollouts_requests must be >= 1, got {rollouts_requests}")
    rng = random.Random(seed)
    scale = 0.25 if quick else 1.0

    def lengths(low: int, high: int) -> tuple[int, int]:
        return max(low, int(low * scale)), max(low, int(high * scale))

    out = []
    num = rollouts_requests or (QUICK_ROLLOUTS_REQUESTS if quick else ROLLOUTS_REQUESTS)
    p_lo, p_hi = lengths(32, 1024)
    o_lo, o_hi = lengths(16, 512)
    out.append(
        Workload(
            "rollouts",
            [
                BenchRequest(
                    _prompt(rng, _log_uniform(rng, p_lo, p_hi), vocab_size),
                    _log_uniform(rng, o_lo, o_hi),
                )
                for _ in range(num)
            ],
        )
    )
    num = 8 if quick else 64
    p_lo, p_hi = lengths(512, 2048)
    out.append(
        Workload(
            "extraction",
            [
                BenchRequest(
                    _prompt(rng, _log_uniform(rng, p_lo, p_hi), vocab_size),
                    _log_uniform(rng, 16, 64),
                )
                for _ in range(num)
            ],
        )
    )
    # Search keeps 16 samples per prompt and 48 prompts in quick mode: 768 sequences at once is
    # still the regime coalescing exists for (more decode tokens than one attention micro-batch).
    o_lo, o_hi = (16, 24) if quick else (16, 512)
    num = 48 if quick else 64
    out.append(
        Workload(
            "search",
            [
                BenchRequest(
                    _prompt(rng, _log_uniform(rng, 32, 256), vocab_size),
                    _log_uniform(rng, o_lo, o_hi),
                    n=16,
                )
                for _ in range(num)
            ],
        )
    )
    return out


SHARED_DOCS_QUESTIONS = 16


def make_shared_docs(vocab_size: int, quick: bool, seed: int = 0) -> Workload:
    """The ``shared-docs`` workload (see the module docstring); deterministic for a seed."""
    rng = random.Random(seed)
    requests = []
    for _ in range(2 if quick else 8):
        doc = _prompt(rng, rng.randint(1000, 2000), vocab_size)
        for _ in range(SHARED_DOCS_QUESTIONS):
            question = [rng.randrange(5, vocab_size) for _ in range(_log_uniform(rng, 16, 64))]
            requests.append(BenchRequest(doc + question, _log_uniform(rng, 16, 64)))
    return Workload("shared-docs", requests)
