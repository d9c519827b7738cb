"""OpenAI Batch lines and bodies <-> BatchGen requests and outputs (pure functions, no engine)."""

from __future__ import annotations

import json
import math

import pytest

from batchgen.entrypoints.openai_protocol import (
    batch_line_custom_id,
    CHAT_COMPLETIONS_URL,
    COMPLETIONS_URL,
    INVALID_JSON_LINE,
    INVALID_METHOD,
    INVALID_URL,
    MIN_LOGPROB,
    MISSING_REQUIRED_PARAMETER,
    UNSUPPORTED_PARAMETER,
    BatchLineError,
    ProtocolError,
    chat_response_body,
    completion_response_body,
    dumps_line,
    error_line,
    error_line_from,
    parse_batch_line,
    parse_request_body,
    rejected_error,
    success_line,
)
from batchgen.outputs import CompletionOutput, Logprob, RequestOutput
from batchgen.sampling_params import SamplingParams


class CharTokenizer:
    """Token id = code point."""

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(i) for i in ids)


def envelope(body: dict, url: str = COMPLETIONS_URL, custom_id: str = "req-1") -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def completion(**fields) -> dict:
    return {"model": "m", "prompt": "Hello", **fields}


def chat(**fields) -> dict:
    return {"messages": [{"role": "user", "content": "Hi"}], **fields}


def line_error(raw: str | bytes, line: int = 3) -> BatchLineError:
    with pytest.raises(BatchLineError) as info:
        parse_batch_line(raw, line)
    return info.value


# ------------------------------------------------------------------------------ request bodies


def test_completion_envelope_maps_every_sampling_field():
    body = completion(
        max_tokens=32,
        temperature=0.7,
        top_p=0.9,
        n=3,
        stop=["\n\n", "END"],
        seed=42,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        logprobs=2,
        top_k=40,
        min_p=0.05,
        min_tokens=4,
        repetition_penalty=1.1,
        ignore_eos=True,
        stop_token_ids=[7, 9],
        include_stop_str_in_output=True,
        skip_special_tokens=False,
    )
    req = parse_batch_line(envelope(body), 1)
    assert (req.custom_id, req.line, req.request.url) == ("req-1", 1, COMPLETIONS_URL)
    assert req.request.prompt == "Hello" and req.request.messages is None
    assert req.request.model == "m" and not req.request.is_chat
    sp = req.request.sampling_params
    assert (sp.max_tokens, sp.temperature, sp.top_p, sp.n, sp.seed) == (32, 0.7, 0.9, 3, 42)
    assert sp.stop == ["\n\n", "END"] and sp.stop_token_ids == [7, 9]
    assert (sp.presence_penalty, sp.frequency_penalty, sp.logprobs) == (0.5, -0.5, 2)
    assert (sp.top_k, sp.min_p, sp.min_tokens, sp.repetition_penalty) == (40, 0.05, 4, 1.1)
    assert sp.ignore_eos and sp.include_stop_str_in_output and not sp.skip_special_tokens


def test_openai_defaults():
    sp = parse_request_body(COMPLETIONS_URL, {"prompt": "x"}).sampling_params
    assert (sp.max_tokens, sp.temperature, sp.n, sp.logprobs) == (16, 1.0, 1, None)
    # null means "default" except for max_tokens, where it means "until max_model_len"
    sp = parse_request_body(COMPLETIONS_URL, {"prompt": "x", "max_tokens": None, "n": None})
    assert (sp.sampling_params.max_tokens, sp.sampling_params.n) == (None, 1)
    sp = parse_request_body(CHAT_COMPLETIONS_URL, chat()).sampling_params
    assert (sp.max_tokens, sp.temperature, sp.logprobs) == (None, 1.0, None)


