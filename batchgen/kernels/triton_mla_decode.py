"""MLA decode attention in Triton on the paged latent cache, absorbed form (DeepSeek-V2 paper,
arXiv:2405.04434, section 2.1.2; the decode kernels of vLLM's / SGLang's Triton MLA backend and
FlashMLA compute the same thing): the CUDA decode path of `batchgen.models.layers.mla`, reading
the latents ``c_kv`` and rope keys ``k_pe`` in place through the block table instead of the
torch path's gather of each decode bucket's blocks into a padded copy.

With ``W_UK`` folded into the query (``q_nope_absorbed = W_UK^T q_nope``, ``[B, N, C]``) every
head attends to the same key ``[c_kv, k_pe]`` and value ``c_kv``: multi-query attention with one
key head. The kernel (`batchgen.kernels.triton_mla_kernels.mla_decode_attention_kernel`)
runs one program per (sequence, block of 16 heads, KV split), the head block being the query
tile, so each latent is read from memory once per head block (DeepSeek-V3, 128 heads: 8 reads,
the later ones likely from L2). The output is the latent-space context ``[B, N, C]``; the layer
applies ``W_UV`` after, as the torch path does.

Split-KV (FlashDecoding; vLLM's and SGLang's ``num_kv_splits``): when the batch has too few
(sequence, head block) programs to fill the GPU, each context is cut into S parts attended by
separate programs, whose float32 partial contexts and log-sum-exps `mla_decode_reduce_kernel`
merges (`default_num_kv_splits`). Absent, compared with their kernels: tuned tiles and split
counts (`BLOCK_H`, `BLOCK_N`, `TARGET_PROGRAMS_PER_SM` are guesses), FP8 caches.

Never yet run on a GPU (see docs/gpu.md); proven on CPU under ``TRITON_INTERPRET=1`` in
float32 and float16 (``tests/test_triton_mla.py``), compiled for sm_90 without one
(``tests/triton_compile_check.py``).
"""

from __future__ import annotations

import torch

from batchgen.kernels.paged_attention import check_decode_context
from batchgen.kernels.triton_support import triton_unsupported_reason

BLOCK_H = 16  # heads per program: tl.dot's smallest M (untuned: FlashMLA takes 64)
BLOCK_N = 32  # keys per inner step (untuned; a C = 512 latent tile is 32 KiB in bf16)
TARGET_PROGRAMS_PER_SM = 2  # split until the grid has this many programs per SM (a guess)
MAX_KV_SPLITS = 16
MIN_KEYS_PER_SPLIT = 256  # no split shorter than this many keys (a guess)


