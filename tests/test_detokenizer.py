"""Incremental detokenization equals one-shot decode; stop strings cut at the right place."""

from __future__ import annotations

import random

import pytest
from transformers import AutoTokenizer

from batchgen.engine.detokenizer import IncrementalDetokenizer, fast_decode
from batchgen.models.tokenizer_factory import (
    BOS_ID,
    BYTE_TOKEN_OFFSET,
    EOS_ID,
    IM_END_ID,
    IM_START_ID,
    TRAINING_CORPUS,
    write_tokenizer,
)

TRICKY = [
    "Hello world",
    "a   b",
    "   leading and trailing   ",
    "\n\n\tindented\n    code\n",
    "🦀",
    "🦀🦀 crabs 🦀",
    "👨‍👩‍👧‍👦 family, 🇺🇸🇯🇵 flags, 👋🏽 skin tone",
    "你好，世界！春眠不觉晓",
    "日本語とEnglish混在 😀 mixed 한국어 text",
    "café naïve e\u0301 Ελληνικά ½ ∑",
    "<|im_end|> looks special but is text? no: it is encoded as the special token",
    "def f(x):\n    return x ** 2  # square 🐍\n",
    TRAINING_CORPUS[:600],
]
CHUNKINGS = [1, 2, 3, 5, 1000]


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory):
    out = tmp_path_factory.mktemp("tok")
    write_tokenizer(out)
    return AutoTokenizer.from_pretrained(out)


def encode(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def feed(detok: IncrementalDetokenizer, ids: list[int], chunk: int) -> list[str]:
    """Feed ``ids`` in chunks; return ``output_text`` after every chunk."""
    texts = []
    for i in range(0, len(ids), chunk):
        assert detok.add_tokens(ids[i : i + chunk]) is None
        texts.append(detok.output_text)
    return texts


class CountingTokenizer:
    """Wraps a tokenizer and records the length of every id list passed to ``decode``."""

    def __init__(self, tok) -> None:
        self.tok = tok
        self.window_lens: list[int] = []

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        self.window_lens.append(len(ids))
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)


@pytest.mark.parametrize("chunk", CHUNKINGS)
@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_incremental_equals_one_shot(tok, chunk: int, skip_special_tokens: bool) -> None:
    prompt = encode(tok, "prompt: ")
    for text in TRICKY:
        ids = encode(tok, text) + [EOS_ID]
        full = tok.decode(ids, skip_special_tokens=skip_special_tokens)
        detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip_special_tokens)
        for partial in feed(detok, ids, chunk):
            assert full.startswith(partial)
            assert "\ufffd" not in partial  # valid UTF-8: never a replacement char
        assert detok.output_text == full  # the last token completes every character
        assert detok.finalize() == full
        assert detok.output_token_ids == ids


def test_multibyte_char_is_held_back_until_complete(tok) -> None:
    crab = encode(tok, "🦀")
    ids = encode(tok, "ok") + crab
    assert ids == encode(tok, "ok🦀") and len(crab) > 1  # the crab spans several tokens
    texts = feed(IncrementalDetokenizer(tok, []), ids, 1)
    assert texts[-len(crab) :] == ["ok"] * (len(crab) - 1) + ["ok🦀"]


def test_random_ids_match_decode(tok) -> None:
    """Arbitrary ids (incl. invalid UTF-8 and special tokens) in random chunks: the emitted text
    is always a prefix of the one-shot decode and finalize() equals it."""
    rng = random.Random(0)
    for trial in range(300):
        ids = [rng.randrange(len(tok)) for _ in range(rng.randrange(1, 40))]
        skip = trial % 2 == 0
        full = tok.decode(ids, skip_special_tokens=skip)
        detok = IncrementalDetokenizer(tok, [BOS_ID], skip_special_tokens=skip)
        i = 0
        while i < len(ids):
            n = rng.randrange(1, 4)
            detok.add_tokens(ids[i : i + n])
            i += n
            assert full.startswith(detok.output_text)
        assert detok.finalize() == full


def test_trailing_invalid_bytes_flushed_by_finalize(tok) -> None:
    ids = encode(tok, "abc") + [BYTE_TOKEN_OFFSET + 0xF0, BYTE_TOKEN_OFFSET + 0x9F]
    detok = IncrementalDetokenizer(tok, [])
    feed(detok, ids, 1)
    assert detok.output_text == "abc"
    assert detok.finalize() == tok.decode(ids) == "abc\ufffd"
    assert detok.finalize() == "abc\ufffd"  # idempotent
    with pytest.raises(RuntimeError):
        detok.add_tokens([EOS_ID])