def test_chat_lengths_and_logprobs():
    req = parse_request_body(CHAT_COMPLETIONS_URL, chat(max_tokens=10, max_completion_tokens=20))
    assert req.sampling_params.max_tokens == 20 and req.is_chat and req.prompt is None
    req = parse_request_body(CHAT_COMPLETIONS_URL, chat(logprobs=True, top_logprobs=3))
    assert req.sampling_params.logprobs == 3
    req = parse_request_body(CHAT_COMPLETIONS_URL, chat(logprobs=True))
    assert req.sampling_params.logprobs == 0
    req = parse_request_body(CHAT_COMPLETIONS_URL, chat(logprobs=False))
    assert req.sampling_params.logprobs is None


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        (chat(top_logprobs=2), "top_logprobs", "requires 'logprobs': true"),
        (chat(logprobs=3), "logprobs", "must be a boolean"),
        (chat(logprobs=True, top_logprobs=50), "top_logprobs", "top_logprobs must be an integer"),
    ],
)
def test_chat_logprobs_errors(body, param, words):
    with pytest.raises(ProtocolError) as info:
        parse_request_body(CHAT_COMPLETIONS_URL, body)
    assert info.value.param == param and words in str(info.value)


def test_messages_are_normalised():
    messages = [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None, "name": "bot"},
    ]
    req = parse_request_body(CHAT_COMPLETIONS_URL, {"messages": messages})
    assert req.messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "a\nb"},
        {"role": "assistant", "content": "", "name": "bot"},
    ]
    assert messages[0]["role"] == "developer"  # the input is not mutated