def default_num_kv_splits(
    device: torch.device, num_seqs: int, num_heads: int, max_kv_len: int | None = None
) -> int:
    """KV splits for a decode batch: 1 off CUDA (the interpreter gains nothing) or when
    ``num_seqs * ceil(num_heads / BLOCK_H)`` programs already give every SM
    `TARGET_PROGRAMS_PER_SM`; else enough splits to reach that, at most `MAX_KV_SPLITS` and,
    when ``max_kv_len`` is given, at most one per `MIN_KEYS_PER_SPLIT` keys. Host arithmetic
    only (no device sync)."""
    if device.type != "cuda" or num_seqs == 0:
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    programs = num_seqs * -(-num_heads // BLOCK_H)
    splits = min(MAX_KV_SPLITS, -(-TARGET_PROGRAMS_PER_SM * sms // programs))
    if max_kv_len is not None:
        splits = min(splits, -(-max_kv_len // MIN_KEYS_PER_SPLIT))
    return max(1, splits)


def _pow2_at_least_16(n: int) -> int:
    return max(16, 1 << max(n - 1, 0).bit_length())


def triton_mla_decode_attention(
    q_nope_absorbed: torch.Tensor,
    q_pe: torch.Tensor,
    c_kv_cache: torch.Tensor,
    k_pe_cache: torch.Tensor,
    block_tables: torch.Tensor,
    kv_lens: torch.Tensor,
    block_size: int,
    scale: float,
    out: torch.Tensor,
    context_checked: bool = False,
    num_kv_splits: int | None = None,
) -> None:
    """One decode token per sequence attends on its cached latent context; writes ``out``.

    Per sequence b and head h: ``s_j = (q_nope_absorbed[b, h] . c_kv[j] + q_pe[b, h] .
    k_pe[j]) * scale`` over the context's positions j, ``out[b, h] = sum_j softmax(s)_j
    c_kv[j]`` (DeepSeek-V2 paper eq. 1-11 with ``W_UK`` / ``W_UV`` absorbed, section 2.1.2).

    Args:
        q_nope_absorbed: ``[B, N, C]`` float32, float16 or bfloat16: ``q_nope`` multiplied by
            ``W_UK`` (C = kv_lora_rank), last dim contiguous.
        q_pe: ``[B, N, Dr]``, its dtype and device: the rope part of the queries, rotated.
        c_kv_cache: ``[num_blocks * block_size, C]``: the normalised latents, this step's
            written. k_pe_cache: ``[num_blocks * block_size, Dr]``: the rotated rope keys.
            Separate tensors or views of one ``[slots, C + Dr]`` cache; last dims contiguous.
        block_tables: ``[B, n]`` int32 / int64 block ids (entries past a context are not read).
        kv_lens: ``[B]`` int context lengths including the new token (>= 1); the query sits at
            position ``kv_len - 1`` and sees every cached position before it.
        block_size: tokens per KV block; scale: softmax scale (DeepSeek's
            ``qk_head_dim ** -0.5`` times YaRN's mscale squared, `deepseek_softmax_scale`).
        out: ``[B, N, C]``, the queries' dtype and device, last dim contiguous. Scores and
            softmax in float32, the probabilities rounded to the cache dtype for the PV
            product (as FlashAttention does), the output rounded once.
        context_checked: the caller ran `check_decode_context` on these ``block_tables`` and
            ``kv_lens`` for this cache (once per step; it syncs with the host).
        num_kv_splits: parts each context is cut into, each attended by its own programs and
            merged by their log-sum-exps (the result differs only in float32 summation order
            and in where the probabilities are rounded); None: `default_num_kv_splits`.
    Raises:
        ValueError: naming the argument: a wrong rank, shape, dtype, device or layout, a
        context or block id outside the cache, or a device / dtype the kernel cannot run on
        (`triton_unsupported_reason`).
    """
    q = q_nope_absorbed
    for name, t, want in (("q_nope_absorbed", q, 3), ("q_pe", q_pe, 3),
                          ("c_kv_cache", c_kv_cache, 2), ("k_pe_cache", k_pe_cache, 2),
                          ("out", out, 3), ("block_tables", block_tables, 2),
                          ("kv_lens", kv_lens, 1)):  # fmt: skip
        if t.dim() != want:
            raise ValueError(f"{name} must have {want} dimensions, got shape {tuple(t.shape)}")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q_nope_absorbed on {q.device}")
    reason = triton_unsupported_reason(q.device, q.dtype)
    if reason is not None:
        raise ValueError(f"Triton MLA decode attention cannot run: {reason}")
    for name, t in (("q_pe", q_pe), ("c_kv_cache", c_kv_cache), ("k_pe_cache", k_pe_cache),
                    ("out", out)):  # fmt: skip
        if t.dtype != q.dtype:
            raise ValueError(f"{name} must be {q.dtype} like q_nope_absorbed, got {t.dtype}")
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension")
    if q.stride(-1) != 1:
        raise ValueError("q_nope_absorbed must be contiguous in its last dimension")
    b, n, c = q.shape
    dr = q_pe.shape[2]
    if c_kv_cache.shape[1] != c or out.shape != q.shape:
        raise ValueError(
            f"c_kv_cache {tuple(c_kv_cache.shape)} and out {tuple(out.shape)} must match "
            f"q_nope_absorbed {tuple(q.shape)} in kv_lora_rank (C = {c})"
        )
    if q_pe.shape[:2] != (b, n) or k_pe_cache.shape[1] != dr:
        raise ValueError(
            f"q_pe {tuple(q_pe.shape)} must be [{b}, {n}, Dr] and k_pe_cache "
            f"{tuple(k_pe_cache.shape)} [slots, Dr]"
        )
    slots = c_kv_cache.shape[0]
    if k_pe_cache.shape[0] != slots:
        raise ValueError(f"k_pe_cache has {k_pe_cache.shape[0]} slots, c_kv_cache {slots}")
    if not isinstance(block_size, int) or block_size < 1 or slots % block_size:
        raise ValueError(
            f"block_size must be a positive int dividing the cache's {slots} slots, "
            f"got {block_size!r}"
        )
    if block_tables.shape[0] != b or kv_lens.shape != (b,):
        raise ValueError(
            f"block_tables {tuple(block_tables.shape)} and kv_lens {tuple(kv_lens.shape)} "
            f"must have one row per query ({b})"
        )
    if num_kv_splits is not None and (
        not isinstance(num_kv_splits, int) or not 1 <= num_kv_splits <= 256
    ):
        raise ValueError(f"num_kv_splits must be None or an int in [1, 256], got {num_kv_splits!r}")
    if b == 0:
        return
    if not context_checked:
        check_decode_context(block_tables, kv_lens, block_size, slots // block_size)
    from batchgen.kernels import triton_mla_kernels as kernels
    from batchgen.kernels.triton_moe_kernels import dot_precision

    width = block_tables.shape[1] * block_size  # >= every context: a bound known on the host
    splits = num_kv_splits or default_num_kv_splits(q.device, b, n, width)
    block_c = _pow2_at_least_16(c)
    if splits > 1:
        mid_out = torch.empty(b, n, splits, c, device=q.device, dtype=torch.float32)
        mid_lse = torch.empty(b, n, splits, device=q.device, dtype=torch.float32)
    else:  # not read: the programs write ``out`` directly
        mid_out = mid_lse = out
    kernels.mla_decode_attention_kernel[(b, -(-n // BLOCK_H), splits)](
        q, q_pe, c_kv_cache, k_pe_cache, out, mid_out, mid_lse, block_tables, kv_lens,
        float(scale), n, c, dr, block_size,
        q.stride(0), q.stride(1), q_pe.stride(0), q_pe.stride(1),
        c_kv_cache.stride(0), k_pe_cache.stride(0), out.stride(0), out.stride(1),
        block_tables.stride(0),
        NUM_SPLITS=splits,
        BLOCK_H=BLOCK_H,
        BLOCK_C=block_c,
        BLOCK_R=_pow2_at_least_16(dr),
        BLOCK_N=BLOCK_N,
        DOT_PRECISION=dot_precision(q.dtype),
    )  # fmt: skip
    if splits > 1:
        kernels.mla_decode_reduce_kernel[(b, n)](
            mid_out, mid_lse, out, kv_lens, n, c, out.stride(0), out.stride(1),
            NUM_SPLITS=splits, BLOCK_C=block_c,
        )  # fmt: skip
