"""GPT-OSS as transformers' GptOssForCausalLM stores it. Attention as the shared one (rotate-half RoPE: wq's and wk's
rows and biases permuted) with its sinks; the router as mlp.router; the experts fused as transformers holds them,
(experts, in, out) with gate and up interleaved in gate_up_proj (Titan's w1 and w3), or as the release stores them,
MXFP4 blocks and scales, which an import dequantizes. config.json's rope_scaling is the release's own (YaRN,
truncate false, no mscale fields)."""

from titan.models.common.hf_mapping import (
    MXFP4,
    HFMapping,
    Interleaved,
    OneOf,
    Same,
    Transform,
    attention_transforms,
    decoder_config_fields,
    decoder_transforms,
    norm_transforms,
)
from titan.models.gpt_oss.args import GptOssArgs


def expert_transforms(titan: str, hf: str) -> list[Transform]:
    """The router and the experts of block `titan` as HF's mlp in `hf`."""
    experts, hf_experts = f"{titan}.moe.experts", f"{hf}.mlp.experts"
    gate_up, down = (f"{experts}.w1", f"{experts}.w3"), (f"{experts}.w2",)
    return [Same(f"{titan}.moe.router.gate.weight", f"{hf}.mlp.router.weight"),
            Same(f"{titan}.moe.router.gate.bias", f"{hf}.mlp.router.bias"),
            OneOf((Interleaved(gate_up, f"{hf_experts}.gate_up_proj"), MXFP4(gate_up, f"{hf_experts}.gate_up_proj"))),
            Interleaved((f"{experts}.w1_bias", f"{experts}.w3_bias"), f"{hf_experts}.gate_up_proj_bias"),
            OneOf((Interleaved(down, f"{hf_experts}.down_proj"), MXFP4(down, f"{hf_experts}.down_proj"))),
            Same(f"{experts}.w2_bias", f"{hf_experts}.down_proj_bias")]


def transforms(args: GptOssArgs) -> list[Transform]:
    return decoder_transforms(args, lambda titan, hf, layer_id: [
        *attention_transforms(titan, hf, args.head_dim, bias=True),
        Same(f"{titan}.attention.sinks", f"{hf}.self_attn.sinks"),
        *expert_transforms(titan, hf), *norm_transforms(titan, hf)])


def layer_types(args: GptOssArgs) -> list[str]:
    return ["sliding_attention" if args.layer_attention(layer_id).window is not None else "full_attention"
            for layer_id in range(args.n_layers)]


def config_fields(args: GptOssArgs) -> dict:
    moe, swiglu = args.moe, args.moe.expert_function
    return {**decoder_config_fields(args), "attention_bias": True, "num_local_experts": moe.num_experts,
            "num_experts_per_tok": moe.top_k, "intermediate_size": moe.hidden_dim,
            "sliding_window": args.sliding_window, "layer_types": layer_types(args),
            "swiglu_limit": swiglu.limit, "swiglu_alpha": swiglu.alpha}


def rope_scaling(args: GptOssArgs) -> dict:
    """The release's rope_scaling: YaRN without mscale fields, which transformers reads as Titan's mscale 1 over
    mscale_all_dim 0 (titan/models/gpt_oss/args.py)."""
    yarn = args.rope_scaling
    return {"rope_type": "yarn", "factor": yarn.factor, "beta_fast": yarn.beta_fast, "beta_slow": yarn.beta_slow,
            "original_max_position_embeddings": yarn.original_max_position_embeddings, "truncate": yarn.truncate}


GPT_OSS_HF = HFMapping("GPT-OSS", "gpt_oss", "GptOssForCausalLM", transforms=transforms, config_fields=config_fields,
                       rope_scaling=rope_scaling)


def hf_mapping(args: GptOssArgs) -> HFMapping:
    return GPT_OSS_HF