@pytest.mark.parametrize(
    ("messages", "param", "code"),
    [
        (None, "messages", MISSING_REQUIRED_PARAMETER),
        ([], "messages", "invalid_request"),
        ("hi", "messages", "invalid_request"),
        ([{"role": "bot", "content": "x"}], "messages[0].role", "invalid_request"),
        ([{"role": "user"}], "messages[0].content", MISSING_REQUIRED_PARAMETER),
        ([{"role": "user", "content": 5}], "messages[0].content", "invalid_request"),
        (
            [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
            "messages[0].content[0]",
            UNSUPPORTED_PARAMETER,
        ),
    ],
)
def test_bad_messages_name_the_field(messages, param, code):
    body = {} if messages is None else {"messages": messages}
    with pytest.raises(ProtocolError) as info:
        parse_request_body(CHAT_COMPLETIONS_URL, body)
    assert (info.value.param, info.value.code) == (param, code)
    assert param.split("[")[0] in str(info.value)


def test_prompt_forms():
    assert parse_request_body(COMPLETIONS_URL, {"prompt": ["one"]}).prompt == "one"
    assert parse_request_body(COMPLETIONS_URL, {"prompt": [1, 2, 3]}).prompt == [1, 2, 3]
    assert parse_request_body(COMPLETIONS_URL, {"prompt": [[4, 5]]}).prompt == [4, 5]


@pytest.mark.parametrize(
    ("prompt", "code", "words"),
    [
        (["a", "b"], UNSUPPORTED_PARAMETER, "holds 2 prompts"),
        ([[1], [2]], UNSUPPORTED_PARAMETER, "one batch line per prompt"),
        ("", "invalid_request", "must not be empty"),
        ([], "invalid_request", "non-empty list of token ids"),
        ([1, -2], "invalid_request", ">= 0"),
        ([1, "a"], "invalid_request", 'got [1, "a"] (array)'),
        ([True], "invalid_request", "list of token ids"),
        (3, "invalid_request", "got 3 (integer)"),
    ],
)
def test_bad_prompts(prompt, code, words):
    with pytest.raises(ProtocolError) as info:
        parse_request_body(COMPLETIONS_URL, {"prompt": prompt})
    assert info.value.code == code and info.value.param == "prompt"
    assert words in str(info.value)


def test_missing_prompt():
    with pytest.raises(ProtocolError) as info:
        parse_request_body(COMPLETIONS_URL, {"max_tokens": 3})
    assert info.value.code == MISSING_REQUIRED_PARAMETER and "'prompt'" in str(info.value)


@pytest.mark.parametrize(
    ("field", "value", "words"),
    [
        ("temperature", "hot", "'temperature' must be a number, got \"hot\" (string)"),
        ("n", 1.5, "'n' must be an integer, got 1.5 (number)"),
        ("n", True, "'n' must be an integer, got true (boolean)"),
        ("max_tokens", "10", "'max_tokens' must be an integer"),
        ("stop", 5, "'stop' must be a string or a list of strings"),
        ("stop", ["a", 1], "'stop' must be a string or a list of strings"),
        ("ignore_eos", "yes", "'ignore_eos' must be a boolean"),
        ("stop_token_ids", [1, "2"], "'stop_token_ids' must be a list of integers"),
        ("logprobs", True, "'logprobs' must be an integer"),
        ("model", 3, "'model' must be a string"),
        ("top_p", 1.5, "top_p must be in (0, 1], got 1.5"),
        ("n", 0, "n must be an integer >= 1"),
        ("logprobs", 21, "logprobs must be an integer in [0, 20] or null, got 21"),
        # SamplingParams says None (Python, vLLM's wording); a JSON line says null.
        ("max_tokens", 0, "max_tokens must be an integer >= 1 or null, got 0"),
        ("presence_penalty", 3, "presence_penalty must be in [-2, 2]"),
        # Values no engine tensor holds fail their line with the range, not the engine step.
        ("top_k", 2**63, "top_k must be an integer >= 1, or 0 or -1 to disable it, and at most"),
        ("min_tokens", 2**64, "min_tokens must be an integer in [0, 9223372036854775807]"),
        ("temperature", 10**400, "temperature must be in [0, 10000], got 1000000000"),
    ],
)
def test_wrong_fields_name_the_field(field, value, words):
    err = line_error(envelope(completion(**{field: value})))
    assert words in str(err), str(err)
    assert err.param == field and err.custom_id == "req-1"
    assert str(err).startswith("line 3: ")


def test_the_python_api_keeps_none_in_its_messages():
    with pytest.raises(ValueError, match=r"max_tokens must be an integer >= 1 or None, got 0"):
        SamplingParams(max_tokens=0)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("stream", True),
        ("echo", True),
        ("suffix", "tail"),
        ("best_of", 3),
        ("tools", [{"type": "function"}]),
    ],
)
def test_unsupported_values_are_rejected(field, value):
    err = line_error(envelope(completion(**{field: value})))
    assert err.code == UNSUPPORTED_PARAMETER and err.param == field
    assert f"'{field}' is not supported" in str(err)


def test_harmless_fields_are_accepted():
    body = completion(
        stream=False,
        echo=False,
        suffix=None,
        best_of=2,
        n=2,
        logit_bias={},
        user="u-1",
        metadata={"k": "v"},
        stream_options={"include_usage": True},
        response_format={"type": "text"},
    )
    assert parse_request_body(COMPLETIONS_URL, body).sampling_params.n == 2


def test_unknown_field_suggests_the_close_one():
    err = line_error(envelope(completion(max_token=5)))
    assert err.code == UNSUPPORTED_PARAMETER and err.param == "max_token"
    assert "did you mean 'max_tokens'?" in str(err)
    # the output line: a 400 naming the field, as the OpenAI API answers an unknown parameter
    out = error_line_from(err)
    assert out["response"]["status_code"] == 400
    assert out["response"]["body"]["error"]["param"] == "max_token"
    assert out["error"]["message"] == (
        "line 3: unknown field 'max_token' for /v1/completions; did you mean 'max_tokens'?"
    )
    # chat-only fields are unknown to completions
    err = line_error(envelope(completion(messages=[])))
    assert err.param == "messages"
    assert "/v1/completions takes 'prompt'" in str(err)
    # a chat line with a completions prompt is pointed at `messages`
    err = line_error(envelope({"prompt": "hi"}, url="/v1/chat/completions"))
    assert err.param == "prompt"
    assert "/v1/chat/completions takes 'messages'" in str(err)


