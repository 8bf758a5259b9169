"""Titan <-> Hugging Face LlamaForCausalLM: parameter names, the RoPE row layout of wq/wk, vocab padding
and config.json.

RoPE layouts. Both rotate channel pairs of each head by position * freq_i, i < head_dim/2, but they pair
different channels:
  Titan (Meta, complex pairs): channels (2i, 2i+1),          out[2i] = x[2i] cos - x[2i+1] sin
  HF (rotate_half):            channels (i, i + head_dim/2), out[i]  = x[i] cos - x[i + head_dim/2] sin
So HF channel i is Titan channel 2i and HF channel i + head_dim/2 is Titan channel 2i+1: within each head,
HF row r*head_dim/2 + i of wq/wk is Titan row 2i + r (r = 0 real part, 1 imaginary part). Permuting the
output channels of q and k the same way leaves every q.k score unchanged; v and wo don't see RoPE.
"""

import json
from collections.abc import Mapping
from pathlib import Path

import torch
from torch import Tensor

from titan.checkpoint.safetensors import load_folder
from titan.config.errors import ConfigError
from titan.models.llama.args import ModelArgs, ffn_hidden_dim, padded_vocab_size
from titan.models.llama.model import Transformer

HF_CONFIG_FILE = "config.json"

# Titan FQN inside layers.{i} -> HF name inside model.layers.{i}, in Titan's state-dict order.
# SwiGLU w2(silu(w1 x) * w3 x): w1 is HF's gate, w3 its up and w2 its down projection.
LAYER_NAMES = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
# Titan pads these rows to padded_vocab_size; HF has exactly vocab_size rows.
VOCAB_FQNS = ("tok_embeddings.weight", "output.weight")
HF_EMBEDDING, HF_OUTPUT = "model.embed_tokens.weight", "lm_head.weight"


def hf_names(args: ModelArgs) -> dict[str, str]:
    """Titan FQN -> HF LlamaForCausalLM name for every parameter, in Titan's state-dict order."""
    names = {"tok_embeddings.weight": HF_EMBEDDING}
    for layer_id in range(args.n_layers):
        names.update({f"layers.{layer_id}.{titan}": f"model.layers.{layer_id}.{hf}"
                      for titan, hf in LAYER_NAMES.items()})
    names.update({"norm.weight": "model.norm.weight", "output.weight": HF_OUTPUT})
    return names


def titan_shapes(args: ModelArgs) -> dict[str, torch.Size]:
    """Shape of every tensor in a Titan state dict for `args`, read off a model built on meta."""
    with torch.device("meta"):
        model = Transformer(args)
    return {fqn: tensor.shape for fqn, tensor in model.state_dict().items()}


def hf_shapes(args: ModelArgs) -> dict[str, torch.Size]:
    """Shape of every tensor in the HF state dict for `args`: Titan's, with the vocab rows unpadded."""
    titan = titan_shapes(args)
    return {hf: torch.Size([args.vocab_size, args.dim]) if fqn in VOCAB_FQNS else titan[fqn]
            for fqn, hf in hf_names(args).items()}


def check_tensors(tensors: Mapping[str, Tensor], expected: dict[str, torch.Size], source: str) -> None:
    """Raise one ConfigError listing every missing, unexpected and wrongly shaped tensor in `tensors`."""
    problems = []
    missing = [name for name in expected if name not in tensors]
    unexpected = [name for name in tensors if name not in expected]
    if missing:
        problems.append(f"{source} lacks {len(missing)} tensors the model needs: {missing[:8]}"
                        f"{' ...' if len(missing) > 8 else ''}.")
    if unexpected:
        problems.append(f"{source} has {len(unexpected)} tensors the model doesn't have: {unexpected[:8]}"
                        f"{' ...' if len(unexpected) > 8 else ''}.")
    for name, shape in expected.items():
        if name in tensors and tensors[name].shape != shape:
            problems.append(f"{source} tensor {name} has shape {list(tensors[name].shape)}, but the model "
                            f"needs {list(shape)}.")
    if problems:
        problems.append("Check that --model.flavor and --model.tokenizer_path are the ones the checkpoint was "
                        "trained with.")
        raise ConfigError(problems)


