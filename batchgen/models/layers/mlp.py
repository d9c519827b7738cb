"""Gated feed-forward (SwiGLU, Shazeer 2020): ``down(act(gate(x)) * up(x))``."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from batchgen.models.batch_invariant import invariant_activation

ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu, "gelu_pytorch_tanh": lambda x: F.gelu(x, "tanh")}


def get_activation(name: str):
    """The activation for an HF ``hidden_act`` name; ValueError lists the supported ones."""
    if name not in ACTIVATIONS:
        raise ValueError(f"hidden_act must be one of {sorted(ACTIVATIONS)}, got {name!r}")
    return ACTIVATIONS[name]


class GatedMLP(nn.Module):
    """Dense gated MLP. Weights ``gate_up_proj.weight [2I, H]`` (gate rows first),
    ``down_proj.weight [H, I]``. Input/output ``[T, H]``."""

    def __init__(
        self, hidden_size: int, intermediate_size: int, hidden_act: str = "silu", bias: bool = False
    ) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)
        self.act = get_activation(hidden_act)
        # Batch-invariant mode (`batchgen.models.batch_invariant`): an activation whose value
        # for an element does not depend on the tensor's size.
        self.batch_invariant = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # [T, I] each
        act = invariant_activation(self.act) if self.batch_invariant else self.act
        return self.down_proj(act(gate) * up)
