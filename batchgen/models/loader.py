"""Model loading: resolve a local directory or hub id, read the HF config, build the model on
the meta device, and fill it from safetensors lazily (one tensor at a time, memory-mapped).

Loading is declarative: `checkpoint_rules` (`batchgen.models.checkpoint_names`) maps each checkpoint tensor name to (parameter,
piece); afterwards every parameter must have all of its pieces filled and every checkpoint
tensor must have been used, otherwise `WeightLoadError` names the odd ones out.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from batchgen.models.checkpoint_names import (  # noqa: F401  (re-exported)
    Target,
    checkpoint_rules,
    expected_pieces,
    find_target,
    is_expert_param,
    slot_piece,
    target_view,
)
from batchgen.models.decoder import CausalLM
from batchgen.models.model_config import ModelConfig

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CPU_HALF_PRECISION_WARNING = (
    "dtype %s on CPU is no faster than float32 here: %s; keep --dtype auto (bfloat16 for a "
    "bfloat16 checkpoint on a CPU with avx512_bf16 or AMX-BF16, else float32) unless the "
    "weights do not fit in memory otherwise"
)
# The reason `CPU_HALF_PRECISION_WARNING` gives, by dtype.
CPU_HALF_PRECISION_REASONS = {
    "float16": (
        "no CPU kernel serves float16 (the MoE experts take the per-expert torch GEMMs, "
        "decode attention the gathered torch attention)"
    ),
    "bfloat16": (
        "the fused MoE kernel runs bf16 only where the CPU has avx512_bf16 (vdpbf16ps) or "
        "AMX-BF16 and the CPU kernels are on, so the experts take the per-expert torch GEMMs, "
        "about half float32's speed"
    ),
}
# Checkpoint tensors that carry no learned state and are ignored on purpose.


class WeightLoadError(ValueError):
    """A checkpoint does not match the model: missing, unexpected or mis-shaped tensors."""


def resolve_model_path(model: str) -> Path:
    """A local directory, or a hub id resolved through `huggingface_hub.snapshot_download`
    (which honours ``HF_HUB_OFFLINE`` and the local cache).

    Raises:
        ValueError: when ``model`` is neither a directory nor a resolvable hub id.
    """
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"model directory {str(path)!r} has no config.json")
        return path
    if path.exists():
        raise ValueError(f"model {model!r} is a file; pass the checkpoint directory")
    if model.startswith(("/", "./", "../", "~")) or model.count("/") > 1:
        raise ValueError(f"model directory {model!r} does not exist; {_make_model_hint(model)}")
    try:
        from huggingface_hub import snapshot_download

        local = snapshot_download(
            repo_id=model,
            allow_patterns=["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt"],
        )
    except Exception as exc:  # the hub raises many types (offline, 404, auth, bad id)
        raise ValueError(
            f"model {model!r} is not a local directory and could not be resolved from the "
            f"Hugging Face hub (HF_HUB_OFFLINE={os.environ.get('HF_HUB_OFFLINE', '0')}): "
            f"{type(exc).__name__}: {exc}"
        ) from None
    return Path(local)


def _make_model_hint(model: str) -> str:
    """What to do about a local model directory that does not exist: the `batchgen make-model`
    command that writes it when its name says which tiny model it is (the examples'
    ``/tmp/batchgen-tiny-mixtral``), else how to make one."""
    from batchgen.models.make_model import SUPPORTED_MAKE_ARCHS

    tiny = re.search(r"batchgen-tiny-(\w+?)/?$", model)
    if tiny and tiny[1] in SUPPORTED_MAKE_ARCHS:
        return f"write it with `batchgen make-model --arch {tiny[1]} --out {model}`"
    return (
        "give an HF checkpoint directory, or write a tiny random-weight one with "
        "`batchgen make-model --arch mixtral --out DIR`"
    )


def cpu_has_fast_bf16() -> bool:
    """True when this CPU runs the bf16 MoE experts on native bf16 dot products: the fused
    kernel's `kernel_isa` is ``"amx_bf16"`` (AMX tiles) or ``"avx512_bf16"`` (vdpbf16ps); False
    on AVX2-only CPUs and where ``BATCHGEN_CPU_KERNELS`` leaves the kernel out (the per-expert
    torch GEMMs). Builds the kernel library on first use (cached)."""
    from batchgen.kernels.fused_moe import kernel_isa

    return kernel_isa(torch.bfloat16) in ("amx_bf16", "avx512_bf16")


def resolve_dtype(
    dtype: str, device: torch.device, cfg: ModelConfig, batch_invariant: bool = False
) -> torch.dtype:
    """ "auto": the checkpoint's dtype on CUDA. On CPU: bfloat16 for a bfloat16 checkpoint
    where `cpu_has_fast_bf16` (AMX-BF16 or avx512_bf16) outside the batch-invariant mode (which
    covers float32 only), else float32 (where bf16 matmuls are slow).

    Measured for that rule (`batchgen bench --quick --workloads rollouts --modes coalesce`,
    alternated, three rounds each). 2-core AMD EPYC Zen 4 (avx512_bf16, no AMX), load average
    2.3-3.4: bfloat16 on vdpbf16ps 474.4, 412.4, 455.8 useful tok/s, float32 228.8, 249.5,
    273.2 (1.8x; the 256-request peer bench: 1,566 vs 987 tok/s, 1.59x). 2-core Intel AMX
    machine, load average 7-12: bfloat16 with the AMX MoE kernel 129.9, 127.9, 130.4, with
    vdpbf16ps instead of AMX 100.8, 108.6, 130.9, float32 60.4, 70.5, 65.6. (An older
    vdpbf16ps kernel had measured 1.15x and 0.96x float32 there, when auto stayed float32.)

    An explicit half-precision dtype on CPU is honoured, with a logged warning
    (`CPU_HALF_PRECISION_WARNING`, with its `CPU_HALF_PRECISION_REASONS`) for float16, and for
    bfloat16 where not `cpu_has_fast_bf16`."""
    if dtype != "auto":
        if device.type == "cpu" and dtype in ("bfloat16", "float16"):
            if dtype == "float16" or not cpu_has_fast_bf16():
                logger.warning(CPU_HALF_PRECISION_WARNING, dtype, CPU_HALF_PRECISION_REASONS[dtype])
        return _DTYPES[dtype]
    if device.type == "cpu":
        if cfg.torch_dtype == "bfloat16" and not batch_invariant and cpu_has_fast_bf16():
            return torch.bfloat16
        return torch.float32
    return _DTYPES.get(cfg.torch_dtype, torch.bfloat16)


def checkpoint_files(path: Path) -> list[Path]:
    """The safetensors files of a checkpoint (single file or sharded with an index).

    Raises:
        ValueError: when the directory holds no safetensors weights.
    """
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [path / f for f in sorted(set(weight_map.values()))]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(
            f"no *.safetensors weights in {str(path)!r} (only safetensors checkpoints are "
            "supported; convert .bin/.pt files with `transformers` save_pretrained)"
        )
    return files


def iter_checkpoint(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` lazily, one tensor at a time (memory-mapped reads)."""
    for name, read in iter_checkpoint_lazy(files):
        yield name, read()


