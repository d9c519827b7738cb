"""MoE routing on CPU in one kernel call each (``csrc/moe_routing.cpp``).

`topk_softmax` is vLLM's ``topk_softmax`` for the softmax routers (Mixtral, Qwen-MoE, OLMoE):
router logits ``[T, E]`` -> ``topk_weights [T, A]`` float32, ``topk_ids [T, A]`` int64, in
Hugging Face's order of operations (softmax in float32, torch.topk, optional renormalisation),
in two calls instead of six torch ops: torch's own softmax (so the probabilities are HF's bit
for bit; a C++ softmax with another exp differed in the last bits, which changed 23 of 70 greedy
bf16 continuations of the bench model), then one kernel call for the top-k, with torch.topk's
choice and order of tied experts, and the renormalisation: the result is HF's bit for bit.
`moe_sort` is the stable counting sort of ``topk_ids`` by expert: exactly
``torch.argsort(ids, stable=True)`` and ``torch.bincount(ids, minlength=E)`` in one call.

Where the kernel does not serve (not CPU, other dtypes, gradients, the library not built,
``BATCHGEN_CPU_KERNELS`` without ``moe_routing``) the ``*_available`` functions are False and
the callers run the torch ops.

Shape legend: T = num_tokens, E = num_experts, A = num_experts_per_tok (top-k).
"""

from __future__ import annotations

import ctypes
import numbers

import torch
from torch.profiler import record_function

from batchgen.kernels.cpu_build import kernels_enabled, load_library

_i64, _ptr = ctypes.c_int64, ctypes.c_void_p
_lib: dict[str, object] | None = None


def _functions() -> dict[str, object]:
    """The kernel's entry points by name; empty while the library is unavailable."""
    global _lib
    if _lib is None:
        lib = load_library("moe_routing")
        fns: dict[str, object] = {}
        if lib is not None:
            fn = lib.batchgen_topk_renorm
            fn.restype = ctypes.c_int
            fn.argtypes = [_ptr] * 3 + [_i64] * 3 + [ctypes.c_int, ctypes.c_float, _i64]
            fns["topk"] = fn
            fn = lib.batchgen_moe_sort
            fn.restype = ctypes.c_int
            fn.argtypes = [_ptr, _i64, _i64, _ptr, _ptr]
            fns["sort"] = fn
        _lib = fns
    return _lib


# Top-k sizes whose float32 row sum torch.sum adds in slot order, as the kernel does (measured on
# torch 2.13's AVX-512 build; 5-7 and 9+ are added in another order, so torch renormalises
# those). tests/test_fused_small_ops.py checks every k from 1 to 16 bit for bit.
_SLOT_ORDER_SUM_K = (1, 2, 3, 4, 8)


def topk_softmax_available(router_logits: torch.Tensor) -> bool:
    """True when `topk_softmax` serves ``router_logits``: a 2-D float32 or bfloat16 CPU tensor,
    no gradient needed, the kernel built and enabled."""
    return (
        router_logits.device.type == "cpu"
        and router_logits.dim() == 2
        and router_logits.dtype in (torch.float32, torch.bfloat16)
        and not (torch.is_grad_enabled() and router_logits.requires_grad)
        and kernels_enabled("moe_routing")
        and bool(_functions())
    )


def _call(name: str, fn, *args) -> int:
    if torch.autograd._profiler_enabled():  # the scope costs ~5 us even when not profiled
        with record_function(f"batchgen::{name}"):
            return fn(*args)
    return fn(*args)


