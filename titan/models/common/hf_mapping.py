"""A family's model as its Hugging Face transformers class stores it, as data: parameter names, which tensors hold
rows in RoPE's channel order, and the config.json fields. titan/checkpoint/hf.py converts both ways with a family's
mapping and names no family itself."""

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from titan.models.common.args import DecoderArgs

# Titan FQN inside layers.{i} -> HF name inside model.layers.{i}, in Titan's state-dict order, for the shared modules.
ATTENTION_NAMES = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
}
# SwiGLU w2(silu(w1 x) * w3 x): w1 is HF's gate, w3 its up and w2 its down projection (in Titan's order).
SWIGLU_PROJECTIONS = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}


def swiglu_names(titan_prefix: str, hf_prefix: str) -> dict[str, str]:
    """A SwiGLU feed-forward's weights, Titan's `titan_prefix`.w1.weight ... -> HF's `hf_prefix`.gate_proj.weight ..."""
    return {f"{titan_prefix}.{w}.weight": f"{hf_prefix}.{projection}.weight"
            for w, projection in SWIGLU_PROJECTIONS.items()}


FEED_FORWARD_NAMES = swiglu_names("feed_forward", "mlp")
NORM_NAMES = {
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
ROUTER_NAMES = {"moe.router.gate.weight": "mlp.gate.weight"}
# Stacked Titan tensor (num_experts, rows, cols) inside layers.{i} -> HF name of expert {expert}'s (rows, cols).
EXPERT_NAMES = {f"moe.experts.{w}": f"mlp.experts.{{expert}}.{projection}.weight"
                for w, projection in SWIGLU_PROJECTIONS.items()}
ROPE_ROWS = ("attention.wq.weight", "attention.wk.weight")
"""The shared attention's tensors whose rows (of each head) are in RoPE's channel order."""


def decoder_config_fields(args: DecoderArgs) -> dict:
    """The config.json fields of the shared decoder's shapes and math, as every family's transformers class names
    them."""
    return {
        "hidden_size": args.dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads,
        "head_dim": args.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": args.norm_eps,
        "attention_bias": False,
    }


def no_fields(args: DecoderArgs) -> dict:
    return {}


def no_layers(args: DecoderArgs) -> int:
    return 0


@dataclass(frozen=True)
class HFMapping:
    """One transformers class of a family (a family may have several: Qwen3 dense and Qwen3-MoE)."""

    name: str
    """For messages: "Llama", "Qwen3", "Qwen3-MoE"."""
    model_type: str
    architecture: str
    layer_names: Mapping[str, str]
    """Titan FQN inside layers.{i} -> HF name inside model.layers.{i}, in Titan's state-dict order."""
    rope_rows: tuple[str, ...]
    """FQN suffixes of the tensors whose rows (of each head) are in RoPE's channel order: Titan's interleaved pairs,
    HF's halves."""
    config_fields: Callable[[Any], dict]
    """The config.json fields, from the args, that fix the weights' shapes and the model's math (RoPE's and
    vocab_size aside): written on export, checked on import."""
    expert_names: Mapping[str, str] = field(default_factory=dict)
    """Stacked Titan tensor inside layers.{i} -> HF name of expert {expert}'s matrix."""
    hub_pads_vocab: bool = False
    """Its hub checkpoints may hold more vocab rows than the tokenizer has tokens."""
    unchecked_config_fields: Callable[[Any], dict] = no_fields
    """Fields that exports write, as the published configs have them, but that fix nothing, so imports don't check."""
    dense_layer_names: Mapping[str, str] = field(default_factory=dict)
    """The names of the first num_dense_layers(args) layers instead of layer_names, where a family puts dense blocks
    before its mixtures of experts (DeepSeek-V3); they have no experts."""
    num_dense_layers: Callable[[Any], int] = no_layers
    extra_layers: str | None = None
    """What the layers numbered n_layers and up of a hub checkpoint hold, which the transformers class skips (an
    import skips them too, and logs this); None: such tensors are an error, as any tensor the model lacks."""
    not_exported: Mapping[str, str] = field(default_factory=dict)
    """Titan FQN prefix -> why the transformers class has no such tensors: an export leaves them out, and logs it."""