def iter_checkpoint_lazy(files: list[Path]) -> Iterator[tuple[str, Callable]]:
    """Yield ``(name, read)``: ``read()`` returns the tensor, ``read(start, stop)`` only rows
    ``[start, stop)`` of its first dimension; nothing is read for a name nobody reads."""
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():

                def read(start: int | None = None, stop: int | None = None, _n=name, _f=f):
                    if start is None:
                        return _f.get_tensor(_n)
                    return _f.get_slice(_n)[start:stop]

                yield name, read


def held_experts(model: CausalLM) -> list[int] | None:
    """The logical experts every MoE layer of ``model`` holds, or None when it holds all."""
    for module in model.modules():
        ids = getattr(module, "expert_ids", None)
        if ids is not None:
            return None if ids == list(range(module.num_experts)) else ids
    return None


def load_weights(model: CausalLM, files: list[Path]) -> None:
    """Fill ``model``'s parameters from safetensors ``files``.

    A model that holds a shard of the routed experts (expert parallelism) reads only those:
    per-expert tensors of other experts are skipped unread, fused ``[E, ...]`` tensors are
    sliced.

    Raises:
        WeightLoadError: naming tensors that are unexpected or mis-shaped, and parameters that
            were not (fully) filled.
    """
    cfg = model.config
    params = dict(model.named_parameters())
    remaining = {n: expected_pieces(n, p, cfg) for n, p in params.items()}
    rules = checkpoint_rules(cfg)
    held = held_experts(model)
    slot_of = None if held is None else {e: i for i, e in enumerate(held)}
    unexpected: list[str] = []
    for name, read in iter_checkpoint_lazy(files):
        known, target = find_target(name, rules)
        if not known:
            unexpected.append(name)
            continue
        if target is None:
            continue
        if target.param not in params:
            unexpected.append(name)
            continue
        expert = target.expert
        if slot_of is not None and expert is not None:
            if expert not in slot_of:
                continue  # another rank's expert
            expert = slot_of[expert]
        if slot_of is not None and target.expert is None and is_expert_param(target.param):
            tensor = read_experts(read, held)  # a fused [E, ...] tensor: this rank's rows
        else:
            tensor = read()
        dest = target_view(params[target.param], target, expert)
        if tuple(dest.shape) != tuple(tensor.shape):
            raise WeightLoadError(
                f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, expected "
                f"{tuple(dest.shape)} for parameter {target.param!r}"
            )
        dest.copy_(tensor)  # through .data: no version bump, hence the invalidation below
        pieces = remaining[target.param]
        if target.piece == "all":
            pieces.clear()
        else:
            renamed = slot_of is not None and target.expert is not None
            pieces.discard(slot_piece(target, slot_of) if renamed else target.piece)
    for module in model.modules():  # caches derived from the weights (the CPU MoE kernel's)
        invalidate = getattr(module, "invalidate_packed_weights", None)
        if invalidate is not None:
            invalidate()
    missing = sorted(n for n, pieces in remaining.items() if pieces)
    if unexpected or missing:
        parts = []
        if missing:
            parts.append(
                f"missing from the checkpoint (parameters not filled): {missing[:20]}"
                + (f" and {len(missing) - 20} more" if len(missing) > 20 else "")
            )
        if unexpected:
            parts.append(
                f"unexpected checkpoint tensors: {unexpected[:20]}"
                + (f" and {len(unexpected) - 20} more" if len(unexpected) > 20 else "")
            )
        raise WeightLoadError(f"checkpoint does not match {cfg.architecture}: " + "; ".join(parts))


