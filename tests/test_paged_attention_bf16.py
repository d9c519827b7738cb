"""The bfloat16 CPU paged decode attention kernel: against a float64 reference on the same bf16
inputs (within the two bf16 roundings it makes), against the gathered torch path in bf16, and in
bf16 models against `transformers`.

Tolerances. The kernel widens bf16 exactly to float32 and runs scores, softmax and the
weighted sum in float32 (the float32 kernel's arithmetic, checked at rtol = atol = 1e-5 in
`test_cpu_kernels.py`). Like torch's CPU SDPA in bf16, it rounds each unnormalised softmax
weight to bf16 before the weighted sum (the sum of the weights stays float32), and the output
once: ``|round(x) - x| <= u |x|`` with u = 2^-8, bf16's unit roundoff. Output element ``o_d``
is then within ``u |o_d| + u (p @ |v|)_d`` of the exact ``o_d = (p @ v)_d`` (p the exact softmax
probabilities: each weight's rounding moves the sum by at most ``u p_j |v_jd|``), plus 1e-5
(1 + |o_d|) of float32 arithmetic. Against torch (which rounds its output and weights the same
way, summing in another order): ``rtol = 2u + 1e-5, atol = u * max|v| + 1e-5``.
"""

from __future__ import annotations

import math
import shutil

import pytest
import torch

from batchgen.kernels import cpu_build
from batchgen.kernels.paged_attention import (
    decode_kernel_available,
    decode_kernel_isa,
    paged_decode_attention,
)
from batchgen.models.layers.attention import (
    AttentionMetadata,
    DecodeBucket,
    paged_attention,
    plan_decode_buckets,
)

U_BF16 = 2.0**-8
# Why the tiny Mixtral is an expected failure against transformers in bf16 (see the session note).
MIXTRAL_BF16 = (
    "one generated position of the tiny Mixtral lands 2.2 deltas below HF bf16's best logit "
    "(the criterion allows 1). The gathered torch attention path is HF's SDPA itself and "
    "matched HF exactly; this kernel sums in another order (and its float32 softmax weights, "
    "before they were rounded to bf16 like SDPA's, were 3.3 deltas off), so a near-tie on this "
    "random checkpoint flips; llama, mistral_sliding, qwen2 and qwen3_moe pass"
)
needs_compiler = pytest.mark.skipif(
    not shutil.which(cpu_build.cxx_command()[0]), reason="no C++ compiler to build the kernel"
)


def assert_greedy_agrees_with_reference(name, prompts, outs, ref) -> None:
    """Teacher-force our greedy tokens through ``ref`` (a `transformers` model): at every
    position our token is within 4 bf16 ulps at the largest logit of the reference's best,
    and at least 90% of positions are its argmax (shared with `test_fused_moe_bf16`)."""
    exact = total = 0
    dev = next(ref.parameters()).device  # the reference's device (CUDA in the device run)
    for prompt, out in zip(prompts, outs):
        ours = list(out.outputs[0].token_ids)
        with torch.no_grad():
            logits = ref(torch.tensor([prompt + ours], device=dev)).logits[0, len(prompt) - 1 : -1]
        logits = logits.float()
        delta = 4 * 2.0**-7 * logits.abs().max().item()
        chosen = logits.gather(1, torch.tensor(ours, device=dev)[:, None])[:, 0]
        assert (chosen >= logits.max(-1).values - delta).all(), (name, ours)
        exact += int((logits.argmax(-1) == torch.tensor(ours, device=dev)).sum())
        total += len(ours)
    assert exact >= 0.9 * total, f"{exact}/{total} positions are the reference's argmax"


