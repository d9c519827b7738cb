"""The ``extraction-json`` workload: extraction prompts, each with a JSON schema of 5-10 fields,
run constrained (structured outputs) and unconstrained in the same process.

The constrained run ends each request where its grammar completes (greedy, ``max_tokens``
`MAX_TOKENS`); the unconstrained run then generates exactly as many tokens per request
(``ignore_eos``, ``max_tokens`` = the constrained output's length), so both do the same work
(each mode runs twice, in the order constrained, unconstrained, unconstrained, constrained, and
keeps its faster run)
and their tokens/s compare: issue 16's target is constrained >= 0.9x unconstrained (the
schemas are compiled in a warm-up, as a long job compiles each once). Reported
too: the ``grammar_mask`` stage's share of the constrained run (the matcher's mask and advance
work; applying the masks is in ``sampling``), the share of requests that ended with ``stop``
and how many of those parse and validate against their schema.
"""

from __future__ import annotations

import json
import random
import time

from batchgen.bench.workloads import _log_uniform, _prompt

MAX_TOKENS = 256
NUM_REQUESTS, QUICK_NUM_REQUESTS = 64, 16

_STR = {"type": "string", "maxLength": 16}
# Four extraction schemas of 5 to 10 fields (the "5-10 fields"), strict-style.
SCHEMAS: list[dict] = [
    {
        "type": "object",
        "properties": {
            "invoice_id": {"type": "string", "pattern": "^INV-[0-9]{4}$"},
            "vendor": _STR,
            "total": {"type": "number", "minimum": 0, "maximum": 100000},
            "currency": {"enum": ["USD", "EUR", "GBP"]},
            "paid": {"type": "boolean"},
        },
        "required": ["invoice_id", "vendor", "total", "currency", "paid"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "name": _STR,
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "email": {"type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.com$"},
            "city": _STR,
            "country": {"enum": ["FR", "DE", "US", "JP"]},
            "employed": {"type": "boolean"},
            "skills": {"type": "array", "items": _STR, "maxItems": 3},
        },
        "required": ["name", "age", "email", "city", "country", "employed", "skills"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "title": _STR,
            "authors": {"type": "array", "items": _STR, "minItems": 1, "maxItems": 3},
            "year": {"type": "integer", "minimum": 1900, "maximum": 2030},
            "venue": _STR,
            "pages": {"type": "integer", "minimum": 1, "maximum": 999},
            "doi": {"type": "string", "pattern": "^10\\.[0-9]{4}/[a-z0-9]{1,8}$"},
            "open_access": {"type": "boolean"},
            "field": {"enum": ["cs", "bio", "physics", "math"]},
        },
        "required": ["title", "authors", "year", "venue", "pages", "doi", "open_access", "field"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "order_id": {"type": "integer", "minimum": 1, "maximum": 999999},
            "customer": _STR,
            "status": {"enum": ["pending", "shipped", "delivered", "returned"]},
            "items": {"type": "integer", "minimum": 1, "maximum": 50},
            "subtotal": {"type": "number", "minimum": 0, "maximum": 10000},
            "tax": {"type": "number", "minimum": 0, "maximum": 1000},
            "express": {"type": "boolean"},
            "carrier": {"enum": ["ups", "dhl", "fedex"]},
            "date": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"},
            "note": _STR,
        },
        "required": ["order_id", "customer", "status", "items", "subtotal", "tax", "express"],
        "additionalProperties": False,
    },
]


def make_extraction_json(
    vocab_size: int, quick: bool, seed: int = 0
) -> list[tuple[list[int], dict]]:
    """``(prompt_token_ids, schema)`` per request: the extraction workload's prompts (512-2048
    tokens, 128-512 in quick mode, log-uniform), schemas in turn."""
    rng = random.Random(seed)
    low, high = (128, 512) if quick else (512, 2048)
    num = QUICK_NUM_REQUESTS if quick else NUM_REQUESTS
    return [
        (_prompt(rng, _log_uniform(rng, low, high), vocab_size), SCHEMAS[i % len(SCHEMAS)])
        for i in range(num)
    ]


