"""Titan <-> Hugging Face causal LMs, each as its family's mapping describes its transformers class
(titan/models/<family>/hf.py: LlamaForCausalLM, Qwen3ForCausalLM, Qwen3MoeForCausalLM): parameter names, the RoPE row
layout of wq/wk (and of Qwen3's QK-norm), per-expert tensors, vocab rows and config.json.

RoPE layouts. Both rotate channel pairs of each head by position * freq_i, i < head_dim/2, but they pair
different channels:
  Titan (Meta, complex pairs): channels (2i, 2i+1),          out[2i] = x[2i] cos - x[2i+1] sin
  HF (rotate_half):            channels (i, i + head_dim/2), out[i]  = x[i] cos - x[i + head_dim/2] sin
So HF channel i is Titan channel 2i and HF channel i + head_dim/2 is Titan channel 2i+1: within each head,
HF row r*head_dim/2 + i of wq/wk is Titan row 2i + r (r = 0 real part, 1 imaginary part). Permuting the
output channels of q and k the same way leaves every q.k score unchanged; v and wo don't see RoPE. Qwen3's
q_norm/k_norm scale each channel of a head before the rotation, so their head_dim weights move the same way (an
RMS over a head doesn't depend on the channels' order).

Experts. Titan stacks a layer's experts into one (num_experts, rows, cols) tensor per projection; Qwen3-MoE
checkpoints on the hub store one tensor per expert (mlp.experts.<e>.gate_proj.weight ...), which is also what
transformers 5.x's save_pretrained writes back after fusing them at load time. hf_names keys expert e's matrix
of the Titan tensor `fqn` as `fqn[e]`, so every key maps to exactly one HF tensor.

Vocab rows. Titan pads the embedding and output to padded_vocab_size rows; those padding rows have no HF row.
Llama checkpoints hold exactly the tokenizer's rows. Qwen's hub checkpoints hold more (151,936 for a tokenizer of
151,669 tokens): import reads the first vocab_size rows (the tokenizer's; no id reaches the others, and Titan's
own padding rows stay zero), and export writes exactly vocab_size rows with config.json's vocab_size to match.
"""

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from titan.config.errors import ConfigError
from titan.models.common.args import DecoderArgs, YarnScaling
from titan.models.common.hf_mapping import HFMapping
from titan.models.families import family_of

HF_CONFIG_FILE = "config.json"

# Titan pads these rows to padded_vocab_size; HF has vocab_size rows (or more, see the module docstring).
VOCAB_FQNS = ("tok_embeddings.weight", "output.weight")
HF_EMBEDDING, HF_OUTPUT = "model.embed_tokens.weight", "lm_head.weight"


def hf_family(args: DecoderArgs) -> HFMapping:
    """The transformers class that holds a model of `args`, as its family maps it (titan/models/<family>/hf.py). A
    flavor that none holds is a ConfigError saying why."""
    try:
        return family_of(args).hf_mapping(args)
    except ValueError as error:
        raise ConfigError(f"{error} (--model.flavor)") from None


def expert_key(fqn: str, expert: int) -> str:
    """hf_names' key of expert `expert`'s matrix of the stacked Titan tensor `fqn`."""
    return f"{fqn}[{expert}]"


def titan_fqn(key: str) -> str:
    """The Titan FQN of an hf_names key: the key itself, or the stacked tensor an expert's key indexes."""
    return key.partition("[")[0]


def hf_names(args: DecoderArgs) -> dict[str, str]:
    """Key -> HF name of every HF tensor, in Titan's state-dict order. A key is a Titan FQN, or `fqn[e]` for expert
    e's matrix of a stacked expert tensor. A tied output has no key (HF stores only the embedding), nor does
    MoE's routing bias where the class has none (Qwen3-MoE's: auxiliary-loss-free balancing is Titan's), nor what
    the family's mapping does not export (DeepSeek-V3's multi-token prediction modules)."""
    family = hf_family(args)
    names = {"tok_embeddings.weight": HF_EMBEDDING}
    for layer_id in range(args.n_layers):
        titan_layer, hf_layer = f"layers.{layer_id}", f"model.layers.{layer_id}"
        dense = layer_id < family.num_dense_layers(args)
        layer_names = family.dense_layer_names if dense else family.layer_names
        num_experts = args.moe.num_experts if family.expert_names and not dense else 0
        names.update({f"{titan_layer}.{titan}": f"{hf_layer}.{hf}" for titan, hf in layer_names.items()})
        names.update({expert_key(f"{titan_layer}.{titan}", expert): f"{hf_layer}.{hf.format(expert=expert)}"
                      for titan, hf in family.expert_names.items() for expert in range(num_experts)})
    names["norm.weight"] = "model.norm.weight"
    if not args.tie_embeddings:
        names["output.weight"] = HF_OUTPUT
    return names


