"""Model FLOPs and the machine's measured matmul peak, for model FLOP utilisation (MFU).

MFU = (model FLOPs of the useful work) / seconds / peak FLOP/s, where model FLOPs count
2 multiply-adds per weight a token touches (active parameters: attention projections, the
router, the top-k experts and any shared expert, dense MLPs, the LM head), plus attention's
``QK^T`` and ``AV`` (``4 * context * Hq * D`` per token per layer), as in the PaLM paper's
MFU definition (Chowdhery et al. 2022, appendix B). Padding and recomputation do not count.
"""

from __future__ import annotations

import time

import torch

from batchgen.models.model_config import ModelConfig


def active_params_per_token(cfg: ModelConfig) -> int:
    """Weights one token multiplies through, summed over layers plus the LM head."""
    h = cfg.hidden_size
    if cfg.mla is not None:
        m = cfg.mla
        q = (
            h * m.q_lora_rank + m.q_lora_rank * cfg.num_attention_heads * m.qk_head_dim
            if m.q_lora_rank
            else h * cfg.num_attention_heads * m.qk_head_dim
        )
        attn = (
            q
            + h * (m.kv_lora_rank + m.qk_rope_head_dim)
            + m.kv_lora_rank * cfg.num_attention_heads * (m.qk_nope_head_dim + m.v_head_dim)
            + cfg.num_attention_heads * m.v_head_dim * h
        )
    else:
        q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
        attn = h * (q + 2 * kv) + q * h
    total = 0
    for is_moe in cfg.layer_is_moe:
        if is_moe:
            ffn = (
                h * cfg.num_local_experts  # router
                + cfg.num_experts_per_tok * 3 * h * cfg.moe_intermediate_size
                + 3 * h * cfg.shared_expert_intermediate_size
            )
        else:
            ffn = 3 * h * cfg.intermediate_size
        total += attn + ffn
    return total + h * cfg.vocab_size


def attention_flops(cfg: ModelConfig, context_len: int) -> int:
    """FLOPs of ``QK^T`` and ``AV`` for one token attending ``context_len`` positions."""
    d_qk = cfg.mla.qk_head_dim if cfg.mla is not None else cfg.head_dim
    d_v = cfg.mla.v_head_dim if cfg.mla is not None else cfg.head_dim
    return 2 * context_len * cfg.num_attention_heads * (d_qk + d_v) * cfg.num_hidden_layers


def sequence_flops(cfg: ModelConfig, prompt_len: int, output_len: int, n: int = 1) -> int:
    """Model FLOPs to prefill ``prompt_len`` tokens once and decode ``output_len`` more for
    each of ``n`` samples (the samples share the prompt, so its prefill counts once: computing
    it ``n`` times is recomputation, which MFU does not count)."""
    per_token = 2 * active_params_per_token(cfg)
    per_layer_ctx = attention_flops(cfg, 1)  # one query attending one position
    # Causal attention: the token at position i attends i + 1 positions.
    prefill = per_token * prompt_len + per_layer_ctx * prompt_len * (prompt_len + 1) // 2
    total = prompt_len + output_len
    decode = per_token * output_len + per_layer_ctx * (
        total * (total + 1) // 2 - prompt_len * (prompt_len + 1) // 2
    )
    return prefill + n * decode


def best_rate(fn, work: float, device: torch.device, seconds: float) -> float:
    """The best ``work / seconds-per-call`` of ``fn()`` over ~``seconds`` of repeats after one
    warm-up call, at least one timed (float16 on a CPU takes longer than ``seconds`` for its
    warm-up alone); CUDA calls are synchronised around each timing."""
    fn()
    best = 0.0
    deadline = time.perf_counter() + seconds
    while best == 0.0 or time.perf_counter() < deadline:
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = max(best, work / (time.perf_counter() - t0))
    return best


def measure_peak_gflops(
    dtype: torch.dtype, device: torch.device, size: int = 1024, seconds: float = 1.0
) -> float:
    """Best dense ``size x size`` matmul rate (GFLOP/s) over ~``seconds`` (`best_rate`)."""
    a = torch.randn(size, size, dtype=dtype, device=device)
    b = torch.randn(size, size, dtype=dtype, device=device)
    return best_rate(lambda: torch.mm(a, b), 2 * size**3 / 1e9, device, seconds)
