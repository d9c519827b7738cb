"""The Triton MLA decode kernel (`batchgen.kernels.triton_mla_decode`) against the torch
absorbed path (`batchgen.models.layers.mla.mla_decode_torch` on gathered latents), unsplit and
split over the context; the KV-split and backend rules (`default_num_kv_splits`,
`mla_decode_backend`); the MLA layer on the forced Triton path against HF's DeepSeek attention
and against the torch backend; and a tiny DeepSeek-V3 engine on the Triton path against the
torch path, token for token.

Without CUDA the kernel runs under ``TRITON_INTERPRET=1`` on CPU tensors (set by
tests/conftest.py before triton's first import; see tests/test_triton_kernels.py for why and
for triton 3.9.0's broken bf16 in the interpreter): float32 and float16 here, bf16 only on CUDA.

Tolerances: float32 differs from the oracle only in summation order (1e-5). float16: the
oracle rounds the scores to fp16 before the float32 softmax (half an ulp of |s| <= ~16: 4e-3,
times the scale ~0.1), and rounds the normalised probabilities while the kernel rounds the
unnormalised ones (FlashAttention's rounding): up to 2^-11 of max |c_kv| (< 5 for these N(0, 1)
latents) plus one rounding of the output: the GQA kernel's fp16 / bf16 tolerance.
"""

from __future__ import annotations

import json
import logging

import pytest
import torch

from batchgen.models.layers.attention_backend import ATTENTION_BACKEND_ENV

try:  # after tests/conftest.py has set TRITON_INTERPRET=1 (without CUDA)
    import triton  # noqa: F401
    import triton.language as tl

    _NO_TRITON = None
except ImportError as exc:
    _NO_TRITON = f"triton does not import: {exc}"

