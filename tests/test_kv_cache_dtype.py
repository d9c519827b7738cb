"""``kv_cache_dtype`` (vLLM's): a KV cache narrower than the model's dtype, proven against
`transformers` with the same rounding of K and V.

The oracle is `transformers` in float32 with an attention function that rounds the key and
value states (after RoPE, the whole cache each call: rounding is idempotent) to the cache
format and back before SDPA, which is what the engine's cache does. Against it the engine's
greedy tokens are identical, token for token, on the float32 oracle's criterion, under
chunked prefill and preemption too. Not token-identical to the unrounded model, nor should it
be; how far the narrower caches move the logits is measured and bounded below.
"""

from __future__ import annotations

import pytest
import torch
import transformers as tf
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from batchgen import LLM, SamplingParams
from batchgen.config import EngineConfig
from batchgen.models.layers.kv_cache_dtype import quantize_kv, resolve_kv_cache_dtype
from tests.test_model_oracle import PROMPTS, _hf_greedy

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
FORMATS = {
    "bfloat16": torch.bfloat16,
    "fp8": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}


def _rounding_attention(cache_dtype: torch.dtype):
    sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]

    def attention(module, query, key, value, attention_mask, **kwargs):
        key = quantize_kv(key, cache_dtype).to(key.dtype)
        value = quantize_kv(value, cache_dtype).to(value.dtype)
        return sdpa(module, query, key, value, attention_mask, **kwargs)

    return attention


def _hf_rounded(path, kv_cache_dtype: str) -> torch.nn.Module:
    """`transformers` float32 whose attention reads K/V rounded to ``kv_cache_dtype``."""
    name = f"batchgen_kv_{kv_cache_dtype}"
    AttentionInterface.register(name, _rounding_attention(FORMATS[kv_cache_dtype]))
    AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])  # sdpa's masks
    return tf.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation=name
    ).eval()


@pytest.mark.parametrize("kv_cache_dtype", list(FORMATS))
@pytest.mark.parametrize(
    "name",
    [
        "mixtral",
        "llama_mqa_bias_llama3",
        "qwen3_moe",  # per-head q/k norm, head_dim 24, one KV head
        "qwen2_moe_step2",  # Qwen2's qkv bias (K/V offsets rounded with them), shared expert
        "olmoe_clip_norm",  # full q/k norm, clip_qkv before the rounding
        "mistral_sliding",  # sliding-window decode over the rounded cache
    ],
)
def test_greedy_matches_transformers_with_rounded_kv(checkpoint_dir, name, kv_cache_dtype):
    path = checkpoint_dir(name)
    llm = LLM(str(path), dtype="float32", kv_cache_dtype=kv_cache_dtype, kv_cache_memory_gb=0.05)
    assert llm.llm_engine.runner.kv_caches[0][0].dtype == FORMATS[kv_cache_dtype]
    ids = [llm.get_tokenizer().encode(p) for p in PROMPTS]
    outs = llm.generate([{"prompt_token_ids": i} for i in ids], GREEDY, use_tqdm=False)
    ref = _hf_rounded(path, kv_cache_dtype)
    for prompt_ids, out in zip(ids, outs):
        assert out.outputs[0].token_ids == _hf_greedy(ref, prompt_ids, GREEDY.max_tokens)


@pytest.mark.parametrize("prefill", ["auto", "sdpa"])
@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "bfloat16"])
@pytest.mark.parametrize("name", ["mixtral", "mistral_sliding"])
def test_rounded_kv_under_preemption_and_chunked_prefill(
    checkpoint_dir, monkeypatch, name, kv_cache_dtype, prefill
):
    """Chunks of 8 tokens read their earlier chunks back from the rounded cache, and preempted
    sequences are recomputed: the tokens stay the oracle's, with prefill on the CPU kernel
    (``auto`` where it runs) and on SDPA (which dequantises the fresh chunk itself)."""
    monkeypatch.setenv("BATCHGEN_PREFILL_ATTENTION", prefill)
    path = checkpoint_dir(name)
    llm = LLM(
        str(path),
        dtype="float32",
        kv_cache_dtype=kv_cache_dtype,
        num_gpu_blocks_override=6,
        block_size=16,
        max_num_batched_tokens=8,
    )
    ids = [llm.get_tokenizer().encode(p) for p in PROMPTS]
    outs = llm.generate([{"prompt_token_ids": i} for i in ids], GREEDY, use_tqdm=False)
    assert llm.llm_engine.stats.num_preemptions > 0
    ref = _hf_rounded(path, kv_cache_dtype)
    for prompt_ids, out in zip(ids, outs):
        assert out.outputs[0].token_ids == _hf_greedy(ref, prompt_ids, GREEDY.max_tokens)


