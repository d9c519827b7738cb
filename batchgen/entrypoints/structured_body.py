"""The structured-output fields of an OpenAI / vLLM request body -> `StructuredOutputsParams`.

Accepted, at most one per body (so that the field an error names is the one that set it):

* OpenAI's ``response_format``: ``{"type": "text"}`` (no constraint), ``{"type":
  "json_object"}``, ``{"type": "json_schema", "json_schema": {"name", "schema", "strict",
  "description"}}``. ``strict`` may be true or false: the output is constrained to the schema
  either way.
* vLLM's ``structured_outputs``: ``{"json" | "regex" | "choice" | "grammar" | "json_object":
  ...}``;
* vLLM's older fields ``guided_json``, ``guided_regex``, ``guided_choice``, ``guided_grammar``
  (``guided_decoding_backend`` is accepted and ignored: BatchGen has one grammar engine).

The grammar engine checks the spec when `SamplingParams` is built; `param_for` turns the field
named in its message (``structured_outputs.json``) into the body field that carried it.
"""

from __future__ import annotations

from typing import Any

from batchgen.structured.params import SPEC_FIELDS

# vLLM's old body fields -> the `StructuredOutputsParams` field each one sets.
GUIDED_FIELDS = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}
STRUCTURED_BODY_FIELDS = frozenset(
    {"response_format", "structured_outputs", "guided_decoding_backend", *GUIDED_FIELDS}
)
RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema")


class BodyFieldError(ValueError):
    """A malformed structured-output field; ``param`` is its dotted path in the body and
    ``code`` the OpenAI error code."""

    def __init__(self, message: str, param: str, code: str = "invalid_request") -> None:
        super().__init__(message)
        self.param = param
        self.code = code


def parse_structured_fields(body: dict[str, Any]) -> tuple[dict[str, Any] | None, str | None]:
    """``(spec, field)``: the `StructuredOutputsParams` fields a body asks for (None when it
    asks for none) and the dotted body path that carried them (named in errors), e.g.
    ``({"json": {...}}, "response_format.json_schema.schema")``.

    Raises:
        BodyFieldError: two fields ask for a structure, or one is malformed (wrong type, an
            unknown ``response_format`` type, a ``json_schema`` without ``schema``).
    """
    found: list[tuple[dict[str, Any], str]] = []
    response_format = body.get("response_format")
    if response_format is not None:
        parsed = _response_format(response_format)
        if parsed is not None:
            found.append(parsed)
    structured = body.get("structured_outputs")
    if structured is not None:
        if not isinstance(structured, dict):
            raise BodyFieldError(
                f"'structured_outputs' must be an object with one of {', '.join(SPEC_FIELDS)}",
                "structured_outputs",
            )
        unknown = sorted(k for k in structured if k not in SPEC_FIELDS)
        if unknown:
            raise BodyFieldError(
                f"'structured_outputs.{unknown[0]}' is not supported by BatchGen (supported: "
                f"{', '.join(SPEC_FIELDS)})",
                f"structured_outputs.{unknown[0]}",
                code="unsupported_parameter",
            )
        given = [k for k in SPEC_FIELDS if structured.get(k) not in (None, False)]
        found.append(
            (
                dict(structured),
                f"structured_outputs.{given[0]}" if len(given) == 1 else "structured_outputs",
            )
        )
    for name, field in GUIDED_FIELDS.items():
        if body.get(name) is not None:
            found.append(({field: body[name]}, name))
    if len(found) > 1:
        first, second = found[0][1].split(".")[0], found[1][1].split(".")[0]
        raise BodyFieldError(
            f"'{second}' and '{first}' both constrain the output; give only one of them",
            second,
        )
    return found[0] if found else (None, None)


def _response_format(value: Any) -> tuple[dict[str, Any], str] | None:
    if not isinstance(value, dict) or value.get("type") not in RESPONSE_FORMAT_TYPES:
        kind = value.get("type") if isinstance(value, dict) else None
        raise BodyFieldError(
            '\'response_format\' must be {"type": "text"}, {"type": "json_object"} or '
            '{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}'
            + (f"; type {kind!r} is not supported" if isinstance(kind, str) else ""),
            "response_format.type" if isinstance(value, dict) else "response_format",
            code="unsupported_parameter" if isinstance(kind, str) else "invalid_request",
        )
    kind = value["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}, "response_format"
    schema_spec = value.get("json_schema")
    if not isinstance(schema_spec, dict):
        raise BodyFieldError(
            '\'response_format.json_schema\' must be an object {"name", "schema", "strict"}',
            "response_format.json_schema",
        )
    name = schema_spec.get("name")
    if name is not None and not isinstance(name, str):
        raise BodyFieldError(
            "'response_format.json_schema.name' must be a string",
            "response_format.json_schema.name",
        )
    strict = schema_spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise BodyFieldError(
            "'response_format.json_schema.strict' must be a boolean",
            "response_format.json_schema.strict",
        )
    schema = schema_spec.get("schema")
    if not isinstance(schema, dict):
        raise BodyFieldError(
            "'response_format.json_schema.schema' must be a JSON Schema object",
            "response_format.json_schema.schema",
        )
    return {"json": schema}, "response_format.json_schema.schema"


def param_for(message: str, field: str | None) -> tuple[str, str]:
    """``(message, param)`` of a spec error: ``structured_outputs.<kind>`` at the start of
    ``message`` (the grammar engine's naming) replaced by the body ``field`` that carried it."""
    head = message.split(" ", 1)[0]
    if field is None or not head.startswith("structured_outputs"):
        return message, head
    return f"'{field}'" + message[len(head) :], field
