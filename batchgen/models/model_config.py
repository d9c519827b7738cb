"""`ModelConfig`: the Hugging Face config translated once into a frozen, typed dataclass.

Field names keep HF's spelling (`num_experts_per_tok`, `moe_intermediate_size`,
`norm_topk_prob`, `kv_lora_rank`, ...). Both rope conventions found in the wild are read:
`rope_theta`/`rope_scaling` at the top level (most hub checkpoints, transformers 4) and
`rope_parameters` (transformers 5); `transformers.AutoConfig` already folds the former into the
latter, and `_rope_parameters` handles raw dicts too.

Every family-specific rule (which layers are sparse, how the router scores, where q/k norms
sit) is resolved here, so model code never reads the HF config.
"""

from __future__ import annotations

from dataclasses import dataclass, field

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "MixtralForCausalLM",
    "Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM",
    "OlmoeForCausalLM",
    "DeepseekV2ForCausalLM",
    "DeepseekV3ForCausalLM",
)
# The `model_type`s `batchgen make-model --arch` writes a tiny checkpoint of (one per supported
# architecture; `batchgen.models.make_model`). Here, without torch, so that the CLI can list them.
SUPPORTED_MAKE_ARCHS: tuple[str, ...] = (
    "mixtral",
    "qwen2_moe",
    "qwen3_moe",
    "olmoe",
    "deepseek_v2",
    "deepseek_v3",
    "llama",
    "mistral",
    "qwen2",
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
class RouterConfig:
    """How a sparse layer picks experts.

    Attributes:
        scoring_func: "softmax" (Mixtral, Qwen-MoE, OLMoE, DeepSeek-V2) or "sigmoid"
            (DeepSeek-V3).
        topk_method: "greedy" (plain top-k), "group_limited_greedy" (DeepSeek-V2: groups ranked
            by their best expert) or "noaux_tc" (DeepSeek-V3: groups ranked by the sum of their
            top-2 biased scores, `e_score_correction_bias` used for choosing only).
        norm_topk_prob: renormalise the chosen weights to sum to 1.
        n_group / topk_group: expert groups and how many of them a token may use.
        routed_scaling_factor: multiplies the routed experts' weights.
    """

    scoring_func: str = "softmax"
    topk_method: str = "greedy"
    norm_topk_prob: bool = True
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0


@dataclass(frozen=True)
class MLAConfig:
    """Multi-head Latent Attention sizes (DeepSeek-V2 paper, section 2.1)."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool = True

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclass(frozen=True)
class ModelConfig:
    """Typed view of an HF decoder config (dense, MoE, or MLA + MoE).

    Per-layer facts are tuples indexed by layer: ``layer_sliding_windows[i]`` (tokens, or None
    for full attention) and ``layer_is_moe[i]``. ``intermediate_size`` is the dense MLP's width,
    ``moe_intermediate_size`` one routed expert's. ``shared_expert_intermediate_size`` > 0 adds
    a dense shared expert to every sparse layer, scaled by ``sigmoid(shared_expert_gate(x))``
    when ``shared_expert_gate`` (Qwen2-MoE). ``qk_norm`` is None, "head" (Qwen3: RMSNorm over
    each head) or "full" (OLMoE: RMSNorm over the whole q / k projection). ``mla`` is set for
    DeepSeek models.
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
    qk_norm: str | None = None
    clip_qkv: float | None = None
    layer_sliding_windows: tuple[int | None, ...] = ()
    layer_is_moe: tuple[bool, ...] = ()
    num_local_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    router: RouterConfig = field(default_factory=RouterConfig)
    shared_expert_intermediate_size: int = 0
    shared_expert_gate: bool = False
    mla: MLAConfig | None = None
    torch_dtype: str = "float32"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @property
    def is_moe(self) -> bool:
        return any(self.layer_is_moe)

    @property
    def norm_topk_prob(self) -> bool:
        return self.router.norm_topk_prob

    @classmethod
    def from_hf(cls, hf_config) -> ModelConfig:
        """Build from a `transformers.PretrainedConfig`.

        Raises:
            ValueError: unsupported architecture (the message lists the supported ones), or an
                unsupported setting of a supported one (named).
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
        num_layers = c.num_hidden_layers
        eos = getattr(c, "eos_token_id", None)
        eos_ids = (
            tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
        )
        dtype = getattr(c, "dtype", None) or getattr(c, "torch_dtype", None) or "float32"
        attention_bias = bool(getattr(c, "attention_bias", False))
        fields_ = dict(
            architecture=arch,
            model_type=c.model_type,
            vocab_size=c.vocab_size,
            hidden_size=c.hidden_size,
            intermediate_size=c.intermediate_size,
            num_hidden_layers=num_layers,
            num_attention_heads=num_heads,
            num_key_value_heads=getattr(c, "num_key_value_heads", None) or num_heads,
            head_dim=getattr(c, "head_dim", None) or c.hidden_size // num_heads,
            rms_norm_eps=c.rms_norm_eps,
            hidden_act=getattr(c, "hidden_act", "silu"),
            max_position_embeddings=c.max_position_embeddings,
            rope_parameters=_rope_parameters(c),
            tie_word_embeddings=bool(getattr(c, "tie_word_embeddings", False)),
            qkv_bias=attention_bias,
            o_bias=attention_bias,
            mlp_bias=bool(getattr(c, "mlp_bias", False)),
            layer_sliding_windows=_sliding_windows(c, num_layers),
            layer_is_moe=(False,) * num_layers,
            torch_dtype=str(dtype).replace("torch.", ""),
            bos_token_id=getattr(c, "bos_token_id", None),
            eos_token_ids=eos_ids,
        )
        fields_.update(_FAMILY_FIELDS.get(arch, _no_fields)(c))
        return cls(**fields_)


def _sliding_windows(c, num_layers: int) -> tuple[int | None, ...]:
    sliding = getattr(c, "sliding_window", None)
    if getattr(c, "use_sliding_window", True) is False or not sliding:
        return (None,) * num_layers
    layer_types = getattr(c, "layer_types", None)
    return tuple(
        sliding if (layer_types is None or layer_types[i] == "sliding_attention") else None
        for i in range(num_layers)
    )


def _no_fields(c) -> dict:
    return {}


def _qwen2(c) -> dict:
    return {"qkv_bias": True}


def _mixtral(c) -> dict:
    return dict(
        layer_is_moe=(True,) * c.num_hidden_layers,
        num_local_experts=c.num_local_experts,
        num_experts_per_tok=c.num_experts_per_tok,
        moe_intermediate_size=c.intermediate_size,
        router=RouterConfig(norm_topk_prob=True),
    )


def _qwen_moe_layers(c) -> tuple[bool, ...]:
    """HF `Qwen2MoeDecoderLayer`: sparse unless in `mlp_only_layers`, every
    `decoder_sparse_step`-th layer (1-based)."""
    mlp_only = set(getattr(c, "mlp_only_layers", None) or [])
    step = getattr(c, "decoder_sparse_step", 1) or 1
    return tuple(
        i not in mlp_only and c.num_experts > 0 and (i + 1) % step == 0
        for i in range(c.num_hidden_layers)
    )


def _qwen2_moe(c) -> dict:
    return dict(
        qkv_bias=bool(getattr(c, "qkv_bias", True)),
        layer_is_moe=_qwen_moe_layers(c),
        num_local_experts=c.num_experts,
        num_experts_per_tok=c.num_experts_per_tok,
        moe_intermediate_size=c.moe_intermediate_size,
        router=RouterConfig(norm_topk_prob=bool(c.norm_topk_prob)),
        shared_expert_intermediate_size=c.shared_expert_intermediate_size or 0,
        shared_expert_gate=True,
    )


def _qwen3_moe(c) -> dict:
    return dict(
        qk_norm="head",
        layer_is_moe=_qwen_moe_layers(c),
        num_local_experts=c.num_experts,
        num_experts_per_tok=c.num_experts_per_tok,
        moe_intermediate_size=c.moe_intermediate_size,
        router=RouterConfig(norm_topk_prob=bool(c.norm_topk_prob)),
    )


def _olmoe(c) -> dict:
    return dict(
        qk_norm="full",
        clip_qkv=getattr(c, "clip_qkv", None),
        layer_is_moe=(True,) * c.num_hidden_layers,
        num_local_experts=c.num_experts,
        num_experts_per_tok=c.num_experts_per_tok,
        moe_intermediate_size=c.intermediate_size,
        router=RouterConfig(norm_topk_prob=bool(c.norm_topk_prob)),
    )


def _deepseek(c) -> dict:
    """DeepSeek-V2/V3: MLA attention, dense layers before `first_k_dense_replace` and MoE from
    there on (as HF's `DeepseekV3DecoderLayer`, which ignores `moe_layer_freq`),
    `n_shared_experts` always-on experts."""
    is_v3 = c.model_type == "deepseek_v3"
    first_dense = getattr(c, "first_k_dense_replace", 0) or 0
    n_experts = c.n_routed_experts or 0
    layer_is_moe = tuple(n_experts > 0 and i >= first_dense for i in range(c.num_hidden_layers))
    default_method = "noaux_tc" if is_v3 else "greedy"
    return dict(
        head_dim=c.qk_nope_head_dim + c.qk_rope_head_dim,
        num_key_value_heads=c.num_attention_heads,
        layer_is_moe=layer_is_moe,
        num_local_experts=n_experts,
        num_experts_per_tok=c.num_experts_per_tok,
        moe_intermediate_size=c.moe_intermediate_size,
        router=RouterConfig(
            scoring_func=getattr(c, "scoring_func", None) or ("sigmoid" if is_v3 else "softmax"),
            topk_method=getattr(c, "topk_method", None) or default_method,
            norm_topk_prob=bool(getattr(c, "norm_topk_prob", False)),
            n_group=getattr(c, "n_group", None) or 1,
            topk_group=getattr(c, "topk_group", None) or 1,
            routed_scaling_factor=float(getattr(c, "routed_scaling_factor", 1.0) or 1.0),
        ),
        shared_expert_intermediate_size=c.moe_intermediate_size * (c.n_shared_experts or 0),
        mla=MLAConfig(
            q_lora_rank=getattr(c, "q_lora_rank", None),
            kv_lora_rank=c.kv_lora_rank,
            qk_nope_head_dim=c.qk_nope_head_dim,
            qk_rope_head_dim=c.qk_rope_head_dim,
            v_head_dim=c.v_head_dim,
            rope_interleave=bool(getattr(c, "rope_interleave", True)),
        ),
    )


_FAMILY_FIELDS = {
    "Qwen2ForCausalLM": _qwen2,
    "MixtralForCausalLM": _mixtral,
    "Qwen2MoeForCausalLM": _qwen2_moe,
    "Qwen3MoeForCausalLM": _qwen3_moe,
    "OlmoeForCausalLM": _olmoe,
    "DeepseekV2ForCausalLM": _deepseek,
    "DeepseekV3ForCausalLM": _deepseek,
}