def test_special_tokens_skipped_or_kept(tok) -> None:
    ids = [IM_START_ID, *encode(tok, "Hi"), IM_END_ID, *encode(tok, " there"), EOS_ID]
    kept = IncrementalDetokenizer(tok, [], skip_special_tokens=False)
    feed(kept, ids, 1)
    assert kept.finalize() == "<|im_start|>Hi<|im_end|> there</s>"
    skipped = IncrementalDetokenizer(tok, [], skip_special_tokens=True)
    texts = feed(skipped, ids, 1)
    assert texts[0] == ""  # a skipped special token emits nothing
    assert skipped.finalize() == "Hi there"


def test_cost_per_step_is_window_not_length(tok) -> None:
    ids = encode(tok, TRAINING_CORPUS)
    counting = CountingTokenizer(tok)
    detok = IncrementalDetokenizer(counting, [], stop=["NEVER_PRESENT_STOP"])
    feed(detok, ids, 1)
    assert len(ids) > 1000
    assert detok.finalize() == tok.decode(ids)
    # Windows stay a few tokens long (longer only while tokens keep ending mid-character,
    # as in the CJK lines), independent of the 1000+ tokens of output.
    assert max(counting.window_lens) <= 16
    assert sum(counting.window_lens) / len(counting.window_lens) < 3


def test_fast_decode_only_where_it_equals_decode(tok, tmp_path) -> None:
    # The fast tokenizer without clean-up: the Rust decode itself, equal to tok.decode.
    backend_decode = fast_decode(tok)
    assert backend_decode is not None
    rng = random.Random(1)
    for _ in range(300):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(6))]
        for skip in (True, False):
            assert backend_decode(ids, skip_special_tokens=skip) == tok.decode(
                ids, skip_special_tokens=skip
            )
    # Anything else keeps going through its own decode: a wrapper, a tokenizer that cleans
    # up tokenization spaces, a subclass with its own decode.
    assert fast_decode(CountingTokenizer(tok)) is None
    write_tokenizer(tmp_path)
    cleaning = AutoTokenizer.from_pretrained(tmp_path, clean_up_tokenization_spaces=True)
    assert fast_decode(cleaning) is None

    class OwnDecode(type(tok)):
        def decode(self, token_ids, skip_special_tokens=False, **kwargs):
            return "x"

    own = AutoTokenizer.from_pretrained(tmp_path)
    own.__class__ = OwnDecode
    assert fast_decode(own) is None
    detok = IncrementalDetokenizer(own, [])
    detok.add_tokens(encode(tok, "Hello"))
    assert detok.finalize() == "x"


def test_detokenize_false_keeps_ids_and_decodes_nothing(tok) -> None:
    ids = encode(tok, "Hello world 🦀")
    counting = CountingTokenizer(tok)
    detok = IncrementalDetokenizer(counting, [], detokenize=False)
    assert feed(detok, ids, 1) == [""] * len(ids)
    assert detok.finalize() == "" and detok.output_token_ids == ids
    assert counting.window_lens == []
    with pytest.raises(ValueError, match="stop strings need detokenize=True"):
        IncrementalDetokenizer(tok, [], stop=["x"], detokenize=False)


# ---- stop strings -------------------------------------------------------------------------


def char_spans(tok, ids: list[int]) -> list[tuple[int, int]]:
    """(start, end) character span of every token's text in decode(ids) (ASCII text only)."""
    spans, pos = [], 0
    for i in range(len(ids)):
        end = len(tok.decode(ids[: i + 1]))
        spans.append((pos, end))
        pos = end
    return spans


def test_stop_spanning_tokens(tok) -> None:
    text = "The quick brown fox jumps over the lazy dog"
    ids = encode(tok, text)
    spans = char_spans(tok, ids)
    stop = "brown fox"
    start = text.index(stop)
    first = next(k for k, (a, b) in enumerate(spans) if a <= start < b)
    last = next(k for k, (a, b) in enumerate(spans) if a < start + len(stop) <= b)
    assert last - first >= 2  # the stop string really spans several tokens

    for include, expected in [(False, "The quick "), (True, "The quick brown fox")]:
        detok = IncrementalDetokenizer(tok, [], stop=[stop], include_stop_str_in_output=include)
        results = [detok.add_tokens([i]) for i in ids[: last + 1]]
        assert results == [None] * last + [stop]  # matched exactly when completed
        assert detok.output_text == expected
        assert detok.stop_str == stop
        assert detok.finalize() == expected
        with pytest.raises(RuntimeError):
            detok.add_tokens(ids[last + 1 :])


