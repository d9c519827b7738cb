"""The Triton kernels (`batchgen.kernels.triton_moe`, `batchgen.kernels.triton_paged_attention`)
against the torch oracles: `fused_experts_reference` and the torch decode attention path.

Without CUDA the kernels run under ``TRITON_INTERPRET=1`` on CPU tensors (numpy executes each
program); with CUDA they compile and run on the GPU, and the bf16 cases run too. The variable
is set by tests/conftest.py before triton is first imported (``triton.jit`` reads it when it
decorates a function, and triton decorates its own library functions at import;
transformers' DeepSeek modules import triton during collection, so setting it at the top of
this module would be too late in a full run). It stays set for the whole session: it only lets
a forced Triton path run on CPU (`auto` never picks Triton on CPU), and tests that check the
refusal unset it.

bfloat16 under the interpreter: triton 3.9.0's interpreter converts float32 to bf16 wrongly
(checked here: a float32 -> bf16 store is off by up to 2 bf16 ulps against torch's
round-to-nearest-even, and ``tl.dot`` of bf16 tiles returns garbage; loading bf16 and widening
to float32 is exact). The MoE kernels round each GEMM output to the activations' dtype as the
reference does, so bf16 MoE is proven on a GPU only; the CPU run covers float32 and float16.

Without a GPU the compiler is still checked: `tests/triton_compile_check.py` compiles every
kernel ahead of time for sm_90 down to a cubin (the interpreter never runs the compiler).

Tolerances: float32 differs from the oracle only in the order a GEMM sums its K terms (1e-5);
float16 / bf16 by at most one rounding of an intermediate in that dtype (2 ulps at the output's
scale: 2e-3 for fp16, 1.6e-2 for bf16).
"""

from __future__ import annotations

import logging
import os
import sys

import pytest
import torch
import torch.nn.functional as F

from batchgen.models.layers.expert_path import MOE_PATH_ENV, expert_path
from batchgen.models.layers.moe import SparseMoeBlock, fused_experts_reference
from batchgen.models.model_config import RouterConfig

try:  # after tests/conftest.py has set TRITON_INTERPRET=1 (without CUDA)
    import triton  # noqa: F401
    import triton.language as tl

    _NO_TRITON = None
except ImportError as exc:  # not installed (the test extra pins it on x86-64 Linux only)
    _NO_TRITON = f"triton does not import: {exc}"

CUDA = torch.cuda.is_available()

pytestmark = pytest.mark.skipif(_NO_TRITON is not None, reason=str(_NO_TRITON))

DEVICE = torch.device("cuda" if CUDA else "cpu")
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if CUDA else [])
TOL = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2),
}


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    if CUDA:
        return
    from triton.runtime.interpreter import InterpretedFunction

    if not isinstance(tl.cdiv, InterpretedFunction):
        pytest.fail(
            "triton was imported in this process without TRITON_INTERPRET=1, so its library "
            "functions are compiled ones and cannot run on CPU: set it before the first import "
            "of triton (tests/conftest.py does unless the variable is already set)"
        )
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _experts(num_tokens, e, h, i, a, seed, dtype, ids=None):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, h, generator=g)
    w13 = torch.randn(e, 2 * i, h, generator=g) * h**-0.5
    w2 = torch.randn(e, h, i, generator=g) * i**-0.5
    probs = torch.softmax(torch.randn(num_tokens, e, generator=g), dim=-1)
    tw, topk = torch.topk(probs, a, dim=-1)  # [T, A]
    ids = topk if ids is None else torch.tensor(ids, dtype=torch.int64)
    return [t.to(DEVICE) for t in (x.to(dtype), w13.to(dtype), w2.to(dtype), tw, ids)]