def _reference(q, k_seq, v_seq, scale, window, with_bound=False):
    """``q [Hq, D]`` at position L - 1 over ``k_seq, v_seq [L, Hkv, D]`` in float64; with
    ``with_bound``, also the kernel's error bound per element (module docstring)."""
    hq, hkv = q.shape[0], k_seq.shape[1]
    k = k_seq.double().repeat_interleave(hq // hkv, dim=1)
    v = v_seq.double().repeat_interleave(hq // hkv, dim=1)
    scores = torch.einsum("hd,lhd->hl", q.double(), k) * scale
    if window is not None:
        visible = torch.arange(k.shape[0]) > k.shape[0] - 1 - window
        scores = scores.masked_fill(~visible, float("-inf"))
    p = torch.softmax(scores, -1)
    out = torch.einsum("hl,lhd->hd", p, v)
    if not with_bound:
        return out
    bound = U_BF16 * out.abs() + U_BF16 * torch.einsum("hl,lhd->hd", p, v.abs())
    return out, bound + 1e-5 * (1 + out.abs())


def _paged_case(kv_lens, hq, hkv, d, block_size, seed=0):
    """bf16 q ``[B, Hq, D]`` (x3: a sharp softmax) and caches over scattered blocks; the block
    tables padded with ids past the cache (never read), and each sequence's slots."""
    g = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-n // block_size) for n in kv_lens) + 5
    k_cache = torch.randn(num_blocks * block_size, hkv, d, generator=g).bfloat16()
    v_cache = torch.randn(num_blocks * block_size, hkv, d, generator=g).bfloat16()
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables, taken = [], 0
    for n in kv_lens:
        nb = -(-n // block_size)
        tables.append(perm[taken : taken + nb])
        taken += nb
    width = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [10**9] * (width - len(t)) for t in tables])
    slots = [
        torch.tensor([t[p // block_size] * block_size + p % block_size for p in range(n)])
        for t, n in zip(tables, kv_lens)
    ]
    q = (torch.randn(len(kv_lens), hq, d, generator=g) * 3).bfloat16()
    return q, k_cache, v_cache, block_tables, slots


CASES = [
    (8, 2, 64, 16, None, 2),  # the bench model's GQA
    (4, 4, 32, 4, None, 1),  # multi-head (G = 1), one thread
    (6, 1, 16, 8, 7, 2),  # multi-query, sliding window shorter than most contexts
    (8, 2, 128, 16, 1, 3),  # window 1: only the token itself; more threads than needed
    (4, 2, 12, 16, None, 2),  # head size not a multiple of 8: the generic loops only
    (8, 8, 8, 4, 5, 1),  # one __m256 per head (AVX2 even under auto); G = 1 with a window
    # AVX512-BF16 path (head size a multiple of 32): G = 8 (two passes of 4 heads over V),
    # G = 4 at D 128 (two 64-dim passes), G = 6 (4 + 2) under a window (AMX chunks starting
    # before the window), G = 3 at D 96 (a 32-dim tail pass) in blocks of 32 under a window,
    # blocks of 8 (no AMX), G = 16 and D 192 (AMX's limits), D 256 (no AMX); D 48 falls back
    # to AVX-512F.
    (8, 1, 64, 16, None, 2),
    (8, 2, 128, 16, None, 2),
    (12, 2, 64, 16, 20, 2),
    (3, 1, 96, 32, 40, 1),
    (8, 2, 64, 8, 33, 2),
    (16, 1, 32, 16, None, 2),
    (4, 1, 192, 16, None, 1),
    (2, 1, 256, 16, 100, 1),
    (4, 2, 48, 16, None, 2),
]
KV_LENS = [1, 2, 3, 15, 16, 17, 31, 32, 33, 57, 200, 1, 64, 65, 5, 9, 700]  # block edges
ISA_NAMES = ["auto", "amx", "avx512_bf16", "avx512f", "avx2", "generic"]


@needs_compiler
@pytest.mark.parametrize("isa", ISA_NAMES)
@pytest.mark.parametrize("hq,hkv,d,block_size,window,threads", CASES)
def test_bf16_kernel_within_its_roundings_of_the_float64_reference(
    hq, hkv, d, block_size, window, threads, isa, monkeypatch
):
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    kv_lens = KV_LENS + [block_size, block_size + 1, 3 * block_size - 1]
    q, k_cache, v_cache, tables, slots = _paged_case(kv_lens, hq, hkv, d, block_size)
    out = torch.full(q.shape, float("nan"), dtype=torch.bfloat16)
    scale = d**-0.5
    paged_decode_attention(
        q, k_cache, v_cache, tables, torch.tensor(kv_lens), block_size, scale, window, out, isa
    )
    assert out.dtype == torch.bfloat16
    for i, s in enumerate(slots):
        want, bound = _reference(q[i], k_cache[s], v_cache[s], scale, window, with_bound=True)
        err = (out[i].double() - want).abs()
        assert (err <= bound).all(), f"sequence {i}: worst error/bound {(err / bound).max():.3f}"


def test_isa_names_the_path_for_the_head_size():
    if decode_kernel_isa(torch.bfloat16, 64) is None:
        pytest.skip("kernel not built")
    flags = cpu_build.cpu_flags().split()
    has_bf16, has_amx = "avx512_bf16" in flags, "amx_bf16" in flags
    bf16_paths = {"amx", "avx512_bf16"} if has_amx else {"avx512_bf16"}  # AMX: if Linux grants it
    assert (decode_kernel_isa(torch.bfloat16, 64, 4, 16) in bf16_paths) == has_bf16
    assert (decode_kernel_isa(torch.bfloat16, 96, 3, 32) in bf16_paths) == has_bf16
    # AMX scores need blocks of a multiple of 16, at most 16 query heads per KV head and a
    # head size of at most 192.
    for group, block, d in ((4, 8, 64), (17, 16, 64), (4, 16, 256)):
        assert (decode_kernel_isa(torch.bfloat16, d, group, block) == "avx512_bf16") == has_bf16
    assert decode_kernel_isa(torch.bfloat16, 48) in ("avx512f", "avx2", "generic")  # not % 32
    assert decode_kernel_isa(torch.bfloat16, 12) == "generic"
    assert decode_kernel_isa(torch.float32, 64) in ("avx2", "generic")  # float32: AVX2 at most
    assert decode_kernel_isa(torch.bfloat16, 8) in ("avx2", "generic")
    assert decode_kernel_isa(torch.float16, 64) is None


@needs_compiler
def test_isa_environment_variable_forces_a_path(monkeypatch):
    """``BATCHGEN_PAGED_ATTENTION_ISA`` is the default ``isa`` (bit-identical to passing it);
    an unknown value raises naming the variable."""
    kv_lens = [1, 17, 300]
    q, k_cache, v_cache, tables, _ = _paged_case(kv_lens, 8, 2, 64, 16, seed=3)
    lens = torch.tensor(kv_lens)
    for isa in ("avx512f", "avx512_bf16", "amx", "generic"):
        explicit, from_env = torch.empty_like(q), torch.empty_like(q)
        paged_decode_attention(q, k_cache, v_cache, tables, lens, 16, 0.125, None, explicit, isa)
        monkeypatch.setenv("BATCHGEN_PAGED_ATTENTION_ISA", f" {isa.upper()} ")
        paged_decode_attention(q, k_cache, v_cache, tables, lens, 16, 0.125, None, from_env)
        assert torch.equal(explicit, from_env), isa
    monkeypatch.setenv("BATCHGEN_PAGED_ATTENTION_ISA", "avx512")
    with pytest.raises(ValueError, match="BATCHGEN_PAGED_ATTENTION_ISA"):
        paged_decode_attention(q, k_cache, v_cache, tables, lens, 16, 0.125, None, q.clone())


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("hq,hkv,d", [(8, 2, 64), (8, 1, 128), (4, 4, 64), (8, 2, 48)])
@torch.no_grad()
def test_bf16_decode_kernel_matches_the_gathered_torch_path(window, hq, hkv, d, monkeypatch):
    """`paged_attention` in bf16 (GQA, many sequences over several buckets): the kernel (its
    default path, AVX512-BF16 where the CPU has it; D 48 falls back) against the block
    gathers + SDPA path that ``BATCHGEN_CPU_KERNELS=0`` takes, on the same cache."""
    if not shutil.which(cpu_build.cxx_command()[0]):
        pytest.skip("no C++ compiler: the CPU kernel cannot be built here")
    block_size = 16
    kv_lens = sorted([1, 2, 15, 16, 17, 33, 47, 48, 49, 100, 130, 200] * 3)
    q, k_cache, v_cache, tables, _ = _paged_case(kv_lens, hq, hkv, d, block_size, seed=2)
    k_new, v_new = torch.randn(2, len(kv_lens), hkv, d).bfloat16()
    table_lists = [row[: math.ceil(n / block_size)].tolist() for row, n in zip(tables, kv_lens)]
    buckets = []
    for start, end in plan_decode_buckets([len(t) for t in table_lists]):
        width = len(table_lists[end - 1])
        rows = [t + [0] * (width - len(t)) for t in table_lists[start:end]]
        lens = torch.tensor(kv_lens[start:end])
        buckets.append(DecodeBucket(start, end, torch.tensor(rows), lens))
    slot_mapping = torch.tensor(
        [
            t[(n - 1) // block_size] * block_size + (n - 1) % block_size
            for t, n in zip(table_lists, kv_lens)
        ]
    )
    meta = AttentionMetadata(
        positions=torch.tensor([n - 1 for n in kv_lens]),
        slot_mapping=slot_mapping,
        num_decode_tokens=len(kv_lens),
        decode_buckets=buckets,
        block_size=block_size,
    )
    outs = {}
    for path, env in (("kernel", "1"), ("torch", "0")):
        monkeypatch.setenv("BATCHGEN_CPU_KERNELS", env)
        assert decode_kernel_available(torch.device("cpu"), torch.bfloat16) == (path == "kernel")
        caches = (k_cache.clone(), v_cache.clone())
        outs[path] = paged_attention(q, k_new, v_new, caches, meta, d**-0.5, window)
    assert outs["kernel"].dtype == torch.bfloat16
    v_max = v_cache.float().abs().max().item()
    torch.testing.assert_close(
        outs["kernel"].float(),
        outs["torch"].float(),
        rtol=2 * U_BF16 + 1e-5,
        atol=U_BF16 * max(v_max, v_new.float().abs().max().item()) + 1e-5,
    )


@pytest.mark.parametrize(
    "name,ref_dtype",
    [
        ("llama", torch.bfloat16),
        ("mistral_sliding", torch.bfloat16),
        ("qwen2", torch.bfloat16),
        ("llama_d64", torch.bfloat16),  # head size 64: the AVX512-BF16 path
        ("mixtral_d64", torch.bfloat16),
        pytest.param("mixtral", torch.bfloat16, marks=pytest.mark.xfail(reason=MIXTRAL_BF16)),
    ],
)
def test_bf16_model_greedy_tokens_through_the_kernel_agree_with_transformers(
    checkpoint_dir, name, ref_dtype, monkeypatch
):
    """A bf16 model's decode attention runs the kernel (counted), and its greedy continuation,
    teacher-forced through `transformers` (``ref_dtype`` on the bf16 weights), passes
    `test_fused_moe_bf16`'s criterion: at every position our token is within 4 bf16 ulps at
    the largest logit of the reference's best, and at least 90% of positions are its argmax."""
    import transformers as tf

    from batchgen import LLM, SamplingParams
    from batchgen.models.layers import attention

    if not shutil.which(cpu_build.cxx_command()[0]):
        pytest.skip("no C++ compiler: the CPU kernel cannot be built here")
    calls = []

    def counted(q, *args, **kwargs):
        calls.append((q.dtype, q.shape[-1]))
        return paged_decode_attention(q, *args, **kwargs)

    monkeypatch.setattr(attention, "paged_decode_attention", counted)
    path = str(checkpoint_dir(name))
    llm = LLM(path, device="cpu", dtype="bfloat16", kv_cache_memory_gb=0.05)
    tok = llm.get_tokenizer()
    prompts = [tok.encode(p) for p in ("The quick brown fox", "def fib(n):", "a b c d e f")]
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    assert calls and {dtype for dtype, _ in calls} == {torch.bfloat16}
    if name.endswith("_d64"):  # the AVX512-BF16 path (AMX scores where usable)
        assert {d for _, d in calls} == {64}
        has_bf16 = "avx512_bf16" in cpu_build.cpu_flags().split()
        assert (decode_kernel_isa(torch.bfloat16, 64, 4) in ("amx", "avx512_bf16")) == has_bf16
    ref = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval().to(ref_dtype)
    assert_greedy_agrees_with_reference(name, prompts, outs, ref)
