"""Field checks of `SamplingParams`: the bounds of its numeric fields and the functions that
validate and normalise one field each, raising ValueError with a message that names the field
and its allowed range (``"top_p must be in (0, 1], got 1.5"``).

Pure Python (no torch), like `batchgen.sampling_params`, which re-exports the bounds.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from numbers import Integral, Real

from batchgen.structured.params import StructuredOutputsParams

# Bounds beyond which float32 sampling would overflow, and a cap on samples per request
# (each sample is a sequence with its own KV cache; OpenAI caps n at 128).
MAX_N = 1024
MAX_TEMPERATURE = 1e4
MIN_REPETITION_PENALTY = 1e-4
MAX_REPETITION_PENALTY = 1e4
# Below this temperature a request is greedy (vLLM's `_SAMPLING_EPS`).
GREEDY_TEMPERATURE_EPS = 1e-5
# Largest `logprobs` a request may ask for (vLLM's default `max_logprobs`, OpenAI's cap).
MAX_LOGPROBS = 20
# Largest value of an integer field that counts tokens or names them (top_k, max_tokens,
# min_tokens, stop_token_ids): such values meet int64 tensors in the sampler and in rank-to-rank
# exchanges, so a larger one would fail the whole engine step instead of this request.
MAX_INT64 = 2**63 - 1
# OpenAI's range for a `logit_bias` value.
MAX_LOGIT_BIAS = 100.0


def check_structured_outputs(spec: object) -> StructuredOutputsParams:
    """``spec`` as a `StructuredOutputsParams` checked by the grammar engine."""
    if isinstance(spec, dict):
        unknown = sorted(set(spec) - set(StructuredOutputsParams.__dataclass_fields__))
        if unknown:
            raise ValueError(f"structured_outputs has an unknown field {unknown[0]!r}")
        spec = StructuredOutputsParams(**spec)
    if not isinstance(spec, StructuredOutputsParams):
        raise ValueError(
            f"structured_outputs must be a StructuredOutputsParams or None, got {short_repr(spec)}"
        )
    from batchgen.structured.grammar import check_spec  # imports the grammar engine

    check_spec(spec)
    return spec


def raise_field_error(param: str, message: str) -> None:
    """Raise ValueError(message) carrying the OpenAI error ``code`` and the field ``param``."""
    err = ValueError(message)
    err.code = "invalid_request"
    err.param = param
    raise err


def check_bad_words(words: object) -> list[str]:
    """``bad_words`` as a list of strings, each with a non-space character (None: ``[]``)."""
    if words is None:
        return []
    if not isinstance(words, (list, tuple)) or not all(isinstance(w, str) for w in words):
        raise ValueError(f"bad_words must be a list of strings or None, got {short_repr(words)}")
    if any(not w.strip() for w in words):
        raise ValueError(
            f"bad_words entries must contain a non-space character, got {short_repr(list(words))}"
        )
    return list(words)


def check_logit_bias(bias: object) -> dict[int, float] | None:
    """``bias`` as ``{token_id: float}``, keys and values checked (see ``logit_bias``)."""
    if bias is None:
        return None
    if not isinstance(bias, dict):
        raise ValueError(
            "logit_bias must be an object (dict) of token id -> bias in "
            f"[-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}] or None, got {short_repr(bias)}"
        )
    out: dict[int, float] = {}
    for key, value in bias.items():
        if isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 19:
            token = int(key)
        elif is_int(key) and key >= 0:
            token = int(key)
        else:
            token = -1
        if not 0 <= token <= MAX_INT64:
            raise ValueError(
                "logit_bias keys must be token ids: integers >= 0 or strings of decimal digits "
                f"(as JSON carries them), got {short_repr(key)}"
            )
        number = math.nan
        if isinstance(value, Real) and not isinstance(value, bool):
            try:
                number = float(value)
            except OverflowError:
                number = math.nan
        if not -MAX_LOGIT_BIAS <= number <= MAX_LOGIT_BIAS:  # NaN fails too
            raise ValueError(
                f"logit_bias values must be numbers in [-{MAX_LOGIT_BIAS:g}, "
                f"{MAX_LOGIT_BIAS:g}], got {short_repr(value)} for token {short_repr(key)}"
            )
        out[token] = number
    return out


def is_int(value: object) -> bool:
    """True for an integer that is not a bool (numpy integers included)."""
    return isinstance(value, Integral) and not isinstance(value, bool)


def short_repr(value: object) -> str:
    """``repr(value)``, cut to about 40 characters (an integer of 4,000 digits stays readable)."""
    text = repr(value)
    if len(text) <= 40:
        return text
    return f"{text[:20]}... ({len(text)} characters)"


def check_int(
    value: object,
    name: str,
    minimum: int | None = None,
    maximum: int | None = None,
    or_none: bool = False,
) -> int:
    """``value`` as an int in [``minimum``, ``maximum``] (either bound optional); ``or_none``
    only adds "or None" to the error message."""
    too_large = is_int(value) and maximum is not None and value > maximum
    if not is_int(value) or (minimum is not None and value < minimum) or too_large:
        none = " or None" if or_none else ""
        if too_large:
            bound = f"an integer in [{minimum}, {maximum}]"
        else:
            bound = "an integer" if minimum is None else f"an integer >= {minimum}"
        raise ValueError(f"{name} must be {bound}{none}, got {short_repr(value)}")
    return int(value)


def check_float(value: object, name: str, allowed: str, ok: Callable[[float], bool]) -> float:
    """``value`` as a finite float accepted by ``ok``; ``allowed`` describes the range in the
    error message (``"(0, 1]"``, or ``">= 0"`` for a one-sided one)."""
    number = math.nan
    if isinstance(value, Real) and not isinstance(value, bool):
        try:
            number = float(value)
        except OverflowError:  # an integer beyond float range (JSON allows 4,300 digits)
            number = math.nan
    if not math.isfinite(number) or not ok(number):
        # "in [0, 1]" for a bounded range, "a finite number >= 0" for a one-sided one.
        words = f"a finite number {allowed}" if allowed[0] in "<>" else f"in {allowed}"
        raise ValueError(f"{name} must be {words}, got {short_repr(value)}")
    return number


def check_stop_strings(stop: object) -> list[str]:
    """``stop`` as a list of non-empty strings (a string: one element; None: ``[]``)."""
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
        raise ValueError(f"stop must be a string, a list of strings or None, got {stop!r}")
    if any(s == "" for s in stop):
        raise ValueError(f"stop must not contain empty strings, got {stop!r}")
    return list(stop)


def check_stop_token_ids(ids: object) -> list[int]:
    """``stop_token_ids`` as a list of ints in [0, ``MAX_INT64``] (None: ``[]``)."""
    if ids is None:
        return []
    if not isinstance(ids, (list, tuple)) or not all(
        is_int(i) and 0 <= i <= MAX_INT64 for i in ids
    ):
        raise ValueError(
            f"stop_token_ids must be a list of integers >= 0 or None, each at most {MAX_INT64}, "
            f"got {short_repr(ids)}"
        )
    return [int(i) for i in ids]
