"""DeepSeek-V3 as transformers stores it (DeepseekV3ForCausalLM, deepseek-ai/DeepSeek-V3's layout): dense MLPs in
the first first_k_dense_replace layers, the router with its e_score_correction_bias (Titan's expert_bias), routed and
shared experts in the others. rope_interleave is true, so RoPE's rows are in Titan's order: nothing is permuted.

The multi-token prediction modules are no part of the inference model: exports leave them out, and imports skip the
layers past the last (the release stores its MTP module as layer 61, which transformers skips too)."""

from titan.models.common.hf_mapping import (
    HFMapping,
    Same,
    Transform,
    decoder_transforms,
    norm_transforms,
    split_expert_transforms,
    swiglu_transforms,
)
from titan.models.deepseek_v3.args import DeepSeekV3Args

ATTENTION_NAMES = {
    "wkv_a.weight": "kv_a_proj_with_mqa.weight",
    "kv_norm.weight": "kv_a_layernorm.weight",
    "wkv_b.weight": "kv_b_proj.weight",
    "wo.weight": "o_proj.weight",
}
QUERY_NAMES = {"wq.weight": "q_proj.weight"}
LOW_RANK_QUERY_NAMES = {
    "wq_a.weight": "q_a_proj.weight",
    "q_norm.weight": "q_a_layernorm.weight",
    "wq_b.weight": "q_b_proj.weight",
}


def attention_transforms(args: DeepSeekV3Args, titan: str, hf: str) -> list[Transform]:
    """Latent attention's tensors and the block's norms. rope_interleave is true, so RoPE's rows are in Titan's order:
    nothing is permuted."""
    names = {**(QUERY_NAMES if args.q_lora_rank == 0 else LOW_RANK_QUERY_NAMES), **ATTENTION_NAMES}
    return [*(Same(f"{titan}.attention.{name}", f"{hf}.self_attn.{hf_name}") for name, hf_name in names.items()),
            *norm_transforms(titan, hf)]


def moe_transforms(args: DeepSeekV3Args, titan: str, hf: str) -> list[Transform]:
    """The router with its e_score_correction_bias (Titan's expert_bias), shared experts as one SwiGLU, and each
    routed expert's weights apart."""
    return [Same(f"{titan}.moe.router.expert_bias", f"{hf}.mlp.gate.e_score_correction_bias"),
            Same(f"{titan}.moe.router.gate.weight", f"{hf}.mlp.gate.weight"),
            *swiglu_transforms(f"{titan}.moe.shared_experts", f"{hf}.mlp.shared_experts"),
            *split_expert_transforms(titan, hf, args.moe.num_experts)]


def transforms(args: DeepSeekV3Args) -> list[Transform]:
    """Dense MLPs in the first first_k_dense_replace layers, mixtures of experts after them."""
    def block(titan: str, hf: str, layer_id: int) -> list[Transform]:
        if layer_id < args.first_k_dense_replace:
            return [*attention_transforms(args, titan, hf), *swiglu_transforms(f"{titan}.feed_forward", f"{hf}.mlp")]
        return [*attention_transforms(args, titan, hf), *moe_transforms(args, titan, hf)]
    return decoder_transforms(args, block)


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


def hf_mapping(args: DeepSeekV3Args) -> HFMapping:
    """DeepseekV3ForCausalLM routes by sigmoid scores: a softmax-routed flavor (16B, DeepSeek-V2-Lite's routing) has
    no transformers class here."""
    if args.moe.score_func != "sigmoid":
        raise ValueError(f"DeepseekV3ForCausalLM routes by sigmoid scores, and this DeepSeek-V3 flavor routes by "
                         f"{args.moe.score_func}: Titan has no Hugging Face class for it. Use a sigmoid-routed "
                         f"flavor (671B, debugmodel).")
    return HFMapping("DeepSeek-V3", "deepseek_v3", "DeepseekV3ForCausalLM", transforms=transforms,
                     config_fields=config_fields, hub_pads_vocab=True, unchecked_config_fields=unchecked_fields,
                     extra_layers="DeepSeek-V3's multi-token prediction modules, which DeepseekV3ForCausalLM skips",
                     not_exported={"mtp.": "the multi-token prediction modules train the model and are no part of "
                                           "DeepseekV3ForCausalLM"})
