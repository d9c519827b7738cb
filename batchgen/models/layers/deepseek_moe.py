"""DeepSeek-V2/V3 expert routing as named, pure steps: route (``router_logits``) -> select
(``topk_weights``, ``topk_ids``). The expert GEMMs and the combine are the generic ones of
`batchgen.models.layers.moe` (``fused_experts_reference``); shared experts are a plain MLP added
to the routed output.

Shape legend: T = num_tokens, H = hidden_size, E = n_routed_experts, A = num_experts_per_tok,
G = n_group.

Sources (transformers 5.x): ``DeepseekV2TopkRouter.forward`` (softmax scores; "greedy" or
"group_limited_greedy"), ``DeepseekV3TopkRouter.forward`` (sigmoid scores, "noaux_tc":
auxiliary-loss-free balancing with ``e_score_correction_bias``, DeepSeek-V3 paper
arXiv:2412.19437 section 2.1.2).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

SCORING_FUNCS = ("softmax", "sigmoid")
TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")


def deepseek_router_logits(hidden_states: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``hidden_states [T, H]`` x ``weight [E, H]`` -> ``router_logits [T, E]`` float32.

    Both operands are upcast first, as HF does (``F.linear(hidden_states.type(torch.float32),
    self.weight.type(torch.float32))`` in ``DeepseekV{2,3}TopkRouter.forward``); HF also keeps
    ``gate.weight`` and ``e_score_correction_bias`` in float32 (``_keep_in_fp32_modules_strict``).
    """
    return F.linear(hidden_states.float(), weight.float())


def _group_mask(group_scores: torch.Tensor, topk_group: int, group_size: int) -> torch.Tensor:
    """``group_scores [T, G]`` -> bool ``[T, G * group_size]``: True on experts of the
    ``topk_group`` best groups (HF's ``group_mask`` / ``score_mask``)."""
    group_idx = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]  # [T, topk_group]
    group_mask = torch.zeros_like(group_scores)
    group_mask.scatter_(1, group_idx, 1)  # [T, G]
    return group_mask.bool().repeat_interleave(group_size, dim=1)  # [T, E]


def select_experts_deepseek(
    router_logits: torch.Tensor,
    top_k: int,
    scoring_func: str = "softmax",
    topk_method: str = "greedy",
    n_group: int | None = None,
    topk_group: int | None = None,
    norm_topk_prob: bool = False,
    routed_scaling_factor: float = 1.0,
    e_score_correction_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek expert selection.

    - scores: ``softmax`` (V2) or ``sigmoid`` (V3) of the float32 logits.
    - "greedy": top-k of the scores (DeepSeek-V2-Lite).
    - "group_limited_greedy" (DeepSeek-V2): experts split into ``n_group`` contiguous groups; a
      group's score is its max expert score; only experts of the ``topk_group`` best groups
      compete (others are filled with 0.0, as HF does), top-k of those.
    - "noaux_tc" (DeepSeek-V3): choice on the *biased* ``scores + e_score_correction_bias``;
      a group's score is the sum of its two best biased scores; experts outside the
      ``topk_group`` best groups are filled with -inf; top-k. The weights are the *unbiased*
      scores gathered at the chosen ids: the bias steers load balance, never the mix.
    - then weights are renormalised to sum to 1 if ``norm_topk_prob`` (HF V3:
      ``/ (sum + 1e-20)``, even for top_k == 1), then multiplied by ``routed_scaling_factor``.

    HF ``DeepseekV2TopkRouter`` never normalises (it has no ``norm_topk_prob`` branch), so the V2
    methods match it with ``norm_topk_prob=False``, which every released V2 checkpoint sets.
    (DeepSeek's own V2 ``modeling_deepseek.py`` normalises *instead of* scaling when the flag is
    set; vLLM normalises and scales, as here.)

    ``torch.topk(..., sorted=False)`` exactly as HF, so ids come in HF's order on the same device.

    Args:
        router_logits: ``[T, E]`` (upcast to float32).
        e_score_correction_bias: ``[E]``, required by "noaux_tc", rejected by the others.
    Returns:
        ``topk_weights [T, A]`` float32 and ``topk_ids [T, A]`` int64.
    Raises:
        ValueError: unknown scoring_func / topk_method, a missing or unexpected bias, or group
            sizes that do not divide E.
    """
    if scoring_func not in SCORING_FUNCS:
        raise ValueError(f"scoring_func must be one of {SCORING_FUNCS}, got {scoring_func!r}")
    if topk_method not in TOPK_METHODS:
        raise ValueError(f"topk_method must be one of {TOPK_METHODS}, got {topk_method!r}")
    if (topk_method == "noaux_tc") != (e_score_correction_bias is not None):
        raise ValueError(
            "e_score_correction_bias is required by, and only by, topk_method 'noaux_tc'"
        )
    num_tokens, num_experts = router_logits.shape
    logits = router_logits.float()
    scores = logits.softmax(dim=-1) if scoring_func == "softmax" else logits.sigmoid()  # [T, E]
    if topk_method == "greedy":
        topk_weights, topk_ids = torch.topk(scores, k=top_k, dim=-1, sorted=False)  # [T, A]
    else:
        if not n_group or not topk_group or num_experts % n_group:
            raise ValueError(
                f"{topk_method} needs n_group dividing n_routed_experts={num_experts} and "
                f"topk_group, got n_group={n_group}, topk_group={topk_group}"
            )
        group_size = num_experts // n_group
        if topk_method == "group_limited_greedy":
            group_scores = scores.view(num_tokens, n_group, group_size).max(dim=-1).values  # [T, G]
            mask = _group_mask(group_scores, topk_group, group_size)  # [T, E]
            masked = scores.masked_fill(~mask, 0.0)
            topk_weights, topk_ids = torch.topk(masked, k=top_k, dim=-1, sorted=False)
        else:  # noaux_tc
            for_choice = scores + e_score_correction_bias.float()  # [T, E]
            group_scores = (
                for_choice.view(num_tokens, n_group, group_size).topk(2, dim=-1)[0].sum(dim=-1)
            )  # [T, G]
            mask = _group_mask(group_scores, topk_group, group_size)
            for_choice = for_choice.masked_fill(~mask, float("-inf"))
            topk_ids = torch.topk(for_choice, k=top_k, dim=-1, sorted=False)[1]  # [T, A]
            topk_weights = scores.gather(1, topk_ids)  # unbiased
    if norm_topk_prob:
        topk_weights = topk_weights / (topk_weights.sum(dim=-1, keepdim=True) + 1e-20)
    return topk_weights * routed_scaling_factor, topk_ids
