"""The decode phase's roofline: the least time the decode-only steps could take on this machine,
from the measured matmul peak and the measured memory read bandwidth.

Decode is two kinds of work. The weight multiplies (attention projections, router, experts,
LM head: ``2 * active_params_per_token`` FLOPs per token, `batchgen.bench.flops`) run as GEMMs
over the step's batch and are compute-bound once the batch is a few dozen rows; they also read
every weight once per step. Attention's ``QK^T`` and ``AV`` read each sequence's whole K/V
cache for one query token (4 FLOPs per cached element and query head, one read of the element
per KV head): 4-16 FLOPs per byte, memory-bound on CPUs. The roofline (Williams, Waterman and
Patterson, "Roofline: an insightful visual performance model", CACM 2009) bounds each part by
``max(FLOPs / peak, bytes / bandwidth)``; the two parts run one after the other in a step, so
their bounds add:

    roofline_s = sum over steps of max(step_tokens * matmul_flops_per_token / peak,
                                       weight_bytes / bw)
               + max(attention_flops / peak, kv_bytes / bw)

The weight part is bounded step by step (a step of a few tokens, as at the end of a batch
job, waits on its weights, one of hundreds on its FLOPs), each weight counted as read once
per step (every expert touched: an upper bound on the bytes for steps of fewer tokens than
experts); the attention part over the workload's totals at its mean context.
``decode_mfu_ceiling = (matmul_flops + attention_flops) / peak / roofline_s`` is the most
decode MFU this machine allows on that workload; ``decode_roofline_fraction = roofline_s /
decode_only_seconds`` is how close the engine came (1.0: at the roofline). The bandwidth is a
read of a buffer far larger than the last-level cache (`measure_read_gbps`): weights or K/V
that stay in cache between steps or layers can beat it, so a fraction above 1.0 is possible
on small models and workloads. Sliding-window layers are counted at the full context (their
K/V bytes are an upper bound there).
"""

from __future__ import annotations

import time
from collections.abc import Mapping

import torch

from batchgen.bench.flops import active_params_per_token, attention_flops
from batchgen.models.model_config import ModelConfig

READ_BUFFER_MIB = 512  # well above any CPU's last-level cache (32 MiB on the bench machines)


def measure_read_gbps(
    device: torch.device, mib: int = READ_BUFFER_MIB, seconds: float = 2.0
) -> float:
    """Best rate (GB/s, 1e9 bytes) of summing a ``mib`` MiB float32 buffer over ~``seconds``:
    the memory read bandwidth the engine's threads reach (torch's reduction runs on all of
    them, as the decode kernels do). A buffer's first few hundred milliseconds read slower on
    the bench machines (AMD EPYC VM: 28-34 GB/s, then 52-58 GB/s for as long as it lives; the
    engine's weights and KV cache live for the run), hence the best of ~``seconds``."""
    a = torch.ones(mib * 2**20 // 4, dtype=torch.float32, device=device)
    a.sum()
    best = 0.0
    deadline = time.perf_counter() + seconds
    while True:
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        a.sum()
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = max(best, a.numel() * 4 / (time.perf_counter() - t0) / 1e9)
        if time.perf_counter() >= deadline:
            return best


def kv_bytes_per_position(cfg: ModelConfig, kv_itemsize: int) -> int:
    """Bytes of K/V cache one position holds over all layers: K and V of every KV head, or
    MLA's compressed latent plus its RoPE key (one vector shared by the heads)."""
    if cfg.mla is not None:
        per_layer = cfg.mla.kv_lora_rank + cfg.mla.qk_rope_head_dim
    else:
        per_layer = 2 * cfg.num_key_value_heads * cfg.head_dim
    return per_layer * kv_itemsize * cfg.num_hidden_layers


def weight_bytes(cfg: ModelConfig, itemsize: int) -> int:
    """Bytes of the weights a decode step multiplies through (every expert of every MoE layer
    counted, each read once per step), LM head included, embeddings not (a gather)."""
    total = active_params_per_token(cfg)
    h = cfg.hidden_size
    for is_moe in cfg.layer_is_moe:
        if is_moe:
            unused = cfg.num_local_experts - cfg.num_experts_per_tok
            total += unused * 3 * h * cfg.moe_intermediate_size
    return total * itemsize


def decode_roofline(
    cfg: ModelConfig,
    *,
    step_tokens: Mapping[int | str, int],
    mean_context: float,
    seconds: float,
    weight_itemsize: int,
    kv_itemsize: int,
    peak_gflops: float,
    read_gbps: float,
) -> dict:
    """The roofline of decode-only steps that took ``seconds``, given as ``step_tokens`` (a
    step's token count -> how many steps had it; string keys as read back from JSON) at a mean
    context of ``mean_context`` positions per token (module docstring for the model).

    Returns ``{"roofline_s", "matmul_s", "matmul_memory_bound_steps", "attention_s",
    "attention_bound" ("memory" or "compute"), "kv_gb" (K/V read, GB), "decode_mfu_ceiling",
    "decode_roofline_fraction"}`` (seconds; None for the fraction when ``seconds`` is 0).

    Raises:
        ValueError: ``peak_gflops`` or ``read_gbps`` is not positive, or no step has tokens.
    """
    if peak_gflops <= 0 or read_gbps <= 0:
        raise ValueError(
            f"peak_gflops and read_gbps must be > 0, got {peak_gflops} and {read_gbps}"
        )
    steps = {int(n): c for n, c in step_tokens.items() if int(n) > 0 and c > 0}
    if not steps:
        raise ValueError(f"step_tokens holds no step with tokens: {dict(step_tokens)}")
    peak, bw = peak_gflops * 1e9, read_gbps * 1e9
    tokens = sum(n * c for n, c in steps.items())
    per_token = 2 * active_params_per_token(cfg)
    weights_s = weight_bytes(cfg, weight_itemsize) / bw
    matmul_s = sum(c * max(n * per_token / peak, weights_s) for n, c in steps.items())
    memory_bound_steps = sum(c for n, c in steps.items() if weights_s > n * per_token / peak)
    attn_flops = attention_flops(cfg, 1) * mean_context * tokens
    kv_bytes = kv_bytes_per_position(cfg, kv_itemsize) * mean_context * tokens
    attn_compute_s, attn_memory_s = attn_flops / peak, kv_bytes / bw
    roofline_s = matmul_s + max(attn_compute_s, attn_memory_s)
    return {
        "roofline_s": roofline_s,
        "matmul_s": matmul_s,
        "matmul_memory_bound_steps": memory_bound_steps,
        "steps": sum(steps.values()),
        "attention_s": max(attn_compute_s, attn_memory_s),
        "attention_bound": "memory" if attn_memory_s >= attn_compute_s else "compute",
        "kv_gb": kv_bytes / 1e9,
        "decode_mfu_ceiling": (per_token * tokens + attn_flops) / peak / roofline_s,
        "decode_roofline_fraction": roofline_s / seconds if seconds > 0 else None,
    }
