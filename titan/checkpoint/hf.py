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

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from titan.config.errors import ConfigError
from titan.models.llama.args import ModelArgs, ffn_hidden_dim
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


def check_shapes(shapes: Mapping[str, torch.Size], expected: dict[str, torch.Size], source: str,
                 files: Mapping[str, str] | None = None) -> None:
    """Raise one ConfigError listing every missing, unexpected and wrongly shaped tensor in `shapes` (name -> shape).
    `files` (name -> file name) says which file of a folder holds each tensor, for the user to check."""
    problems = []
    missing = [name for name in expected if name not in shapes]
    unexpected = [name for name in shapes if name not in expected]
    if missing:
        problems.append(f"{source} lacks {len(missing)} tensors the model needs: {missing[:8]}"
                        f"{' ...' if len(missing) > 8 else ''}.")
    if unexpected:
        problems.append(f"{source} has {len(unexpected)} tensors the model doesn't have: {unexpected[:8]}"
                        f"{' ...' if len(unexpected) > 8 else ''}.")
    for name, shape in expected.items():
        if name in shapes and tuple(shapes[name]) != tuple(shape):
            where = f" in {files[name]}" if files else ""
            problems.append(f"{source} tensor {name}{where} has shape {list(shapes[name])}, but the model "
                            f"needs {list(shape)}.")
    if problems:
        problems.append("Check that --model.flavor and --model.tokenizer_path are the ones the checkpoint was "
                        "trained with.")
        raise ConfigError(problems)


def rope_heads(fqn: str, args: ModelArgs) -> int | None:
    """Number of heads whose rows need the RoPE permutation in the tensor `fqn`; None if it has no RoPE."""
    if fqn.endswith("attention.wq.weight"):
        return args.n_heads
    if fqn.endswith("attention.wk.weight"):
        return args.n_kv_heads
    return None


def rotate_half_rows(rows: Tensor, head_dim: int) -> Tensor:
    """HF row of each Titan wq/wk row in `rows`: within its head, Titan row 2i + r is HF row r * head_dim/2 + i."""
    head, channel = rows // head_dim, rows % head_dim
    return head * head_dim + (channel % 2) * (head_dim // 2) + channel // 2


@dataclass(frozen=True)
class RowBlock:
    """HF rows hf_row, hf_row + 1, ... of a tensor hold the rows `local_rows` of a Titan chunk, in that order."""

    hf_row: int
    local_rows: Tensor  # int64 indices into the chunk's dim 0

    @property
    def contiguous_start(self) -> int | None:
        """The first local row if the local rows are consecutive (the block is a plain slice of the chunk). Every step
        is checked: a block of whole wq/wk heads also starts and ends at its chunk's ends, permuted in between."""
        steps = torch.diff(self.local_rows)
        return int(self.local_rows[0]) if bool((steps == 1).all()) else None


def row_blocks(fqn: str, first_row: int, num_rows: int, args: ModelArgs) -> list[RowBlock]:
    """Where rows [first_row, first_row + num_rows) of the Titan tensor `fqn` (one rank's chunk of it) lie in the HF
    tensor, as runs of consecutive HF rows. This is what lets each rank read and write only its own shard: FSDP and
    TP chunk every tensor into row ranges (TP's column shards keep all rows), and a row range maps to

    - itself, for tensors with the same layout in both;
    - itself cut at vocab_size, for the embedding and output, whose padding rows have no HF row;
    - at most three HF runs for wq/wk: the permutation stays inside a head, so whole heads map onto the same rows,
      and a head cut by the chunk's start or end splits into its even (first HF half) and odd (second half) rows.
    """
    end = first_row + num_rows
    if fqn in VOCAB_FQNS:
        end = min(end, args.vocab_size)
    if end <= first_row:
        return []
    rows = torch.arange(first_row, end)
    heads = rope_heads(fqn, args)
    if heads is None:
        return [RowBlock(first_row, rows - first_row)]
    hf_rows, local_rows = torch.sort(rotate_half_rows(rows, args.dim // args.n_heads))
    breaks = (torch.diff(hf_rows) != 1).nonzero().flatten() + 1  # where one run of consecutive HF rows ends
    return [RowBlock(int(run[0]), local) for run, local in zip(hf_rows.tensor_split(breaks),
                                                               local_rows.tensor_split(breaks))]


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
