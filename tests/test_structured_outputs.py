"""Structured outputs' parts without a model: the spec and its check, the compile cache and
worker thread, per-sample grammar state, the batch bitmask in the sampler, the body fields."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoTokenizer

from batchgen import SamplingParams, StructuredOutputsParams
from batchgen.engine.sampler import (
    Sampler,
    SamplingRow,
    apply_token_bitmask,
    unpack_token_bitmask,
)
from batchgen.entrypoints.openai_protocol import (
    CHAT_COMPLETIONS_URL,
    COMPLETIONS_URL,
    ProtocolError,
    parse_request_body,
)
from batchgen.models.tokenizer_factory import write_tokenizer
from batchgen.structured.compiler import GrammarCompiler
from batchgen.structured.matcher import SequenceGrammar, fill_token_bitmask

SCHEMA = {
    "type": "object",
    "properties": {"b": {"type": "integer"}, "a": {"enum": ["x", "y"]}},
    "required": ["b", "a"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    write_tokenizer(path, 512)
    return AutoTokenizer.from_pretrained(path)


@pytest.fixture()
def compiler(tokenizer):
    return GrammarCompiler(tokenizer, 512, [tokenizer.eos_token_id], cache_size=2)


# ----------------------------------------------------------------------------- the spec


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({}, "exactly one of json, regex, choice, grammar or json_object, got none"),
        ({"regex": "a", "choice": ["a"]}, "got regex, choice"),
        ({"choice": []}, "structured_outputs.choice must be a non-empty list"),
        ({"json": "{not json"}, "structured_outputs.json is not valid JSON text"),
        ({"regex": ""}, "structured_outputs.regex must be a non-empty string"),
    ],
)
def test_spec_shape_errors_name_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        StructuredOutputsParams(**kwargs)


@pytest.mark.parametrize(
    "spec, message",
    [
        ({"json": {"type": "foo"}}, "structured_outputs.json is invalid: Invalid type: foo"),
        ({"json": {"$ref": "#/$defs/missing"}}, "structured_outputs.json is invalid"),
        ({"json": {"type": "string", "pattern": "(?=a)b"}}, "look-around"),
        ({"regex": "[a-z"}, "(?s)structured_outputs.regex is invalid.*unclosed character class"),
        ({"grammar": "start: foo"}, 'structured_outputs.grammar is invalid.*unknown name: "foo"'),
        ({"grammar": "root ::= ("}, "structured_outputs.grammar is invalid"),
        ({"jsn": {}}, "structured_outputs has an unknown field 'jsn'"),
    ],
)
def test_sampling_params_check_the_spec_with_the_grammar_engine(spec, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(structured_outputs=spec)


def test_spec_key_keeps_property_order_and_json_text_equals_dict():
    a = StructuredOutputsParams(json=SCHEMA)
    b = StructuredOutputsParams(json=json.dumps(SCHEMA, indent=2))
    assert a.key == b.key and a.kind == "json"
    reordered = dict(reversed(list(SCHEMA.items())))
    assert StructuredOutputsParams(json=reordered).key != a.key
    params = SamplingParams(structured_outputs={"choice": ["x", "y"]})
    assert params.structured_outputs.key == ("choice", '["x","y"]')


# ----------------------------------------------------------------------------- compiling


def test_compiles_once_per_spec_and_keeps_a_bounded_lru(compiler):
    specs = [StructuredOutputsParams(regex=r) for r in ("[0-9]+", "[a-z]+", "x|y")]
    first = compiler.compile(specs[0])
    assert first.template is not None and first.error is None
    assert compiler.compile(StructuredOutputsParams(regex="[0-9]+")) is first  # a cache hit
    assert compiler.num_compiles == 1
    compiler.compile(specs[1])
    compiler.compile(specs[2])  # cache_size=2: the least recently used ([0-9]+) goes
    assert compiler.num_compiles == 3
    compiler.compile(specs[0])
    assert compiler.num_compiles == 4
    compiler.shutdown()


def test_vocabulary_dependent_errors_are_found_at_compile_and_cached(compiler):
    spec = StructuredOutputsParams(grammar="start: <[600]>")  # token id past the vocabulary
    SamplingParams(structured_outputs=spec)  # the tokenizer-free check cannot know
    compiled = compiler.compile(spec)
    assert compiled.template is None
    assert compiled.error.startswith("structured_outputs.grammar is invalid")
    assert "600" in compiled.error
    assert compiler.submit(spec).done()  # the failure is cached too
    with pytest.raises(ValueError, match="600"):
        SequenceGrammar(compiled)


def test_matcher_advances_stops_and_replays(compiler, tokenizer):
    compiled = compiler.compile(StructuredOutputsParams(json=SCHEMA))
    grammar = SequenceGrammar(compiled)
    ids = tokenizer.encode('{"b":12,"a":"y"}', add_special_tokens=False)
    for token in ids[:-1]:
        grammar.accept(token)
    assert not grammar.is_stopped
    bitmask = fill_token_bitmask([None, grammar], 512)
    allowed = unpack_token_bitmask(bitmask, 512)
    assert allowed[0].all()  # the unconstrained row allows everything
    assert allowed[1].nonzero().squeeze(1).tolist() == [ids[-1]]  # only "}" may close it
    grammar.accept(ids[-1])
    assert grammar.is_stopped and grammar.num_tokens == len(ids)
    with pytest.raises(ValueError, match="breaks the request's structured output grammar"):
        SequenceGrammar(compiled).accept(tokenizer.encode("x", add_special_tokens=False)[0])
    other = SequenceGrammar(compiled)
    other.replay(ids[:3])
    assert other.num_tokens == 3 and not other.is_stopped


def test_worker_thread_compiles_while_the_caller_goes_on(compiler):
    spec = StructuredOutputsParams(json={"type": "array", "items": {"type": "number"}})
    future = compiler.submit(spec)
    assert compiler.submit(spec) is future or future.done()  # one compile per spec
    assert future.result(timeout=30).template is not None


def sentencepiece_style_tokenizer():
    """A Llama/Mistral-style vocabulary: BPE over "▁"-marked words with byte fallback
    (``<0x00>``..``<0xFF>`` as ordinary vocabulary entries), as a fast HF tokenizer."""
    from tokenizers import Tokenizer, decoders, models, normalizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=120,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=list('{}":,abcdefghijklmnopqrstuvwxyz0123456789▁'),
    )
    tok.train_from_iterator(['{"name": "Bob", "age": 42}', "the quick brown fox"] * 50, trainer)
    spec = json.loads(tok.to_str())
    for b in range(256):
        spec["model"]["vocab"][f"<0x{b:02X}>"] = len(spec["model"]["vocab"])
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(json.dumps(spec)),
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
    )


def test_sentencepiece_style_vocabulary_with_byte_fallback():
    tokenizer = sentencepiece_style_tokenizer()
    vocab = len(tokenizer)

    def token_bytes(i: int) -> bytes:
        piece = tokenizer.convert_ids_to_tokens(i)
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            return bytes([int(piece[3:5], 16)])
        return piece.replace("▁", " ").encode()

    compiler = GrammarCompiler(tokenizer, vocab, [tokenizer.eos_token_id])
    schema = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
    grammar = SequenceGrammar(compiler.compile(StructuredOutputsParams(json=schema)))
    target, chosen = '{"name":"Zoë bob"}'.encode(), []
    while target:
        allowed = unpack_token_bitmask(fill_token_bitmask([grammar], vocab), vocab)[0]
        # Force-decode: the allowed token that covers the most of what is left.
        fits = [
            i
            for i in allowed.nonzero().squeeze(1).tolist()
            if target.startswith(token_bytes(i)) and token_bytes(i)
        ]
        token = max(fits, key=lambda i: len(token_bytes(i)))
        grammar.accept(token)
        chosen.append(token)
        target = target[len(token_bytes(token)) :]
    assert grammar.is_stopped
    pieces = tokenizer.convert_ids_to_tokens(chosen)
    assert "<0xC3>" in pieces and "<0xAB>" in pieces  # "ë" by byte fallback
    assert any(p.startswith("▁") for p in pieces), pieces  # "▁" is a space in the string
    assert tokenizer.decode(chosen) == '{"name":"Zoë bob"}'
    # At the start only "{" fits: a "▁"-prefixed piece would put a space before the JSON.
    first = SequenceGrammar(compiler.compile(StructuredOutputsParams(json=schema)))
    allowed = unpack_token_bitmask(fill_token_bitmask([first], vocab), vocab)[0]
    assert all(token_bytes(i).startswith(b"{") for i in allowed.nonzero().squeeze(1).tolist())
    compiler.shutdown()


# ----------------------------------------------------------------------------- the sampler


def test_unpack_token_bitmask_layout():
    words = torch.tensor([[5, 0], [-1, 1]], dtype=torch.int32)  # bits 0 and 2; all; bit 32
    allowed = unpack_token_bitmask(words, 34)
    assert allowed[0].nonzero().squeeze(1).tolist() == [0, 2]
    assert allowed[1].nonzero().squeeze(1).tolist() == list(range(33))


def test_bitmask_masks_only_constrained_rows_and_sampling_obeys_it():
    vocab = 40
    logits = torch.randn(4, vocab)
    bitmask = torch.full((4, 2), -1, dtype=torch.int32)
    bitmask[1] = torch.tensor([0, 1 << 3], dtype=torch.int32)  # only token 35
    bitmask[3] = torch.tensor([0b1010, 0], dtype=torch.int32)  # tokens 1 and 3
    masked = apply_token_bitmask(logits.clone(), bitmask)
    assert torch.equal(masked[0], logits[0]) and torch.equal(masked[2], logits[2])
    assert torch.isfinite(masked[1]).nonzero().squeeze(1).tolist() == [35]

    greedy = SamplingParams(temperature=0.0)
    rows = [SamplingRow(greedy, [1], []) for _ in range(4)]
    out = Sampler()(logits, rows, bitmask)
    assert out.sampled_token_ids[0] == int(logits[0].argmax())
    assert out.sampled_token_ids[1] == 35
    assert out.sampled_token_ids[3] == (1 if logits[3, 1] > logits[3, 3] else 3)
    # Log-probabilities stay those of the raw model distribution (vLLM v1's default).
    assert out.sampled_logprobs[1] == pytest.approx(float(logits[1].log_softmax(-1)[35]))

    hot = SamplingParams(temperature=5.0, seed=1)
    for _ in range(20):
        rows = [SamplingRow(hot, [1], []) for _ in range(4)]
        picks = Sampler()(logits, rows, bitmask).sampled_token_ids
        assert picks[1] == 35 and picks[3] in (1, 3)


def test_min_tokens_yields_to_the_grammar():
    # The grammar allows only EOS (0), min_tokens forbids it: the row samples EOS, not
    # a token the grammar forbids.
    logits = torch.randn(1, 32)
    bitmask = torch.tensor([[1]], dtype=torch.int32)
    params = SamplingParams(temperature=0.0, min_tokens=3)
    out = Sampler()(logits, [SamplingRow(params, [1], [], None, [0])], bitmask)
    assert out.sampled_token_ids == [0]


# ----------------------------------------------------------------------------- body fields


def body_spec(url, **fields):
    base = (
        {"prompt": "p"}
        if url == COMPLETIONS_URL
        else {"messages": [{"role": "user", "content": "p"}]}
    )
    request = parse_request_body(url, dict(base, **fields))
    spec = request.sampling_params.structured_outputs
    return (spec.kind, spec.key[1]) if spec else None, request.structured_outputs_field


@pytest.mark.parametrize("url", [COMPLETIONS_URL, CHAT_COMPLETIONS_URL])
def test_body_fields_map_to_the_spec(url):
    schema_format = {
        "type": "json_schema",
        "json_schema": {"name": "n", "schema": SCHEMA, "strict": True},
    }
    assert body_spec(url, response_format={"type": "text"}) == (None, None)
    assert body_spec(url, response_format={"type": "json_object"}) == (
        ("json_object", ""),
        "response_format",
    )
    kind, field = body_spec(url, response_format=schema_format)
    assert kind[0] == "json" and json.loads(kind[1]) == SCHEMA
    assert field == "response_format.json_schema.schema"
    assert body_spec(url, guided_regex="a+") == (("regex", "a+"), "guided_regex")
    assert body_spec(url, guided_json=json.dumps(SCHEMA))[1] == "guided_json"
    assert body_spec(url, guided_choice=["a", "b"], guided_decoding_backend="xgrammar") == (
        ("choice", '["a","b"]'),
        "guided_choice",
    )
    assert body_spec(url, guided_grammar="start: /[0-9]+/")[1] == "guided_grammar"
    assert body_spec(url, structured_outputs={"regex": "b+"}) == (
        ("regex", "b+"),
        "structured_outputs.regex",
    )


@pytest.mark.parametrize(
    "fields, code, param, message",
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "n", "schema": {"type": "foo"}},
                }
            },
            "invalid_request",
            "response_format.json_schema.schema",
            "Invalid type: foo",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "n"}}},
            "invalid_request",
            "response_format.json_schema.schema",
            "must be a JSON Schema",
        ),
        (
            {"response_format": {"type": "grammar"}},
            "unsupported_parameter",
            "response_format.type",
            "type 'grammar' is not supported",
        ),
        ({"response_format": "json"}, "invalid_request", "response_format", "must be"),
        ({"guided_regex": "(a"}, "invalid_request", "guided_regex", "unclosed group"),
        ({"guided_choice": "a"}, "invalid_request", "guided_choice", "non-empty list"),
        (
            {"structured_outputs": {"grammar": "start: x"}},
            "invalid_request",
            "structured_outputs.grammar",
            "unknown name",
        ),
        (
            {"structured_outputs": {"structural_tag": "{}"}},
            "unsupported_parameter",
            "structured_outputs.structural_tag",
            "not supported",
        ),
        (
            {"structured_outputs": {"regex": "a", "choice": ["a"]}},
            "invalid_request",
            "structured_outputs",
            "exactly one",
        ),
        (
            {"guided_json": {"type": "object"}, "guided_regex": "a"},
            "invalid_request",
            "guided_regex",
            "give only one",
        ),
    ],
)
def test_body_field_errors_name_the_field(fields, code, param, message):
    with pytest.raises(ProtocolError, match=message) as info:
        parse_request_body(COMPLETIONS_URL, dict({"prompt": "p"}, **fields))
    assert (info.value.code, info.value.param) == (code, param)
