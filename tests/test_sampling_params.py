"""SamplingParams: defaults, normalisation, sampling type, and validation messages."""

from __future__ import annotations

import math
import re
import subprocess
import sys

import pytest

from batchgen.sampling_params import SamplingParams, SamplingType


def test_defaults_match_vllm():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (p.seed, p.max_tokens, p.min_tokens, p.logprobs) == (None, 16, 0, None)
    assert p.stop == [] and p.stop_token_ids == []
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert p.skip_special_tokens and not p.ignore_eos and not p.include_stop_str_in_output
    assert p.detokenize
    assert p.sampling_type is SamplingType.RANDOM and not p.is_greedy and not p.has_penalties


def test_normalisation():
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(stop_token_ids=(7, 9)).stop_token_ids == [7, 9]
    assert SamplingParams(top_k=-1).top_k == 0
    p = SamplingParams(temperature=0, top_p=1, presence_penalty=1)
    assert isinstance(p.temperature, float) and isinstance(p.top_p, float)
    assert isinstance(p.presence_penalty, float) and p.has_penalties


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"temperature": 0.0}, SamplingType.GREEDY),
        ({"temperature": 0.0, "seed": 3}, SamplingType.GREEDY),
        ({"temperature": 9e-6}, SamplingType.GREEDY),
        ({"temperature": 1e-5}, SamplingType.RANDOM),
        ({"temperature": 0.7, "seed": 0}, SamplingType.RANDOM_SEED),
    ],
)
def test_sampling_type(kwargs, expected):
    p = SamplingParams(**kwargs)
    assert p.sampling_type is expected
    assert p.is_greedy == (expected is SamplingType.GREEDY)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"top_p": 1.0, "min_p": 0.0, "logprobs": 0},
        {"min_p": 1.0, "logprobs": 20},
        {"presence_penalty": -2.0, "frequency_penalty": 2.0},
        {"min_tokens": 16, "max_tokens": 16},
        {"max_tokens": None, "min_tokens": 10_000},
        {"seed": -(2**70)},
        {"seed": 2**80},
        {"top_k": 1},
        {"top_k": 2**63 - 1, "max_tokens": 2**63 - 1, "stop_token_ids": [2**63 - 1]},
        {"max_tokens": None, "min_tokens": 2**63 - 1},
        {"repetition_penalty": 1e-3},
    ],
)
def test_boundary_values_accepted(kwargs):
    p = SamplingParams(**kwargs)
    for name, value in kwargs.items():
        assert getattr(p, name) == value


