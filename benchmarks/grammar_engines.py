"""Grammar engines side by side: the measurement that chose llguidance for structured outputs.

    .venv/bin/python benchmarks/grammar_engines.py [--tokenizer DIR] [--vocab-size N]

For llguidance (a BatchGen dependency) and, when installed, xgrammar and outlines-core (pip
install them into a scratch environment; they are not dependencies): the time to build the
engine's view of the vocabulary, to compile an 8-field JSON schema (cold, then a second schema),
and per generated token the time to compute the next-token mask and to advance the matcher,
averaged over a compact JSON value that validates against the schema. The tokenizer defaults to
the default model's (byte-level BPE, 512 tokens). Prints one line per engine.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

VALUE = {
    "invoice_id": "INV-0042",
    "vendor": "Acme Widgets Ltd",
    "total": 1234.5,
    "currency": "EUR",
    "date": "2024-03-01",
    "paid": True,
    "lines": [{"sku": "A-1", "qty": 3}, {"sku": "B-22", "qty": 10}],
}


def schema(variant: int) -> dict:
    """An 8-field extraction schema; ``variant`` renames the optional field (a new spec)."""
    line = {
        "type": "object",
        "properties": {
            "sku": {"type": "string", "maxLength": 12},
            "qty": {"type": "integer", "minimum": 1, "maximum": 99},
        },
        "required": ["sku", "qty"],
        "additionalProperties": False,
    }
    return {
        "type": "object",
        "properties": {
            "invoice_id": {"type": "string", "pattern": "^INV-[0-9]{4}$"},
            "vendor": {"type": "string", "maxLength": 40},
            "total": {"type": "number", "minimum": 0, "maximum": 100000},
            "currency": {"enum": ["USD", "EUR", "GBP"]},
            "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
            "paid": {"type": "boolean"},
            "lines": {"type": "array", "maxItems": 5, "items": line},
            f"note_{variant}": {"type": "string", "maxLength": 30},
        },
        "required": ["invoice_id", "vendor", "total", "currency", "date", "paid", "lines"],
        "additionalProperties": False,
    }


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def walk(ids, reset, mask_fn, advance_fn, reps: int = 5) -> tuple[float, float]:
    """Mean seconds per token of ``mask_fn()`` and ``advance_fn(token)`` over ``ids``, the
    matcher ``reset()`` before each of ``reps`` walks."""
    mask = advance = 0.0
    for _ in range(reps):
        reset()
        for token in ids:
            mask += timed(mask_fn)[1]
            ok, seconds = timed(lambda t=token: advance_fn(t))
            advance += seconds
            assert ok is not False, f"token {token} rejected"
    n = reps * len(ids)
    return mask / n, advance / n


def llguidance_row(tok, vocab: int, ids: list[int]) -> dict:
    import llguidance
    import llguidance.hf

    lltok, t_vocab = timed(lambda: llguidance.hf.from_tokenizer(tok, n_vocab=vocab))
    options = {"item_separator": ",", "key_separator": ":", "whitespace_flexible": False}

    def compile_(i):
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema(i), defaults=options)
        return llguidance.LLMatcher(lltok, grammar, log_level=0)

    matcher, t_cold = timed(lambda: compile_(0))
    _, t_second = timed(lambda: compile_(1))
    bitmask = torch.zeros((1, (vocab + 31) // 32), dtype=torch.int32)
    mask, advance = walk(
        ids,
        matcher.reset,
        lambda: matcher.unsafe_compute_mask_ptr(bitmask.data_ptr(), bitmask.numel() * 4),
        matcher.consume_token,
    )
    return dict(vocab=t_vocab, cold=t_cold, second=t_second, mask=mask, advance=advance)


def xgrammar_row(tok, vocab: int, ids: list[int]) -> dict:
    import xgrammar as xgr

    def setup():
        info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab)
        return xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)

    compiler, t_vocab = timed(setup)

    def compile_(i):
        compiled = compiler.compile_json_schema(
            json.dumps(schema(i)), any_whitespace=False, separators=(",", ":")
        )
        return xgr.GrammarMatcher(compiled)

    matcher, t_cold = timed(lambda: compile_(0))
    _, t_second = timed(lambda: compile_(1))
    bitmask = xgr.allocate_token_bitmask(1, vocab)
    mask, advance = walk(
        ids,
        matcher.reset,
        lambda: matcher.fill_next_token_bitmask(bitmask, 0),
        matcher.accept_token,
    )
    return dict(vocab=t_vocab, cold=t_cold, second=t_second, mask=mask, advance=advance)


def outlines_core_row(tok, vocab: int, ids: list[int]) -> dict:
    from outlines_core import Guide, Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema

    def setup():
        tokens: dict[str, list[int]] = {}
        for i in range(len(tok)):
            if i != tok.eos_token_id and i not in tok.all_special_ids:
                tokens.setdefault(tok.convert_ids_to_tokens(i), []).append(i)
        return Vocabulary(tok.eos_token_id, tokens)

    vocabulary, t_vocab = timed(setup)

    def compile_(i):
        regex = build_regex_from_schema(json.dumps(schema(i)), whitespace_pattern="")
        return Index(regex, vocabulary)

    index, t_cold = timed(lambda: compile_(0))
    _, t_second = timed(lambda: compile_(1))
    guide = [Guide(index)]

    def reset():
        guide[0] = Guide(index)

    mask, advance = walk(ids, reset, lambda: guide[0].get_tokens(), lambda t: guide[0].advance(t))
    return dict(vocab=t_vocab, cold=t_cold, second=t_second, mask=mask, advance=advance)


def main() -> None:
    from transformers import AutoTokenizer

    from batchgen.models.default_model import default_model_path

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokenizer", default=None, help="tokenizer dir (default: the default model)")
    p.add_argument("--vocab-size", type=int, default=None, help="default: the tokenizer's size")
    args = p.parse_args()
    tok = AutoTokenizer.from_pretrained(args.tokenizer or default_model_path())
    vocab = args.vocab_size or len(tok)
    ids = tok.encode(json.dumps(VALUE, separators=(",", ":")), add_special_tokens=False)
    print(f"vocabulary {vocab} tokens; the JSON value is {len(ids)} tokens")
    rows = [
        ("llguidance", llguidance_row),
        ("xgrammar", xgrammar_row),
        ("outlines-core", outlines_core_row),
    ]
    for name, row in rows:
        try:
            r = row(tok, vocab, ids)
        except ImportError:
            print(f"{name:<14} not installed")
            continue
        print(
            f"{name:<14} vocabulary {r['vocab'] * 1e3:7.1f} ms | compile cold "
            f"{r['cold'] * 1e3:8.2f} ms, 2nd schema {r['second'] * 1e3:8.2f} ms | mask "
            f"{r['mask'] * 1e6:7.1f} us/token | advance {r['advance'] * 1e6:6.1f} us/token"
        )


if __name__ == "__main__":
    main()