def test_stop_ending_inside_a_token(tok) -> None:
    text = "Throughput is measured in tokens per second"
    ids = encode(tok, text)
    spans = char_spans(tok, ids)
    # A token of 3+ characters whose text is cut by the stop string's end.
    k = next(k for k, (a, b) in enumerate(spans) if k > 1 and b - a >= 3)
    a, b = spans[k]
    assert b > a + 1  # token k's text continues past the stop string's end
    stop = text[a - 2 : a + 1]  # begins two chars into the previous text, ends inside token k
    assert text.index(stop) == a - 2
    for include, expected in [(False, text[: a - 2]), (True, text[: a + 1])]:
        detok = IncrementalDetokenizer(tok, [], stop=[stop], include_stop_str_in_output=include)
        results = [detok.add_tokens([i]) for i in ids[: k + 1]]
        assert results[-1] == stop and results[:-1] == [None] * k
        assert detok.output_text == expected  # the rest of token k is dropped


def test_stop_at_first_generated_token(tok) -> None:
    ids = encode(tok, "ing the answer")
    assert tok.decode(ids[:1]) == "ing"  # a multi-character first token
    for stop, include, expected in [
        ("in", False, ""),
        ("in", True, "in"),
        ("ing", False, ""),
        ("ing", True, "ing"),
    ]:
        detok = IncrementalDetokenizer(
            tok, encode(tok, "say: "), stop=[stop], include_stop_str_in_output=include
        )
        assert detok.add_tokens(ids[:1]) == stop
        assert detok.output_text == expected
        assert detok.finalize() == expected


def test_stop_in_prompt_does_not_trigger(tok) -> None:
    prompt = encode(tok, "Answer after STOP. Then ST")
    ids = encode(tok, "OP no stop here")  # prompt + output would contain "STOP"
    detok = IncrementalDetokenizer(tok, prompt, stop=["STOP"])
    feed(detok, ids, 1)
    assert detok.stop_str is None
    assert detok.finalize() == "OP no stop here"


@pytest.mark.parametrize("chunk", [1, 3, 1000])
def test_several_stops_earliest_wins(tok, chunk: int) -> None:
    ids = encode(tok, "hello world, hello again")
    for stops in (["world", "lo w"], ["lo w", "world"]):
        detok = IncrementalDetokenizer(tok, [], stop=stops)
        matched = None
        for i in range(0, len(ids), chunk):
            matched = detok.add_tokens(ids[i : i + chunk])
            if matched:
                break
        assert matched == "lo w"
        assert detok.output_text == "hel"

    # The stop string that completes first wins, even if another one starts earlier; on the
    # same end position the longer one wins. Independent of how the ids are chunked.
    for stops, stop_str, expected in [
        (["hello world, h", "world"], "world", "hello "),
        (["world", "o world"], "o world", "hell"),
    ]:
        detok = IncrementalDetokenizer(tok, [], stop=stops)
        for i in range(0, len(ids), chunk):
            if detok.add_tokens(ids[i : i + chunk]):
                break
        assert (detok.stop_str, detok.output_text) == (stop_str, expected)


def test_stop_on_special_token_text(tok) -> None:
    ids = [*encode(tok, "Hi"), IM_END_ID, *encode(tok, " more")]
    kept = IncrementalDetokenizer(
        tok, [], skip_special_tokens=False, stop=["<|im_end|>"], include_stop_str_in_output=True
    )
    n = ids.index(IM_END_ID) + 1
    assert [kept.add_tokens([i]) for i in ids[:n]] == [None] * (n - 1) + ["<|im_end|>"]
    assert kept.output_text == "Hi<|im_end|>"
    skipped = IncrementalDetokenizer(tok, [], skip_special_tokens=True, stop=["<|im_end|>"])
    feed(skipped, ids, 1)
    assert skipped.stop_str is None and skipped.finalize() == "Hi more"


def test_min_tokens_defers_stop_strings(tok) -> None:
    text = "x stop y stop z"
    ids = encode(tok, text)
    first_done = next(k + 1 for k in range(len(ids)) if "stop" in tok.decode(ids[: k + 1]))
    detok = IncrementalDetokenizer(tok, [], stop=["stop"], min_tokens=first_done + 1)
    results = [detok.add_tokens([i]) for i in ids[: len(encode(tok, "x stop y stop"))]]
    assert results[-1] == "stop" and results.count("stop") == 1
    assert detok.output_text == "x stop y "


def test_empty_inputs(tok) -> None:
    detok = IncrementalDetokenizer(tok, [1, 2, 3], stop=["", "x"])
    assert detok.add_tokens([]) is None
    assert detok.output_text == ""
    assert detok.finalize() == ""
