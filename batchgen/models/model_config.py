"""`ModelConfig`: the Hugging Face config translated once into a frozen, typed dataclass.

Field names keep HF's spelling (`num_experts_per_tok`, `num_key_value_heads`, ...). Both rope
conventions found in the wild are read: `rope_theta`/`rope_scaling` at the top level (most hub
checkpoints, transformers 4) and `rope_parameters` (transformers 5); `transformers.AutoConfig`
already folds the former into the latter, and `_rope_parameters` handles raw dicts too.
"""

from __future__ import annotations

from dataclasses import dataclass, field

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "MixtralForCausalLM",
)


def _rope_parameters(hf_config) -> dict:
    params = getattr(hf_config, "rope_parameters", None)
    if isinstance(params, dict) and "full_attention" in params:  # per-layer-type form
        params = params["full_attention"]
    params = dict(params or {})
    scaling = getattr(hf_config, "rope_scaling", None)
    if isinstance(scaling, dict):
        params = {**scaling, **params}
    if "rope_type" not in params and "type" in params:
        params["rope_type"] = params.pop("type")
    params.setdefault("rope_type", "default")
    if "rope_theta" not in params:
        params["rope_theta"] = float(getattr(hf_config, "rope_theta", None) or 10000.0)
    return params


@dataclass(frozen=True)
class ModelConfig:
    """Typed view of an HF decoder config (dense or Mixtral-style MoE).

    Attributes follow HF names. ``layer_sliding_windows[i]`` is the sliding-window size (tokens)
    of layer i or None for full attention. ``num_local_experts == 0`` means a dense model.
    """

    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    hidden_act: str
    max_position_embeddings: int
    rope_parameters: dict = field(hash=False)
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    layer_sliding_windows: tuple[int | None, ...] = ()
    num_local_experts: int = 0
    num_experts_per_tok: int = 0
    norm_topk_prob: bool = True
    torch_dtype: str = "float32"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @property
    def is_moe(self) -> bool:
        return self.num_local_experts > 0

    @classmethod
    def from_hf(cls, hf_config) -> ModelConfig:
        """Build from a `transformers.PretrainedConfig`.

        Raises:
            ValueError: unsupported architecture (the message lists the supported ones).
        """
        archs = list(getattr(hf_config, "architectures", None) or [])
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ValueError(
                f"unsupported architecture {archs or getattr(hf_config, 'model_type', None)!r}; "
                f"supported architectures: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        c = hf_config
        num_heads = c.num_attention_heads
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // num_heads
        num_layers = c.num_hidden_layers
        windows: list[int | None] = [None] * num_layers
        sliding = getattr(c, "sliding_window", None)
        if arch == "Qwen2ForCausalLM" and not getattr(c, "use_sliding_window", False):
            sliding = None
        if sliding is not None:
            layer_types = getattr(c, "layer_types", None)
            windows = [
                sliding if (layer_types is None or layer_types[i] == "sliding_attention") else None
                for i in range(num_layers)
            ]
        eos = getattr(c, "eos_token_id", None)
        eos_ids = (
            tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
        )
        dtype = getattr(c, "dtype", None) or getattr(c, "torch_dtype", None) or "float32"
        is_moe = arch == "MixtralForCausalLM"
        attention_bias = bool(getattr(c, "attention_bias", False))
        return cls(
            architecture=arch,
            model_type=c.model_type,
            vocab_size=c.vocab_size,
            hidden_size=c.hidden_size,
            intermediate_size=c.intermediate_size,
            num_hidden_layers=num_layers,
            num_attention_heads=num_heads,
            num_key_value_heads=getattr(c, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            rms_norm_eps=c.rms_norm_eps,
            hidden_act=getattr(c, "hidden_act", "silu"),
            max_position_embeddings=c.max_position_embeddings,
            rope_parameters=_rope_parameters(c),
            tie_word_embeddings=bool(getattr(c, "tie_word_embeddings", False)),
            qkv_bias=arch == "Qwen2ForCausalLM" or attention_bias,
            o_bias=attention_bias,
            mlp_bias=bool(getattr(c, "mlp_bias", False)),
            layer_sliding_windows=tuple(windows),
            num_local_experts=c.num_local_experts if is_moe else 0,
            num_experts_per_tok=c.num_experts_per_tok if is_moe else 0,
            norm_topk_prob=True,
            torch_dtype=str(dtype).replace("torch.", ""),
            bos_token_id=getattr(c, "bos_token_id", None),
            eos_token_ids=eos_ids,
        )
