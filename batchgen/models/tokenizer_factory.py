"""A tiny, deterministic byte-level BPE tokenizer for offline test checkpoints.

No model hub is reachable in tests, so a random-weight checkpoint directory needs a tokenizer
built on the spot. ``write_tokenizer`` trains byte-level BPE merges (GPT-2 / Llama-3 / Qwen
style: ByteLevel pre-tokenizer and decoder, so every Unicode string round-trips) on a small
embedded corpus and writes the three files ``transformers.AutoTokenizer.from_pretrained`` reads:
``tokenizer.json``, ``tokenizer_config.json`` and ``special_tokens_map.json``.

Vocabulary layout (ids are fixed, so tests and the make-model code can hard-code them)::

    0 <pad>   1 <s> (BOS)   2 </s> (EOS)   3 <|im_start|>   4 <|im_end|> (end of chat turn)
    5 .. 260  the 256 ByteLevel byte tokens, in byte order: id = BYTE_TOKEN_OFFSET + byte value
    261 ..    learned merges, most frequent pair first, up to ``vocab_size`` tokens

The merges are learned by a small greedy BPE trainer in this module (not ``tokenizers``'
``BpeTrainer``), so the written files are byte-for-byte identical across runs, machines and
``tokenizers`` versions. Ties between equally frequent pairs go to the pair with the smaller
(left id, right id).

Plain encodes get ``<s>`` prepended (Llama's ``add_bos_token``). The chat template is ChatML
(``<|im_start|>{role}\\n{content}<|im_end|>\\n``) and starts with ``<s>`` itself, so rendered
chat text must be encoded with ``add_special_tokens=False`` (as ``apply_chat_template(...,
tokenize=True)`` and vLLM's chat path do); otherwise the BOS would be doubled.
"""

from __future__ import annotations

import heapq
import json
from collections import Counter
from itertools import pairwise
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

PAD_ID = 0
BOS_ID = 1
EOS_ID = 2
IM_START_ID = 3
IM_END_ID = 4

PAD_TOKEN = "<pad>"
BOS_TOKEN = "<s>"
EOS_TOKEN = "</s>"
IM_START_TOKEN = "<|im_start|>"
IM_END_TOKEN = "<|im_end|>"
SPECIAL_TOKENS: tuple[str, ...] = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, IM_START_TOKEN, IM_END_TOKEN)