def titan_shapes(args: DecoderArgs) -> dict[str, torch.Size]:
    """Shape of every tensor in a Titan state dict for `args`, read off a model built on meta."""
    with torch.device("meta"):
        model = family_of(args).model(args)
    return {fqn: tensor.shape for fqn, tensor in model.state_dict().items()}


def hf_shapes(args: DecoderArgs, vocab_rows: int | None = None) -> dict[str, torch.Size]:
    """Shape of every tensor in the HF state dict for `args`: Titan's, with `vocab_rows` (default: vocab_size)
    rows for the embedding and output, and one (rows, cols) matrix per expert."""
    titan = titan_shapes(args)
    shapes = {}
    for key, hf in hf_names(args).items():
        fqn = titan_fqn(key)
        if fqn in VOCAB_FQNS:
            shapes[hf] = torch.Size([args.vocab_size if vocab_rows is None else vocab_rows, args.dim])
        else:
            shapes[hf] = titan[fqn][1:] if key != fqn else titan[fqn]
    return shapes


def hf_vocab_rows(config: dict, args: DecoderArgs) -> int:
    """The vocab rows the embedding and output of a folder with this config.json hold: vocab_size, or for a
    family whose hub pads its vocab, config.json's count (check_hf_config has checked it is not fewer)."""
    if hf_family(args).hub_pads_vocab:
        return config.get("vocab_size", args.vocab_size)
    return args.vocab_size


def raise_mismatches(problems: list[str]) -> None:
    """Raise one ConfigError listing `problems`, where a checkpoint disagrees with the model args, and the fix they
    share; return if there are none."""
    if problems:
        raise ConfigError([*problems, "Pick the --model.name, --model.flavor and --model.tokenizer_path this "
                                      "checkpoint was made for."])


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
    raise_mismatches(problems)


def rotate_half_rows(rows: Tensor, head_dim: int) -> Tensor:
    """HF row of each Titan wq/wk (or QK-norm) row in `rows`: within its head, Titan row 2i + r is HF row
    r * head_dim/2 + i."""
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


def row_blocks(key: str, first_row: int, num_rows: int, args: DecoderArgs) -> list[RowBlock]:
    """Where rows [first_row, first_row + num_rows) of the Titan tensor `key` (an hf_names key: one rank's chunk of
    it) lie in the HF tensor, as runs of consecutive HF rows. This is what lets each rank read and write only its own
    shard: FSDP and TP chunk every tensor into row ranges (TP's column shards keep all rows), and a row range maps to

    - itself, for tensors with the same layout in both (an expert's matrix among them);
    - itself cut at vocab_size, for the embedding and output, whose padding rows have no HF row;
    - at most three HF runs for wq/wk and the QK-norms: the permutation stays inside a head, so whole heads map onto
      the same rows, and a head cut by the chunk's start or end splits into its even (first HF half) and odd
      (second half) rows.
    """
    end = first_row + num_rows
    if key in VOCAB_FQNS:
        end = min(end, args.vocab_size)
    if end <= first_row:
        return []
    rows = torch.arange(first_row, end)
    if not key.endswith(hf_family(args).rope_rows):
        return [RowBlock(first_row, rows - first_row)]
    hf_rows, local_rows = torch.sort(rotate_half_rows(rows, args.head_dim))
    breaks = (torch.diff(hf_rows) != 1).nonzero().flatten() + 1  # where one run of consecutive HF rows ends
    return [RowBlock(int(run[0]), local) for run, local in zip(hf_rows.tensor_split(breaks),
                                                               local_rows.tensor_split(breaks))]


def hf_rope_scaling(args: DecoderArgs) -> dict[str, float | int | str] | None:
    """The rope_scaling entry of config.json: HF's "llama3" or "yarn" rope type, or None for plain RoPE (always, for
    Qwen3)."""
    scaling = args.rope_scaling
    if scaling is None:
        return None
    if isinstance(scaling, YarnScaling):
        return {"rope_type": "yarn", "factor": scaling.factor,
                "original_max_position_embeddings": scaling.original_max_position_embeddings,
                "beta_fast": scaling.beta_fast, "beta_slow": scaling.beta_slow, "mscale": scaling.mscale,
                "mscale_all_dim": scaling.mscale_all_dim}
    return {"rope_type": "llama3", "factor": scaling.factor, "low_freq_factor": scaling.low_freq_factor,
            "high_freq_factor": scaling.high_freq_factor,
            "original_max_position_embeddings": scaling.original_max_position_embeddings}


