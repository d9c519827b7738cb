"""In-place weight updates between `generate` calls (RL rollouts: the policy changes every
step, the engine, its KV cache and its compiled kernels stay).

    n = update_weights(engine, {"model.layers.0.mlp.gate.weight": w, ...})  # a state dict
    n = update_weights(engine, "/ckpt/step-100")  # a safetensors checkpoint directory

Names are Hugging Face checkpoint names, mapped to engine parameters by the loader's own rules
(`batchgen.models.checkpoint_names.checkpoint_rules`): ``q_proj/k_proj/v_proj`` into ``qkv_proj``,
per-expert ``w1/w2/w3`` or ``gate_proj/up_proj/down_proj`` into the stacked ``w13_weight
[E, 2I, H]`` / ``w2_weight [E, H, I]``, transformers 5's fused ``experts.gate_up_proj`` and
``experts.down_proj`` onto them whole. A partial update changes only the tensors named.

On an expert-parallel rank (``LLM(data_parallel_size=N, enable_expert_parallel=True)``; the
frontend sends every rank the same update, `batchgen.distributed.frontend_weights`) only the
rank's held experts are written: per-expert tensors of other experts are skipped unread and
fused ``[E, ...]`` tensors are sliced to the held rows, as at load time (`load_weights`).

The update is all or nothing for what can be checked up front: every name, shape and dtype is
validated before the first byte is copied, so a bad entry raises `ValueError` and leaves the
model as it was. Afterwards the caches derived from the weights are dropped: the CPU fused-MoE
kernel's packed expert weights (packed again on the next forward) and the prefix cache
(`KVCacheManager.reset_prefix_cache`), so no K/V computed with the old weights is reused.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import safe_open

from batchgen.models.loader import (
    checkpoint_files,
    checkpoint_rules,
    find_target,
    held_experts,
    is_expert_param,
    read_experts,
    target_view,
)
from batchgen.models.model_config import ModelConfig

if TYPE_CHECKING:
    from batchgen.engine.llm_engine import LLMEngine

logger = logging.getLogger(__name__)

WeightsLike = Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]] | str | os.PathLike
# Config fields a checkpoint of the same model may differ in (the weights' storage dtype, ids).
_CONFIG_FIELDS_FREE = {"torch_dtype", "bos_token_id", "eos_token_ids"}
_MAX_LISTED = 20


@dataclass(frozen=True)
class _Source:
    """One named tensor offered for the update: its shape and dtype (read without loading it)
    and ``read()`` returning it, ``read(start, stop)`` only rows ``[start, stop)`` of its first
    dimension."""

    name: str
    shape: tuple[int, ...]
    is_float: bool
    read: Callable[..., torch.Tensor]


@dataclass(frozen=True)
class _Write:
    """A validated copy: source tensor ``source`` into ``dest`` (a view of parameter
    ``param``, in the engine's dtype and device)."""

    source: _Source
    param: str
    dest: torch.Tensor


def update_weights(engine: LLMEngine, weights: WeightsLike) -> int:
    """Replace some or all of ``engine``'s weights in place; return how many checkpoint
    tensors were copied (tensors ignored on purpose, such as rotary caches or the ``lm_head``
    of a model with tied embeddings, are not counted).

    Args:
        weights: Hugging Face checkpoint names -> tensors (a state dict, possibly partial, or
            an iterable of ``(name, tensor)`` pairs, vLLM's ``load_weights`` form), or the
            path of a safetensors checkpoint directory of the same model. Tensors of any
            floating dtype on any device; they are converted to the engine's dtype and device.
    Raises:
        RuntimeError: requests are in flight (the update happens between `generate` calls).
        NotImplementedError: an expert-parallel rank that streams the experts it does not hold
            (``prefill_strategy='data_parallel_offload'``).
        ValueError: names no engine parameter takes, shapes other than expected (the message
            names the tensor, the engine parameter and the expected shape), non-floating
            dtypes, tensors on the meta device, or a directory whose config.json describes
            another model. Nothing is changed then.
        TypeError: a value that is not a tensor.
    """
    return len(apply_weight_update(engine, weights))


def apply_weight_update(engine: LLMEngine, weights: WeightsLike) -> list[str]:
    """`update_weights`, returning the names of the checkpoint tensors copied (same errors)."""
    if engine.has_unfinished_requests():
        raise RuntimeError(
            f"update_weights: {engine.get_num_unfinished_requests()} requests are in flight; "
            "update the weights between generate calls (finish or abort them first)"
        )
    if engine.expert_parallel is not None and engine.expert_parallel.streamer is not None:
        raise NotImplementedError(
            "update_weights with prefill_strategy 'data_parallel_offload': the experts a rank "
            "does not hold are streamed from the checkpoint files it was started on, which "
            "the update does not change; use prefill_strategy 'expert_parallel'"
        )
    with ExitStack() as stack:
        if isinstance(weights, (str, os.PathLike)):
            sources = list(_directory_sources(Path(weights), engine.model_config, stack))
        else:
            sources = list(_tensor_sources(weights))
        writes, ignored = _plan_update(engine.runner.model, engine.model_config, sources)
        with torch.no_grad():
            for write in writes:  # one source tensor in memory at a time
                write.dest.copy_(write.source.read())  # converts dtype and device
    model = engine.runner.model
    for module in model.modules():  # caches derived from the weights (the CPU MoE kernel's)
        invalidate = getattr(module, "invalidate_packed_weights", None)
        if invalidate is not None:
            invalidate()
    if not engine.kv_cache.reset_prefix_cache():  # no block is held: cannot fail here
        raise RuntimeError("update_weights: the prefix cache could not be reset")
    params = {w.param for w in writes}
    logger.info(
        "update_weights: %d tensors copied into %d of %d parameters%s; prefix cache reset",
        len(writes),
        len(params),
        len(dict(model.named_parameters())),
        f", {len(ignored)} ignored ({ignored[:3]}...)" if ignored else "",
    )
    return [w.source.name for w in writes]


def _plan_update(
    model: torch.nn.Module, cfg: ModelConfig, sources: list[_Source]
) -> tuple[list[_Write], list[str]]:
    """Map every source to its destination and check it, copying nothing. A model holding a
    shard of the routed experts (`held_experts`) takes only its experts' tensors.

    Returns:
        ``(writes, ignored)``: the copies to make, and the names ignored on purpose.
    Raises:
        ValueError: listing every unknown name, wrong shape and non-floating dtype found.
    """
    params = dict(model.named_parameters())
    rules = checkpoint_rules(cfg)
    held = held_experts(model)
    slot_of = None if held is None else {e: i for i, e in enumerate(held)}
    writes: list[_Write] = []
    ignored: list[str] = []
    problems: list[str] = []
    for source in sources:
        known, target = find_target(source.name, rules)
        if known and target is None:
            ignored.append(source.name)
            continue
        if not known or target.param not in params:
            problems.append(f"{source.name!r}: no engine parameter takes this name")
            continue
        expert, expected_lead = target.expert, None
        if expert is not None and not 0 <= expert < cfg.num_local_experts:
            problems.append(
                f"{source.name!r}: expert {expert} does not exist (the model has "
                f"{cfg.num_local_experts} experts: 0..{cfg.num_local_experts - 1})"
            )
            continue
        other_rank = slot_of is not None and expert is not None and expert not in slot_of
        if slot_of is not None and expert is not None:
            # Another rank's expert is checked (as that rank will) but not written: every rank
            # refuses the same bad update, so none applies it alone.
            expert = 0 if other_rank else slot_of[expert]
        fused = slot_of is not None and target.expert is None and is_expert_param(target.param)
        dest = target_view(params[target.param], target, expert)
        expected = tuple(dest.shape)
        if fused:  # a fused [E, ...] tensor: every expert offered, this rank's rows written
            expected_lead = (cfg.num_local_experts, *expected[1:])
        if source.shape != (expected_lead or expected):
            problems.append(
                f"{source.name!r} has shape {source.shape}, expected {expected_lead or expected} "
                f"(engine parameter {target.param!r})"
            )
        elif not source.is_float:
            problems.append(f"{source.name!r} is not a floating-point tensor")
        elif other_rank:
            continue
        elif fused:
            rows = dataclasses.replace(
                source, shape=expected, read=lambda s=source: read_experts(s.read, held)
            )
            writes.append(_Write(rows, target.param, dest))
        else:
            writes.append(_Write(source, target.param, dest))
    if problems:
        more = len(problems) - _MAX_LISTED
        raise ValueError(
            f"update_weights changed nothing: {len(problems)} bad tensors for "
            f"{cfg.architecture}: "
            + "; ".join(problems[:_MAX_LISTED])
            + (f"; and {more} more" if more > 0 else "")
            + " (names are Hugging Face checkpoint names, e.g. "
            "'model.layers.0.self_attn.q_proj.weight')"
        )
    return writes, ignored


def _tensor_sources(
    weights: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
) -> Iterator[_Source]:
    items = weights.items() if isinstance(weights, Mapping) else weights
    seen: set[str] = set()
    for name, tensor in items:
        check_update_tensor(name, tensor)
        check_unique_name(name, seen)
        yield _Source(
            str(name),
            tuple(tensor.shape),
            tensor.is_floating_point(),
            lambda start=None, stop=None, t=tensor: t if start is None else t[start:stop],
        )


def check_unique_name(name: object, seen: set[str]) -> None:
    """Raises ValueError when ``name`` is in ``seen`` (one update naming a tensor twice is
    ambiguous: refused on every engine, single-process or data-parallel); else adds it."""
    if str(name) in seen:
        raise ValueError(
            f"update_weights: {str(name)!r} appears twice in the update; name each tensor once"
        )
    seen.add(str(name))


def check_update_tensor(name: object, tensor: object) -> None:
    """Raises TypeError for a value that is not a tensor, ValueError for a meta tensor (no
    data: found before anything is copied, not halfway through the copies)."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"update_weights: {name!r} is a {type(tensor).__name__}, not a tensor")
    if tensor.is_meta:
        raise ValueError(f"update_weights: {name!r} is on the meta device (it holds no data)")


def _directory_sources(path: Path, cfg: ModelConfig, stack: ExitStack) -> Iterator[_Source]:
    """The tensors of a safetensors checkpoint directory, their files held open on ``stack``
    (read one at a time when copied). Raises ValueError when ``path`` is no checkpoint
    directory or its config.json describes another model."""
    if not path.is_dir():
        raise ValueError(f"update_weights: {str(path)!r} is not a checkpoint directory")
    if (path / "config.json").is_file():
        _check_same_model(path, cfg)
    for file in checkpoint_files(path):
        f = stack.enter_context(safe_open(str(file), framework="pt", device="cpu"))
        for name in f.keys():
            piece = f.get_slice(name)
            dtype = piece.get_dtype()  # safetensors' codes: F32, BF16, F8_E4M3, I64, ...
            yield _Source(
                name,
                tuple(piece.get_shape()),
                dtype.startswith(("F", "BF")),
                lambda start=None, stop=None, _f=f, _n=name: (
                    _f.get_tensor(_n) if start is None else _f.get_slice(_n)[start:stop]
                ),
            )


def _check_same_model(path: Path, cfg: ModelConfig) -> None:
    from transformers import AutoConfig

    other = ModelConfig.from_hf(AutoConfig.from_pretrained(path))
    diffs = [
        f"{f.name}={getattr(other, f.name)!r} (engine: {getattr(cfg, f.name)!r})"
        for f in dataclasses.fields(cfg)
        if f.name not in _CONFIG_FIELDS_FREE and getattr(other, f.name) != getattr(cfg, f.name)
    ]
    if diffs:
        raise ValueError(
            f"update_weights: {str(path)!r} holds another model than the engine's: "
            + ", ".join(diffs)
            + "; start a new LLM for another architecture or config"
        )
