"""How many KV cache blocks an engine gets: the memory budget over the bytes of one block.

On CUDA the budget comes from a profiling forward (`batchgen.engine.memory_profile`, vLLM's
method) where the engine passes one, else from the estimate `activation_reserve_bytes` (an
expert-parallel rank: its MoE layers cannot run alone before its dispatcher is installed).
"""

from __future__ import annotations

import logging

import torch

from batchgen.config import EngineConfig
from batchgen.engine.model_runner import kv_cache_bytes_per_token
from batchgen.models.model_config import ModelConfig

logger = logging.getLogger("batchgen.engine.llm_engine")  # the engine's start-up log lines

_GiB = 1 << 30
DEFAULT_CPU_KV_CACHE_GB = 1.0


def num_kv_blocks(
    c: EngineConfig,
    cfg: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    model: torch.nn.Module | None = None,
    cache_dtype: torch.dtype | None = None,
) -> int:
    """KV cache blocks for an engine: ``num_gpu_blocks_override`` if set, else the budget
    (``kv_cache_memory_gb``; on CUDA with ``model`` given, what a profiling step of ``model``
    leaves under ``gpu_memory_utilization`` less the CUDA graphs' estimated memory
    (`batchgen.engine.memory_profile.profiled_kv_budget_bytes`), without it the free memory
    under ``gpu_memory_utilization`` less `activation_reserve_bytes`; on CPU
    `DEFAULT_CPU_KV_CACHE_GB`) over the bytes of one block (`kv_cache_bytes_per_token` x
    ``block_size``). ``dtype`` is the model's (the profiling step runs in it), ``cache_dtype``
    the cache's (None: ``dtype``; narrower under ``kv_cache_dtype``: more blocks).

    Raises:
        ValueError: the budget holds no block.
    """
    per_block = kv_cache_bytes_per_token(cfg, cache_dtype or dtype) * c.block_size
    budget = 0
    if c.num_gpu_blocks_override is not None:
        num_blocks = c.num_gpu_blocks_override
    else:
        if c.kv_cache_memory_gb is not None:
            budget = c.kv_cache_memory_gb * _GiB
        elif device.type == "cuda" and model is not None:
            from batchgen.engine.memory_profile import profiled_kv_budget_bytes

            budget = profiled_kv_budget_bytes(model, c, cfg, device, dtype)
        elif device.type == "cuda":
            free, total = torch.cuda.mem_get_info(device)
            budget = total * c.gpu_memory_utilization - (total - free)
            budget -= activation_reserve_bytes(c, cfg)
        else:
            budget = DEFAULT_CPU_KV_CACHE_GB * _GiB
        num_blocks = int(budget // per_block)
    if num_blocks < 1:
        raise ValueError(
            f"the KV cache budget ({budget / _GiB:.2f} GiB) holds no block of "
            f"{c.block_size} tokens ({per_block} bytes); raise kv_cache_memory_gb or "
            "gpu_memory_utilization, or lower max_num_batched_tokens / max_num_seqs (a step's "
            "activations come out of the same memory on a GPU)"
        )
    logger.info(
        "KV cache: %d blocks x %d tokens = %d tokens, %.1f MiB (%d bytes/token, %s)",
        num_blocks,
        c.block_size,
        num_blocks * c.block_size,
        num_blocks * per_block / (1 << 20),
        per_block // c.block_size,
        str(cache_dtype or dtype).removeprefix("torch."),
    )
    return num_blocks


def activation_reserve_bytes(c: EngineConfig, cfg: ModelConfig) -> int:
    """Device memory kept free for one step's activations (bytes): a float32 upper estimate
    per batched token (residual, QKV, attention output, MLP/expert intermediates for every
    selected expert) plus the sampler's copies of ``max_running_seqs`` rows of logits, plus
    1 GiB of slack for the allocator and kernels' workspaces. An estimate, not a profile."""
    experts = max(cfg.num_experts_per_tok, 1)
    per_token = 4 * (
        16 * cfg.hidden_size + experts * (4 * cfg.intermediate_size + 2 * cfg.hidden_size)
    )
    logits = 4 * 4 * min(c.max_running_seqs, c.max_num_batched_tokens) * cfg.vocab_size
    return c.max_num_batched_tokens * per_token + logits + _GiB
