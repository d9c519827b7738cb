"""The offline byte-level BPE tokenizer: loads with AutoTokenizer, round-trips, is deterministic."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from batchgen.models.tokenizer_factory import (
    BOS_ID,
    BYTE_TOKEN_OFFSET,
    EOS_ID,
    IM_END_ID,
    IM_START_ID,
    MIN_VOCAB_SIZE,
    PAD_ID,
    TRAINING_CORPUS,
    write_tokenizer,
)

FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
ROUND_TRIP = [
    "Hello world",
    "a   b",
    "   leading and trailing spaces   ",
    "tabs\tand\nnewlines\n\n",
    "🦀",
    "👨‍👩‍👧‍👦 family, 🇺🇸 flag, 👋🏽 skin tone",
    "你好，世界！",
    "日本語とEnglish混在 😀 mixed 한국어 text",
    "café naïve e\u0301 Ελληνικά",
    "def f(x):\n    return x ** 2  # square\n",
    "\ufffd literal replacement char",
    "",
]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tok")
    write_tokenizer(out)
    return out


@pytest.fixture(scope="module")
def tok(tok_dir: Path):
    return AutoTokenizer.from_pretrained(tok_dir)


def test_writes_loadable_files(tok_dir: Path, tok) -> None:
    assert sorted(p.name for p in tok_dir.iterdir()) == sorted(FILES)
    config = json.loads((tok_dir / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert config["model_max_length"] == 4096
    assert "<|im_start|>" in config["chat_template"]
    assert tok.model_max_length == 4096
    assert len(tok) == 512


def test_special_token_ids(tok) -> None:
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (PAD_ID, BOS_ID, EOS_ID)
    assert tok.convert_tokens_to_ids(["<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]) == [
        PAD_ID,
        BOS_ID,
        EOS_ID,
        IM_START_ID,
        IM_END_ID,
    ]
    assert set(tok.all_special_ids) == {0, 1, 2, 3, 4}
    # Byte tokens follow in byte order.
    assert tok.convert_ids_to_tokens([BYTE_TOKEN_OFFSET + ord("A"), BYTE_TOKEN_OFFSET + 0x20]) == [
        "A",
        "Ġ",
    ]
    assert tok.decode([BYTE_TOKEN_OFFSET + b for b in "é".encode()]) == "é"


def test_encode_adds_one_bos(tok) -> None:
    ids = tok.encode("Hello world")
    assert ids[0] == BOS_ID and ids.count(BOS_ID) == 1
    assert ids[1:] == tok.encode("Hello world", add_special_tokens=False)
    assert tok.decode(ids) == "<s>Hello world"


@pytest.mark.parametrize("text", ROUND_TRIP)
def test_round_trip(tok, text: str) -> None:
    ids = tok.encode(text)
    assert tok.decode(ids, skip_special_tokens=True) == text
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text


def test_multi_space_runs_are_tokens(tok) -> None:
    ids = tok.encode("a   b", add_special_tokens=False)
    assert tok.convert_ids_to_tokens(ids) == ["a", "ĠĠ", "Ġb"]


def test_multibyte_chars_span_several_tokens(tok) -> None:
    assert "🦀" not in TRAINING_CORPUS  # so no merge can cover all four bytes
    crab = tok.encode("🦀", add_special_tokens=False)
    assert 1 < len(crab) <= 4
    assert "\ufffd" in tok.decode(crab[:1])  # the first piece alone is an incomplete character
    cjk = tok.encode("界", add_special_tokens=False)
    assert len(cjk) > 1
    # Learned merges exist: frequent English pieces are single tokens above the byte range.
    assert any(
        i >= BYTE_TOKEN_OFFSET + 256 for i in tok.encode(" the tokens", add_special_tokens=False)
    )


def test_chat_template(tok) -> None:
    messages = [
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello! 😀"},
    ]
    text = tok.apply_chat_template(messages, tokenize=False)
    assert text == (
        "<s><|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\nHello! 😀<|im_end|>\n"
    )
    prompt = tok.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True)
    assert prompt == "<s><|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"

    ids = tok.apply_chat_template(messages[:1], add_generation_prompt=True, return_dict=False)
    assert ids[:2] == [BOS_ID, IM_START_ID] and ids.count(BOS_ID) == 1
    assert ids == tok.encode(prompt, add_special_tokens=False)
    assert ids[-1] == tok.encode("\n", add_special_tokens=False)[0]
    assert IM_END_ID in ids


def test_deterministic_across_processes(tmp_path: Path, tok_dir: Path) -> None:
    """Same bytes every run, whatever the hash seed (no dict/set-order dependence)."""
    repo = Path(__file__).resolve().parents[1]
    for seed in ("1", "12345"):
        out = tmp_path / f"seed{seed}"
        code = "import sys; from batchgen.models.tokenizer_factory import write_tokenizer as w; "
        code += "w(sys.argv[1])"
        env = {**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": str(repo)}
        subprocess.run([sys.executable, "-c", code, str(out)], check=True, env=env, timeout=60)
        for name in FILES:
            assert (out / name).read_bytes() == (tok_dir / name).read_bytes(), name


def test_other_vocab_sizes(tmp_path: Path) -> None:
    write_tokenizer(tmp_path, vocab_size=2048)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    assert len(tok) == 2048
    text = "Throughput is measured in tokens per second. 你好 🦀"
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    assert max(ids) < 2048


@pytest.mark.parametrize("vocab_size", [0, 261, MIN_VOCAB_SIZE - 1, 100_000])
def test_bad_vocab_size(tmp_path: Path, vocab_size: int) -> None:
    with pytest.raises(ValueError, match="vocab_size"):
        write_tokenizer(tmp_path, vocab_size=vocab_size)
    assert not (tmp_path / "tokenizer.json").exists()
