"""Model loading: resolve a local directory or hub id, read the HF config, build the model on
the meta device, and fill it from safetensors lazily (one tensor at a time, memory-mapped).

Loading is declarative: `checkpoint_rules` maps each checkpoint tensor name to (parameter,
piece); afterwards every parameter must have all of its pieces filled and every checkpoint
tensor must have been used, otherwise `WeightLoadError` names the odd ones out.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from batchgen.models.decoder import CausalLM
from batchgen.models.model_config import ModelConfig

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CPU_HALF_PRECISION_WARNING = (
    "dtype %s on CPU is no faster than float32 in repeatable measurements: the paged decode "
    "attention kernel serves float32 and bf16 (float16 takes gathered torch attention), and "
    "the fused MoE kernel serves bf16 only on CPUs with avx512_bf16 (float16 never; else the "
    "per-expert torch GEMMs, about half float32's speed); keep --dtype auto (float32 on CPU) "
    "unless the weights do not fit in memory otherwise"
)
# Checkpoint tensors that carry no learned state and are ignored on purpose.
_IGNORED = re.compile(r"(rotary_emb\.inv_freq|\.rotary_emb\.cos_cached|\.rotary_emb\.sin_cached)$")


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


def resolve_dtype(dtype: str, device: torch.device, cfg: ModelConfig) -> torch.dtype:
    """ "auto": the checkpoint's dtype on CUDA; float32 on CPU (where bf16 matmuls are slow).

    An explicit half-precision dtype on CPU is honoured with a logged warning
    (`CPU_HALF_PRECISION_WARNING`). Auto stays float32 on CPU: with the bf16 fused MoE kernel
    (`batchgen.kernels.fused_moe`, avx512_bf16) `batchgen bench --quick --workloads rollouts
    --modes coalesce` ran bf16 at 1.15x and 0.96x float32 in two alternated rounds on a loaded
    2-core machine: not a measured win."""
    if dtype != "auto":
        if device.type == "cpu" and dtype in ("bfloat16", "float16"):
            logger.warning(CPU_HALF_PRECISION_WARNING, dtype)
        return _DTYPES[dtype]
    if device.type == "cpu":
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


@dataclass(frozen=True)
class Target:
    """Where a checkpoint tensor goes: a parameter, an optional expert index (dim 0) and an
    optional row range ``[row_start, row_start + rows)`` along the next dim."""

    param: str
    piece: object
    expert: int | None = None
    row_start: int | None = None
    rows: int | None = None


def find_target(name: str, rules: list[tuple[re.Pattern, object]]) -> tuple[bool, Target | None]:
    """``(known, target)`` for checkpoint tensor ``name`` under `checkpoint_rules`: ``known``
    is False when no rule matches; ``target`` is None for a tensor ignored on purpose (rotary
    caches, the ``lm_head`` of a model with tied embeddings)."""
    if _IGNORED.search(name):
        return True, None
    for pattern, fn in rules:
        match = pattern.match(name)
        if match:
            return True, fn(match)
    return False, None


def target_view(param: torch.Tensor, target: Target, expert: int | None) -> torch.Tensor:
    """The part of ``param`` (through ``.data``) that ``target`` fills: expert slot ``expert``
    (dim 0; `Target.expert`, or its held slot under expert parallelism), then the rows
    ``[row_start, row_start + rows)``."""
    dest = param.data
    if expert is not None:
        dest = dest[expert]
    if target.row_start is not None:
        dest = dest.narrow(0, target.row_start, target.rows)
    return dest


def expected_pieces(name: str, param: torch.Tensor, cfg: ModelConfig) -> set:
    """The pieces that must all be filled for parameter ``name`` (expert weights: one per held
    slot, see `SparseMoeBlock.expert_ids`)."""
    if name.endswith("qkv_proj.weight") or name.endswith("qkv_proj.bias"):
        return {"q", "k", "v"}
    if name.endswith("gate_up_proj.weight") or name.endswith("gate_up_proj.bias"):
        return {"gate", "up"}
    if name.endswith("w13_weight"):
        return {(e, s) for e in range(param.shape[0]) for s in ("gate", "up")}
    if name.endswith("w2_weight"):
        return set(range(param.shape[0]))
    return {"all"}


_LAYER = r"model\.layers\.(\d+)\."


def checkpoint_rules(cfg: ModelConfig) -> list[tuple[re.Pattern, object]]:
    """Regex rules from HF checkpoint names to `Target`s (or None for ignored tensors).

    Expert weights are accepted in every layout found in the wild: Mixtral's hub names
    ``block_sparse_moe.experts.{e}.w1/w2/w3``, the Qwen/OLMoE/DeepSeek names
    ``mlp.experts.{e}.gate_proj/up_proj/down_proj`` and transformers 5's fused
    ``mlp.experts.gate_up_proj [E, 2I, H]`` / ``down_proj [E, H, I]``.
    """
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    qkv_offset = {"q": 0, "k": q, "v": q + kv}
    qkv_rows = {"q": q, "k": kv, "v": kv}
    up_offset = {
        "mlp": cfg.intermediate_size,
        "experts": cfg.moe_intermediate_size,
        "shared": cfg.shared_expert_intermediate_size,
    }

    def qkv(m):
        return Target(
            f"layers.{m[1]}.self_attn.qkv_proj.{m[3]}",
            m[2],
            row_start=qkv_offset[m[2]],
            rows=qkv_rows[m[2]],
        )

    def gate_up(m):
        return Target(
            f"layers.{m[1]}.mlp.gate_up_proj.{m[3]}",
            m[2],
            row_start=0 if m[2] == "gate" else up_offset["mlp"],
            rows=up_offset["mlp"],
        )

    def shared_gate_up(m):
        return Target(
            f"layers.{m[1]}.mlp.shared_experts.gate_up_proj.weight",
            m[2],
            row_start=0 if m[2] == "gate" else up_offset["shared"],
            rows=up_offset["shared"],
        )

    def expert(layer: str, e: int, which: str) -> Target:
        if which == "down":
            return Target(f"layers.{layer}.mlp.w2_weight", e, expert=e)
        return Target(
            f"layers.{layer}.mlp.w13_weight",
            (e, which),
            expert=e,
            row_start=0 if which == "gate" else up_offset["experts"],
            rows=up_offset["experts"],
        )

    w123 = {"1": "gate", "3": "up", "2": "down"}

    def plain(template):
        return lambda m: Target(template.format(*m.groups()), "all")

    if cfg.mla is not None:
        attention = [
            (
                _LAYER + r"self_attn\.(q_proj|q_a_proj|q_a_layernorm|q_b_proj|kv_a_proj_with_mqa"
                r"|kv_a_layernorm|kv_b_proj|o_proj)\.(weight|bias)",
                plain("layers.{}.self_attn.{}.{}"),
            ),
        ]
    else:
        attention = [
            (_LAYER + r"self_attn\.(q|k|v)_proj\.(weight|bias)", qkv),
            (_LAYER + r"self_attn\.o_proj\.(weight|bias)", plain("layers.{}.self_attn.o_proj.{}")),
            (
                _LAYER + r"self_attn\.(q_norm|k_norm)\.weight",
                plain("layers.{}.self_attn.{}.weight"),
            ),
        ]
    rules = [
        (r"model\.embed_tokens\.weight", plain("embed_tokens.weight")),
        (r"model\.norm\.weight", plain("norm.weight")),
        (
            r"lm_head\.weight",
            (lambda m: None) if cfg.tie_word_embeddings else plain("lm_head.weight"),
        ),
        (
            _LAYER + r"(input_layernorm|post_attention_layernorm)\.weight",
            plain("layers.{}.{}.weight"),
        ),
        *attention,
        (_LAYER + r"mlp\.(gate|up)_proj\.(weight|bias)", gate_up),
        (_LAYER + r"mlp\.down_proj\.(weight|bias)", plain("layers.{}.mlp.down_proj.{}")),
        (_LAYER + r"(?:block_sparse_moe|mlp)\.gate\.weight", plain("layers.{}.mlp.gate.weight")),
        (
            _LAYER + r"mlp\.gate\.e_score_correction_bias",
            plain("layers.{}.mlp.gate.e_score_correction_bias"),
        ),
        (
            _LAYER + r"block_sparse_moe\.experts\.(\d+)\.w(1|2|3)\.weight",
            lambda m: expert(m[1], int(m[2]), w123[m[3]]),
        ),
        (
            _LAYER + r"mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight",
            lambda m: expert(m[1], int(m[2]), m[3]),
        ),
        (_LAYER + r"mlp\.experts\.gate_up_proj", plain("layers.{}.mlp.w13_weight")),
        (_LAYER + r"mlp\.experts\.down_proj", plain("layers.{}.mlp.w2_weight")),
        (_LAYER + r"mlp\.shared_experts?\.(gate|up)_proj\.weight", shared_gate_up),
        (
            _LAYER + r"mlp\.shared_experts?\.down_proj\.weight",
            plain("layers.{}.mlp.shared_experts.down_proj.weight"),
        ),
        (
            _LAYER + r"mlp\.shared_expert_gate\.weight",
            plain("layers.{}.mlp.shared_expert_gate.weight"),
        ),
    ]
    return [(re.compile(pattern + "$"), fn) for pattern, fn in rules]


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
            pieces.discard(_slot_piece(target, slot_of) if renamed else target.piece)
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


def is_expert_param(param: str) -> bool:
    return param.endswith("mlp.w13_weight") or param.endswith("mlp.w2_weight")


def _slot_piece(target: Target, slot_of: dict[int, int]):
    """A per-expert piece (``e`` or ``(e, "gate")``) renamed to the expert's held slot."""
    if isinstance(target.piece, tuple):
        return (slot_of[target.piece[0]], target.piece[1])
    return slot_of[target.piece]


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
