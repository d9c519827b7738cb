"""A `StructuredOutputsParams` spec -> an llguidance grammar, and its tokenizer-free check.

The grammar engine is llguidance (guidance-ai/llguidance, on PyPI as ``llguidance``; no runtime
dependencies). Why it and not xgrammar or outlines-core: docs/structured-outputs.md, "The
grammar engine". Every spec kind becomes llguidance's grammar text:

* ``json``: the schema compiled by llguidance's JSON Schema compiler, compact separators
  (``,`` and ``:``, no free whitespace: fewer tokens, and no way for a model to loop on
  spaces), unknown or unenforceable keywords an error (not ``lenient``);
* ``json_object``: the schema ``{"type": "object"}``;
* ``regex``: the regex as the whole output;
* ``choice``: the Lark grammar ``start: "a" | "b" | ...``;
* ``grammar``: Lark as is, GBNF (a ``::=`` rule) converted to Lark by llguidance.
"""

from __future__ import annotations

import json
from functools import lru_cache

from batchgen.structured.params import StructuredOutputsParams

# llguidance's JSON compile options (`JsonCompileOptions`).
JSON_OPTIONS = {"item_separator": ",", "key_separator": ":", "whitespace_flexible": False}
# Distinct specs whose check result is remembered (a batch file of a million lines usually
# has a handful of schemas).
CHECK_CACHE_SIZE = 1024


class GrammarError(ValueError):
    """A spec the grammar engine refuses. ``str(err)`` starts with ``structured_outputs.<kind>``
    (the field), then says what is wrong. ``code`` and ``param`` are the OpenAI error's (the
    HTTP and batch layers name the body field that carried the spec instead)."""

    code = "invalid_request"
    param = "structured_outputs"


def grammar_text(kind: str, value: str) -> str:
    """llguidance's grammar text for the spec ``(kind, value)`` (`StructuredOutputsParams.key`).

    Raises:
        GrammarError: the value cannot even be turned into grammar text (e.g. a GBNF grammar
            that does not parse); most errors surface later, in `check_spec` / the matcher.
    """
    from llguidance import LLMatcher
    from llguidance.gbnf_to_lark import any_to_lark

    try:
        if kind == "json":
            return LLMatcher.grammar_from_json_schema(value, defaults=JSON_OPTIONS)
        if kind == "json_object":
            return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
        if kind == "regex":
            return LLMatcher.grammar_from_regex(value)
        if kind == "choice":
            options = json.loads(value)
            return LLMatcher.grammar_from_lark("start: " + " | ".join(map(json.dumps, options)))
        if kind == "grammar":
            return LLMatcher.grammar_from_lark(any_to_lark(value))
    except Exception as err:  # the GBNF converter raises its own GbnfToLarkError
        raise GrammarError(f"structured_outputs.{kind} is invalid: {err}") from None
    raise GrammarError(f"unknown structured output kind {kind!r}")


@lru_cache(maxsize=CHECK_CACHE_SIZE)
def _check(kind: str, value: str) -> str:
    """The engine's error for ``(kind, value)``, or "" when it is a valid grammar."""
    from llguidance import LLMatcher

    try:
        text = grammar_text(kind, value)
    except GrammarError as err:
        return str(err)
    error = LLMatcher.validate_grammar(text, None)
    return f"structured_outputs.{kind} is invalid: {error.strip()}" if error else ""


def check_spec(spec: StructuredOutputsParams) -> None:
    """Check ``spec`` with the grammar engine, without a tokenizer (about 0.1-2 ms the first
    time for a spec, a dictionary look-up after that).

    Catches what is wrong in the spec itself: an invalid or unsupported JSON Schema (an
    unknown type or format, a ``$ref`` to nowhere, a ``pattern`` with look-around), a regex
    that does not compile, a grammar with a syntax error or an undefined rule. What depends on
    the vocabulary (a grammar no token can start) is found when the engine compiles it.

    Raises:
        GrammarError: with the engine's message, prefixed by the field.
    """
    error = _check(*spec.key)
    if error:
        raise GrammarError(error)