# ------------------------------------------------------------------------------ batch lines


@pytest.mark.parametrize(
    ("raw", "words"),
    [
        ("{not json", "not valid JSON"),
        ('{"prompt": NaN}', "not valid JSON"),
        (b'{"prompt": "\xff"}', "not valid UTF-8"),
        ("[1, 2]", "must be a JSON object, got array"),
        ('"text"', "must be a JSON object, got string"),
    ],
)
def test_unparseable_lines(raw, words):
    err = line_error(raw, line=7)
    assert err.code == INVALID_JSON_LINE and err.custom_id is None and err.line == 7
    assert str(err).startswith("line 7: ") and words in str(err)


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        # the newline ends the line, it is not a second line of JSON
        (
            b'{"custom_id": "a" "url": 1}\n',
            "not valid JSON at column 19 (in characters): Expecting ',' delimiter",
        ),
        (
            b'{"prompt": "x"\n',
            "not valid JSON at column 15 (in characters): Expecting ',' delimiter",
        ),
        (
            b"{not json\r\n",
            "not valid JSON at column 2 (in characters): Expecting property name enclosed in",
        ),
        (
            '{"prompt": "\u00e9\u00e9" 1}\n',
            "not valid JSON at column 17 (in characters): Expecting ','",
        ),
        ('\ufeff{"a" 1}\n', "not valid JSON at column 6 (in characters): Expecting ':' delimiter"),
        (b'{"a": 1} {"b": 2}\n', "not valid JSON at column 10 (in characters): Extra data"),
        (b'{"prompt": NaN}\n', "not valid JSON: NaN is not a JSON value"),
        # json's messages that end in "at" lose it (a position follows in ours)
        (
            b'{"prompt": "abc\n',
            "not valid JSON at column 12 (in characters): Unterminated string starting\n",
        ),
        (b"[" * 5000 + b"]" * 5000 + b"\n", "JSON nested too deeply"),
        (
            b'{"max_tokens": ' + b"9" * 5000 + b"}\n",
            "not valid JSON: an integer has more than 4300 digits",
        ),
    ],
)
def test_invalid_json_names_the_line_and_the_column_in_it(raw, message):
    err = line_error(raw, line=8)
    assert (err.code, err.param, err.line) == (INVALID_JSON_LINE, None, 8)
    assert (str(err) + "\n").startswith(f"line 8: {message}")
    assert "line 2" not in str(err) and "(char" not in str(err)


@pytest.mark.parametrize(
    ("raw", "custom_id"),
    [
        ('{"custom_id": "bad-json", "url": "/v1/completions", "body": {"prompt": "x"', "bad-json"),
        (b'{"custom_id":"r\\"7", "prompt": NaN}\n', 'r"7'),  # escapes decoded
        (b'{"prompt": "\xff", "custom_id": "u-1"}', "u-1"),  # invalid UTF-8 elsewhere
        ('{"url": 1, "custom_id": "a", "custom_id": "b"', None),  # two: which one?
        ('{"prompt": "a, \\"custom_id\\": \\"x\\"" 1}', None),  # inside a string
        ('{"custom_id": "", "prompt": 1 1}', None),  # empty
        ('{"custom_id": 5, "prompt": 1 1}', None),  # not a string
        ('{"custom_id": "\\ud800" 1}', None),  # lone surrogate
        ('{"custom_id": "cut', None),  # the string never ends
        ('{not json "custom_id": "x"}', None),  # not where a key can be
        ("[1, 2]", None),  # valid JSON, not an object: nothing is salvaged
    ],
)
def test_an_invalid_json_line_keeps_the_custom_id_its_raw_text_names(raw, custom_id):
    err = line_error(raw, line=6)
    assert (err.code, err.line, err.custom_id) == (INVALID_JSON_LINE, 6, custom_id)
    assert batch_line_custom_id(raw, 6) == custom_id


