"""Rotary position embedding (Su et al. 2021, RoFormer) with `rope_type` default, linear and llama3.

The inverse frequencies follow Hugging Face `transformers.modeling_rope_utils`
(`_compute_default_rope_parameters`, `_compute_linear_scaling_rope_parameters`,
`_compute_llama3_parameters`); the rotation is the "rotate half" (non-interleaved) layout used
by Llama, Mistral, Mixtral and Qwen checkpoints.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from batchgen.kernels.rotary_embedding import (
    rotary_embedding_and_cache_available,
    rotary_embedding_and_cache_checked_,
    rotary_embedding_available,
    rotary_embedding_checked_,
)

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def compute_inv_freq(rotary_dim: int, rope_parameters: dict) -> torch.Tensor:
    """Inverse frequencies ``[rotary_dim // 2]`` float32 for the given HF `rope_parameters`.

    Raises:
        ValueError: for a `rope_type` outside `SUPPORTED_ROPE_TYPES`.
    """
    rope_type = rope_parameters.get("rope_type", "default")
    base = float(rope_parameters.get("rope_theta", 10000.0))
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    inv_freq = 1.0 / (base**exponents)
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(rope_parameters["factor"])
    if rope_type == "llama3":
        factor = float(rope_parameters["factor"])
        low_freq_factor = float(rope_parameters["low_freq_factor"])
        high_freq_factor = float(rope_parameters["high_freq_factor"])
        old_context_len = float(rope_parameters["original_max_position_embeddings"])
        low_freq_wavelen = old_context_len / low_freq_factor
        high_freq_wavelen = old_context_len / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        # Long wavelengths are divided by `factor`, short ones kept, the middle band smoothed.
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_context_len / wavelen - low_freq_factor) / (
            high_freq_factor - low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    raise ValueError(
        f"rope_parameters.rope_type must be one of {SUPPORTED_ROPE_TYPES}, got {rope_type!r}"
    )


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class RotaryEmbedding(nn.Module):
    """Applies RoPE to query and key tensors at given absolute positions.

    cos/sin are computed from float32 ``positions x inv_freq`` (as HF does, so that results
    match bit-for-bit in fp32) and cast to the activation dtype: once per step when the caller
    passes the step's ``cache`` dict (`AttentionMetadata.rope_cache`: every layer with the same
    rotary dim and parameters reuses the first layer's cos/sin, the very same values), else
    per call.
    """

    def __init__(self, rotary_dim: int, rope_parameters: dict) -> None:
        super().__init__()
        self.rotary_dim = rotary_dim
        # Layers whose key is equal compute equal inv_freq, hence equal cos/sin.
        self.cache_key = (rotary_dim, repr(sorted(rope_parameters.items())))
        # A plain CPU tensor, not a buffer: the model is built on the meta device and
        # materialised with `to_empty`, which would leave a buffer uninitialised.
        with torch.device("cpu"):
            self._inv_freq_cpu = compute_inv_freq(rotary_dim, rope_parameters)
        self._inv_freq: torch.Tensor | None = None

    def inv_freq(self, device: torch.device) -> torch.Tensor:
        if self._inv_freq is None or self._inv_freq.device != device:
            self._inv_freq = self._inv_freq_cpu.to(device)
        return self._inv_freq

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos, sin [T, 1, D]`` in ``dtype`` at ``positions [T]`` (int64)."""
        freqs = positions.float()[:, None] * self.inv_freq(positions.device)[None, :]  # [T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [T, D]
        return emb.cos().to(dtype)[:, None, :], emb.sin().to(dtype)[:, None, :]

    def _cached_cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype, cache: dict | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`cos_sin`, through the step's ``cache`` dict where given (see `forward`)."""
        if cache is None:
            return self.cos_sin(positions, dtype)
        key = (self.cache_key, dtype)
        if key not in cache:
            cache[key] = self.cos_sin(positions, dtype)
        return cache[key]

    def rotate_and_cache_(
        self,
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cache: dict | None,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        slot_mapping: torch.Tensor,
    ) -> bool:
        """Where the CPU kernel serves (`rotary_embedding_and_cache_available`): rotate ``q [T,
        Hq, D]`` and ``k [T, Hkv, D]`` in place as ``forward(..., inplace=True)`` does (the same
        bits) and write the rotated k and ``v [T, Hkv, D]`` to rows ``slot_mapping [T]`` of
        ``kv_cache`` (each ``[num_slots, Hkv, D]``) in the same pass; returns True. Elsewhere
        it does nothing and returns False: the caller rotates and writes the cache itself."""
        if q.device.type != "cpu":
            return False
        cos, sin = self._cached_cos_sin(positions, q.dtype, cache)
        if not rotary_embedding_and_cache_available(q, k, v, cos, sin, kv_cache, slot_mapping):
            return False
        # the availability check above read these very tensors' layouts
        rotary_embedding_and_cache_checked_(q, k, v, cos, sin, kv_cache, slot_mapping)
        return True

    def forward(
        self,
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        cache: dict | None = None,
        inplace: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate ``q [T, Hq, D]`` and ``k [T, Hkv, D]`` at ``positions [T]`` (int64).
        ``cache``: a dict that lives as long as ``positions`` (one step), shared by the layers
        that rotate at these positions; None computes cos/sin here. ``inplace``: q and k may
        be overwritten; on CPU one kernel call then rotates them in place, bit for bit the
        eager result (`batchgen.kernels.rotary_embedding`)."""
        cos, sin = self._cached_cos_sin(positions, q.dtype, cache)
        if inplace and rotary_embedding_available(q, k, cos, sin):
            return rotary_embedding_checked_(q, k, cos, sin)  # layout checked just above
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        return q, k
