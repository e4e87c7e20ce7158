"""Tiny Mixture-of-Experts models of transformers' families, built from configs (no downloads)."""

from __future__ import annotations

from typing import Any

import transformers as T


def moe_model(family: str, small: dict[str, Any], experts: int, shared: bool = False) -> Any:
    """A ``family`` model (mixtral, qwen2_moe, qwen3_moe, deepseek_v3) of ``small``'s sizes with ``experts`` routed
    experts, two chosen per token (``shared``: DeepSeek's shared expert too; Qwen2-MoE always has one)."""
    if family == "mixtral":
        return T.MixtralForCausalLM(T.MixtralConfig(**small, num_local_experts=experts, num_experts_per_tok=2))
    if family == "qwen2_moe":
        return T.Qwen2MoeForCausalLM(
            T.Qwen2MoeConfig(
                **small,
                num_experts=experts,
                num_experts_per_tok=2,
                moe_intermediate_size=16,
                shared_expert_intermediate_size=16,
            )
        )
    if family == "qwen3_moe":
        return T.Qwen3MoeForCausalLM(
            T.Qwen3MoeConfig(**small, num_experts=experts, num_experts_per_tok=2, moe_intermediate_size=16)
        )
    if family == "deepseek_v3":  # a sigmoid router with a bias; MLA attention
        return T.DeepseekV3ForCausalLM(
            T.DeepseekV3Config(
                **{**small, "num_key_value_heads": small["num_attention_heads"]},
                n_routed_experts=experts,
                num_experts_per_tok=2,
                moe_intermediate_size=16,
                **({"n_shared_experts": 1} if shared else {}),
                first_k_dense_replace=0,
                n_group=1,
                topk_group=1,
                q_lora_rank=None,
                kv_lora_rank=16,
                qk_rope_head_dim=8,
                qk_nope_head_dim=8,
                v_head_dim=8,
            )
        )
    raise ValueError(family)
