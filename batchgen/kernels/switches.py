"""The environment switches of the kernels and execution paths, read strictly.

Each switch is read where it takes effect (often only on the first forward of a layer, or only
in one dtype), so a mistyped value used to surface mid-run (every request of the first step
failed) or not at all (an on/off switch took any other word for "on"). `check_kernel_switches`
reads every one of them when the engine starts, so a bad value stops the engine before it loads
weights with an error naming the variable and its allowed values (docs/performance.md,
"The switches").
"""

from __future__ import annotations

import os

FLAG_ON = ("1", "true", "yes", "on")
FLAG_OFF = ("0", "false", "no", "off")


def env_flag(name: str, default: bool = True) -> bool:
    """An on/off environment switch: ``1``/``true``/``yes``/``on`` or ``0``/``false``/``no``/
    ``off`` (case and surrounding spaces ignored); ``default`` when unset or empty.

    Raises:
        ValueError: any other value, naming the variable and the allowed values.
    """
    raw = os.environ.get(name, "")
    value = raw.strip().lower()
    if not value:
        return default
    if value in FLAG_ON:
        return True
    if value in FLAG_OFF:
        return False
    allowed = "/".join(FLAG_ON) + " (on) or " + "/".join(FLAG_OFF) + " (off)"
    raise ValueError(f"{name}={raw!r}: expected {allowed}")


def env_choice(name: str, choices, default: str = "auto") -> str:
    """A switch with named values: ``$name`` lower-cased with surrounding spaces dropped,
    ``default`` when unset or empty.

    Args:
        name: the environment variable.
        choices: the allowed values (lower case); the error lists them in this order.
        default: the value when the variable is unset or empty (need not be in ``choices``).

    Raises:
        ValueError: any other value, naming the variable and the allowed values.
    """
    raw = os.environ.get(name, "")
    value = raw.strip().lower() or default
    if value not in choices:
        raise ValueError(f"{name}={raw!r}: expected one of {tuple(choices)}")
    return value


def check_kernel_switches() -> None:
    """Read every kernel and path switch once, so that a bad value fails at engine start:
    ``BATCHGEN_CPU_KERNELS``, ``BATCHGEN_CPU_AMX``, ``BATCHGEN_PACKED_LINEAR``,
    ``BATCHGEN_ONEDNN_LINEAR``, ``BATCHGEN_ONEDNN_LINEAR_F32``, ``BATCHGEN_PAGED_ATTENTION_ISA``,
    ``BATCHGEN_MOE_PATH``, ``BATCHGEN_ATTENTION_BACKEND``, ``BATCHGEN_PREFILL_ATTENTION`` and
    ``BATCHGEN_HUGE_PAGES``. Builds and loads nothing.

    Raises:
        ValueError: the first bad value, naming the variable and the allowed values; or
            ``BATCHGEN_PREFILL_ATTENTION=kernel`` with ``BATCHGEN_CPU_KERNELS`` turning that
            kernel off (the first prefill failed with it, long after start).
    """
    # Imported here: these modules import torch-side code that imports this module.
    from batchgen.engine.host_allocator import huge_pages_enabled
    from batchgen.kernels.cpu_build import kernels_enabled
    from batchgen.kernels.fused_moe import amx_enabled
    from batchgen.kernels.onednn_linear import onednn_f32_mode, prepacked_linear_enabled
    from batchgen.kernels.packed_linear import packed_linear_enabled
    from batchgen.kernels.paged_attention import default_isa
    from batchgen.kernels.prefill_attention import prefill_attention_mode
    from batchgen.models.layers.attention_backend import attention_backend_override
    from batchgen.models.layers.expert_path import moe_path_override

    kernels_enabled()
    amx_enabled()
    huge_pages_enabled()
    packed_linear_enabled()
    prepacked_linear_enabled()
    onednn_f32_mode()
    default_isa()
    moe_path_override()
    attention_backend_override()
    if prefill_attention_mode() == "kernel" and not kernels_enabled("prefill_attention"):
        raise ValueError(
            "BATCHGEN_PREFILL_ATTENTION=kernel forces the CPU prefill attention kernel, but "
            f"BATCHGEN_CPU_KERNELS={os.environ.get('BATCHGEN_CPU_KERNELS')!r} turns it off: add "
            "prefill_attention to the list, or set BATCHGEN_PREFILL_ATTENTION to auto or sdpa"
        )
