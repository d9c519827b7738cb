"""What a request asks its output to match: vLLM's `StructuredOutputsParams`.

Pure Python (no torch, no grammar engine at import), like `batchgen.sampling_params`, so that a
client process can build requests without the engine. The grammar engine checks the spec itself
in `batchgen.structured.grammar.check_spec`, which `SamplingParams` calls on construction.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

# The fields of which exactly one must be set, in vLLM's order and with vLLM's names.
SPEC_FIELDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass
class StructuredOutputsParams:
    """Constrain a request's output to a JSON schema, a regex, a choice or a grammar.

    Exactly one of the fields is set (vLLM's rule):

    Attributes:
        json: a JSON Schema, as a dict or as JSON text; the output is one JSON value that
            validates against it. ``strict`` OpenAI schemas and the usual keywords (``type``,
            ``properties``, ``required``, ``additionalProperties``, ``items``, ``enum``,
            ``const``, ``anyOf``, ``$ref``/``$defs``, ``minimum``/``maximum``, ``minLength``/
            ``maxLength``, ``pattern``, ``minItems``/``maxItems``, ``format``) are supported;
            a keyword the grammar engine cannot enforce is an error, never ignored silently.
        regex: the output matches this regular expression as a whole (Rust ``regex`` syntax:
            no look-around, no back-references).
        choice: the output is exactly one of these strings (a non-empty list).
        grammar: a context-free grammar, in Lark syntax (``start: ...``) or GBNF (llama.cpp's,
            ``root ::= ...``); the output is a sentence of it.
        json_object: the output is any JSON object (OpenAI's ``{"type": "json_object"}``).

    Raises:
        ValueError: none or several fields set, or a field of the wrong type; the message names
            the field as ``structured_outputs.<field>``.
    """

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def __post_init__(self) -> None:
        given = [name for name in SPEC_FIELDS if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            what = "none" if not given else ", ".join(given)
            raise ValueError(
                "structured_outputs must set exactly one of json, regex, choice, grammar or "
                f"json_object, got {what}"
            )
        if isinstance(self.json, str):
            try:
                self.json = json.loads(self.json)
            except ValueError as err:
                raise ValueError(f"structured_outputs.json is not valid JSON text: {err}") from None
        if self.json is not None and not isinstance(self.json, (dict, bool)):
            raise ValueError(
                "structured_outputs.json must be a JSON Schema (an object), "
                f"got {type(self.json).__name__}"
            )
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string")
        if self.choice is not None:
            ok = isinstance(self.choice, (list, tuple)) and self.choice
            if not ok or not all(isinstance(c, str) and c for c in self.choice):
                raise ValueError(
                    "structured_outputs.choice must be a non-empty list of non-empty strings"
                )
            self.choice = list(self.choice)
        if self.json_object is not None and not isinstance(self.json_object, bool):
            raise ValueError("structured_outputs.json_object must be a boolean")

    @property
    def kind(self) -> str:
        """The field that is set: ``"json"``, ``"regex"``, ``"choice"``, ``"grammar"`` or
        ``"json_object"``."""
        return next(name for name in SPEC_FIELDS if getattr(self, name) not in (None, False))

    @property
    def key(self) -> tuple[str, str]:
        """``(kind, text)``: the grammar cache's key, and what the grammar is built from. A
        schema's key order counts (properties are generated in the order the schema lists
        them, as OpenAI does), whitespace does not."""
        kind = self.kind
        value: Any = getattr(self, kind)
        if kind in ("json", "choice"):
            return kind, json.dumps(value, separators=(",", ":"), ensure_ascii=False)
        return kind, "" if kind == "json_object" else value