def interleaved_to_rotate_half(weight: Tensor, num_heads: int) -> Tensor:
    """wq/wk rows from Titan's layout to HF's: within each head, row 2i + r moves to r * head_dim/2 + i."""
    rows, dim = weight.shape
    head_dim = rows // num_heads
    pairs = weight.reshape(num_heads, head_dim // 2, 2, dim)  # (heads, pair i, part r, dim)
    return pairs.transpose(1, 2).reshape(rows, dim)  # (heads, part r, pair i, dim) flattened to rows


def rotate_half_to_interleaved(weight: Tensor, num_heads: int) -> Tensor:
    """wq/wk rows from HF's layout back to Titan's: the inverse of interleaved_to_rotate_half."""
    rows, dim = weight.shape
    head_dim = rows // num_heads
    halves = weight.reshape(num_heads, 2, head_dim // 2, dim)  # (heads, part r, pair i, dim)
    return halves.transpose(1, 2).reshape(rows, dim)  # (heads, pair i, part r, dim) flattened to rows


def rope_heads(fqn: str, args: ModelArgs) -> int | None:
    """Number of heads whose rows need the RoPE permutation in the tensor `fqn`; None if it has no RoPE."""
    if fqn.endswith("attention.wq.weight"):
        return args.n_heads
    if fqn.endswith("attention.wk.weight"):
        return args.n_kv_heads
    return None


def to_hf_state_dict(state_dict: Mapping[str, Tensor], args: ModelArgs) -> dict[str, Tensor]:
    """A full (unsharded) Titan model state dict as a LlamaForCausalLM one: HF names, wq/wk rows in the
    rotate-half layout, embedding and output cut to the real vocab_size rows. Dtypes are kept."""
    check_tensors(state_dict, titan_shapes(args), "The Titan state dict")
    hf = {}
    for fqn, hf_name in hf_names(args).items():
        tensor = state_dict[fqn]
        heads = rope_heads(fqn, args)
        if heads is not None:
            tensor = interleaved_to_rotate_half(tensor, heads)
        elif fqn in VOCAB_FQNS:
            tensor = tensor[: args.vocab_size]
        hf[hf_name] = tensor
    return hf


def from_hf_state_dict(hf: Mapping[str, Tensor], args: ModelArgs) -> dict[str, Tensor]:
    """A LlamaForCausalLM state dict as a Titan one: the inverse of to_hf_state_dict. The padding rows of the
    embedding and output are zeros. Dtypes are kept."""
    check_tensors(hf, hf_shapes(args), "The Hugging Face state dict")
    padding_rows = padded_vocab_size(args.vocab_size, args.vocab_size_multiple_of) - args.vocab_size
    state_dict = {}
    for fqn, hf_name in hf_names(args).items():
        tensor = hf[hf_name]
        heads = rope_heads(fqn, args)
        if heads is not None:
            tensor = rotate_half_to_interleaved(tensor, heads)
        elif fqn in VOCAB_FQNS:
            tensor = torch.cat([tensor, tensor.new_zeros(padding_rows, args.dim)])
        state_dict[fqn] = tensor
    return state_dict


def hf_rope_scaling(args: ModelArgs) -> dict[str, float | int | str] | None:
    """The rope_scaling entry of config.json: HF's "llama3" rope type, or None for plain RoPE."""
    if args.rope_scaling is None:
        return None
    scaling = args.rope_scaling
    return {"rope_type": "llama3", "factor": scaling.factor, "low_freq_factor": scaling.low_freq_factor,
            "high_freq_factor": scaling.high_freq_factor,
            "original_max_position_embeddings": scaling.original_max_position_embeddings}


def hf_architecture(args: ModelArgs) -> dict:
    """The config.json fields that fix the weights' shapes and the model's math, other than RoPE's.
    (max_position_embeddings is not among them: a position's rotary angles don't depend on it.)"""
    return {
        "vocab_size": args.vocab_size,
        "hidden_size": args.dim,
        "intermediate_size": ffn_hidden_dim(args),
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads,
        "head_dim": args.dim // args.n_heads,
        "hidden_act": "silu",
        "rms_norm_eps": args.norm_eps,
        "attention_bias": False,
        "mlp_bias": False,
    }


def hf_config(args: ModelArgs, dtype: torch.dtype, bos_token_id: int, eos_token_id: int) -> dict:
    """config.json of a LlamaForCausalLM with Titan's shapes, in the layout of Meta's published Llama 3
    configs (rope_theta + rope_scaling), which transformers 4.x and 5.x both read. The output layer is
    untied, as Titan trains it. The token ids matter to transformers' generate(), whose defaults (1, 2)
    are Llama 2's."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **hf_architecture(args),
        "max_position_embeddings": args.max_seq_len,
        "rope_theta": args.rope_theta,
        "rope_scaling": hf_rope_scaling(args),
        "tie_word_embeddings": False,
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }


def read_rope(config: dict) -> tuple[float | None, dict | None]:
    """(rope_theta, llama3 scaling or None) from a config.json in either layout: transformers 4.x writes
    rope_theta and rope_scaling, 5.x writes one rope_parameters dict holding both."""
    if "rope_parameters" not in config:
        return config.get("rope_theta"), config.get("rope_scaling")
    parameters = dict(config["rope_parameters"] or {})
    theta = parameters.pop("rope_theta", None)
    return theta, (parameters if parameters.get("rope_type", "default") != "default" else None)


def check_hf_config(config: dict, args: ModelArgs, path: Path) -> None:
    """Raise one ConfigError naming every config.json field that disagrees with `args`. Fields the file
    leaves out are not checked."""
    problems = [f"{path} has {field} {config[field]!r}, but the Titan model args give {value!r}."
                for field, value in hf_architecture(args).items() if field in config and config[field] != value]
    theta, scaling = read_rope(config)
    if theta is not None and theta != args.rope_theta:
        problems.append(f"{path} has rope_theta {theta!r}, but the Titan model args give {args.rope_theta!r}.")
    if scaling != hf_rope_scaling(args):
        problems.append(f"{path} has RoPE scaling {scaling!r}, but the Titan model args give "
                        f"{hf_rope_scaling(args)!r}.")
    if problems:
        problems.append("Pick the --model.flavor and --model.tokenizer_path this checkpoint was made for.")
        raise ConfigError(problems)


def load_hf_weights(folder: str | Path, args: ModelArgs) -> dict[str, Tensor]:
    """A Titan state dict from a Hugging Face LlamaForCausalLM folder (safetensors, single or sharded),
    after checking its config.json, if there is one, against `args`."""
    folder = Path(folder)
    config_path = folder / HF_CONFIG_FILE
    config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    if config:
        check_hf_config(config, args, config_path)
    hf = load_folder(folder)
    # Tied checkpoints (Meta's Llama 3.2 1B and 3B) store only the embedding; Titan's output is its own copy.
    if config.get("tie_word_embeddings") and HF_OUTPUT not in hf:
        hf[HF_OUTPUT] = hf[HF_EMBEDDING]
    return from_hf_state_dict(hf, args)
