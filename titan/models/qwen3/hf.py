"""Qwen3 as transformers stores it: Qwen3ForCausalLM for the dense flavors, Qwen3MoeForCausalLM where every block is
a mixture of experts (Titan's Qwen3 has no dense blocks between them); the QK-norms' weights, like wq's and wk's rows,
are in RoPE's channel order."""

from titan.models.common.hf_mapping import (
    ATTENTION_NAMES,
    EXPERT_NAMES,
    FEED_FORWARD_NAMES,
    NORM_NAMES,
    ROPE_ROWS,
    ROUTER_NAMES,
    HFMapping,
    decoder_config_fields,
)
from titan.models.qwen3.args import Qwen3Args

QK_NORM_NAMES = {
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
}
# Qwen3's q_norm/k_norm scale each channel of a head before the rotation, so their head_dim weights move as wq's rows
# (an RMS over a head doesn't depend on the channels' order).
QWEN3_ROPE_ROWS = (*ROPE_ROWS, "attention.q_norm.weight", "attention.k_norm.weight")


def qwen3_fields(args: Qwen3Args) -> dict:
    """Titan's Qwen3 attends over the whole context in every layer, and a tied output has no matrix of its own."""
    return {**decoder_config_fields(args), "use_sliding_window": False, "tie_word_embeddings": args.tie_embeddings}


def dense_fields(args: Qwen3Args) -> dict:
    return {**qwen3_fields(args), "intermediate_size": args.hidden_dim}


def moe_fields(args: Qwen3Args) -> dict:
    """Every block is a mixture of experts (no dense mlp_only_layers), so intermediate_size, the dense MLP's, fixes
    nothing: it is among the unchecked fields."""
    return {**qwen3_fields(args), "num_experts": args.moe.num_experts, "num_experts_per_tok": args.moe.top_k,
            "moe_intermediate_size": args.moe.hidden_dim, "norm_topk_prob": args.moe.norm_topk_prob,
            "decoder_sparse_step": 1, "mlp_only_layers": []}


def moe_unchecked_fields(args: Qwen3Args) -> dict:
    """Every hub config has the dense MLP's size; the flavor keeps the hub config's value."""
    return {"intermediate_size": args.hidden_dim}


QWEN3_HF = HFMapping("Qwen3", "qwen3", "Qwen3ForCausalLM",
                     layer_names={**ATTENTION_NAMES, **QK_NORM_NAMES, **FEED_FORWARD_NAMES, **NORM_NAMES},
                     rope_rows=QWEN3_ROPE_ROWS, config_fields=dense_fields, hub_pads_vocab=True)
QWEN3_MOE_HF = HFMapping("Qwen3-MoE", "qwen3_moe", "Qwen3MoeForCausalLM",
                         layer_names={**ATTENTION_NAMES, **QK_NORM_NAMES, **ROUTER_NAMES, **NORM_NAMES},
                         rope_rows=QWEN3_ROPE_ROWS, config_fields=moe_fields, expert_names=EXPERT_NAMES,
                         hub_pads_vocab=True, unchecked_config_fields=moe_unchecked_fields)


def hf_mapping(args: Qwen3Args) -> HFMapping:
    return QWEN3_HF if args.moe is None else QWEN3_MOE_HF