def same_rope_scaling(found: dict | None, expected: dict | None) -> bool:
    """Whether a config.json's scaling is `expected`: the published configs name the type "type" (DeepSeek-V3's),
    and transformers 5.x adds defaults of its own (yarn's truncate), which fix nothing Titan sets differently."""
    if found is None or expected is None:
        return found is expected
    kind = found.get("rope_type", found.get("type"))
    return kind == expected["rope_type"] and all(found.get(key) == value for key, value in expected.items()
                                                 if key != "rope_type")


def hf_architecture(args: DecoderArgs) -> dict:
    """The config.json fields that fix the weights' shapes and the model's math, other than RoPE's and vocab_size
    (check_hf_config checks those on their own). max_position_embeddings is not among them: a position's rotary
    angles don't depend on it, and a run may train on another context length than the checkpoint's."""
    return hf_family(args).config_fields(args)


def hf_config(args: DecoderArgs, dtype: torch.dtype, bos_token_id: int | None, eos_token_id: int) -> dict:
    """config.json of the family's transformers class with Titan's shapes, in the layout of the published configs
    (Meta's Llama 3, Qwen's Qwen3: rope_theta + rope_scaling), which transformers 4.x and 5.x both read. Llama's
    output layer is untied, as Titan trains it. The token ids matter to transformers' generate(), whose defaults
    (1, 2) are Llama 2's."""
    family = hf_family(args)
    config = {
        "architectures": [family.architecture],
        "model_type": family.model_type,
        "vocab_size": args.vocab_size,
        "tie_word_embeddings": args.tie_embeddings,
        **hf_architecture(args),
        **family.unchecked_config_fields(args),
        "max_position_embeddings": args.max_seq_len,
        "rope_theta": args.rope_theta,
        "rope_scaling": hf_rope_scaling(args),
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
    return config


def read_rope(config: dict) -> tuple[float | None, dict | None]:
    """(rope_theta, llama3 scaling or None) from a config.json in either layout: transformers 4.x writes
    rope_theta and rope_scaling, 5.x writes one rope_parameters dict holding both."""
    if "rope_parameters" not in config:
        return config.get("rope_theta"), config.get("rope_scaling")
    parameters = dict(config["rope_parameters"] or {})
    theta = parameters.pop("rope_theta", None)
    return theta, (parameters if parameters.get("rope_type", "default") != "default" else None)


# Fields that transformers 5.x writes under another name than the hub's configs (and 4.x) do.
CONFIG_ALIASES = {"num_experts": "num_local_experts"}


def config_field(config: dict, field: str) -> tuple[str, object] | None:
    """(the name config.json uses, its value) for `field`, under either name; None if the file leaves it out."""
    for name in (field, CONFIG_ALIASES.get(field, field)):
        if name in config:
            return name, config[name]
    return None


def check_vocab_size(config: dict, args: DecoderArgs, path: Path) -> str | None:
    """config.json's vocab_size must be the tokenizer's, or for a family whose hub pads the vocab, at least that."""
    if "vocab_size" not in config:
        return None
    rows, pads = config["vocab_size"], hf_family(args).hub_pads_vocab
    if rows == args.vocab_size or (pads and rows > args.vocab_size):
        return None
    return (f"{path} has vocab_size {rows!r}, but the Titan model args give {'at least ' if pads else ''}"
            f"{args.vocab_size!r} (the size of --model.tokenizer_path's tokenizer).")


def check_hf_config(config: dict, args: DecoderArgs, path: Path) -> None:
    """Raise one ConfigError naming every config.json field that disagrees with `args`. Fields the file
    leaves out are not checked."""
    problems = []
    for field, value in hf_architecture(args).items():
        found = config_field(config, field)
        if found is not None and found[1] != value:
            problems.append(f"{path} has {found[0]} {found[1]!r}, but the Titan model args give {value!r}.")
    vocab_problem = check_vocab_size(config, args, path)
    if vocab_problem is not None:
        problems.append(vocab_problem)
    theta, scaling = read_rope(config)
    if theta is not None and theta != args.rope_theta:
        problems.append(f"{path} has rope_theta {theta!r}, but the Titan model args give {args.rope_theta!r}.")
    if not same_rope_scaling(scaling, hf_rope_scaling(args)):
        problems.append(f"{path} has RoPE scaling {scaling!r}, but the Titan model args give "
                        f"{hf_rope_scaling(args)!r}.")
    raise_mismatches(problems)
