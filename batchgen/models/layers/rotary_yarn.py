"""YaRN rotary embedding (Peng et al. 2023, arXiv:2309.00071) as DeepSeek-V2/V3 use it, plus the
interleaved rotation layout of DeepSeek checkpoints.

Sources (transformers 5.x):

- inverse frequencies and ``attention_factor``: `transformers.modeling_rope_utils.
  _compute_yarn_parameters` (``ROPE_INIT_FUNCTIONS["yarn"]``), reproduced line by line in
  `compute_yarn_inv_freq`; the attention factor multiplies cos/sin (``DeepseekV3RotaryEmbedding.
  forward``: ``cos = emb.cos() * self.attention_scaling``).
- softmax-scale correction: ``yarn_apply_mscale`` called from ``DeepseekV{2,3}Attention.__init__``
  (``self.scaling = yarn_apply_mscale(config.rope_parameters, self.qk_head_dim ** (-0.5))``), in
  `deepseek_softmax_scale`.
- layouts: "rotate half" (``apply_rotary_pos_emb``; Llama, and DeepSeek-V3 with
  ``rope_interleave=False``) and "interleaved" pairs ``(x0, x1), (x2, x3), ...`` each rotated by one
  frequency: DeepSeek-V2 always (``apply_rotary_emb``, a complex multiply on ``view_as_complex``
  pairs), DeepSeek-V3 when ``config.rope_interleave`` is true, which is the default
  (``apply_rotary_pos_emb_interleave``).

Layout detail: HF's V3 ``apply_rotary_pos_emb_interleave`` returns its result de-interleaved,
``cat(rotated evens, rotated odds)``, while V2's complex form keeps the pairs interleaved. Both
apply the same permutation to q and k, so ``q . k`` (all attention ever sees) is identical; this
module keeps the interleaved order (V2, vLLM's ``is_neox_style=False``).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from batchgen.models.layers.rotary import SUPPORTED_ROPE_TYPES, compute_inv_freq

SUPPORTED_SCALED_ROPE_TYPES = (*SUPPORTED_ROPE_TYPES, "yarn")


def yarn_get_mscale(scale: float = 1.0, mscale: float = 1.0) -> float:
    """YaRN's attention temperature ``0.1 * mscale * ln(scale) + 1`` (1.0 when ``scale <= 1``).

    Same as HF ``modeling_deepseek_v3.yarn_get_mscale`` and ``get_mscale`` inside
    ``_compute_yarn_parameters``.
    """
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def compute_yarn_inv_freq(
    dim: int, rope_parameters: dict, max_position_embeddings: int
) -> tuple[torch.Tensor, float]:
    """YaRN inverse frequencies ``[dim // 2]`` float32 and the cos/sin ``attention_factor``.

    A line-by-line port of HF `_compute_yarn_parameters`:

    - ``factor`` falls back to ``max_position_embeddings / original_max_position_embeddings``
      when None; ``original_max_position_embeddings`` falls back to ``max_position_embeddings``
      (what HF's ``standardize_rope_params`` fills in).
    - ``attention_factor`` (unless given) is ``get_mscale(factor, mscale) /
      get_mscale(factor, mscale_all_dim)`` when both are set and non-zero, else
      ``get_mscale(factor)``. For DeepSeek-V2/V3 checkpoints ``mscale == mscale_all_dim``, so it
      is 1.0 and the whole YaRN temperature goes into the softmax scale instead
      (`deepseek_softmax_scale`).
    - ``beta_fast`` / ``beta_slow`` default to 32 / 1 (``or``, so 0 also means the default);
      the correction range is floored/ceiled unless ``truncate`` is False.
    - ``inv_freq = interp * (1 - e) + extrap * e`` with ``e = 1 - ramp(low, high)``: high
      frequencies (short wavelengths) keep their pretrained value, low ones are divided by
      ``factor``.

    Args:
        dim: rotary dimension (DeepSeek: ``qk_rope_head_dim``; HF takes ``config.head_dim``,
            which DeepSeek configs set to ``qk_rope_head_dim``).
        rope_parameters: HF ``rope_parameters`` with ``rope_type == "yarn"``.
        max_position_embeddings: the (post-YaRN) context length of the config.
    """
    base = float(rope_parameters.get("rope_theta", 10000.0))
    factor = rope_parameters.get("factor")
    attention_factor = rope_parameters.get("attention_factor")
    mscale = rope_parameters.get("mscale")
    mscale_all_dim = rope_parameters.get("mscale_all_dim")
    original_max = rope_parameters.get("original_max_position_embeddings", max_position_embeddings)
    if factor is None:
        factor = max_position_embeddings / original_max
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = float(
                yarn_get_mscale(factor, mscale) / yarn_get_mscale(factor, mscale_all_dim)
            )
        else:
            attention_factor = yarn_get_mscale(factor)
    beta_fast = rope_parameters.get("beta_fast") or 32
    beta_slow = rope_parameters.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        # The dimension whose wavelength makes `num_rotations` turns over `original_max` tokens.
        return (dim * math.log(original_max / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rope_parameters.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # HF: prevent a singularity in the ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)

    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)  # [dim/2]
    inv_freq_extrapolation = 1.0 / pos_freqs
    inv_freq_interpolation = 1.0 / (factor * pos_freqs)
    extrapolation_factor = 1 - ramp  # [dim/2]: 1 keeps the pretrained frequency
    inv_freq = (
        inv_freq_interpolation * (1 - extrapolation_factor)
        + inv_freq_extrapolation * extrapolation_factor
    )
    return inv_freq, attention_factor


def compute_rope_parameters(
    dim: int, rope_parameters: dict, max_position_embeddings: int
) -> tuple[torch.Tensor, float]:
    """``(inv_freq [dim // 2] float32, attention_factor)`` for any supported `rope_type`.

    "yarn" goes to `compute_yarn_inv_freq`; "default", "linear" and "llama3" to
    `batchgen.models.layers.rotary.compute_inv_freq` with ``attention_factor = 1.0``.

    Raises:
        ValueError: for a `rope_type` outside `SUPPORTED_SCALED_ROPE_TYPES`.
    """
    rope_type = rope_parameters.get("rope_type", "default")
    if rope_type == "yarn":
        return compute_yarn_inv_freq(dim, rope_parameters, max_position_embeddings)
    if rope_type in SUPPORTED_ROPE_TYPES:
        return compute_inv_freq(dim, rope_parameters), 1.0
    raise ValueError(
        f"rope_parameters.rope_type must be one of {SUPPORTED_SCALED_ROPE_TYPES}, got {rope_type!r}"
    )


def deepseek_softmax_scale(qk_head_dim: int, rope_parameters: dict) -> float:
    """DeepSeek attention softmax scale: ``qk_head_dim ** -0.5``, times ``mscale ** 2`` with
    ``mscale = yarn_get_mscale(factor, mscale_all_dim)`` when `rope_type` is not "default" and
    ``mscale_all_dim`` is set and non-zero.

    HF ``yarn_apply_mscale`` (modeling_deepseek_v2/v3), applied in ``DeepseekV{2,3}Attention.
    __init__``; DeepSeek's own ``modeling_deepseek.py`` does the same. Note that it reads
    ``rope_parameters["factor"]`` directly (no fallback) and is keyed on "not default" rather
    than "yarn". With DeepSeek-V3's ``factor=40, mscale_all_dim=1`` this is ``(1 + 0.1 ln 40)^2
    ~= 1.87`` times the plain scale.
    """
    scale = qk_head_dim**-0.5
    if rope_parameters.get("rope_type", "default") != "default":
        mscale_all_dim = rope_parameters.get("mscale_all_dim", 0)
        if mscale_all_dim:
            mscale = yarn_get_mscale(rope_parameters["factor"], mscale_all_dim)
            scale = scale * mscale * mscale
    return scale


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class ScaledRotaryEmbedding(nn.Module):
    """RoPE with YaRN / linear / llama3 scaling, in the rotate-half or the interleaved layout.

    Same interface as `batchgen.models.layers.rotary.RotaryEmbedding`: ``forward(positions [T],
    q [T, Hq, D], k [T, Hk, D]) -> (q, k)`` with ``D == rotary_dim``. cos/sin come from float32
    ``positions x inv_freq`` times ``attention_factor`` (HF's order).

    - ``interleaved=False`` ("rotate half"): cos/sin are cast to the activation dtype and the
      rotation runs in it, like HF ``apply_rotary_pos_emb``.
    - ``interleaved=True``: pairs ``(x[2i], x[2i+1])`` are rotated by frequency i in float32 and
      cast back, like HF V2's complex ``apply_rotary_emb``; the output stays interleaved (see the
      module docstring on V3's de-interleaved output: the dot products are the same).

    Attributes:
        attention_factor: the cos/sin multiplier (YaRN's ``attention_factor``; 1.0 otherwise).
    """

    def __init__(
        self,
        rotary_dim: int,
        rope_parameters: dict,
        max_position_embeddings: int,
        interleaved: bool = False,
    ) -> None:
        super().__init__()
        self.rotary_dim = rotary_dim
        self.interleaved = interleaved
        # A plain CPU tensor, not a buffer: the model is built on the meta device and
        # materialised with `to_empty`, which would leave a buffer uninitialised.
        with torch.device("cpu"):
            self._inv_freq_cpu, self.attention_factor = compute_rope_parameters(
                rotary_dim, rope_parameters, max_position_embeddings
            )
        self._inv_freq: torch.Tensor | None = None

    def inv_freq(self, device: torch.device) -> torch.Tensor:
        if self._inv_freq is None or self._inv_freq.device != device:
            self._inv_freq = self._inv_freq_cpu.to(device)
        return self._inv_freq

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 ``cos, sin [T, D/2]`` (one angle per frequency), scaled by attention_factor."""
        freqs = positions.float()[:, None] * self.inv_freq(positions.device)[None, :]  # [T, D/2]
        return freqs.cos() * self.attention_factor, freqs.sin() * self.attention_factor

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate ``q [T, Hq, D]`` and ``k [T, Hk, D]`` at ``positions [T]`` (int64)."""
        cos, sin = self.cos_sin(positions)  # [T, D/2]
        cos, sin = cos[:, None, :], sin[:, None, :]  # [T, 1, D/2]
        if self.interleaved:
            return _rotate_interleaved(q, cos, sin), _rotate_interleaved(k, cos, sin)
        cos = torch.cat((cos, cos), dim=-1).to(q.dtype)  # [T, 1, D]
        sin = torch.cat((sin, sin), dim=-1).to(q.dtype)
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def _rotate_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x [T, H, D]`` with pairs ``(x[2i], x[2i+1])`` as complex numbers times ``cos + i sin``
    (``cos, sin [T, 1, D/2]`` float32), computed in float32; returns x's dtype and layout."""
    x32 = x.float().unflatten(-1, (-1, 2))  # [T, H, D/2, 2]
    re, im = x32[..., 0], x32[..., 1]  # [T, H, D/2]
    out = torch.stack((re * cos - im * sin, re * sin + im * cos), dim=-1)  # [T, H, D/2, 2]
    return out.flatten(-2).to(x.dtype)  # [T, H, D]
