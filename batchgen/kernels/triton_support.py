"""Where the Triton kernels (`batchgen.kernels.triton_moe`,
`batchgen.kernels.triton_paged_attention`) can run. Imports triton only inside
`triton_unsupported_reason`, so that importing the engine never imports it.
"""

from __future__ import annotations

import os

import torch

TRITON_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def triton_interpret() -> bool:
    """True when ``TRITON_INTERPRET`` asks triton to interpret kernels on the host (``1``,
    ``true``, ``on``, ``yes``: triton's ``env_bool`` spellings)."""
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "on", "yes")


def triton_unsupported_reason(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why the Triton kernels cannot run on ``device`` in ``dtype``, or None when they can:
    CUDA (or any device under ``TRITON_INTERPRET=1``), triton importable, float32 / float16 /
    bfloat16 activations."""
    if device.type != "cuda" and not triton_interpret():
        return f"device {device.type}: Triton kernels run on CUDA (or under TRITON_INTERPRET=1)"
    if dtype not in TRITON_DTYPES:
        return f"dtype {dtype} (the Triton kernels take float32, float16, bfloat16)"
    try:
        import triton  # noqa: F401
    except ImportError as exc:  # not installed, or a platform without wheels
        return f"triton does not import ({exc})"
    return None
