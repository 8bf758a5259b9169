"""Llama 3 as transformers' LlamaForCausalLM stores it: the shared modules' tensors, and config.json's fields."""

from titan.models.common.hf_mapping import (
    HFMapping,
    Transform,
    attention_transforms,
    decoder_config_fields,
    decoder_transforms,
    norm_transforms,
    swiglu_transforms,
)
from titan.models.llama.args import ModelArgs, ffn_hidden_dim


def llama_config_fields(args: ModelArgs) -> dict:
    return {**decoder_config_fields(args), "intermediate_size": ffn_hidden_dim(args), "mlp_bias": False}


def transforms(args: ModelArgs) -> list[Transform]:
    return decoder_transforms(args, lambda titan, hf, layer_id: [
        *attention_transforms(titan, hf, args.head_dim), *swiglu_transforms(f"{titan}.feed_forward", f"{hf}.mlp"),
        *norm_transforms(titan, hf)])


LLAMA_HF = HFMapping("Llama", "llama", "LlamaForCausalLM", transforms=transforms, config_fields=llama_config_fields)


def hf_mapping(args: ModelArgs) -> HFMapping:
    return LLAMA_HF
