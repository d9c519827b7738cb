"""A rank's side of `UpdateWeights` and `ResetPrefixCache` (`batchgen.distributed.protocol`):
apply them to the rank's engine and answer with `Reply`. The frontend's side is
`batchgen.distributed.frontend_weights`."""

from __future__ import annotations

from typing import TYPE_CHECKING

from safetensors.torch import load as load_safetensors

from batchgen.distributed import protocol as msg
from batchgen.engine.weight_update import apply_weight_update

if TYPE_CHECKING:
    from batchgen.engine.llm_engine import LLMEngine


def apply_update(engine: LLMEngine, message: msg.UpdateWeights) -> list[str]:
    """Apply ``message`` to ``engine``; returns the checkpoint names copied (an expert-parallel
    rank copies only its held experts). Raises as `update_weights` does."""
    if message.path is not None:
        return apply_weight_update(engine, message.path)
    return apply_weight_update(engine, load_safetensors(message.data))


def answer(engine: LLMEngine, rank: int, message) -> msg.Reply:
    """Run ``message`` (`UpdateWeights` or `ResetPrefixCache`) and answer it; an exception
    becomes the reply's ``error`` (the frontend raises it), never the rank's failure."""
    try:
        if isinstance(message, msg.UpdateWeights):
            result: object = apply_update(engine, message)
        else:
            result = engine.kv_cache.reset_prefix_cache()
    except Exception as exc:  # noqa: BLE001 - reported to the caller, the rank runs on
        return msg.Reply(rank, message.token, error=str(exc), error_type=type(exc).__name__)
    return msg.Reply(rank, message.token, result)