BAD_VALUES = [
    ("n", 0, "n must be an integer >= 1"),
    ("n", 1.5, "n must be an integer >= 1"),
    ("n", True, "n must be an integer >= 1"),
    ("n", "2", "n must be an integer >= 1"),
    ("n", 1025, "n must be in [1, 1024], got 1025"),
    ("temperature", 1e5, "temperature must be in [0, 10000], got 100000.0"),
    ("repetition_penalty", 1e-50, "repetition_penalty must be in [0.0001, 10000], got 1e-50"),
    ("temperature", -0.1, "temperature must be in [0, 10000]"),
    ("temperature", math.nan, "temperature must be in [0, 10000]"),
    ("temperature", math.inf, "temperature must be in [0, 10000]"),
    ("temperature", None, "temperature must be in [0, 10000]"),
    ("temperature", True, "temperature must be in [0, 10000]"),
    ("top_p", 0.0, "top_p must be in (0, 1]"),
    ("top_p", 1.5, "top_p must be in (0, 1], got 1.5"),
    ("top_p", -0.2, "top_p must be in (0, 1]"),
    ("top_p", math.nan, "top_p must be in (0, 1]"),
    ("top_k", -2, "top_k must be an integer >= 1, or 0 or -1"),
    ("top_k", 2.0, "top_k must be an integer >= 1, or 0 or -1"),
    ("top_k", True, "top_k must be an integer >= 1, or 0 or -1"),
    # Past int64 the value cannot reach the sampler's tensors: it must fail here, naming the range.
    (
        "top_k",
        2**63,
        "top_k must be an integer >= 1, or 0 or -1 to disable it, and at most "
        "9223372036854775807, got 9223372036854775808",
    ),
    ("max_tokens", 2**63, "max_tokens must be an integer in [1, 9223372036854775807] or None"),
    ("min_tokens", 2**70, "min_tokens must be an integer in [0, 9223372036854775807], got"),
    ("stop_token_ids", [2**63], "stop_token_ids must be a list of integers >= 0 or None, each at"),
    # An integer too large for a float (JSON allows 4,300 digits) is out of range, not a crash.
    ("temperature", 10**400, "temperature must be in [0, 10000], got 10000000000000000000..."),
    ("top_p", -(10**400), "top_p must be in (0, 1], got -1000000000000000000... (402 characters)"),
    ("min_p", -0.01, "min_p must be in [0, 1]"),
    ("min_p", 1.01, "min_p must be in [0, 1]"),
    ("min_p", math.nan, "min_p must be in [0, 1]"),
    ("seed", 1.0, "seed must be an integer"),
    ("seed", True, "seed must be an integer"),
    ("seed", "7", "seed must be an integer"),
    ("max_tokens", 0, "max_tokens must be an integer >= 1 or None"),
    ("max_tokens", -3, "max_tokens must be an integer >= 1 or None"),
    ("max_tokens", 8.0, "max_tokens must be an integer >= 1 or None"),
    ("max_tokens", True, "max_tokens must be an integer >= 1 or None"),
    ("min_tokens", -1, "min_tokens must be an integer >= 0"),
    ("min_tokens", 1.0, "min_tokens must be an integer >= 0"),
    ("min_tokens", 17, "min_tokens must be <= max_tokens (16), got 17"),
    ("stop", "", "stop must not contain empty strings"),
    ("stop", ["ok", ""], "stop must not contain empty strings"),
    ("stop", [1], "stop must be a string, a list of strings or None"),
    ("stop", 5, "stop must be a string, a list of strings or None"),
    ("stop_token_ids", [-1], "stop_token_ids must be a list of integers >= 0 or None"),
    ("stop_token_ids", [1.5], "stop_token_ids must be a list of integers >= 0 or None"),
    ("stop_token_ids", [True], "stop_token_ids must be a list of integers >= 0 or None"),
    ("stop_token_ids", 3, "stop_token_ids must be a list of integers >= 0 or None"),
    ("ignore_eos", 1, "ignore_eos must be a bool"),
    ("include_stop_str_in_output", "yes", "include_stop_str_in_output must be a bool"),
    ("skip_special_tokens", None, "skip_special_tokens must be a bool"),
    ("detokenize", 0, "detokenize must be a bool"),
    ("logprobs", -1, "logprobs must be an integer in [0, 20] or None"),
    ("logprobs", 21, "logprobs must be an integer in [0, 20] or None"),
    ("logprobs", 2.0, "logprobs must be an integer in [0, 20] or None"),
    ("logprobs", True, "logprobs must be an integer in [0, 20] or None"),
    ("presence_penalty", 2.5, "presence_penalty must be in [-2, 2]"),
    ("presence_penalty", -2.01, "presence_penalty must be in [-2, 2]"),
    ("presence_penalty", math.inf, "presence_penalty must be in [-2, 2]"),
    ("frequency_penalty", 3, "frequency_penalty must be in [-2, 2]"),
    ("frequency_penalty", math.nan, "frequency_penalty must be in [-2, 2]"),
    ("repetition_penalty", 0.0, "repetition_penalty must be in [0.0001, 10000]"),
    ("repetition_penalty", -1.0, "repetition_penalty must be in [0.0001, 10000]"),
    ("repetition_penalty", math.inf, "repetition_penalty must be in [0.0001, 10000]"),
    ("repetition_penalty", math.nan, "repetition_penalty must be in [0.0001, 10000]"),
]


@pytest.mark.parametrize(("field", "value", "message"), BAD_VALUES)
def test_invalid_values_name_field_and_range(field, value, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        SamplingParams(**{field: value})


def test_min_tokens_above_max_tokens():
    with pytest.raises(ValueError, match=re.escape("min_tokens must be <= max_tokens (4), got 5")):
        SamplingParams(min_tokens=5, max_tokens=4)


def test_importing_sampling_params_does_not_import_torch():
    code = "import sys, batchgen.sampling_params; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_stop_strings_need_detokenize():
    assert SamplingParams(detokenize=False, stop_token_ids=[7]).stop_token_ids == [7]
    with pytest.raises(ValueError, match=r"stop strings need detokenize=True.*'###'"):
        SamplingParams(detokenize=False, stop="###")
