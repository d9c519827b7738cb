"""Structured outputs end to end on the tiny random-weight Mixtral (vocab 512), whose text is
otherwise gibberish: every output that ends with "stop" must parse and validate against its
JSON schema (jsonschema), match its regex or be one of its choices; with n=4 and seeds, under
preemption, mixed with unconstrained requests, resumed on another engine, and through
``batchgen run``'s batch files with per-line errors."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from batchgen import LLM, SamplingParams, StructuredOutputsParams
from batchgen.entrypoints.batch_runner import run_batch_file

# Ten schemas: nested objects, arrays, enums, number ranges, required / optional fields,
# string patterns, $ref, anyOf, a top-level array.
SCHEMAS: list[dict] = [
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 10},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
        },
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer", "minimum": 1, "maximum": 9999},
                    "email": {"type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,6}\\.com$"},
                },
                "required": ["id", "email"],
                "additionalProperties": False,
            },
            "active": {"type": "boolean"},
        },
        "required": ["user", "active"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "tags": {
                "type": "array",
                "items": {"enum": ["red", "green", "blue"]},
                "minItems": 1,
                "maxItems": 4,
            }
        },
        "required": ["tags"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "price": {"type": "number", "minimum": 0, "maximum": 1000},
            "qty": {"type": "integer", "minimum": 1, "maximum": 50},
            "discount": {"type": "number", "minimum": 0, "exclusiveMaximum": 1},
        },
        "required": ["price", "qty", "discount"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "a": {"type": "string", "maxLength": 5},
            "b": {"type": "integer", "minimum": -100, "maximum": 100},
            "c": {"type": "boolean"},
        },
        "required": ["a"],
        "additionalProperties": False,
    },
    {  # an extraction schema of 7 fields
        "type": "object",
        "properties": {
            "invoice_id": {"type": "string", "pattern": "^INV-[0-9]{4}$"},
            "vendor": {"type": "string", "maxLength": 12},
            "total": {"type": "number", "minimum": 0, "maximum": 100000},
            "currency": {"enum": ["USD", "EUR", "GBP"]},
            "date": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"},
            "paid": {"type": "boolean"},
            "lines": {
                "type": "array",
                "maxItems": 2,
                "items": {
                    "type": "object",
                    "properties": {
                        "sku": {"type": "string", "maxLength": 6},
                        "n": {"type": "integer", "minimum": 1, "maximum": 99},
                    },
                    "required": ["sku", "n"],
                    "additionalProperties": False,
                },
            },
        },
        "required": ["invoice_id", "vendor", "total", "currency", "date", "paid", "lines"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "value": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"type": "null"}]},
            "label": {"const": "x"},
        },
        "required": ["value", "label"],
        "additionalProperties": False,
    },
    {
        "type": "array",
        "items": {
            "type": "object",
            "properties": {
                "k": {"type": "string", "maxLength": 4},
                "v": {"type": "integer", "minimum": -5, "maximum": 5},
            },
            "required": ["k", "v"],
            "additionalProperties": False,
        },
        "maxItems": 3,
    },
    {
        "$defs": {
            "pt": {
                "type": "object",
                "properties": {
                    "x": {"type": "integer", "minimum": 0, "maximum": 9},
                    "y": {"type": "integer", "minimum": 0, "maximum": 9},
                },
                "required": ["x", "y"],
                "additionalProperties": False,
            }
        },
        "type": "object",
        "properties": {"a": {"$ref": "#/$defs/pt"}, "b": {"$ref": "#/$defs/pt"}},
        "required": ["a", "b"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "status": {"enum": ["ok", "fail"]},
            "code": {"type": "integer", "enum": [200, 404, 500]},
            "msg": {"type": "string", "minLength": 2, "maxLength": 8},
        },
        "required": ["status", "code", "msg"],
        "additionalProperties": False,
    },
]
PROMPTS = ["Extract the invoice:", "Bob is 42 years old.", "hello", "JSON please"]
MAX_TOKENS = 120


@pytest.fixture(scope="module")
def llm(checkpoint_dir):
    return LLM(
        str(checkpoint_dir("mixtral")), device="cpu", kv_cache_memory_gb=0.05, max_model_len=256
    )


def json_params(schema: dict, **kw) -> SamplingParams:
    kw.setdefault("max_tokens", MAX_TOKENS)
    return SamplingParams(structured_outputs=StructuredOutputsParams(json=schema), **kw)


def assert_valid(text: str, schema: dict) -> None:
    jsonschema.validate(json.loads(text), schema)


def test_200_requests_over_10_schemas_all_validate(llm):
    per_schema = 20
    prompts, params, schemas = [], [], []
    for s, schema in enumerate(SCHEMAS):
        for i in range(per_schema):
            prompts.append(PROMPTS[i % len(PROMPTS)])
            params.append(json_params(schema, temperature=1.0, seed=1000 * s + i))
            schemas.append(schema)
    outs = llm.generate(prompts, params, use_tqdm=False)
    stopped = 0
    for out, schema in zip(outs, schemas):
        sample = out.outputs[0]
        assert sample.finish_reason in ("stop", "length")
        if sample.finish_reason == "stop":
            stopped += 1
            assert_valid(sample.text, schema)
    # Without the grammar this model never writes JSON; with it nearly every sample completes.
    assert stopped >= 0.9 * len(outs), stopped
    # The grammar's matcher work is reported as its own stage.
    assert llm.llm_engine.get_metrics()["stage_time_share"]["grammar_mask"] > 0


def test_regex_and_choice_outputs_match(llm):
    regexes = [r"[0-9]{3}-[a-z]{2,4}", r"(yes|no)( maybe)?", r"[A-Z][a-z]{1,6}@[a-z]{2,5}\.org"]
    choices = [["alpha", "beta", "gamma"], ["positive", "negative", "neutral"]]
    params = [
        SamplingParams(
            max_tokens=40, temperature=1.0, seed=i, structured_outputs={"regex": regexes[i % 3]}
        )
        for i in range(12)
    ] + [
        SamplingParams(
            max_tokens=20, temperature=1.0, seed=i, structured_outputs={"choice": choices[i % 2]}
        )
        for i in range(8)
    ]
    outs = llm.generate(["Answer:"] * len(params), params, use_tqdm=False)
    for out, p in zip(outs, params):
        sample = out.outputs[0]
        assert sample.finish_reason == "stop", sample
        spec = p.structured_outputs
        if spec.regex is not None:
            assert re.fullmatch(spec.regex, sample.text), (spec.regex, sample.text)
        else:
            assert sample.text in spec.choice


def test_grammar_output_is_a_sentence_of_it(llm):
    lark = 'start: "(" expr ")"\nexpr: NUM | NUM "+" expr\nNUM: /[0-9]/'
    gbnf = 'root ::= "[" item ("," item)? "]"\nitem ::= [a-c]'
    outs = llm.generate(
        ["x", "y"],
        [
            SamplingParams(
                max_tokens=40, temperature=1.0, seed=3, structured_outputs={"grammar": g}
            )
            for g in (lark, gbnf)
        ],
        use_tqdm=False,
    )
    assert re.fullmatch(r"\([0-9](\+[0-9])*\)", outs[0].outputs[0].text), outs[0].outputs[0]
    assert re.fullmatch(r"\[[a-c](,[a-c])?\]", outs[1].outputs[0].text), outs[1].outputs[0]


def test_n4_seeded_samples_are_each_constrained_and_reproducible(llm):
    schema = SCHEMAS[5]
    params = json_params(schema, n=4, temperature=1.0, seed=7, logprobs=1, max_tokens=220)
    first = llm.generate(["Extract:"], params, use_tqdm=False)[0]
    again = llm.generate(["Extract:"], params, use_tqdm=False)[0]
    texts = [s.text for s in first.outputs]
    assert texts == [s.text for s in again.outputs]
    assert len(set(texts)) > 1  # each sample has its own matcher and its own draws
    for sample in first.outputs:
        assert sample.finish_reason == "stop"
        assert_valid(sample.text, schema)
        assert len(sample.logprobs) == len(sample.token_ids)


def test_mixed_batch_leaves_unconstrained_rows_alone(llm):
    free = SamplingParams(max_tokens=12, temperature=0.0)
    alone = llm.generate(["The cat", "A dog"], free, use_tqdm=False)
    prompts = ["The cat", "Extract:", "A dog", "Regex:"]
    params = [
        free,
        json_params(SCHEMAS[0], temperature=0.0),
        free,
        SamplingParams(max_tokens=20, temperature=0.0, structured_outputs={"regex": "[a-z]{5}"}),
    ]
    mixed = llm.generate(prompts, params, use_tqdm=False)
    assert mixed[0].outputs[0].token_ids == alone[0].outputs[0].token_ids
    assert mixed[2].outputs[0].token_ids == alone[1].outputs[0].token_ids
    assert mixed[1].outputs[0].finish_reason == "stop"
    assert_valid(mixed[1].outputs[0].text, SCHEMAS[0])
    assert re.fullmatch("[a-z]{5}", mixed[3].outputs[0].text)


def test_constrained_requests_survive_preemption(checkpoint_dir):
    # 12 blocks of 16 tokens: 16 sequences of ~10-token prompts and up to 120 tokens cannot
    # all fit, so the scheduler preempts and recomputes while the grammars keep their state.
    llm = LLM(
        str(checkpoint_dir("mixtral")),
        device="cpu",
        num_gpu_blocks_override=12,
        block_size=16,
        max_model_len=192,
    )
    schemas = [SCHEMAS[(0, 4, 6, 8, 9)[i % 5]] for i in range(8)]
    params = [json_params(s, n=2, temperature=1.0, seed=i) for i, s in enumerate(schemas)]
    outs = llm.generate(["Extract the fields:"] * 8, params, use_tqdm=False)
    assert llm.llm_engine.scheduler.num_preemptions > 0
    for out, schema in zip(outs, schemas):
        for sample in out.outputs:
            assert sample.finish_reason == "stop"
            assert_valid(sample.text, schema)


def test_resumed_request_replays_its_grammar(llm):
    engine = llm.llm_engine
    params = json_params(SCHEMAS[1], temperature=1.0, seed=11)
    reference = llm.generate(["Extract:"], params, use_tqdm=False)[0].outputs[0]
    assert reference.finish_reason == "stop"
    engine.add_request("moving", "Extract:", params)
    for _ in range(8):
        assert not engine.step()
    state = engine.release_request("moving")
    assert 0 < len(state.seqs[0].output_token_ids) < len(reference.token_ids)
    processed = engine.input_processor.process("Extract:", params)
    engine.add_processed_request("moved", processed, params, resume=state)
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    # The new engine-side grammar replayed the tokens made before the move, then went on.
    assert outs[0].outputs[0].text == reference.text
    assert_valid(outs[0].outputs[0].text, SCHEMAS[1])


def batch_line(custom_id: str, body: dict, chat: bool = False) -> str:
    url = "/v1/chat/completions" if chat else "/v1/completions"
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def test_batch_file_matches_llm_generate_and_fails_bad_specs_per_line(llm, tmp_path):
    schema = SCHEMAS[0]
    good = {"prompt": "Bob is 42.", "max_tokens": MAX_TOKENS, "temperature": 0}
    lines = [
        batch_line(
            "schema",
            dict(
                good,
                response_format={
                    "type": "json_schema",
                    "json_schema": {"name": "person", "schema": schema, "strict": True},
                },
            ),
        ),
        batch_line("object", dict(good, response_format={"type": "json_object"})),
        batch_line("guided", dict(good, guided_choice=["yes", "no"])),
        batch_line("vllm", dict(good, structured_outputs={"regex": "[0-9]{4}"})),
        batch_line(
            "chat",
            {
                "messages": [{"role": "user", "content": "Bob is 42."}],
                "max_tokens": MAX_TOKENS,
                "temperature": 0,
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "person", "schema": schema},
                },
            },
            chat=True,
        ),
        batch_line(
            "bad-schema",
            dict(
                good,
                response_format={
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "foo"}},
                },
            ),
        ),
        batch_line("bad-regex", dict(good, guided_regex="[a-z")),
        batch_line("bad-grammar", dict(good, structured_outputs={"grammar": "start: foo"})),
        batch_line("bad-vocab", dict(good, guided_grammar="start: <[600]>")),
        batch_line(
            "two-specs", dict(good, guided_regex="a", response_format={"type": "json_object"})
        ),
    ]
    inp = tmp_path / "in.jsonl"
    inp.write_text("\n".join(lines) + "\n")
    summary = run_batch_file(llm.llm_engine, inp, tmp_path / "out.jsonl", progress=False)
    results = {}
    for raw in (tmp_path / "out.jsonl").read_text().splitlines():
        line = json.loads(raw)
        results[line["custom_id"]] = line
    assert summary.failed == 5
    errors = {k: v["error"] for k, v in results.items() if v["error"]}
    assert errors["bad-schema"]["param"] == "response_format.json_schema.schema"
    assert "Invalid type: foo" in errors["bad-schema"]["message"]
    assert errors["bad-regex"]["param"] == "guided_regex"
    assert "unclosed character class" in errors["bad-regex"]["message"]
    assert errors["bad-grammar"]["param"] == "structured_outputs.grammar"
    assert errors["two-specs"]["param"] == "guided_regex"  # the second one named
    # Only the engine, with the vocabulary, can tell that token 600 does not exist.
    assert errors["bad-vocab"]["code"] == "request_failed"
    assert "Token range end too large: 600" in errors["bad-vocab"]["message"]
    body = {k: v["response"]["body"] for k, v in results.items() if not v["error"]}
    choice = {k: b["choices"][0] for k, b in body.items()}
    # Any JSON object: nothing bounds it, so greedy gibberish may run to max_tokens ("length",
    # the documented incomplete case); whatever was cut is the start of an object.
    obj = choice.pop("object")
    assert obj["text"].startswith("{")
    if obj["finish_reason"] == "stop":
        assert isinstance(json.loads(obj["text"]), dict)
    assert {k: c["finish_reason"] for k, c in choice.items()} == dict.fromkeys(choice, "stop")
    assert_valid(choice["schema"]["text"], schema)
    assert choice["guided"]["text"] in ("yes", "no")
    assert re.fullmatch("[0-9]{4}", choice["vllm"]["text"])
    assert_valid(choice["chat"]["message"]["content"], schema)
    # The same greedy request through LLM.generate and LLM.chat gives the same text.
    direct = llm.generate(["Bob is 42."], json_params(schema, temperature=0.0), use_tqdm=False)
    assert direct[0].outputs[0].text == choice["schema"]["text"]
    chat = llm.chat(
        [[{"role": "user", "content": "Bob is 42."}]],
        json_params(schema, temperature=0.0),
        use_tqdm=False,
    )
    assert chat[0].outputs[0].text == choice["chat"]["message"]["content"]


def test_grammar_no_token_can_match_fails_its_request_alone(llm):
    # Valid Lark, but token id 600 is past this model's 512: found when compiling (on the
    # worker thread the first time, from the cache the second), never by the batch.
    bad = SamplingParams(max_tokens=5, structured_outputs={"grammar": "start: <[600]>"})
    good = SamplingParams(max_tokens=5, temperature=0.0, structured_outputs={"regex": "[0-9]+"})
    for _ in range(2):
        outs = llm.generate(["a", "b", "c"], [good, bad, good], use_tqdm=False)
        assert [o.error is None for o in outs] == [True, False, True]
        assert "Token range end too large: 600" in outs[1].error
        assert re.fullmatch("[0-9]+", outs[0].outputs[0].text)
    assert not llm.llm_engine.has_unfinished_requests()


@pytest.mark.timeout(300)
def test_data_parallel_ranks_constrain_like_one_process(llm, checkpoint_dir):
    params = [json_params(SCHEMAS[i], temperature=1.0, seed=i) for i in (0, 4, 8, 9)]
    want = [o.outputs[0].text for o in llm.generate(["Extract:"] * 4, params, use_tqdm=False)]
    bad = SamplingParams(max_tokens=5, structured_outputs={"grammar": "start: <[600]>"})
    dp = LLM(
        str(checkpoint_dir("mixtral")),
        device="cpu",
        kv_cache_memory_gb=0.05,
        max_model_len=256,
        data_parallel_size=2,
        enable_expert_parallel=True,
    )
    try:
        # A rank whose only request has a grammar that cannot compile returns its error
        # (its schedule is empty) and stays in step with the other rank.
        alone = dp.generate(["x"], bad, use_tqdm=False)
        outs = dp.generate(["Extract:"] * 4, params, use_tqdm=False)
    finally:
        dp.shutdown()
    assert "Token range end too large: 600" in alone[0].error
    assert [o.outputs[0].text for o in outs] == want
    for out, p in zip(outs, params):
        if out.outputs[0].finish_reason == "stop":
            assert_valid(out.outputs[0].text, p.structured_outputs.json)


def test_abort_while_the_grammar_compiles_leaves_nothing_behind(llm):
    engine = llm.llm_engine
    params = SamplingParams(max_tokens=30, structured_outputs={"regex": "[a-f]{3}-never-seen"})
    engine.add_request("early", "x", params)
    engine.abort_request("early")
    assert not engine.has_unfinished_requests()
    assert not engine.structured.waiting and not engine.structured.live
    engine.add_request("again", "x", params)  # the compile finished meanwhile or is shared
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert [o.request_id for o in outs] == ["again"]
    assert re.fullmatch("[a-f]{3}-never-seen", outs[0].outputs[0].text)
    assert not engine.structured.live