BYTE_TOKEN_OFFSET = len(SPECIAL_TOKENS)  # id of the token for byte 0x00
NUM_BASE_TOKENS = BYTE_TOKEN_OFFSET + 256  # 261: special tokens + byte tokens, before merges
MIN_VOCAB_SIZE = NUM_BASE_TOKENS + 27  # 288: at least a few merges, so tokens span bytes
DEFAULT_MODEL_MAX_LENGTH = 4096

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# English prose, code, JSON, numbers, Chinese, Japanese, Korean and emoji. Written for this
# module; a few KB is enough for ~1-2k merges while keeping training well under a second.
TRAINING_CORPUS = """\
The quick brown fox jumps over the lazy dog. The dog sleeps in the sun, and the fox runs away.
A batch inference engine reads many prompts, runs the model over all of them together, and
writes the generated text back to disk. Throughput is measured in tokens per second.
Mixture-of-experts models route every token to a few experts out of many. When the batch is
small, each expert sees only a couple of tokens, and the matrix multiply runs far below peak.
The scheduler admits new requests while there is room in the key-value cache; when memory runs
out, it preempts the newest request and recomputes it later. Prefill is compute bound, while
decode is bound by memory bandwidth. This is why the two phases want different layouts.
It's a small test corpus, but it's enough: they're learning merges that we'll reuse, and you'd
see them in the vocabulary. Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 256 1024 2048 4096 65536.
Dates like 2024-05-17 and times like 12:30:45 appear in logs; prices like $19.99 or 3.5%.
Questions? Answers! Quotes: "hello", 'world'. Brackets (a), [b], {c}; slashes a/b and c\\d.

def generate(prompts: list[str], max_tokens: int = 16) -> list[str]:
    \"\"\"Generate a completion for every prompt.\"\"\"
    outputs = []
    for prompt in prompts:
        tokens = tokenizer.encode(prompt)
        for _ in range(max_tokens):
            logits = model(tokens)
            next_token = int(logits[-1].argmax())
            if next_token == tokenizer.eos_token_id:
                break
            tokens.append(next_token)
        outputs.append(tokenizer.decode(tokens))
    return outputs


class BlockAllocator:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.free_blocks = list(range(num_blocks))

    def allocate(self) -> int:
        if not self.free_blocks:
            raise RuntimeError("out of KV cache blocks")
        return self.free_blocks.pop()

    def free(self, block_id: int) -> None:
        self.free_blocks.append(block_id)


for i in range(10):
    x = i * i + 2 * i - 1
    print(f"value {i}: {x}")  # print each value

{"custom_id": "request-1", "method": "POST", "url": "/v1/completions",
 "body": {"model": "tiny", "prompt": "Hello", "max_tokens": 32, "temperature": 0.0}}
{"id": "batch_abc123", "status": "completed", "request_counts": {"total": 2, "failed": 0}}

int main(void) { int n = 0; for (int i = 0; i < 8; ++i) { n += i; } return n; }
SELECT id, name FROM users WHERE age > 30 ORDER BY name;
    if (x != y && z >= 0) || w <= 1 { return; }    // tabs	and	spaces   matter

你好，世界！今天天气很好，我们一起去公园散步吧。
大型语言模型可以生成文本、回答问题、翻译语言和编写代码。
批量推理引擎的目标是提高吞吐量，而不是降低首个词元的延迟。
中文、日本語、한국어都是常见的测试语言。我们的模型很小，但是分词器必须正确。
こんにちは、世界！今日はいい天気ですね。東京の桜はとてもきれいです。
機械学習のモデルは大量のデータから学習します。ありがとうございます。
안녕하세요, 세계! 오늘 날씨가 정말 좋네요. 감사합니다.
인공지능 모델은 텍스트를 생성하고 질문에 답합니다.

Emoji: 😀 😃 😄 😁 😂 🤣 😊 😍 🤔 👍 👋 🙏 🎉 🚀 🔥 ✨ ❤️ ✅ ❌ ⭐ 🌍 🌸 🍕 🐍 🐱 🐶
Great job! 🎉🎉 Ship it 🚀 — thanks 🙏. Family: 👨‍👩‍👧‍👦, flags: 🇺🇸 🇯🇵 🇨🇳, skin tone: 👋🏽.
Accents: café, naïve, résumé, façade, jalapeño, Zürich, São Paulo, Ελληνικά, Русский текст.
Math: α + β = γ, ∑ x² ≤ ∞, π ≈ 3.14159, √2 ≈ 1.41421, a ≠ b, x → y, ½ ¼ ¾ °C.

Sampling parameters control temperature, nucleus probability, minimum probability, repetition
penalties, random seeds, stop strings, and log-probabilities. Greedy decoding picks the argmax.
Every sequence coroutine owns its history, position, phase, block table and sampling state.
Groups advance from stage to stage: embedding, attention, feed-forward, normalization, head.
Weights load lazily from safetensors shards; quantized checkpoints need dequantization first.
Rotary embeddings rotate query and key vectors; YaRN stretches the frequencies for long context.
Elastic recovery restores snapshots after a worker crashes, so jobs resume without losing work.
Monday, Tuesday, Wednesday, Thursday, Friday, Saturday, Sunday; January, February, March, April.
red orange yellow green blue indigo violet; north south east west; alpha beta gamma delta.

import torch
import torch.nn.functional as F

@torch.inference_mode()
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # [heads, T, S]
    mask = torch.ones_like(scores, dtype=torch.bool).tril()
    return F.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1) @ v

async def fetch(session, url):
    async with session.get(url, timeout=30) as response:
        return await response.json()

git commit -m "fix: handle empty batches" && pytest -q tests/ --maxfail=1 | tee log.txt
<div class="note"><p>Hello &amp; welcome</p><a href="https://example.com/?q=1&x=2">link</a></div>

春眠不觉晓，处处闻啼鸟。夜来风雨声，花落知多少。学而时习之，不亦说乎？
数据并行、专家并行和流水线并行是分布式训练的三种主要方法。
吾輩は猫である。名前はまだ無い。どこで生れたかとんと見当がつかぬ。カタカナとひらがな。
프로그래밍 언어로는 파이썬, 러스트, 자바스크립트가 있습니다. 한글은 아름답습니다.
Reactions: 💯 🙌 👀 🤖 💡 📈 🧪 🛠️ 🐛 ⚡ 🌈 🍜 🎵 📦 🔒 🧠 — all tests pass ✅✅✅!
"""


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable-character map used by the ByteLevel components.

    Source: openai/gpt-2 ``encoder.py`` (also ``tokenizers``' ``byte_level.rs``). Printable
    Latin-1 bytes map to themselves; the other 68 bytes map to U+0100 and up, in byte order.
    """
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    mapping: dict[int, str] = {}
    extra = 0
    for b in range(256):
        if b in printable:
            mapping[b] = chr(b)
        else:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def _byte_level_pre_tokenizer() -> pre_tokenizers.ByteLevel:
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _base_vocab() -> dict[str, int]:
    """Special tokens (ids 0-4) then the 256 byte tokens in byte order (ids 5-260)."""
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    for b, char in bytes_to_unicode().items():
        vocab[char] = BYTE_TOKEN_OFFSET + b
    return vocab


def _train_merges(corpus: str, vocab: dict[str, int], vocab_size: int) -> list[tuple[str, str]]:
    """Greedy BPE training (Sennrich et al. 2016) on ``corpus``; extends ``vocab`` in place.

    Each step merges the most frequent adjacent symbol pair over all pre-tokenized words
    (ties: smallest ``(vocab[left], vocab[right])``), until ``len(vocab) == vocab_size``. Pair
    counts are updated incrementally and the best pair is kept in a lazy max-heap, so a step
    costs O(occurrences of the merged pair), not O(corpus).

    Returns:
        The merges in rank order (first learned = applied first when encoding).

    Raises:
        ValueError: when the corpus runs out of pairs before ``vocab_size`` is reached.
    """
    pre_tokenizer = _byte_level_pre_tokenizer()
    word_counts: Counter[str] = Counter()
    for line in corpus.splitlines(keepends=True):
        word_counts.update(piece for piece, _ in pre_tokenizer.pre_tokenize_str(line))
    words = sorted(word_counts)  # fixed order: the result must not depend on hashing
    freqs = [word_counts[w] for w in words]
    splits = [list(w) for w in words]

    pair_counts: Counter[tuple[str, str]] = Counter()
    pair_words: dict[tuple[str, str], set[int]] = {}
    for wi, symbols in enumerate(splits):
        for pair in pairwise(symbols):
            pair_counts[pair] += freqs[wi]
            pair_words.setdefault(pair, set()).add(wi)

    def heap_entry(pair: tuple[str, str]) -> tuple[int, int, int, tuple[str, str]]:
        return (-pair_counts[pair], vocab[pair[0]], vocab[pair[1]], pair)

    heap = [heap_entry(p) for p in pair_counts]
    heapq.heapify(heap)
    merges: list[tuple[str, str]] = []
    while len(vocab) < vocab_size:
        # Pop until an entry matches the pair's current count (older entries are stale).
        while heap and (-heap[0][0] != pair_counts.get(heap[0][3], 0) or heap[0][0] == 0):
            heapq.heappop(heap)
        if not heap:
            raise ValueError(
                f"vocab_size={vocab_size} is larger than the {len(vocab)} tokens the embedded "
                "training corpus supports"
            )
        left, right = best = heapq.heappop(heap)[3]
        merged = left + right
        merges.append(best)
        vocab.setdefault(merged, len(vocab))
        touched: set[tuple[str, str]] = set()
        for wi in sorted(pair_words.pop(best, ())):
            symbols, freq = splits[wi], freqs[wi]
            for pair in pairwise(symbols):
                pair_counts[pair] -= freq
                touched.add(pair)
            out: list[str] = []
            i = 0
            while i < len(symbols):
                if i + 1 < len(symbols) and symbols[i] == left and symbols[i + 1] == right:
                    out.append(merged)
                    i += 2
                else:
                    out.append(symbols[i])
                    i += 1
            splits[wi] = out
            for pair in pairwise(out):
                pair_counts[pair] += freq
                pair_words.setdefault(pair, set()).add(wi)
                touched.add(pair)
        pair_counts.pop(best, None)
        touched.discard(best)
        for pair in sorted(touched, key=lambda p: (vocab[p[0]], vocab[p[1]])):
            if pair_counts[pair] > 0:
                heapq.heappush(heap, heap_entry(pair))
            else:
                pair_counts.pop(pair)
    return merges


def build_tokenizer(vocab_size: int = 512) -> Tokenizer:
    """Build the byte-level BPE ``tokenizers.Tokenizer`` that ``write_tokenizer`` saves.

    Args:
        vocab_size: total number of tokens, special and byte tokens included.

    Raises:
        ValueError: ``vocab_size`` below ``MIN_VOCAB_SIZE`` (288) or above what the embedded
            corpus supports.
    """
    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(
            f"vocab_size={vocab_size} is too small: need at least {MIN_VOCAB_SIZE} "
            f"({len(SPECIAL_TOKENS)} special + 256 byte tokens + some merges)"
        )
    vocab = _base_vocab()
    merges = _train_merges(TRAINING_CORPUS, vocab, vocab_size)

    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tokenizer.pre_tokenizer = _byte_level_pre_tokenizer()
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN}:0 $A:0",
        pair=f"{BOS_TOKEN}:0 $A:0 {BOS_TOKEN}:1 $B:1",
        special_tokens=[(BOS_TOKEN, BOS_ID)],
    )
    tokenizer.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS]
    )
    ids = [tokenizer.token_to_id(t) for t in SPECIAL_TOKENS]
    assert ids == [PAD_ID, BOS_ID, EOS_ID, IM_START_ID, IM_END_ID], ids
    assert tokenizer.get_vocab_size() == vocab_size
    return tokenizer


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def write_tokenizer(
    out_dir: str | Path, vocab_size: int = 512, *, model_max_length: int = DEFAULT_MODEL_MAX_LENGTH
) -> None:
    """Write a complete tokenizer into ``out_dir`` (created if missing).

    Writes ``tokenizer.json``, ``tokenizer_config.json`` (``PreTrainedTokenizerFast``, BOS /
    EOS / PAD tokens, ChatML ``chat_template``, ``model_max_length``) and
    ``special_tokens_map.json``, byte-for-byte identical on every call with the same arguments.
    ``transformers.AutoTokenizer.from_pretrained(out_dir)`` loads the result offline.

    Args:
        out_dir: target directory, usually the checkpoint directory.
        vocab_size: total tokens (ids ``0 .. vocab_size-1``), at least ``MIN_VOCAB_SIZE``.
        model_max_length: the tokenizer's maximum sequence length, in tokens.

    Raises:
        ValueError: ``vocab_size`` out of range (see ``build_tokenizer``).
    """
    tokenizer = build_tokenizer(vocab_size)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tokenizer.json").write_text(tokenizer.to_str(pretty=True) + "\n", encoding="utf-8")
    extra_special = [IM_START_TOKEN, IM_END_TOKEN]
    _write_json(
        out / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": BOS_TOKEN,
            "eos_token": EOS_TOKEN,
            "pad_token": PAD_TOKEN,
            "unk_token": None,
            "additional_special_tokens": extra_special,
            "add_bos_token": True,
            "add_eos_token": False,
            "clean_up_tokenization_spaces": False,
            "model_max_length": model_max_length,
            "padding_side": "left",
            "chat_template": CHAT_TEMPLATE,
            "added_tokens_decoder": {
                str(i): {
                    "content": token,
                    "lstrip": False,
                    "normalized": False,
                    "rstrip": False,
                    "single_word": False,
                    "special": True,
                }
                for i, token in enumerate(SPECIAL_TOKENS)
            },
        },
    )
    _write_json(
        out / "special_tokens_map.json",
        {
            "bos_token": BOS_TOKEN,
            "eos_token": EOS_TOKEN,
            "pad_token": PAD_TOKEN,
            "additional_special_tokens": extra_special,
        },
    )