def test_custom_id_with_a_lone_surrogate_fails_its_line_only():
    for raw in (
        '{"custom_id": "\\ud800", "url": "/v1/completions", "body": {"prompt": "x"}}',
        '{"custom_id": "\\ud800", "prompt": "x"}',
    ):
        err = line_error(raw, line=4)
        assert (err.code, err.param, err.custom_id) == ("invalid_request", "custom_id", None)
        assert "lone surrogate" in str(err)


def test_envelope_errors():
    missing = line_error(json.dumps({"url": COMPLETIONS_URL, "body": completion()}))
    assert missing.custom_id is None and missing.code == MISSING_REQUIRED_PARAMETER
    assert str(missing) == "line 3: missing 'custom_id'" and missing.param == "custom_id"
    null = line_error(json.dumps({"custom_id": None, "url": COMPLETIONS_URL, "body": {}}))
    assert str(null) == "line 3: 'custom_id' must be a non-empty string, got null (null)"
    assert null.code == MISSING_REQUIRED_PARAMETER
    empty = line_error(json.dumps({"custom_id": "", "url": COMPLETIONS_URL, "body": {}}))
    assert "'custom_id' must be a non-empty string, got" in str(empty)
    assert empty.code == "invalid_request"
    numeric = line_error(json.dumps({"custom_id": 5, "url": COMPLETIONS_URL, "body": {}}))
    assert numeric.custom_id is None and "got 5 (integer)" in str(numeric)
    url = line_error(envelope(completion(), url="/v1/embeddings"))
    assert (url.code, url.param, url.custom_id) == (INVALID_URL, "url", "req-1")
    assert "/v1/chat/completions" in str(url)
    get = json.dumps({"custom_id": "a", "method": "GET", "url": COMPLETIONS_URL, "body": {}})
    assert line_error(get).code == INVALID_METHOD
    no_body = line_error(json.dumps({"custom_id": "a", "url": COMPLETIONS_URL}))
    assert no_body.param == "body" and no_body.code == MISSING_REQUIRED_PARAMETER
    not_object = line_error(json.dumps({"custom_id": "a", "url": COMPLETIONS_URL, "body": [1]}))
    assert not_object.param == "body"
    extra = line_error(json.dumps({"custom_id": "a", "url": COMPLETIONS_URL, "body": {}, "x": 1}))
    assert extra.param == "x"


def test_envelope_method_defaults_to_post_and_chat_url():
    raw = json.dumps({"custom_id": "c", "url": CHAT_COMPLETIONS_URL, "body": chat()})
    req = parse_batch_line(raw + "\n", 2)
    assert req.request.is_chat and req.request.messages == [{"role": "user", "content": "Hi"}]


def test_plain_lines():
    req = parse_batch_line('{"prompt": "Tell me a joke", "max_tokens": 8}', 12)
    assert (req.custom_id, req.request.url, req.request.prompt) == (
        "line-12",
        COMPLETIONS_URL,
        "Tell me a joke",
    )
    assert req.request.sampling_params.max_tokens == 8
    req = parse_batch_line('{"custom_id": "mine", "prompt": [1, 2]}', 1)
    assert req.custom_id == "mine" and req.request.prompt == [1, 2]
    req = parse_batch_line(b'\xef\xbb\xbf{"messages": [{"role": "user", "content": "x"}]}', 1)
    assert req.custom_id == "line-1" and req.request.is_chat
    err = line_error('{"prompt": "x", "temperature": "hot"}', line=4)
    assert err.custom_id == "line-4" and err.param == "temperature"


# ------------------------------------------------------------------------------ responses


def lp(value: float, rank: int) -> Logprob:
    return Logprob(logprob=value, rank=rank)