def topk_softmax(
    router_logits: torch.Tensor,
    top_k: int,
    renormalize: bool,
    scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over the experts in float32, top-k, optional renormalisation, times ``scale``.

    Bit for bit `batchgen.models.layers.moe.select_experts_softmax`'s torch ops (HF
    `MixtralTopKRouter`, `Qwen2MoeTopKRouter`: ``softmax(logits.float())``, ``torch.topk``,
    ``w / w.sum()``, then ``* scale``), ties in the probabilities resolved as torch.topk on CPU.

    Args:
        router_logits: ``[T, E]`` float32 or bfloat16 on CPU.
        top_k: A, in ``[1, E]``.
        renormalize: divide the chosen weights by their sum (HF ``norm_topk_prob``).
        scale: multiplies the weights at the end (DeepSeek's ``routed_scaling_factor``).
    Returns:
        ``topk_weights [T, A]`` float32 and ``topk_ids [T, A]`` int64, in descending weight.
    Raises:
        ValueError: ``router_logits`` not a 2-D float32 or bfloat16 CPU tensor, or ``top_k``
            not an int in ``[1, E]``.
    Call only where `topk_softmax_available` is True (these checks keep the kernel from reading
    memory it does not own if not)."""
    if (
        router_logits.dim() != 2
        or router_logits.device.type != "cpu"
        or router_logits.dtype not in (torch.float32, torch.bfloat16)
    ):
        raise ValueError(
            "router_logits must be a 2-D float32 or bfloat16 CPU tensor, got "
            f"{router_logits.dtype} {tuple(router_logits.shape)} on {router_logits.device}"
        )
    num_tokens, num_experts = router_logits.shape
    if not isinstance(top_k, numbers.Integral) or isinstance(top_k, bool):
        raise ValueError(f"top_k must be an int, got {top_k!r}")
    top_k = int(top_k)  # numpy and other integral types as a Python int for ctypes
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be in [1, num_experts={num_experts}], got {top_k}")
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int64)
    if num_tokens == 0:
        return weights, ids
    # HF's softmax(logits.float()) exactly (one op: the cast happens inside, same bits).
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32).contiguous()  # [T, E]
    # The kernel sums the k weights in slot order; torch.sum of a row of k adds them in that
    # order only for these k (measured, tests/test_fused_small_ops.py): elsewhere torch does.
    in_kernel = not renormalize or top_k in _SLOT_ORDER_SUM_K
    rc = _call(
        "topk_softmax", _functions()["topk"], probs.data_ptr(), weights.data_ptr(),
        ids.data_ptr(), num_tokens, num_experts, top_k, int(renormalize and in_kernel),
        scale if in_kernel else 1.0, torch.get_num_threads(),
    )  # fmt: skip
    if rc != 0:
        raise RuntimeError(f"topk_softmax kernel rejected {tuple(probs.shape)}, k={top_k}")
    if not in_kernel:
        weights = weights / weights.sum(dim=-1, keepdim=True)
        if scale != 1.0:
            weights = weights * scale
    return weights, ids


def moe_sort_available(topk_ids: torch.Tensor) -> bool:
    """True when `moe_sort` serves ``topk_ids``: int64 on CPU, the kernel built and enabled."""
    return (
        topk_ids.device.type == "cpu"
        and topk_ids.dtype == torch.int64
        and kernels_enabled("moe_routing")
        and bool(_functions())
    )


def moe_sort(topk_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Stable counting sort of the flattened ``topk_ids [T, A]`` by expert.

    Returns:
        ``order [T*A]`` int64 (exactly ``torch.argsort(topk_ids.reshape(-1), stable=True)``)
        and ``counts [E]`` int64 (``torch.bincount(..., minlength=E)``).
    Raises:
        ValueError: ``topk_ids`` not an int64 CPU tensor, an id outside ``[0, num_experts)``,
            or ``num_experts`` < 1.
    Call only where `moe_sort_available` is True."""
    if topk_ids.dtype != torch.int64 or topk_ids.device.type != "cpu":
        raise ValueError(
            f"topk_ids must be an int64 CPU tensor, got {topk_ids.dtype} on {topk_ids.device}"
        )
    if num_experts < 1:
        raise ValueError(f"num_experts must be >= 1, got {num_experts}")
    flat = topk_ids.reshape(-1).contiguous()
    order = torch.empty_like(flat)
    counts = torch.empty(num_experts, dtype=torch.int64)
    fn = _functions()["sort"]
    rc = _call("moe_sort", fn, flat.data_ptr(), flat.numel(), num_experts, order.data_ptr(),
               counts.data_ptr())  # fmt: skip
    if rc == 2:
        raise ValueError(f"topk_ids holds an expert id outside [0, {num_experts})")
    if rc != 0:
        raise RuntimeError(f"moe_sort kernel rejected {flat.numel()} ids, E={num_experts}")
    return order, counts