def read_experts(read: Callable, experts: list[int]) -> torch.Tensor:
    """Rows ``experts`` of a fused ``[E, ...]`` expert tensor, reading only contiguous runs."""
    runs: list[torch.Tensor] = []
    start = prev = experts[0]
    for e in [*experts[1:], None]:
        if e is not None and e == prev + 1:
            prev = e
            continue
        runs.append(read(start, prev + 1))
        if e is not None:
            start = prev = e
    return runs[0] if len(runs) == 1 else torch.cat(runs)


def load_model(
    path: Path,
    cfg: ModelConfig,
    device: torch.device,
    dtype: torch.dtype,
    expert_ids: list[int] | None = None,
) -> CausalLM:
    """Build `CausalLM` on the meta device, materialise it on ``device`` in ``dtype`` and load
    the safetensors weights of ``path``; ``expert_ids``: hold (and read) only these routed
    experts (an expert-parallel rank's shard; default all)."""
    files = checkpoint_files(path)
    _refuse_quantized(path)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            model = CausalLM(cfg, expert_ids)
    finally:
        torch.set_default_dtype(previous)
    model = model.to_empty(device=device)
    if cfg.tie_word_embeddings:  # to_empty replaces each module's tensors separately
        model.lm_head.weight = model.embed_tokens.weight
    with torch.no_grad():
        load_weights(model, files)
    return model.eval().requires_grad_(False)


def _refuse_quantized(path: Path) -> None:
    config = json.loads((path / "config.json").read_text())
    quant = config.get("quantization_config")
    if quant:
        method = quant.get("quant_method", quant) if isinstance(quant, dict) else quant
        raise WeightLoadError(
            f"quantized checkpoints are not supported yet (quantization_config.quant_method="
            f"{method!r}); use a bf16/fp16/fp32 checkpoint"
        )