def make_output(logprobs: bool) -> RequestOutput:
    # sample 1 lists first, to check that choices come back ordered by index
    second = CompletionOutput(index=1, text="c", token_ids=[99], finish_reason="stop")
    first = CompletionOutput(
        index=0,
        text="ab",
        token_ids=[97, 98],
        finish_reason="length",
        stop_reason=None,
    )
    if logprobs:
        first.logprobs = [
            {97: lp(-0.1, 1), 120: lp(-2.5, 2)},
            {121: lp(-0.2, 1), 122: lp(-1.0, 2), 98: lp(-math.inf, 7)},
        ]
        second.logprobs = [{99: lp(-0.3, 1), 100: lp(-1.5, 2)}]
    return RequestOutput("req_x", "Hi", [1, 2, 3], outputs=[second, first], finished=True)


def test_completion_body():
    body = completion_response_body(
        make_output(logprobs=True), model="tiny", tokenizer=CharTokenizer(), created=123
    )
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    assert (body["created"], body["model"]) == (123, "tiny")
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}
    first, second = body["choices"]
    assert (first["index"], first["text"], first["finish_reason"]) == (0, "ab", "length")
    assert (second["index"], second["finish_reason"]) == (1, "stop")
    assert first["logprobs"] == {
        "tokens": ["a", "b"],
        "token_logprobs": [-0.1, MIN_LOGPROB],
        "top_logprobs": [{"a": -0.1, "x": -2.5}, {"y": -0.2, "z": -1.0, "b": MIN_LOGPROB}],
        "text_offset": [0, 1],
    }
    json.loads(dumps_line(body))  # valid JSON: no Infinity


def test_completion_body_without_logprobs():
    body = completion_response_body(make_output(False), model="m", tokenizer=CharTokenizer())
    assert [c["logprobs"] for c in body["choices"]] == [None, None]
    assert isinstance(body["created"], int)


def test_chat_body_logprobs_keep_top_n():
    body = chat_response_body(
        make_output(logprobs=True), model="m", tokenizer=CharTokenizer(), top_logprobs=1
    )
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    choice = body["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": "ab"}
    content = choice["logprobs"]["content"]
    assert content[0] == {
        "token": "a",
        "logprob": -0.1,
        "bytes": [97],
        "top_logprobs": [{"token": "a", "logprob": -0.1, "bytes": [97]}],
    }
    # the sampled token (rank 7) is reported but not among top_logprobs=1
    assert (content[1]["token"], content[1]["logprob"]) == ("b", MIN_LOGPROB)
    assert [t["token"] for t in content[1]["top_logprobs"]] == ["y"]
    no_lp = chat_response_body(make_output(True), model="m", tokenizer=None, top_logprobs=None)
    assert no_lp["choices"][0]["logprobs"] is None


def test_decoded_token_wins_over_the_tokenizer():
    sample = CompletionOutput(0, "é", [300], logprobs=[{300: Logprob(-1.0, 1, "é")}])
    output = RequestOutput("r", None, [1], outputs=[sample], finished=True)
    body = chat_response_body(output, model="m", tokenizer=None, top_logprobs=0)
    assert body["choices"][0]["logprobs"]["content"][0]["bytes"] == [0xC3, 0xA9]


def test_output_lines():
    ok = success_line("a", "req_1", {"x": 1})
    assert ok["id"].startswith("batch_req_") and ok["error"] is None
    assert ok["response"] == {"status_code": 200, "request_id": "req_1", "body": {"x": 1}}
    bad = error_line(None, INVALID_JSON_LINE, "line 2: not valid JSON", line=2)
    assert bad["custom_id"] is None
    assert bad["response"]["status_code"] == 400
    assert bad["response"]["body"]["error"] == {
        "message": "line 2: not valid JSON",
        "type": "invalid_request_error",
        "param": None,
        "code": INVALID_JSON_LINE,
    }
    assert bad["error"] == {
        "code": INVALID_JSON_LINE,
        "message": "line 2: not valid JSON",
        "param": None,
        "line": 2,
    }
    assert ok["id"] != success_line("a", "req_1", {})["id"]