CUDA = torch.cuda.is_available()
pytestmark = pytest.mark.skipif(_NO_TRITON is not None, reason=str(_NO_TRITON))
DEVICE = torch.device("cuda" if CUDA else "cpu")
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if CUDA else [])
TOL = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.float16: dict(atol=3e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=2.5e-2, rtol=1.6e-2),
}


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    if CUDA:
        return
    from triton.runtime.interpreter import InterpretedFunction

    if not isinstance(tl.cdiv, InterpretedFunction):
        pytest.fail(
            "triton was imported in this process without TRITON_INTERPRET=1 (tests/conftest.py "
            "sets it unless the variable is already set)"
        )
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _mla_batch(kv_lens, n, c, dr, block_size, dtype, seed, num_blocks=48, joint=False):
    """Queries ``q_lat [B, N, C]``, ``q_pe [B, N, Dr]``, caches ``c_kv [slots, C]`` and ``k_pe
    [slots, Dr]`` of random values (views of one ``[slots, C + Dr]`` tensor with ``joint``, as
    vLLM lays the cache out), and a `DecodeBucket` whose blocks are drawn at random."""
    from batchgen.models.layers.attention import DecodeBucket

    g = torch.Generator().manual_seed(seed)
    b = len(kv_lens)
    width = max(-(-ln // block_size) for ln in kv_lens)
    tables = torch.stack([torch.randperm(num_blocks, generator=g)[:width] for _ in range(b)])
    to = dict(device=DEVICE, dtype=dtype)
    kv = torch.randn(num_blocks * block_size, c + dr, generator=g).to(**to)
    c_kv, k_pe = kv[:, :c], kv[:, c:]
    if not joint:
        c_kv, k_pe = c_kv.contiguous(), k_pe.contiguous()
    q_lat = torch.randn(b, n, c, generator=g).to(**to)
    q_pe = torch.randn(b, n, dr, generator=g).to(**to)
    bucket = DecodeBucket(0, b, tables.to(DEVICE), torch.tensor(kv_lens, device=DEVICE))
    return q_lat, q_pe, c_kv, k_pe, bucket


def _torch_path(q_lat, q_pe, c_kv, k_pe, bucket, block_size, scale):
    from batchgen.models.layers.mla import mla_decode_torch

    mask = bucket.mask(bucket.kv_lens - 1, block_size, None)  # [B, 1, 1, L]
    # The torch path gathers whole blocks from contiguous caches (the engine's layout).
    latent = bucket.gather(c_kv.contiguous(), block_size)  # [B, L, C]
    pe = bucket.gather(k_pe.contiguous(), block_size)  # [B, L, Dr]
    return mla_decode_torch(q_lat, q_pe, latent, pe, mask, scale)


def _kernel(q_lat, q_pe, c_kv, k_pe, bucket, block_size, scale, splits=None):
    from batchgen.kernels.triton_mla_decode import triton_mla_decode_attention

    out = torch.full_like(q_lat, float("nan"))
    triton_mla_decode_attention(
        q_lat, q_pe, c_kv, k_pe, bucket.block_tables, bucket.kv_lens, block_size, scale, out,
        num_kv_splits=splits,
    )  # fmt: skip
    return out


# (kv_lens, N, C, Dr, block_size, joint cache): a context of 1 token alone; contexts at a block
# boundary and one past it; longer than BLOCK_N (32) and several steps of it, mixed lengths in
# one batch; N = 1, 3, 16 and 20 (two head blocks, the second partial); C and Dr of 32/64 and
# 16/32, and 48 / 24 / 8 (not powers of two: padded tiles); DeepSeek-V3's C = 512, Dr = 64;
# the latent and rope caches as views of one [slots, C + Dr] tensor.
MLA_CASES = [
    ([1], 1, 32, 16, 4, False),
    ([1, 4, 5, 8, 9], 3, 32, 16, 4, False),
    ([16, 17, 1, 70], 16, 64, 32, 16, True),
    ([3, 33, 64, 100], 20, 48, 24, 8, False),
    ([2, 40, 9], 3, 64, 8, 1, True),
    ([65, 7], 16, 512, 64, 16, True),
]


# KV splits: 1 (the programs write the output), 3 and 16 (contexts shorter than the split count
# leave splits empty; the reduction skips them).
@pytest.mark.parametrize("splits", [1, 3, 16])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", MLA_CASES, ids=str)
def test_triton_mla_decode_equals_the_torch_absorbed_path(case, dtype, splits):
    kv_lens, n, c, dr, block_size, joint = case
    batch = _mla_batch(kv_lens, n, c, dr, block_size, dtype, seed=n + c, joint=joint)
    scale = (c // 4 + dr) ** -0.5  # a qk_head_dim's scale, Dn = C / 4
    want = _torch_path(*batch, block_size, scale)
    got = _kernel(*batch, block_size, scale, splits)
    assert got.dtype == dtype and got.shape == (len(kv_lens), n, c)
    torch.testing.assert_close(got, want, **TOL[dtype])


@pytest.mark.parametrize("splits", [1, 4])
def test_triton_mla_decode_ignores_cache_past_the_context_and_unused_table_entries(
    splits, monkeypatch
):
    """Positions past ``kv_len`` in the last block and table entries past the context hold NaN
    / an out-of-range id, and the split buffers start as NaN (4 splits of contexts 5 and 2
    leave 1 and 2 splits empty, never written): the result is unchanged (nothing unwritten
    is read into it)."""
    q_lat, q_pe, c_kv, k_pe, bucket = _mla_batch([5, 2], 4, 32, 16, 4, torch.float32, seed=3)
    want = _kernel(q_lat, q_pe, c_kv, k_pe, bucket, 4, 0.2)
    tables = bucket.block_tables.clone()
    for row, ln in enumerate(bucket.kv_lens.tolist()):
        last = int(tables[row, (ln - 1) // 4])
        c_kv[last * 4 + (ln - 1) % 4 + 1 : (last + 1) * 4] = float("nan")
        k_pe[last * 4 + (ln - 1) % 4 + 1 : (last + 1) * 4] = float("nan")
    tables[1, 1] = 10_000  # context 2 of block size 4 reads block 0 of its row only
    bucket.block_tables = tables
    real_empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **k: real_empty(*a, **k).fill_(float("nan")))
    got = _kernel(q_lat, q_pe, c_kv, k_pe, bucket, 4, 0.2, splits)
    monkeypatch.undo()
    # Splitting changes only the float32 summation order and where the probabilities round.
    torch.testing.assert_close(got, want, **(TOL[torch.float32] if splits > 1 else dict(
        rtol=0, atol=0)))  # fmt: skip


def test_triton_mla_decode_rejects_bad_input():
    from batchgen.kernels.triton_mla_decode import triton_mla_decode_attention as mla

    q, q_pe, c_kv, k_pe, bucket = _mla_batch([5, 9], 4, 32, 16, 4, torch.float32, seed=0)
    bt, lens = bucket.block_tables, bucket.kv_lens
    out = torch.empty_like(q)
    with pytest.raises(ValueError, match="c_kv_cache .* must match q_nope_absorbed"):
        mla(q[..., :16], q_pe, c_kv, k_pe, bt, lens, 4, 0.2, out[..., :16])
    with pytest.raises(ValueError, match="q_pe .* must be \\[2, 4, Dr\\]"):
        mla(q, q_pe[:, :3], c_kv, k_pe, bt, lens, 4, 0.2, out)
    with pytest.raises(ValueError, match="k_pe_cache must be torch.float32"):
        mla(q, q_pe, c_kv, k_pe.half(), bt, lens, 4, 0.2, out)
    with pytest.raises(ValueError, match="c_kv_cache must be contiguous in its last"):
        mla(q, q_pe, c_kv.t().contiguous().t(), k_pe, bt, lens, 4, 0.2, out)
    with pytest.raises(ValueError, match="k_pe_cache must have 2 dimensions"):
        mla(q, q_pe, c_kv, k_pe[:, None], bt, lens, 4, 0.2, out)
    with pytest.raises(ValueError, match="k_pe_cache has 96 slots"):
        mla(q, q_pe, c_kv, k_pe[:96], bt, lens, 4, 0.2, out)
    with pytest.raises(ValueError, match="block_size must be a positive int"):
        mla(q, q_pe, c_kv, k_pe, bt, lens, 5, 0.2, out)
    with pytest.raises(ValueError, match="one row per query"):
        mla(q, q_pe, c_kv, k_pe, bt[:1], lens, 4, 0.2, out)
    with pytest.raises(ValueError, match="kv_lens must be in"):
        mla(q, q_pe, c_kv, k_pe, bt, lens * 0, 4, 0.2, out)
    with pytest.raises(ValueError, match="block_tables entries"):
        mla(q, q_pe, c_kv, k_pe, bt + 1000, lens, 4, 0.2, out)
    with pytest.raises(ValueError, match="num_kv_splits must be None or an int"):
        mla(q, q_pe, c_kv, k_pe, bt, lens, 4, 0.2, out, num_kv_splits=0)
    with pytest.raises(ValueError, match="dtype torch.int32"):
        mla(q.int(), q_pe.int(), c_kv.int(), k_pe.int(), bt, lens, 4, 0.2, out.int())


def test_default_num_kv_splits_fills_the_sms_without_short_splits(monkeypatch):
    from types import SimpleNamespace

    import batchgen.kernels.triton_mla_decode as md

    props = SimpleNamespace(multi_processor_count=132)  # an H100 / H200
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)
    cuda = torch.device("cuda")
    assert md.default_num_kv_splits(torch.device("cpu"), 1, 128) == 1
    assert md.default_num_kv_splits(cuda, 64, 128) == 1  # 512 programs >= 2 per SM
    assert md.default_num_kv_splits(cuda, 1, 128) == 16  # 8 programs: 33 wanted, capped
    assert md.default_num_kv_splits(cuda, 1, 128, max_kv_len=1000) == 4  # 256 keys per split
    assert md.default_num_kv_splits(cuda, 20, 16, max_kv_len=100_000) == 14  # ceil(264 / 20)
    assert md.default_num_kv_splits(cuda, 0, 16) == 1


def test_mla_decode_backend_rules(monkeypatch, caplog):
    import batchgen.models.layers.attention_backend as ab

    monkeypatch.setattr(ab, "_logged", set())
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    monkeypatch.delenv(ATTENTION_BACKEND_ENV, raising=False)
    monkeypatch.setattr(ab, "triton_unsupported_reason", lambda dev, dt: None)
    assert ab.mla_decode_backend(cpu, torch.float32) == "torch"  # auto: Triton on CUDA only
    with caplog.at_level(logging.INFO, logger=ab.__name__):
        assert ab.mla_decode_backend(cuda, torch.bfloat16) == "triton"
        assert ab.mla_decode_backend(cuda, torch.bfloat16) == "triton"
    logs = [r.getMessage() for r in caplog.records if "MLA decode" in r.getMessage()]
    assert len(logs) == 1 and "triton backend" in logs[0], logs
    monkeypatch.setenv(ATTENTION_BACKEND_ENV, "triton")
    assert ab.mla_decode_backend(cpu, torch.float16) == "triton"
    monkeypatch.setenv(ATTENTION_BACKEND_ENV, "torch")
    assert ab.mla_decode_backend(cuda, torch.bfloat16) == "torch"
    monkeypatch.setenv(ATTENTION_BACKEND_ENV, "cpu_kernel")
    with pytest.raises(ValueError, match="no CPU kernel for MLA decode"):
        ab.mla_decode_backend(cpu, torch.float32)
    monkeypatch.setattr(ab, "triton_unsupported_reason", lambda dev, dt: "triton does not import")
    monkeypatch.setenv(ATTENTION_BACKEND_ENV, "auto")
    assert ab.mla_decode_backend(cuda, torch.bfloat16) == "torch"
    monkeypatch.setenv(ATTENTION_BACKEND_ENV, "triton")
    with pytest.raises(ValueError, match=f"{ATTENTION_BACKEND_ENV}=triton: triton does not"):
        ab.mla_decode_backend(cuda, torch.bfloat16)


@pytest.mark.timeout(300)
def test_deepseek_engine_on_the_triton_mla_path_generates_the_torch_paths_tokens(
    checkpoint_dir, monkeypatch
):
    """A tiny float32 DeepSeek-V3 engine (MLA with q_lora_rank, YaRN) with
    ``BATCHGEN_ATTENTION_BACKEND=triton`` (counted: every decode step of every MLA layer runs
    the kernel) generates the greedy tokens of the ``torch`` path, with log-probabilities
    within float32 reordering of them."""
    import batchgen.models.layers.mla as mla
    from batchgen import LLM, SamplingParams

    calls = []
    real = mla.triton_mla_decode_attention

    def counted(*a, **k):
        calls.append(a[0].shape[0])
        return real(*a, **k)

    monkeypatch.setattr(mla, "triton_mla_decode_attention", counted)
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=1)
    results = {}
    for backend in ("torch", "triton"):
        monkeypatch.setenv(ATTENTION_BACKEND_ENV, backend)
        llm = LLM(str(checkpoint_dir("deepseek_v3")), device=str(DEVICE), dtype="float32",
                  kv_cache_memory_gb=0.05)  # fmt: skip
        tok = llm.get_tokenizer()
        prompts = [tok.encode(p) for p in ("The quick brown fox", "def fib(n):", "a b")]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        results[backend] = [
            (list(o.outputs[0].token_ids), o.outputs[0].cumulative_logprob) for o in outs
        ]
        if backend == "torch":
            assert calls == []
    layers = json.loads((checkpoint_dir("deepseek_v3") / "config.json").read_text())
    # Every MLA layer of each of the 7 decode steps (the 8th token comes from the prefill)
    # attends all 3 sequences in one in-place bucket.
    assert calls == [3] * (layers["num_hidden_layers"] * 7), calls
    assert [ids for ids, _ in results["triton"]] == [ids for ids, _ in results["torch"]]
    for (_, got), (_, want) in zip(results["triton"], results["torch"]):
        assert got == pytest.approx(want, abs=1e-4)


@pytest.mark.parametrize("case", ["v3_qlora_yarn", "v3_noqlora_yarn_bias", "v2_qlora_default"])
def test_mla_layer_on_the_triton_path_matches_hf(case, monkeypatch):
    """`test_deepseek_layers`' three mixed steps (prefills, a continuation chunk, decodes of
    different context lengths, the rest of the cache NaN) with the Triton MLA decode forced:
    every row equals HF's one-shot prefill (float32, 1e-5), and the kernel ran (twice)."""
    import batchgen.models.layers.mla as mla
    import tests.test_deepseek_layers as layers

    calls = []
    real = mla.triton_mla_decode_attention
    monkeypatch.setattr(mla, "triton_mla_decode_attention", lambda *a, **k: (
        calls.append(a[0].shape[0]), real(*a, **k)))  # fmt: skip
    monkeypatch.setenv(ATTENTION_BACKEND_ENV, "triton")
    layers.test_mla_chunked_prefill_and_decode_match_full_prefill(case, absorb_decode=True)
    assert calls == [1, 2]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@torch.no_grad()
def test_mla_layer_decode_triton_equals_torch_in_each_dtype(dtype, monkeypatch):
    """One MLA layer's decode step (5 sequences, contexts 1 to 70, block size 16) with the
    cache full of random latents: the Triton backend's output equals the torch backend's
    within the kernel's tolerance, scaled by the layer's output size (W_UV and o_proj
    multiply the latent-space differences by their norms)."""
    import tests.test_deepseek_layers as layers
    from batchgen.models.layers.attention import AttentionMetadata, DecodeBucket

    _, ours = layers._build_pair("v3_qlora_yarn", absorb_decode=True)
    ours = ours.to(device=DEVICE, dtype=dtype)
    g = torch.Generator().manual_seed(5)
    lens, bs, num_blocks = [1, 16, 17, 33, 70], 16, 24
    width = max(-(-n // bs) for n in lens)
    tables = torch.stack([torch.randperm(num_blocks, generator=g)[:width] for _ in lens])
    pos = torch.tensor(lens) - 1
    slots = tables.gather(1, (pos // bs)[:, None])[:, 0] * bs + pos % bs
    d = ours.dims
    cache = (torch.randn(num_blocks * bs, d.kv_lora_rank, generator=g),
             torch.randn(num_blocks * bs, d.qk_rope_head_dim, generator=g))  # fmt: skip
    x = torch.randn(len(lens), ours.o_proj.out_features, generator=g).to(device=DEVICE, dtype=dtype)
    outs = {}
    for backend in ("torch", "triton"):
        monkeypatch.setenv(ATTENTION_BACKEND_ENV, backend)
        bucket = DecodeBucket(0, len(lens), tables.to(DEVICE), torch.tensor(lens, device=DEVICE))
        meta = AttentionMetadata(positions=pos.to(DEVICE), slot_mapping=slots.to(DEVICE),
                                 num_decode_tokens=len(lens), decode_buckets=[bucket],
                                 block_size=bs)  # fmt: skip
        outs[backend] = ours(x, meta, tuple(c.to(device=DEVICE, dtype=dtype) for c in cache))
    scale = outs["torch"].float().abs().max().item()
    tol = TOL[dtype]
    torch.testing.assert_close(
        outs["triton"], outs["torch"], rtol=tol["rtol"], atol=tol["atol"] * max(1.0, scale)
    )
