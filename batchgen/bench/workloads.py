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
- ``tree-search`` (only when named, `make_tree_search`): trees of branching 4 and depth 3
  (levels 0-3: 1 + 4 + 16 + 64 = 85 nodes per tree). Level 0 is a root prompt of 512-1024
  tokens (a problem statement); a node of level d > 0 extends its parent: its prompt is the
  parent's prompt + the parent's generated tokens + a short suffix of 4-16 tokens, distinct
  among siblings (the branch's next instruction). Each node generates one step of 16-32 tokens
  (32-128 in full mode). The prompts of a level exist only once the level before has generated,
  so it runs one ``generate`` per level (`TreeSearch.run`). 8 trees, 2 in quick mode.

Every request ignores EOS, so every mode does exactly the same useful work: ``output_len``
tokens per sample. Prompts are random token ids (the model has random weights anyway).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
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

    @property
    def num_requests(self) -> int:
        return len(self.requests)

    @property
    def num_sequences(self) -> int:
        return sum(r.n for r in self.requests)

    def shapes(self) -> list[tuple[int, int, int]]:
        """``(prompt_len, output_len, n)`` of every request, in order."""
        return [(len(r.prompt_token_ids), r.output_len, r.n) for r in self.requests]


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


TREE_BRANCHING = 4
TREE_DEPTH = 3


@dataclass(frozen=True)
class TreeSearch:
    """The ``tree-search`` workload (see the module docstring): its random parts, fixed by the
    seed; the prompts below the roots come from the outputs, so `run` builds them level by
    level. Nodes are numbered per level over all trees: node i of level d (d > 0) is child
    ``i % branching`` of node ``i // branching`` of level d - 1 (tree ``i // branching**d``).

    Attributes:
        roots: ``[num_trees]`` root prompts (token ids).
        suffixes: ``[depth + 1][num_trees * branching**d]`` token ids appended after the
            parent's output (level 0's are empty).
        output_lens: ``[depth + 1][num_trees * branching**d]`` tokens each node generates.
    """

    name: str
    roots: list[list[int]]
    suffixes: list[list[list[int]]]
    output_lens: list[list[int]]
    branching: int = TREE_BRANCHING

    @property
    def depth(self) -> int:
        return len(self.output_lens) - 1

    @property
    def num_requests(self) -> int:
        return sum(len(level) for level in self.output_lens)

    num_sequences = num_requests

    @property
    def useful_tokens(self) -> int:
        return sum(map(sum, self.output_lens))

    def prompt_lens(self) -> list[list[int]]:
        """``[depth + 1][nodes]`` prompt lengths: fixed before any output exists, since every
        node generates exactly its ``output_lens`` entry (``ignore_eos``)."""
        lens = [[len(r) for r in self.roots]]
        for d in range(1, self.depth + 1):
            lens.append(
                [
                    lens[d - 1][i // self.branching]
                    + self.output_lens[d - 1][i // self.branching]
                    + len(suffix)
                    for i, suffix in enumerate(self.suffixes[d])
                ]
            )
        return lens

    @property
    def prompt_tokens(self) -> int:
        return sum(map(sum, self.prompt_lens()))

    def shapes(self) -> list[tuple[int, int, int]]:
        """``(prompt_len, output_len, 1)`` of every node, level by level."""
        return [
            (p, o, 1)
            for lens, outs in zip(self.prompt_lens(), self.output_lens)
            for p, o in zip(lens, outs)
        ]

    def children(self, level: int, parents: list[BenchRequest], outputs: list[list[int]]):
        """The requests of ``level`` (>= 1) from level ``level - 1``'s requests and their
        generated token ids: each child's prompt is its parent's prompt + output + suffix."""
        return [
            BenchRequest(
                parents[i // self.branching].prompt_token_ids
                + list(outputs[i // self.branching])
                + suffix,
                self.output_lens[level][i],
            )
            for i, suffix in enumerate(self.suffixes[level])
        ]

    def run(
        self, generate: Callable[[list[BenchRequest]], list[list[int]]]
    ) -> list[tuple[BenchRequest, list[int]]]:
        """Generate the whole tree, one ``generate`` call per level (each call gets a level's
        requests and returns their generated token ids, in order). Returns every node's
        ``(request, output token ids)``, level by level.

        Raises:
            RuntimeError: ``generate`` returned another count of outputs or of tokens.
        """
        nodes: list[tuple[BenchRequest, list[int]]] = []
        requests = [BenchRequest(root, n) for root, n in zip(self.roots, self.output_lens[0])]
        outputs: list[list[int]] = []
        for level in range(self.depth + 1):
            if level:
                requests = self.children(level, requests, outputs)
            outputs = generate(requests)
            got = [len(o) for o in outputs]
            if got != [r.output_len for r in requests]:
                raise RuntimeError(
                    f"{self.name} level {level}: generate returned output lengths {got[:8]}..."
                    f" for {len(requests)} requests of lengths "
                    f"{[r.output_len for r in requests][:8]}..."
                )
            nodes.extend(zip(requests, outputs))
        return nodes


def make_tree_search(vocab_size: int, quick: bool, seed: int = 0) -> TreeSearch:
    """The ``tree-search`` workload (see the module docstring); deterministic for a seed."""
    rng = random.Random(seed)
    num_trees = 2 if quick else 8
    o_lo, o_hi = (16, 32) if quick else (32, 128)
    roots = [_prompt(rng, rng.randint(512, 1024), vocab_size) for _ in range(num_trees)]
    suffixes: list[list[list[int]]] = [[[] for _ in roots]]
    output_lens = [[_log_uniform(rng, o_lo, o_hi) for _ in roots]]
    for d in range(1, TREE_DEPTH + 1):
        level: list[list[int]] = []
        for _ in range(num_trees * TREE_BRANCHING ** (d - 1)):
            siblings: list[list[int]] = []
            while len(siblings) < TREE_BRANCHING:
                suffix = [rng.randrange(5, vocab_size) for _ in range(rng.randint(4, 16))]
                if suffix not in siblings:
                    siblings.append(suffix)
            level += siblings
        suffixes.append(level)
        output_lens.append([_log_uniform(rng, o_lo, o_hi) for _ in level])
    return TreeSearch("tree-search", roots, suffixes, output_lens)
