"""Which implementation runs paged decode attention: decided here and nowhere else.

Backends (every one computes the torch path's result, `batchgen.models.layers.attention.
paged_attention` with ``torch``):

- ``cpu_kernel``: the C++ CPU kernel reading K/V in place
  (`batchgen.kernels.paged_attention.paged_decode_attention`; CPU, float32 and bfloat16 on a
  cache of their dtype, and the narrower caches of ``kv_cache_dtype``: float32 queries on
  bf16 or fp8, bf16 queries on fp8);
- ``triton``: the Triton kernel reading K/V in place
  (`batchgen.kernels.triton_paged_attention.triton_paged_decode_attention`);
- ``torch``: each bucket's blocks gathered into a padded copy, then SDPA.

``BATCHGEN_ATTENTION_BACKEND`` (`ATTENTION_BACKEND_ENV`): ``auto`` (default) picks
``cpu_kernel`` where it serves, else ``triton`` on CUDA where triton imports
(`batchgen.kernels.triton_support.triton_unsupported_reason`), else ``torch``. Whether the
Triton kernel beats the gather + SDPA path on a given GPU is a device measurement
(``benchmarks/gpu_kernels.py`` times both); it has never run on a GPU yet (docs/gpu.md).
``cpu_kernel``, ``triton`` or ``torch`` force that backend (tests force ``triton`` on CPU
under ``TRITON_INTERPRET=1``, and ``torch`` as the oracle); forcing one that cannot run raises.
Prefill always runs SDPA.

MLA's absorbed decode on the latent cache (`batchgen.models.layers.mla`) has its own pair,
chosen by `mla_decode_backend` under the same variable: ``triton``
(`batchgen.kernels.triton_mla_decode.triton_mla_decode_attention`, reading the latent cache in
place) or ``torch`` (each bucket's latents gathered, then two batched GEMMs). ``auto`` picks
``triton`` on CUDA where triton imports, else ``torch``; there is no CPU kernel for MLA, so
``cpu_kernel`` raises for an MLA model. The Triton MLA kernel has never run on a GPU either.
"""

from __future__ import annotations

import logging
import threading
from typing import Literal

import torch

from batchgen.kernels.paged_attention import decode_kernel_available
from batchgen.kernels.switches import env_choice
from batchgen.kernels.triton_support import triton_unsupported_reason

logger = logging.getLogger(__name__)

DecodeBackend = Literal["cpu_kernel", "triton", "torch"]
MLADecodeBackend = Literal["triton", "torch"]
ATTENTION_BACKEND_ENV = "BATCHGEN_ATTENTION_BACKEND"
ATTENTION_BACKEND_CHOICES = ("auto", "cpu_kernel", "triton", "torch")
_logged: set[tuple] = set()
_logged_lock = threading.Lock()


def attention_backend_override() -> str:
    """``BATCHGEN_ATTENTION_BACKEND``, lower-cased (``auto`` when unset or empty).

    Raises:
        ValueError: a value outside `ATTENTION_BACKEND_CHOICES`, naming the variable."""
    return env_choice(ATTENTION_BACKEND_ENV, ATTENTION_BACKEND_CHOICES)


def decode_attention_backend(
    device: torch.device, dtype: torch.dtype, cache_dtype: torch.dtype | None = None
) -> DecodeBackend:
    """The decode attention backend for queries of ``dtype`` on ``device`` reading a KV cache
    of ``cache_dtype`` (None: ``dtype``; a narrower one under ``kv_cache_dtype``,
    `batchgen.models.layers.kv_cache_dtype`; rules in the module docstring: the Triton
    kernel reads only a cache of the queries' dtype, the CPU kernel the pairs
    `decode_kernel_available` names, the torch path every pair). Logs each distinct choice
    once (INFO).

    Raises:
        ValueError: a bad ``BATCHGEN_ATTENTION_BACKEND``, or a forced backend that cannot run
        here (the reason names the device or dtype)."""
    cache_dtype = dtype if cache_dtype is None else cache_dtype
    mixed = cache_dtype != dtype
    override = attention_backend_override()
    kernel_ok = decode_kernel_available(device, dtype, cache_dtype)
    triton_reason = (
        f"the Triton kernel reads a KV cache of the queries' dtype only ({dtype}), not "
        f"{cache_dtype} (kv_cache_dtype)"
        if mixed
        else triton_unsupported_reason(device, dtype)
    )
    if override == "cpu_kernel":
        if not kernel_ok:
            raise ValueError(
                f"{ATTENTION_BACKEND_ENV}=cpu_kernel: the CPU kernel does not serve queries of "
                f"{dtype} on a {cache_dtype} cache on {device.type} (CPU, float32 or bfloat16, "
                "built; narrower caches: see decode_kernel_available)"
            )
        backend: DecodeBackend = "cpu_kernel"
    elif override == "triton":
        if triton_reason is not None:
            raise ValueError(f"{ATTENTION_BACKEND_ENV}=triton: {triton_reason}")
        backend = "triton"
    elif override == "torch":
        backend = "torch"
    elif kernel_ok:
        backend = "cpu_kernel"
    elif device.type == "cuda" and triton_reason is None:
        backend = "triton"
    else:
        backend = "torch"
    what = f"decode attention ({cache_dtype} KV cache)" if mixed else "decode attention"
    _log_once(what, device, dtype, override, backend)
    return backend


def mla_decode_backend(device: torch.device, dtype: torch.dtype) -> MLADecodeBackend:
    """The backend of MLA's absorbed decode on a latent cache of ``dtype`` on ``device``
    (rules in the module docstring). Logs each distinct choice once (INFO).

    Raises:
        ValueError: a bad ``BATCHGEN_ATTENTION_BACKEND``, ``cpu_kernel`` (no CPU kernel for
        MLA), or ``triton`` where it cannot run (the reason names the device or dtype)."""
    override = attention_backend_override()
    if override == "cpu_kernel":
        raise ValueError(
            f"{ATTENTION_BACKEND_ENV}=cpu_kernel: there is no CPU kernel for MLA decode "
            "(DeepSeek-V2/V3 models); use auto, torch or triton"
        )
    if override == "triton":
        reason = triton_unsupported_reason(device, dtype)
        if reason is not None:
            raise ValueError(f"{ATTENTION_BACKEND_ENV}=triton: {reason}")
        backend: MLADecodeBackend = "triton"
    elif override == "auto" and device.type == "cuda":
        backend = "torch" if triton_unsupported_reason(device, dtype) else "triton"
    else:
        backend = "torch"
    _log_once("MLA decode attention", device, dtype, override, backend)
    return backend


def _log_once(what: str, device: torch.device, dtype: torch.dtype, override: str, backend: str):
    key = (what, device.type, dtype, override, backend)
    if key not in _logged:
        with _logged_lock:
            if key not in _logged:
                _logged.add(key)
                logger.info(
                    "%s on %s in %s: %s backend (%s=%s)",
                    what, device.type, dtype, backend, ATTENTION_BACKEND_ENV, override,
                )  # fmt: skip