def test_prefix_cache_hit_gives_the_same_tokens(checkpoint_dir):
    """A prompt whose prefix comes from the (rounded) prefix cache decodes as a cold one: the
    prompt's own chunk attends to rounded K/V too."""
    path = checkpoint_dir("mixtral")
    shared = list(range(5, 45))  # 40 tokens: two full blocks of 16 are cached
    prompts = [{"prompt_token_ids": shared + [7, 8, 9]}, {"prompt_token_ids": shared + [7, 8, 9]}]
    cold = LLM(str(path), dtype="float32", kv_cache_dtype="fp8", enable_prefix_caching=False)
    want = [o.outputs[0].token_ids for o in cold.generate(prompts, GREEDY, use_tqdm=False)]
    warm = LLM(str(path), dtype="float32", kv_cache_dtype="fp8", kv_cache_memory_gb=0.05)
    first = warm.generate(prompts[:1], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    second = warm.generate(prompts[1:], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert warm.llm_engine.kv_cache.prefix_cache.stats.hits == 32
    assert [first, second] == want


def test_budget_holds_more_tokens_in_narrower_caches(checkpoint_dir):
    path = str(checkpoint_dir("mixtral"))
    tokens = {}
    for kv in ("auto", "bfloat16", "fp8"):
        eng = LLM(path, dtype="float32", kv_cache_dtype=kv, kv_cache_memory_gb=0.01).llm_engine
        tokens[kv] = eng.kv_cache.num_blocks * eng.config.block_size
        assert eng.kv_bytes_per_token * {"auto": 1, "bfloat16": 2, "fp8": 4}[kv] == (
            LLM(path, dtype="float32", kv_cache_memory_gb=0.01).llm_engine.kv_bytes_per_token
        )
    assert tokens["bfloat16"] >= 2 * tokens["auto"] and tokens["fp8"] >= 4 * tokens["auto"]


def test_bad_kv_cache_dtype_names_the_field_and_choices():
    with pytest.raises(ValueError, match=r"kv_cache_dtype must be one of .*'fp8_e5m2'.*got 'fp4'"):
        EngineConfig(kv_cache_dtype="fp4")
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        resolve_kv_cache_dtype("int8", torch.float32)


def test_a_cache_as_wide_as_the_model_but_coarser_is_refused():
    with pytest.raises(ValueError, match=r"'bfloat16' under a float16 model stores no fewer"):
        resolve_kv_cache_dtype("bfloat16", torch.float16)
    assert resolve_kv_cache_dtype("fp8", torch.float16) == torch.float8_e4m3fn


def test_mla_takes_only_auto(checkpoint_dir, monkeypatch):
    import batchgen.engine.llm_engine as llm_engine

    def no_load(*args, **kwargs):
        raise AssertionError("the weights loaded before the refusal")

    monkeypatch.setattr(llm_engine, "load_engine_model", no_load)  # refused before loading
    path = str(checkpoint_dir("deepseek_v2"))
    with pytest.raises(ValueError, match=r"kv_cache_dtype='fp8' is not supported for MLA"):
        LLM(path, dtype="float32", kv_cache_dtype="fp8", kv_cache_memory_gb=0.05)
    # the model's own dtype by name is 'auto'
    assert resolve_kv_cache_dtype("bfloat16", torch.bfloat16, mla=True) == torch.bfloat16


def test_quantize_saturates_instead_of_overflowing():
    x = torch.tensor([1e6, -1e6, 300.0, 1e-3, float("nan"), 1e-4])
    e4 = quantize_kv(x, torch.float8_e4m3fn).float()
    assert e4[:2].tolist() == [448.0, -448.0]
    assert e4[2].item() == 288.0  # 300 to nearest (e4m3 spacing 32 there)
    assert e4[3].item() == 2.0**-9  # the smallest subnormal (steps of 2^-9 below 2^-6)
    assert e4[5].item() == 0.0  # under half of it
    assert torch.isnan(e4[4])
    e5 = quantize_kv(x, torch.float8_e5m2).float()
    assert e5[:2].tolist() == [57344.0, -57344.0]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cpu_decode_buckets_bound_the_converted_gather(checkpoint_dir, dtype):
    """The torch decode path gathers a bucket's blocks from the narrower cache and converts
    them to the model's dtype: `CPU_DECODE_GATHER_BYTES` bounds that converted tensor (what is
    allocated and read), so an fp8 cache does not get buckets 4x the size of float32's."""
    path = str(checkpoint_dir("mixtral"))
    blocks = {}
    for kv in ("auto", "fp8", "fp8_e5m2"):
        llm = LLM(path, dtype=dtype, kv_cache_dtype=kv, num_gpu_blocks_override=8)
        blocks[kv] = llm.llm_engine.runner.max_bucket_blocks
    assert blocks["fp8"] == blocks["fp8_e5m2"] == blocks["auto"]


def test_the_kv_cache_log_line_names_the_cache_dtype(checkpoint_dir, caplog):
    """The start-up line is where a user checks the budget: it names the format the tokens and
    bytes are counted in (before: bytes/token only, the same line for a float32 and an fp8
    cache of the same budget, bar the numbers)."""
    import logging

    path = str(checkpoint_dir("mixtral"))
    for kv, name in (("auto", "float32"), ("fp8", "float8_e4m3fn"), ("bfloat16", "bfloat16")):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="batchgen"):
            LLM(path, dtype="float32", kv_cache_dtype=kv, num_gpu_blocks_override=8)
        lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("KV cache:")]
        assert len(lines) == 1 and lines[0].endswith(f" bytes/token, {name})"), lines


def test_decode_backend_for_a_narrower_cache(monkeypatch):
    """Triton reads only a cache of the queries' dtype: a narrower one runs the torch path on
    CUDA, and forcing Triton there says why; the CPU kernel serves the mixed pairs."""
    import batchgen.models.layers.attention_backend as ab

    cpu, cuda, fp8 = torch.device("cpu"), torch.device("cuda"), torch.float8_e4m3fn
    monkeypatch.delenv(ab.ATTENTION_BACKEND_ENV, raising=False)
    assert ab.decode_attention_backend(cuda, torch.bfloat16, fp8) == "torch"
    assert ab.decode_attention_backend(cpu, torch.float32, fp8) == "cpu_kernel"
    monkeypatch.setenv(ab.ATTENTION_BACKEND_ENV, "triton")
    with pytest.raises(ValueError, match="reads a KV cache of the queries' dtype only"):
        ab.decode_attention_backend(cuda, torch.bfloat16, fp8)
