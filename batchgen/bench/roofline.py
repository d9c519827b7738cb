"""The decode phase's roofline: the least time the decode-only steps could take on this machine
(an estimate for steps of few tokens, below), from the measured matmul peak and the measured
memory read bandwidth.

Decode is two kinds of work. The weight multiplies (attention projections, router, experts,
LM head: ``2 * active_params_per_token`` FLOPs per token, `batchgen.bench.flops`) run as GEMMs
over the step's batch and are compute-bound once the batch is a few dozen rows; they also read
each weight they use once per step. Attention's ``QK^T`` and ``AV`` read each sequence's whole K/V
cache for one query token (4 FLOPs per cached element and query head, one read of the element
per KV head): 4-16 FLOPs per byte, memory-bound on CPUs. The roofline (Williams, Waterman and
Patterson, "Roofline: an insightful visual performance model", CACM 2009) bounds each part by
``max(FLOPs / peak, bytes / bandwidth)``; the two parts run one after the other in a step, so
their bounds add:

    roofline_s = sum over steps of max(step_tokens * matmul_flops_per_token / peak,
                                       step_weight_bytes(step_tokens) / bw)
               + max(attention_flops / peak, kv_bytes / bw)

The weight part is bounded step by step (a step of a few tokens, as at the end of a batch
job, waits on its weights, one of hundreds on its FLOPs). A step reads each weight it uses
once: the dense weights (attention, router, shared experts, LM head) and, per MoE layer, the
experts its tokens route to, counted as the expected number of distinct experts n tokens
touch under uniform routing, ``E * (1 - (1 - k / E) ** n)`` (k of E experts per token): k
for one token, nearly all E from a few dozen. Skewed routing touches fewer, so for small
steps this is an estimate, not a strict bound. The attention part is taken over the
workload's totals at its mean context (sliding-window layers counted at the full context:
their K/V bytes are an upper bound there).
``decode_mfu_ceiling = (matmul_flops + attention_flops) / peak / roofline_s`` is the most
decode MFU this machine allows on that workload; ``decode_roofline_fraction = roofline_s /
decode_only_seconds`` is how close the engine came (1.0: at the roofline). A fraction above
1.0 means the engine beat the model: routing more skewed than uniform, weights or K/V held
in cache between steps or layers (small models), or a measured peak or bandwidth below what
the engine's own kernels reach (float16 on a CPU: torch's float16 matmul is far slower than
the engine's paths).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from batchgen.bench.flops import active_params_per_token, attention_flops, best_rate
from batchgen.models.decoder import kv_cache_token_shapes
from batchgen.models.model_config import ModelConfig

READ_BUFFER_MIB = 512  # well above any CPU's last-level cache (32 MiB on the bench machines)


def measure_read_gbps(
    device: torch.device, mib: int = READ_BUFFER_MIB, seconds: float = 2.0
) -> float:
    """Best rate (GB/s, 1e9 bytes) of summing a ``mib`` MiB float32 buffer over ~``seconds``
    (`best_rate`): the memory read bandwidth the engine's threads reach (torch's reduction
    runs on all of them, as the decode kernels do). A buffer's first few hundred milliseconds
    read slower on the bench machines (AMD EPYC VM: 28-34 GB/s, then 52-58 GB/s for as long as
    it lives; the engine's weights and KV cache live for the run), hence the best of
    ~``seconds``."""
    a = torch.ones(mib * 2**20 // 4, dtype=torch.float32, device=device)
    return best_rate(a.sum, a.numel() * 4 / 1e9, device, seconds)


def kv_bytes_per_position(cfg: ModelConfig, kv_itemsize: int) -> int:
    """Bytes of K/V cache one position holds over all layers, by the engine's own cache shapes
    (`batchgen.models.decoder.kv_cache_token_shapes`: K and V of every KV head, or MLA's
    latent plus its RoPE key)."""
    per_layer = sum(math.prod(shape) for shape in kv_cache_token_shapes(cfg))
    return per_layer * kv_itemsize * cfg.num_hidden_layers


def weight_bytes(cfg: ModelConfig, itemsize: int, step_tokens: int | None = None) -> float:
    """Bytes of the weights a decode step of ``step_tokens`` tokens multiplies through, each
    read once: the dense ones (attention, router, shared experts, LM head; embeddings not, a
    gather) and the routed experts it touches, the expected number of distinct ones under
    uniform routing (module docstring); None: every expert."""
    h = cfg.hidden_size
    expert = 3 * h * cfg.moe_intermediate_size
    e, k = cfg.num_local_experts, cfg.num_experts_per_tok
    touched = e if step_tokens is None else e * (1.0 - (1.0 - k / e) ** step_tokens) if e else 0
    total = float(active_params_per_token(cfg))  # the top-k experts of each MoE layer in it
    for is_moe in cfg.layer_is_moe:
        if is_moe:
            total += (touched - k) * expert
    return total * itemsize


def _step_counts(step_tokens: Mapping[int | str, int]) -> dict[int, int]:
    """``step_tokens`` with int keys (JSON gives strings), counts of equal keys summed."""
    steps: dict[int, int] = {}
    for n, c in step_tokens.items():
        try:
            tokens = int(n)
        except ValueError:
            raise ValueError(f"step_tokens keys must be whole token counts, got {n!r}") from None
        if not isinstance(c, int) or isinstance(c, bool) or c < 0 or tokens < 0:
            raise ValueError(
                f"step_tokens must map token counts >= 0 to step counts (ints >= 0), got "
                f"{n!r}: {c!r}"
            )
        if tokens > 0 and c > 0:
            steps[tokens] = steps.get(tokens, 0) + c
    if not steps:
        raise ValueError(f"step_tokens holds no step with tokens: {dict(step_tokens)}")
    return steps


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

    Returns ``{"roofline_s", "matmul_s", "matmul_memory_bound_steps", "steps",
    "attention_s", "attention_bound" ("memory" or "compute"), "kv_gb" (K/V read, GB),
    "decode_mfu_ceiling", "decode_roofline_fraction"}`` (seconds; the fraction None when
    ``seconds`` is not positive).

    Raises:
        ValueError: ``peak_gflops`` or ``read_gbps`` not a positive number (NaN included),
            ``mean_context`` negative, an itemsize below 1, or ``step_tokens`` not token
            counts mapped to step counts, or without a step that has tokens.
    """
    if not (peak_gflops > 0 and read_gbps > 0):  # NaN fails both comparisons
        raise ValueError(
            f"peak_gflops and read_gbps must be > 0, got {peak_gflops} and {read_gbps}"
        )
    if not mean_context >= 0:
        raise ValueError(f"mean_context must be >= 0, got {mean_context}")
    if weight_itemsize < 1 or kv_itemsize < 1:
        raise ValueError(
            f"weight_itemsize and kv_itemsize must be >= 1 byte, got {weight_itemsize} and "
            f"{kv_itemsize}"
        )
    steps = _step_counts(step_tokens)
    peak, bw = peak_gflops * 1e9, read_gbps * 1e9
    tokens = sum(n * c for n, c in steps.items())
    per_token = 2 * active_params_per_token(cfg)
    matmul_s, memory_bound_steps = 0.0, 0
    for n, c in steps.items():
        compute_s, read_s = n * per_token / peak, weight_bytes(cfg, weight_itemsize, n) / bw
        matmul_s += c * max(compute_s, read_s)
        memory_bound_steps += c if read_s > compute_s else 0
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
