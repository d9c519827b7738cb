"""The KV cache's storage dtype (vLLM's ``kv_cache_dtype``): the cache may hold K and V in a
narrower format than the model computes in, so that decode attention, which reads every
sequence's whole context every step, reads fewer bytes.

Values (`KV_CACHE_DTYPES`, vLLM's names):

- ``auto``: the model's dtype (the default; outputs exactly as without this setting);
- ``bfloat16``: bf16 K/V under a float32 (or float16) model: half the bytes of float32;
- ``fp8`` (= ``fp8_e4m3``, vLLM's meaning), ``fp8_e4m3``: torch ``float8_e4m3fn`` (4 exponent
  bits, 3 mantissa bits, finite range +-448);
- ``fp8_e5m2``: torch ``float8_e5m2`` (5 exponent bits, 2 mantissa bits, range +-57,344).

Quantisation (vLLM's default without checkpoint scales: ``k_scale = v_scale = 1.0``): each
element is clamped to the format's finite range and rounded to nearest even (torch's cast);
attention reads it back exactly (every value of these formats is a float32 and a bf16 value).
Attention always sees the quantised K/V, also the prompt's own prefill chunk (which could use
the unrounded values it just computed): so a prompt's tokens do not depend on whether its
prefix came from the cache, how it was chunked, or whether a sequence was preempted and
recomputed.

Not served: MLA models' latent cache (DeepSeek-V2/V3) takes only ``auto`` for now
(`resolve_kv_cache_dtype` says so); per-tensor scales from a checkpoint are not read.
"""

from __future__ import annotations

import torch

from batchgen.config import KV_CACHE_DTYPES

_TORCH_DTYPES = {
    "bfloat16": torch.bfloat16,
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def resolve_kv_cache_dtype(name: str, model_dtype: torch.dtype, mla: bool = False) -> torch.dtype:
    """The torch dtype of the KV cache for ``kv_cache_dtype`` ``name`` under a model computing
    in ``model_dtype``.

    Args:
        name: one of `KV_CACHE_DTYPES`.
        model_dtype: the resolved model dtype (float32, bfloat16 or float16).
        mla: the model uses multi-head latent attention (DeepSeek-V2/V3).
    Returns:
        ``model_dtype`` for ``auto`` (or a name that resolves to it), else the narrower dtype.
    Raises:
        ValueError: ``name`` not in `KV_CACHE_DTYPES`; a format as wide as the model's dtype
        but another one (``bfloat16`` under a float16 model: no bytes saved, coarser K/V;
        ``bfloat16`` under a bf16 model is ``auto``); an MLA model with anything but
        ``auto`` (its latent cache has no narrower path yet).
    """
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {name!r}")
    if name == "auto":
        return model_dtype
    dtype = _TORCH_DTYPES[name]
    if dtype == model_dtype:
        return dtype
    if mla:
        raise ValueError(
            f"kv_cache_dtype={name!r} is not supported for MLA models (DeepSeek-V2/V3: the "
            "latent cache has no narrower path yet); use kv_cache_dtype='auto'"
        )
    if model_dtype is not None and dtype.itemsize >= model_dtype.itemsize:
        model = str(model_dtype).removeprefix("torch.")
        raise ValueError(
            f"kv_cache_dtype={name!r} under a {model} model stores no fewer bytes than the "
            f"model's own dtype and rounds K/V more coarsely; use kv_cache_dtype='auto', or "
            "'fp8' / 'fp8_e5m2' for a narrower cache"
        )
    return dtype


def quantize_kv(x: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """``x`` (any float dtype) in the cache's dtype: clamped to an fp8 format's finite range
    (scale 1.0) and rounded to nearest even; a no-op when ``x`` already has ``cache_dtype``.
    Same shape."""
    if x.dtype == cache_dtype:
        return x
    if cache_dtype in FP8_DTYPES:
        limit = torch.finfo(cache_dtype).max
        return x.clamp(-limit, limit).to(cache_dtype)
    return x.to(cache_dtype)


def write_kv(cache: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
    """``cache[slots[i]] = rows[i]`` with ``rows`` already in the cache's dtype
    (`quantize_kv`); fp8 rows are copied as bytes (torch has no ``index_copy_`` for fp8).

    Args:
        cache: ``[num_slots, *S]``; slots: ``[T]`` int64; rows: ``[T, *S]``."""
    if cache.dtype in FP8_DTYPES:
        cache.view(torch.uint8).index_copy_(0, slots, rows.view(torch.uint8))
    else:
        cache.index_copy_(0, slots, rows)
