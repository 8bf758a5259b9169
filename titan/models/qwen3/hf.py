"""Qwen3 as transformers stores it: Qwen3ForCausalLM for the dense flavors, Qwen3MoeForCausalLM where every block is
a mixture of experts (Titan's Qwen3 has no dense blocks between them); the QK-norms' weights, like wq's and wk's rows,
are in RoPE's channel order."""

from titan.models.common.hf_mapping import (
    HFMapping,
    RopeRows,
    Same,
    Transform,
    attention_transforms,
    decoder_config_fields,
    decoder_transforms,
    norm_transforms,
    split_expert_transforms,
    swiglu_transforms,
)
from titan.models.qwen3.args import Qwen3Args


def qk_norm_transforms(titan: str, hf: str, head_dim: int) -> list[Transform]:
    """Qwen3's q_norm/k_norm scale each channel of a head before the rotation, so their head_dim weights move as wq's
    rows (an RMS over a head doesn't depend on the channels' order)."""
    return [RopeRows(f"{titan}.attention.{norm}.weight", f"{hf}.self_attn.{norm}.weight", head_dim)
            for norm in ("q_norm", "k_norm")]


def dense_transforms(args: Qwen3Args) -> list[Transform]:
    return decoder_transforms(args, lambda titan, hf, layer_id: [
        *attention_transforms(titan, hf, args.head_dim), *qk_norm_transforms(titan, hf, args.head_dim),
        *swiglu_transforms(f"{titan}.feed_forward", f"{hf}.mlp"), *norm_transforms(titan, hf)])


def moe_transforms(args: Qwen3Args) -> list[Transform]:
    """The router as mlp.gate, and each expert's weights apart. The routing bias (auxiliary-loss-free balancing) is
    Titan's own: Qwen3MoeForCausalLM has none."""
    return decoder_transforms(args, lambda titan, hf, layer_id: [
        *attention_transforms(titan, hf, args.head_dim), *qk_norm_transforms(titan, hf, args.head_dim),
        Same(f"{titan}.moe.router.gate.weight", f"{hf}.mlp.gate.weight"), *norm_transforms(titan, hf),
        *split_expert_transforms(titan, hf, args.moe.num_experts)])


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


QWEN3_HF = HFMapping("Qwen3", "qwen3", "Qwen3ForCausalLM", transforms=dense_transforms, config_fields=dense_fields,
                     hub_pads_vocab=True)
QWEN3_MOE_HF = HFMapping("Qwen3-MoE", "qwen3_moe", "Qwen3MoeForCausalLM", transforms=moe_transforms,
                         config_fields=moe_fields, hub_pads_vocab=True, unchecked_config_fields=moe_unchecked_fields)


def hf_mapping(args: Qwen3Args) -> HFMapping:
    return QWEN3_HF if args.moe is None else QWEN3_MOE_HF