# (T, E, H, I, A): E not a multiple of anything (7, 5, 3), top-k 1, 2 and 3, H and I that are
# not multiples of the tiles (40, 24, 72), rows per expert from <1 to > BLOCK_M.
SHAPES = [(5, 7, 32, 48, 2), (1, 3, 64, 32, 1), (9, 5, 40, 24, 3), (40, 3, 72, 16, 2)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_triton_moe_equals_the_reference(shape, dtype):
    from batchgen.kernels.triton_moe import fused_experts_triton

    t, e, h, i, a = shape
    x, w13, w2, tw, ids = _experts(t, e, h, i, a, seed=sum(shape), dtype=dtype)
    got = fused_experts_triton(x, w13, w2, tw, ids)
    want = fused_experts_reference(x, w13, w2, tw, ids)
    assert got.dtype == dtype and got.shape == (t, h)
    torch.testing.assert_close(got, want, **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_triton_moe_experts_with_zero_and_one_token(dtype):
    """Experts 0 and 4 get no token, expert 3 exactly one, expert 1 most (E = 5, A = 2)."""
    from batchgen.kernels.triton_moe import fused_experts_triton

    ids = [[1, 2], [2, 1], [1, 3], [2, 1], [1, 2]]
    x, w13, w2, tw, ids = _experts(5, 5, 32, 16, 2, seed=3, dtype=dtype, ids=ids)
    assert torch.bincount(ids.reshape(-1).cpu(), minlength=5).tolist() == [0, 5, 4, 1, 0]
    got = fused_experts_triton(x, w13, w2, tw, ids, out_dtype=torch.float32)
    want = fused_experts_reference(x, w13, w2, tw, ids, out_dtype=torch.float32)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_triton_moe_rows_at_the_tile_boundary_expert_parallel_shape(dtype):
    """BLOCK_M = 16 with experts of exactly 16, 17 (a second block with one row) and 1 rows;
    top-k 1 and a float32 result, as expert parallelism calls the experts (one row per
    received activation, `batchgen.distributed.ep_moe`)."""
    from batchgen.kernels.triton_moe import fused_experts_triton

    ids = [[0]] * 16 + [[1]] * 17 + [[2]]
    x, w13, w2, tw, ids = _experts(34, 3, 48, 40, 1, seed=7, dtype=dtype, ids=ids)
    tw = tw * 0.75  # router weights that are not 1
    config = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=16)
    got = fused_experts_triton(x, w13, w2, tw, ids, out_dtype=torch.float32, config=config)
    want = fused_experts_reference(x, w13, w2, tw, ids, out_dtype=torch.float32)
    torch.testing.assert_close(got, want, **TOL[dtype])


def test_triton_moe_other_activation_and_empty_batch_and_stats():
    from batchgen.engine.metrics import ExpertGemmStats
    from batchgen.kernels.triton_moe import fused_experts_triton

    x, w13, w2, tw, ids = _experts(6, 4, 32, 16, 2, seed=5, dtype=torch.float32)
    gelu = F.gelu
    got = fused_experts_triton(x, w13, w2, tw, ids, act=gelu)
    torch.testing.assert_close(got, fused_experts_reference(x, w13, w2, tw, ids, act=gelu))
    stats, ref_stats = ExpertGemmStats(), ExpertGemmStats()
    fused_experts_triton(x, w13, w2, tw, ids, stats=stats)
    fused_experts_reference(x, w13, w2, tw, ids, stats=ref_stats)
    assert stats.rows == 0  # counted on the device: no host sync until `flush`
    stats.flush()
    assert stats.__dict__ == ref_stats.__dict__ and stats.rows == 12
    empty = fused_experts_triton(x[:0], w13, w2, tw[:0], ids[:0])
    assert empty.shape == (0, 32)


def test_triton_moe_rejects_bad_input(monkeypatch):
    from batchgen.kernels.triton_moe import fused_experts_triton

    x, w13, w2, tw, ids = _experts(3, 4, 16, 8, 2, seed=1, dtype=torch.float32)
    with pytest.raises(ValueError, match="one dtype"):
        fused_experts_triton(x.half(), w13, w2, tw, ids)
    with pytest.raises(ValueError, match=r"w2 \(2, 16, 8\)"):
        fused_experts_triton(x, w13, w2[:2], tw, ids)
    with pytest.raises(ValueError, match="topk_ids"):
        fused_experts_triton(x, w13, w2, tw, ids[:2])
    with pytest.raises(ValueError, match="dtype torch.float64"):
        fused_experts_triton(x.double(), w13.double(), w2.double(), tw, ids)
    if not CUDA:
        monkeypatch.delenv("TRITON_INTERPRET")
        with pytest.raises(ValueError, match="device cpu"):
            fused_experts_triton(x, w13, w2, tw, ids)


def test_moe_align_block_size_pads_each_expert_to_the_tile():
    from batchgen.kernels.triton_moe import moe_align_block_size

    ids, eids, post = moe_align_block_size(torch.tensor([[2, 0], [0, 1]]), 2, 3)
    assert ids.tolist() == [1, 2, 3, 4, 0, 4, 4, 4]
    assert eids.tolist() == [0, 1, 2, 2] and post.tolist() == [6]
    g = torch.Generator().manual_seed(0)
    topk = torch.randint(0, 11, (37, 3), generator=g)
    block_m = 4
    ids, eids, post = moe_align_block_size(topk, block_m, 11)
    flat, r = topk.reshape(-1), topk.numel()
    used = ids[: int(post)]
    assert sorted(used[used < r].tolist()) == list(range(r))  # every activation exactly once
    assert (ids[int(post) :] == r).all()
    for b in range(int(post) // block_m):
        rows = used[b * block_m : (b + 1) * block_m]
        rows = rows[rows < r].long()
        assert len(rows) and (flat[rows] == eids[b]).all()  # one expert per block, none empty
    counts = torch.bincount(flat, minlength=11)
    assert int(post) == int(((counts + block_m - 1) // block_m * block_m).sum())


def test_sparse_moe_block_runs_the_forced_triton_path_and_logs_it_once(monkeypatch, caplog):
    import batchgen.models.layers.expert_path as ep
    import batchgen.models.layers.moe as moe

    monkeypatch.setattr(ep, "_logged", set())
    monkeypatch.setenv(MOE_PATH_ENV, "triton")
    torch.manual_seed(0)
    block = SparseMoeBlock(32, 16, 6, 2, RouterConfig()).to(DEVICE)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.2)
    calls = []
    real = moe.fused_experts_triton
    monkeypatch.setattr(
        moe, "fused_experts_triton", lambda *a, **k: calls.append(1) or real(*a, **k)
    )
    x = torch.randn(11, 32, device=DEVICE)
    with torch.no_grad(), caplog.at_level(logging.INFO, logger=ep.__name__):
        tw, ids = block.route(x)
        want = fused_experts_reference(x, block.w13_weight, block.w2_weight, tw, ids)
        torch.testing.assert_close(block(x), want, **TOL[torch.float32])
        block(x)
    assert len(calls) == 2
    assert len([r for r in caplog.records if "triton path" in r.getMessage()]) == 1
    kw = dict(batch_invariant=False, cpu_kernel=True, hidden_size=32, intermediate_size=16)
    assert expert_path(DEVICE, torch.float32, num_experts=6, **kw) == "triton"
    assert expert_path(DEVICE, torch.float32, num_experts=6, **{**kw, "batch_invariant": True}) == (
        "cpu_kernel"
    )


# --- paged decode attention ---------------------------------------------------------------

# The probabilities are rounded to the cache dtype before the PV product (FlashAttention's
# rounding; torch's CPU SDPA keeps them in float32): up to 2^-11 (fp16) / 2^-8 (bf16) of
# max |v| (< 5 for these N(0, 1) caches), plus one rounding of the output.
ATTN_TOL = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.float16: dict(atol=3e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=2.5e-2, rtol=1.6e-2),
}


def _decode_batch(kv_lens, hq, hkv, d, block_size, dtype, seed, num_blocks=40):
    """q [B, Hq, D], k/v of the new tokens [B, Hkv, D], caches [num_blocks * block_size, Hkv,
    D] full of random old K/V, and metadata with one decode bucket (blocks at random)."""
    from batchgen.models.layers.attention import AttentionMetadata, DecodeBucket

    g = torch.Generator().manual_seed(seed)
    b = len(kv_lens)
    width = max(-(-n // block_size) for n in kv_lens)
    tables = torch.stack([torch.randperm(num_blocks, generator=g)[:width] for _ in range(b)])
    lens = torch.tensor(kv_lens)
    pos = lens - 1
    slots = tables.gather(1, (pos // block_size)[:, None])[:, 0] * block_size + pos % block_size
    caches = [torch.randn(num_blocks * block_size, hkv, d, generator=g) for _ in range(2)]
    q, k, v = (torch.randn(b, h, d, generator=g) for h in (hq, hkv, hkv))
    to = dict(device=DEVICE, dtype=dtype)
    meta = AttentionMetadata(
        positions=pos.to(DEVICE),
        slot_mapping=slots.to(DEVICE),
        num_decode_tokens=b,
        decode_buckets=[DecodeBucket(0, b, tables.to(DEVICE), lens.to(DEVICE))],
        block_size=block_size,
    )
    return q.to(**to), k.to(**to), v.to(**to), [c.to(**to) for c in caches], meta


def _attend(backend, monkeypatch, q, k, v, caches, meta, window):
    from batchgen.models.layers.attention import paged_attention
    from batchgen.models.layers.attention_backend import ATTENTION_BACKEND_ENV

    monkeypatch.setenv(ATTENTION_BACKEND_ENV, backend)
    meta.decode_buckets[0].checked_num_blocks = None
    kv_cache = tuple(c.clone() for c in caches)
    return paged_attention(q, k, v, kv_cache, meta, q.shape[-1] ** -0.5, window)


# (kv_lens, Hq, Hkv, D, block_size, sliding_window): contexts of 1, at a block boundary and
# one past it, longer than BLOCK_N (64), varying lengths in one batch, GQA groups of 1 and 4
# (and 3: not a power of two), a head size that is not a power of two, sliding windows.
ATTN_CASES = [
    ([1, 4, 5, 8, 9], 4, 1, 32, 4, None),
    ([16, 17, 1, 70], 8, 2, 20, 16, None),
    ([3, 64, 65, 130], 2, 2, 16, 8, None),
    ([9, 1, 33, 100], 6, 2, 16, 4, 7),
    ([2, 40], 4, 4, 32, 8, 64),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", ATTN_CASES, ids=str)
def test_triton_decode_attention_equals_the_torch_path(case, dtype, monkeypatch):
    kv_lens, hq, hkv, d, block_size, window = case
    batch = _decode_batch(kv_lens, hq, hkv, d, block_size, dtype, seed=len(kv_lens) + hq)
    want = _attend("torch", monkeypatch, *batch, window)
    got = _attend("triton", monkeypatch, *batch, window)
    assert got.dtype == dtype and got.shape == (len(kv_lens), hq, d)
    torch.testing.assert_close(got, want, **ATTN_TOL[dtype])


def test_triton_decode_attention_rejects_bad_input(monkeypatch):
    from batchgen.kernels.triton_paged_attention import triton_paged_decode_attention

    q, _, _, (kc, vc), meta = _decode_batch([5, 9], 4, 2, 16, 4, torch.float32, seed=0)
    bucket = meta.decode_buckets[0]
    args = (kc, vc, bucket.block_tables, bucket.kv_lens, 4, 0.25, None)
    out = torch.empty_like(q)
    with pytest.raises(ValueError, match="multiple of the KV heads"):
        triton_paged_decode_attention(q[:, :3], *args, out[:, :3])
    with pytest.raises(ValueError, match="k_cache must be torch.float16"):
        triton_paged_decode_attention(q.half(), *args, out.half())
    with pytest.raises(ValueError, match="kv_lens must be in"):
        bad = (kc, vc, bucket.block_tables, bucket.kv_lens * 0, 4, 0.25, None)
        triton_paged_decode_attention(q, *bad, out)
    with pytest.raises(ValueError, match="block_tables entries"):
        bad = (kc, vc, bucket.block_tables + 1000, bucket.kv_lens, 4, 0.25, None)
        triton_paged_decode_attention(q, *bad, out)
    with pytest.raises(ValueError, match="sliding_window"):
        triton_paged_decode_attention(q, *args[:-1], 0, out)


def test_decode_attention_backend_rules(monkeypatch, caplog):
    import batchgen.models.layers.attention_backend as ab

    monkeypatch.setattr(ab, "_logged", set())
    env, cpu, cuda = ab.ATTENTION_BACKEND_ENV, torch.device("cpu"), torch.device("cuda")
    monkeypatch.delenv(env, raising=False)
    monkeypatch.setattr(
        ab, "decode_kernel_available", lambda dev, dt, cache=None: dev.type == "cpu"
    )
    assert ab.decode_attention_backend(cpu, torch.float32) == "cpu_kernel"
    monkeypatch.setattr(ab, "triton_unsupported_reason", lambda dev, dt: None)
    assert ab.decode_attention_backend(cuda, torch.bfloat16) == "triton"
    monkeypatch.setattr(ab, "triton_unsupported_reason", lambda dev, dt: "triton does not import")
    assert ab.decode_attention_backend(cuda, torch.bfloat16) == "torch"
    with pytest.raises(ValueError, match=f"{env}=triton: triton does not import"):
        monkeypatch.setenv(env, "Triton")
        ab.decode_attention_backend(cpu, torch.float32)
    monkeypatch.setenv(env, "cpu_kernel")
    with pytest.raises(ValueError, match=f"{env}=cpu_kernel"):
        ab.decode_attention_backend(cuda, torch.float32)
    monkeypatch.setenv(env, "torch")
    with caplog.at_level(logging.INFO, logger=ab.__name__):
        assert ab.decode_attention_backend(cpu, torch.float32) == "torch"
        assert ab.decode_attention_backend(cpu, torch.float32) == "torch"
    assert len([r for r in caplog.records if "torch backend" in r.getMessage()]) == 1
    monkeypatch.setenv(env, "flashinfer")
    with pytest.raises(ValueError, match=f"{env}='flashinfer'"):
        ab.decode_attention_backend(cpu, torch.float32)


@pytest.mark.timeout(300)
def test_engine_on_the_triton_paths_generates_the_torch_paths_tokens(
    checkpoint_dir, monkeypatch
):
    """A tiny float32 Mixtral engine with ``BATCHGEN_MOE_PATH=triton`` and
    ``BATCHGEN_ATTENTION_BACKEND=triton`` (both counted: every MoE call and every decode step
    runs them) generates the greedy tokens of the torch oracles (``reference`` experts,
    ``torch`` attention), with log-probabilities within float32 GEMM reordering of them."""
    import batchgen.models.layers.attention as attention
    import batchgen.models.layers.moe as moe
    from batchgen import LLM, SamplingParams
    from batchgen.models.layers.attention_backend import ATTENTION_BACKEND_ENV

    calls = {"moe": 0, "attn": 0}
    real_moe, real_attn = moe.fused_experts_triton, attention.triton_paged_decode_attention

    def count(name, fn):
        def wrapped(*a, **k):
            calls[name] += 1
            return fn(*a, **k)

        return wrapped

    monkeypatch.setattr(moe, "fused_experts_triton", count("moe", real_moe))
    monkeypatch.setattr(attention, "triton_paged_decode_attention", count("attn", real_attn))
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=1)
    results = {}
    for moe_path, attn_backend in (("reference", "torch"), ("triton", "triton")):
        monkeypatch.setenv(MOE_PATH_ENV, moe_path)
        monkeypatch.setenv(ATTENTION_BACKEND_ENV, attn_backend)
        llm = LLM(str(checkpoint_dir("mixtral")), device=str(DEVICE), dtype="float32",
                  kv_cache_memory_gb=0.05)  # fmt: skip
        tok = llm.get_tokenizer()
        prompts = [tok.encode(p) for p in ("The quick brown fox", "def fib(n):", "a b")]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        results[moe_path] = [
            (list(o.outputs[0].token_ids), o.outputs[0].cumulative_logprob) for o in outs
        ]
        if moe_path == "reference":
            assert calls == {"moe": 0, "attn": 0}
    assert calls["moe"] and calls["attn"]
    assert [ids for ids, _ in results["triton"]] == [ids for ids, _ in results["reference"]]
    for (_, got), (_, want) in zip(results["triton"], results["reference"]):
        assert got == pytest.approx(want, abs=1e-4)


@pytest.mark.timeout(180)
def test_kernels_compile_for_hopper_without_a_gpu(tmp_path):
    """Every kernel, in bf16, fp16 and fp32, compiled ahead of time for sm_90 (H100 / H200) down
    to a cubin by triton's bundled ptxas (`tests/triton_compile_check.py`): the compiler's type
    checks and lowering, which the interpreter never runs, pass before any GPU is lent."""
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=str(root), TRITON_CACHE_DIR=str(tmp_path), TRITON_DEFAULT_FP_FUSION="1")
    proc = subprocess.run(
        [sys.executable, str(root / "tests" / "triton_compile_check.py"), "90"],
        env=env, capture_output=True, text=True, timeout=170,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert len(lines) == 21 and all(" ok shared=" in ln for ln in lines), lines