def test_dumps_line_is_compact_utf8_and_survives_lone_surrogates():
    assert dumps_line({"t": "héllo"}) == '{"t":"héllo"}'
    text = dumps_line({"t": "a\ud800"})
    text.encode("utf-8")
    assert json.loads(text) == {"t": "a\ud800"}


def test_rejected_error_names_the_code_and_the_field_to_change():
    completion = parse_request_body(COMPLETIONS_URL, {"prompt": "hi"})
    messages = [{"role": "user", "content": "x"}]
    chat = parse_request_body(CHAT_COMPLETIONS_URL, {"messages": messages})
    too_long = ValueError("prompt has 300 tokens, which leaves no room to generate")
    too_long.code = "context_length_exceeded"
    assert rejected_error(completion, too_long) == ("context_length_exceeded", "prompt")
    assert rejected_error(chat, too_long) == ("context_length_exceeded", "messages")
    unknown_ids = ValueError("prompt token ids must be integers in [0, 512)")
    assert rejected_error(completion, unknown_ids) == ("invalid_prompt", "prompt")
    by_completion_tokens = parse_request_body(
        CHAT_COMPLETIONS_URL, {"messages": messages, "max_completion_tokens": 9}
    )
    past_context = ValueError("this model's maximum context length is 256 tokens, but ...")
    past_context.code, past_context.param = "context_length_exceeded", "max_tokens"
    assert rejected_error(by_completion_tokens, past_context) == (
        "context_length_exceeded",
        "max_completion_tokens",
    )
    does_not_fit = ValueError("this model's maximum context length is 256 tokens, but ...")
    does_not_fit.param, does_not_fit.code = "max_tokens", "context_length_exceeded"
    assert rejected_error(chat, does_not_fit) == ("context_length_exceeded", "max_tokens")


def test_completion_top_logprobs_keep_the_best_of_tokens_with_the_same_text(tmp_path):
    """The offline byte-level tokenizer decodes the lone bytes 0x80, 0x81 and 0x82 (ids 133,
    134, 135) each to U+FFFD: one key, with the highest of their logprobs."""
    from transformers import AutoTokenizer

    from batchgen.models.tokenizer_factory import bytes_to_unicode, write_tokenizer

    write_tokenizer(tmp_path)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    byte_tokens = [bytes_to_unicode()[b] for b in (0x80, 0x81, 0x82)]
    a, b0, b1, b2 = tok.convert_tokens_to_ids(["a", *byte_tokens])
    assert [tok.decode([t]) for t in (a, b0, b1, b2)] == ["a", "\ufffd", "\ufffd", "\ufffd"]
    steps = [
        # the sampled token (b0) ranks below another token with its text
        {b0: Logprob(-2.5, 4), a: Logprob(-0.5, 1), b1: Logprob(-1.0, 2), b2: Logprob(-1.2, 3)},
        # the sampled token (b1) is the best of its text
        {b1: Logprob(-0.7, 1), a: Logprob(-0.9, 2), b2: Logprob(-3.0, 3), b0: Logprob(-4.0, 4)},
    ]
    sample = CompletionOutput(0, "", [b0, b1], None, steps, "length")
    body = completion_response_body(
        RequestOutput("r", "p", [1], [sample], finished=True), model="m", tokenizer=tok
    )
    lp = body["choices"][0]["logprobs"]
    assert lp["tokens"] == ["\ufffd", "\ufffd"] and lp["token_logprobs"] == [-2.5, -0.7]
    assert [list(top.items()) for top in lp["top_logprobs"]] == [
        [("a", -0.5), ("\ufffd", -1.0)],
        [("\ufffd", -0.7), ("a", -0.9)],
    ]
