"""Llama 3 as transformers' LlamaForCausalLM stores it: the shared modules' names, and config.json's fields."""

from titan.models.common.hf_mapping import (
    ATTENTION_NAMES,
    FEED_FORWARD_NAMES,
    NORM_NAMES,
    ROPE_ROWS,
    HFMapping,
    decoder_config_fields,
)
from titan.models.llama.args import ModelArgs, ffn_hidden_dim


def llama_config_fields(args: ModelArgs) -> dict:
    return {**decoder_config_fields(args), "intermediate_size": ffn_hidden_dim(args), "mlp_bias": False}


LLAMA_HF = HFMapping("Llama", "llama", "LlamaForCausalLM", layer_names={**ATTENTION_NAMES, **FEED_FORWARD_NAMES,
                                                                        **NORM_NAMES},
                     rope_rows=ROPE_ROWS, config_fields=llama_config_fields)


def hf_mapping(args: ModelArgs) -> HFMapping:
    return LLAMA_HF
