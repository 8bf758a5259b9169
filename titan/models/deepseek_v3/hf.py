"""DeepSeek-V3 as transformers stores it (DeepseekV3ForCausalLM, deepseek-ai/DeepSeek-V3's layout): dense MLPs in
the first first_k_dense_replace layers, the router with its e_score_correction_bias (Titan's expert_bias), routed and
shared experts in the others. rope_interleave is true, so RoPE's rows are in Titan's order: nothing is permuted.

The multi-token prediction modules are no part of the inference model: exports leave them out, and imports skip the
layers past the last (the release stores its MTP module as layer 61, which transformers skips too)."""

from titan.models.common.hf_mapping import (
    EXPERT_NAMES,
    FEED_FORWARD_NAMES,
    NORM_NAMES,
    ROUTER_NAMES,
    HFMapping,
    swiglu_names,
)
from titan.models.deepseek_v3.args import DeepSeekV3Args

ATTENTION_NAMES = {
    "attention.wkv_a.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attention.kv_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attention.wkv_b.weight": "self_attn.kv_b_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
}
QUERY_NAMES = {"attention.wq.weight": "self_attn.q_proj.weight"}
LOW_RANK_QUERY_NAMES = {
    "attention.wq_a.weight": "self_attn.q_a_proj.weight",
    "attention.q_norm.weight": "self_attn.q_a_layernorm.weight",
    "attention.wq_b.weight": "self_attn.q_b_proj.weight",
}
MOE_NAMES = {
    "moe.router.expert_bias": "mlp.gate.e_score_correction_bias",
    **ROUTER_NAMES,
    **swiglu_names("moe.shared_experts", "mlp.shared_experts"),
}


def config_fields(args: DeepSeekV3Args) -> dict:
    moe = args.moe
    return {
        "hidden_size": args.dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads,
        "intermediate_size": args.hidden_dim,
        "first_k_dense_replace": args.first_k_dense_replace,
        "q_lora_rank": args.q_lora_rank or None,
        "kv_lora_rank": args.kv_lora_rank,
        "qk_nope_head_dim": args.qk_nope_head_dim,
        "qk_rope_head_dim": args.qk_rope_head_dim,
        "v_head_dim": args.v_head_dim,
        "moe_intermediate_size": moe.hidden_dim,
        "n_routed_experts": moe.num_experts,
        "n_shared_experts": moe.num_shared_experts,
        "num_experts_per_tok": moe.top_k,
        "n_group": moe.n_group,
        "topk_group": moe.topk_group,
        "routed_scaling_factor": moe.routed_scaling_factor,
        "norm_topk_prob": moe.norm_topk_prob,
        "hidden_act": "silu",
        "rms_norm_eps": args.norm_eps,
        "attention_bias": False,
        "rope_interleave": True,
    }


def unchecked_fields(args: DeepSeekV3Args) -> dict:
    """The export holds no MTP module, whatever the flavor trained with."""
    return {"num_nextn_predict_layers": 0}


def num_dense_layers(args: DeepSeekV3Args) -> int:
    return args.first_k_dense_replace


def hf_mapping(args: DeepSeekV3Args) -> HFMapping:
    """DeepseekV3ForCausalLM routes by sigmoid scores: a softmax-routed flavor (16B, DeepSeek-V2-Lite's routing) has
    no transformers class here."""
    if args.moe.score_func != "sigmoid":
        raise ValueError(f"DeepseekV3ForCausalLM routes by sigmoid scores, and this DeepSeek-V3 flavor routes by "
                         f"{args.moe.score_func}: Titan has no Hugging Face class for it. Use a sigmoid-routed "
                         f"flavor (671B, debugmodel).")
    query = QUERY_NAMES if args.q_lora_rank == 0 else LOW_RANK_QUERY_NAMES
    attention = {**query, **ATTENTION_NAMES, **NORM_NAMES}
    return HFMapping("DeepSeek-V3", "deepseek_v3", "DeepseekV3ForCausalLM", layer_names={**attention, **MOE_NAMES},
                     rope_rows=(), config_fields=config_fields, expert_names=EXPERT_NAMES, hub_pads_vocab=True,
                     unchecked_config_fields=unchecked_fields,
                     dense_layer_names={**attention, **FEED_FORWARD_NAMES}, num_dense_layers=num_dense_layers,
                     extra_layers="DeepSeek-V3's multi-token prediction modules, which DeepseekV3ForCausalLM skips",
                     not_exported={"mtp.": "the multi-token prediction modules train the model and are no part of "
                                           "DeepseekV3ForCausalLM"})
