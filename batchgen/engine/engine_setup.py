"""Steps of `LLMEngine`'s construction: the device, the served model name, loading the model in
its execution form, and resolving ``max_model_len`` against the model and the KV cache."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from batchgen.models.batch_invariant import enable_batch_invariant
from batchgen.models.layers.linear import enable_prepacked_linear
from batchgen.models.loader import load_model
from batchgen.models.model_config import ModelConfig

logger = logging.getLogger(__name__)


def resolve_device(device: str) -> torch.device:
    """ "auto" -> cuda when available, else cpu. Raises ValueError for cuda without CUDA."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' was requested but CUDA is not available; use 'cpu'")
    return torch.device(device)


def served_model_name(model: str) -> str:
    """The name a model is served under by default: a local directory's name (its path would
    tell every client where the server keeps its files), else the hub id as given."""
    path = Path(model)
    return path.resolve().name if path.is_dir() else model


def load_engine_model(
    path: str,
    cfg: ModelConfig,
    device: torch.device,
    dtype: torch.dtype,
    held: list[int] | None,
    batch_invariant: bool,
) -> torch.nn.Module:
    """The model at ``path`` on ``device`` in ``dtype`` (``held``: the routed experts this
    expert-parallel rank loads, None for all), with its dense layers in the engine's form:
    batch-invariant kernels under ``batch_invariant``, else prepacked weights on the CPU
    (`enable_prepacked_linear`: bf16 where the CPU has avx512_bf16, float32 where
    `onednn_f32_mode` picks oneDNN). Raises what `load_model` raises (missing or mismatched
    tensors, name the tensor)."""
    t0 = time.perf_counter()
    model = load_model(path, cfg, device, dtype, held)
    if batch_invariant:
        enable_batch_invariant(model)
    elif device.type == "cpu" and dtype in (torch.bfloat16, torch.float32):
        enable_prepacked_linear(model)  # packed dense weights where the CPU gains from them
    logger.info(
        "loaded %s (%s) on %s in %.1f s", path, cfg.architecture, device, time.perf_counter() - t0
    )
    return model


def resolve_max_model_len(requested: int | None, cfg: ModelConfig, capacity: int) -> int:
    """The engine's ``max_model_len`` in tokens: ``requested`` (None: the model's
    ``max_position_embeddings``), capped to the KV cache's ``capacity`` in tokens with a
    warning.

    Raises:
        ValueError: ``requested`` above the model's ``max_position_embeddings``.
    """
    max_len = requested or cfg.max_position_embeddings
    if requested and requested > cfg.max_position_embeddings:
        raise ValueError(
            f"max_model_len={requested} exceeds the model's "
            f"max_position_embeddings={cfg.max_position_embeddings}"
        )
    if max_len > capacity:
        logger.warning(
            "max_model_len %d capped to the KV cache capacity of %d tokens", max_len, capacity
        )
        max_len = capacity
    return max_len
