"""The float32 paths of the paged decode attention kernel: the AVX-512F path
(``csrc/paged_decode_attention_f32.h``) against the AVX2 path it replaced and a float64
reference. Its scores are the AVX2 path's bit for bit (same FMA chains, same sum tree); its
softmax is explicit AVX-512 (Cephes' exp, 16-lane sums) where the AVX2 path's is GCC's
vectorisation of a loop, so the outputs differ by a few float32 ulps; the AVX2 path itself is
unchanged (isa="avx2")."""

import pytest
import torch

from batchgen.kernels.paged_attention import (
    decode_kernel_available,
    decode_kernel_isa,
    paged_decode_attention,
)

pytestmark = pytest.mark.skipif(
    not decode_kernel_available(torch.device("cpu"), torch.float32), reason="kernel not built"
)


def _case(kv_lens, hq, hkv, d, block_size, seed=0):
    g = torch.Generator().manual_seed(seed)
    nbs = [-(-n // block_size) for n in kv_lens]
    perm = torch.randperm(sum(nbs) + 3, generator=g)  # scattered blocks, some unused
    tables = torch.zeros(len(kv_lens), max(nbs), dtype=torch.int64)
    taken = 0
    for i, nb in enumerate(nbs):
        tables[i, :nb] = perm[taken : taken + nb]
        taken += nb
    rows = (sum(nbs) + 3) * block_size
    k = torch.randn(rows, hkv, d, generator=g)
    v = torch.randn(rows, hkv, d, generator=g)
    q = torch.randn(len(kv_lens), hq, d, generator=g) * 2
    return q, k, v, tables, torch.tensor(kv_lens)


@pytest.mark.parametrize(
    "hq,hkv,d,block_size",
    [
        (8, 2, 64, 16),  # the bench model: G = 4
        (8, 2, 128, 16),  # D = 128
        (4, 2, 64, 16),  # G = 2: one head pair per KV head
        (8, 1, 64, 8),  # multi-query, G = 8: two passes of P @ V
        (12, 2, 128, 16),  # G = 6, D = 128: passes of 2 heads
        (6, 3, 64, 4),  # blocks of 4
        (8, 8, 64, 16),  # G = 1: the AVX2 path (no head pairs)
        (8, 2, 96, 16),  # D = 96: the AVX2 path
    ],
)
@pytest.mark.parametrize("window", [None, 37])
@pytest.mark.parametrize("threads", [1, 2])
def test_f32_avx512f_path_matches_avx2_and_float64(hq, hkv, d, block_size, window, threads,
                                                    monkeypatch):
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    lens = [1, 7, 8, block_size, block_size + 1, 40, 333, 1000]
    q, k, v, tables, kv_lens = _case(lens, hq, hkv, d, block_size)
    outs = {}
    for isa in ("avx2", "avx512f", "auto"):
        outs[isa] = torch.full_like(q, float("nan"))
        paged_decode_attention(q, k, v, tables, kv_lens, block_size, d**-0.5, window,
                               outs[isa], isa=isa)
    # auto is avx512f where it applies; a few ulps from AVX2 (outputs are O(1) here)
    assert torch.equal(outs["auto"], outs["avx512f"])
    torch.testing.assert_close(outs["avx512f"], outs["avx2"], rtol=0, atol=2e-6)
    if decode_kernel_isa(torch.float32, d, hq // hkv) != "avx512f":  # the AVX2 path ran
        assert torch.equal(outs["avx512f"], outs["avx2"])
    # and both are attention: against a float64 reference
    for i, n in enumerate(lens):
        p = torch.arange(max(0, n - window) if window else 0, n)
        slots = tables[i, p // block_size] * block_size + p % block_size
        kk = k[slots].double().repeat_interleave(hq // hkv, 1)  # [n, Hq, D]
        vv = v[slots].double().repeat_interleave(hq // hkv, 1)
        s = torch.einsum("hd,nhd->hn", q[i].double(), kk) * d**-0.5
        ref = torch.einsum("hn,nhd->hd", s.softmax(-1), vv)
        for isa in ("avx512f", "avx2"):
            torch.testing.assert_close(outs[isa][i].double(), ref, rtol=1e-5, atol=1e-5)


def test_f32_isa_names_the_avx512f_path_where_it_applies():
    isa = decode_kernel_isa(torch.float32, 64, 4)
    assert isa in ("avx512f", "avx2", "generic")
    if isa == "avx512f":
        assert decode_kernel_isa(torch.float32, 64, 1) == "avx2"  # no head pairs
        assert decode_kernel_isa(torch.float32, 96, 4) == "avx2"  # D not 64 or 128
    assert decode_kernel_isa(torch.float32, 12, 4) == "generic"


def test_f32_log_line_says_why_the_avx2_path_runs_on_an_avx512_cpu(monkeypatch, caplog):
    """A float32 run on an AVX-512 CPU logged "avx2 path" for decode attention beside the MoE
    kernel's "avx512f" with no reason: the float32 AVX-512F path covers D 64/128, even G."""
    import logging

    from batchgen.kernels import paged_attention as pa

    monkeypatch.setattr(pa, "_logged", set())
    monkeypatch.setattr(pa, "cpu_flags", lambda: "flags : fpu avx2 avx512f")
    with caplog.at_level(logging.INFO, logger="batchgen.kernels.paged_attention"):
        for d, g in [(32, 2), (128, 1), (128, 2)]:
            pa._log_once(torch.float32, d, g, 16, "auto")
        pa._log_once(torch.bfloat16, 32, 2, 16, "auto")
    lines = [r.getMessage() for r in caplog.records]
    why = " (the float32 AVX-512F path needs head size 64 or 128 and an even number of query "
    why += "heads per KV head)"
    for line, d, g in zip(lines, [32, 128, 128], [2, 1, 2]):
        isa = decode_kernel_isa(torch.float32, d, g)
        assert line == (
            f"paged decode attention, torch.float32, head size {d}, {g} query heads per KV "
            f"head, blocks of 16: {isa} path" + (why if isa == "avx2" else "")
        )
    assert not lines[3].endswith(why)
    monkeypatch.setattr(pa, "cpu_flags", lambda: "flags : fpu avx2")  # no AVX-512: no reason
    assert pa._why_not_avx512(torch.float32, "avx2") == ""


def test_f32_generic_path_is_attention_too():
    q, k, v, tables, kv_lens = _case([5, 300], 8, 2, 64, 16, seed=1)
    a, b = torch.empty_like(q), torch.empty_like(q)
    paged_decode_attention(q, k, v, tables, kv_lens, 16, 0.125, None, a, isa="generic")
    paged_decode_attention(q, k, v, tables, kv_lens, 16, 0.125, None, b, isa="avx512f")
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["mixtral_d64"])
def test_f32_model_greedy_through_the_avx512f_path_matches_transformers(checkpoint_dir, name,
                                                                       monkeypatch):
    """The bench model's attention shape (8 query heads, 2 KV heads of 64) in float32: decode
    attention runs this kernel's AVX-512F path (counted) and the greedy tokens are
    `transformers` generate's, token for token."""
    from batchgen import LLM, SamplingParams
    from batchgen.models.layers import attention
    from tests.test_model_oracle import PROMPTS, _hf, _hf_greedy

    calls = []

    def counted(q, *args, **kwargs):
        calls.append((q.dtype, q.shape[-1], q.shape[1] // args[0].shape[1]))
        return paged_decode_attention(q, *args, **kwargs)

    monkeypatch.setattr(attention, "paged_decode_attention", counted)
    path = str(checkpoint_dir(name))
    llm = LLM(path, device="cpu", dtype="float32", kv_cache_memory_gb=0.05)
    tok = llm.get_tokenizer()
    ids = [tok.encode(p) for p in PROMPTS]
    sp = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": i} for i in ids], sp, use_tqdm=False)
    assert calls and set(calls) == {(torch.float32, 64, 4)}
    if "avx512f" in open("/proc/cpuinfo").read():
        assert decode_kernel_isa(torch.float32, 64, 4) == "avx512f"
    ref = _hf(path)
    for prompt_ids, out in zip(ids, outs):
        assert out.outputs[0].token_ids == _hf_greedy(ref, prompt_ids, 32)


@pytest.mark.parametrize("isa", ["avx512f", "avx2", "generic"])
def test_f32_a_nan_key_makes_that_sequence_nan(isa):
    """A NaN in one cached key gives torch's SDPA a NaN output row; every float32 path says so
    too (the AVX-512F softmax's max and `exp_ps` keep a NaN) and leaves the other sequences
    finite."""
    lens = [1, 16, 17, 40]
    q, k, v, tables, kv_lens = _case(lens, 8, 2, 64, 16, seed=2)
    k[tables[3, 0] * 16 + 5] = float("nan")  # position 5 of sequence 3, every KV head
    out = torch.zeros_like(q)
    paged_decode_attention(q, k, v, tables, kv_lens, 16, 0.125, None, out, isa=isa)
    assert out[3].isnan().all()
    assert not out[:3].isnan().any()