def run_extraction_json(
    path: str, quick: bool, policy: str, engine_kwargs: dict, vocab_size: int
) -> dict:
    """Both runs of the workload on one engine; the record's ``extraction-json`` entry."""
    from batchgen import LLM, SamplingParams

    requests = make_extraction_json(vocab_size, quick)
    llm = LLM(path, scheduler_policy=policy, **engine_kwargs)
    # Warm-up, grammars included: a million-line job compiles each schema once, so the timed
    # runs compare steady-state decoding (the compile's cost is in docs/structured-outputs.md).
    warm = [
        SamplingParams(max_tokens=4, temperature=0.0, structured_outputs={"json": s})
        for s in SCHEMAS
    ]
    llm.generate([[1, 5, 6, 7]] * len(warm), warm, use_tqdm=False)
    prompts = [{"prompt_token_ids": ids} for ids, _ in requests]

    def timed(params: list[SamplingParams]) -> tuple[list, float, dict]:
        llm.llm_engine.reset_metrics()
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        return outs, time.perf_counter() - t0, llm.get_metrics()

    constrained = [
        SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, structured_outputs={"json": s})
        for _, s in requests
    ]
    c_outs, c_secs, c_metrics = timed(constrained)
    lengths = [len(o.outputs[0].token_ids) for o in c_outs]
    free = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in lengths]
    # Order A B B A, each mode's faster run kept: the machine's load and the allocator's
    # warm-up move a single run by 5-10% on 2 shared cores.
    free_runs = [timed(free), timed(free)]
    u_outs, u_secs, u_metrics = min(free_runs, key=lambda run: run[1])
    again = timed(constrained)
    runs_seconds = {
        "constrained": [c_secs, again[1]],
        "unconstrained": [run[1] for run in free_runs],
    }
    if again[1] < c_secs:
        c_outs, c_secs, c_metrics = again
    llm.shutdown()

    stopped = [(o.outputs[0], s) for o, (_, s) in zip(c_outs, requests)]
    stopped = [(sample, s) for sample, s in stopped if sample.finish_reason == "stop"]
    valid = sum(_valid(sample.text, schema) for sample, schema in stopped)
    tokens = sum(lengths)
    return {
        "requests": len(requests),
        "policy": policy,
        "generated_tokens": tokens,
        "constrained": _mode(tokens, c_secs, c_metrics),
        "unconstrained": _mode(sum(len(o.outputs[0].token_ids) for o in u_outs), u_secs, u_metrics),
        "ratio": (tokens / c_secs) / (tokens / u_secs),
        "runs_seconds": runs_seconds,
        "stop_share": len(stopped) / len(requests),
        "valid_share_of_stopped": valid / len(stopped) if stopped else None,
    }


def _mode(tokens: int, seconds: float, metrics: dict) -> dict:
    return {
        "tokens_per_s": tokens / seconds,
        "seconds": seconds,
        "stage_time_share": metrics["stage_time_share"],
    }


def _valid(text: str, schema: dict) -> bool:
    """Parses as JSON and validates against ``schema`` (with ``jsonschema`` when installed,
    else only parses)."""
    try:
        value = json.loads(text)
    except ValueError:
        return False
    try:
        import jsonschema
    except ImportError:  # a test extra; without it the bench reports "parses"
        return True
    try:
        jsonschema.validate(value, schema)
    except jsonschema.ValidationError:
        return False
    return True


def format_extraction_json(entry: dict) -> list[str]:
    """The table's lines for the workload."""
    c, u = entry["constrained"], entry["unconstrained"]
    valid = entry["valid_share_of_stopped"]
    shares = ", ".join(f"{k} {v:.3f}" for k, v in c["stage_time_share"].items() if v >= 0.0005)
    return [
        "",
        f"extraction-json ({entry['requests']} requests, {entry['policy']}, "
        f"{entry['generated_tokens']} tokens each run): constrained {c['tokens_per_s']:.1f} "
        f"tok/s, unconstrained {u['tokens_per_s']:.1f} tok/s, ratio {entry['ratio']:.3f} "
        "(target >= 0.9)",
        "  seconds per run: constrained (1st, 4th) "
        + ", ".join(f"{x:.1f}" for x in entry["runs_seconds"]["constrained"])
        + "; unconstrained (2nd, 3rd) "
        + ", ".join(f"{x:.1f}" for x in entry["runs_seconds"]["unconstrained"]),
        f"  ended with stop: {entry['stop_share']:.0%}; schema-valid among them: "
        + ("-" if valid is None else f"{valid:.0%}"),
        f"  constrained stage shares: {shares}",
    ]
