"""Titan <-> Hugging Face causal LMs, each as its family's mapping describes its transformers class
(titan/models/<family>/hf.py): config.json, and a list of tensor transforms (titan/models/common/hf_mapping.py) whose
reads and writes this module plans, chunk by chunk, so that each rank reads and writes only the rows of its own
shards (titan/checkpoint/hf_io.py runs the plans through DCP's Hugging Face storage).

A chunk is a rank's part of a Titan tensor: a box, its offsets in the whole tensor and its local shape (FSDP and TP
cut tensors into boxes; an FSDP-sharded stack of experts holds some experts whole). Each transform maps a chunk to
boxes of Hugging Face tensors:
- Same, VocabRows: the box itself (cut at vocab_size for the embedding and output: their padding rows have no HF row,
  and a hub checkpoint's extra rows, Qwen's 151,936 for 151,669 tokens, are never read).
- RopeRows: at most three runs of consecutive HF rows. Both layouts rotate channel pairs of each head:
    Titan (Meta, complex pairs): channels (2i, 2i+1),          out[2i] = x[2i] cos - x[2i+1] sin
    HF (rotate_half):            channels (i, i + head_dim/2), out[i]  = x[i] cos - x[i + head_dim/2] sin
  so within each head Titan row 2i + r is HF row r * head_dim/2 + i. Permuting the output channels of q and k the same
  way leaves every q.k score unchanged (v and wo don't see RoPE). The permutation stays inside a head: whole heads map
  onto the same rows, and a head cut by the chunk's start or end splits into its even and odd rows.
- ExpertSplit: one box per expert the chunk holds, that expert's matrix (Qwen3-MoE's and DeepSeek-V3's hub layout,
  which transformers 5.x's save_pretrained also writes back after fusing them at load time).
- Interleaved: one box of the merged tensor, its rows k times the chunk's, of which the chunk takes every k-th.
- MXFP4: the blocks and scales of the chunk's rows and 32-column groups, decoded with the OCP MX code of titan/quant.
"""

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from titan.config.errors import ConfigError
from titan.models.common.args import DecoderArgs, YarnScaling
from titan.models.common.hf_mapping import (
    MXFP4,
    ExpertSplit,
    HFMapping,
    Interleaved,
    OneOf,
    RopeRows,
    Same,
    Transform,
    VocabRows,
)
from titan.models.families import family_of
from titan.quant.formats import MX_BLOCK_SIZE
from titan.quant.mx.numerics import dequantize
from titan.quant.nvfp4.numerics import e2m1_values, unpack

HF_CONFIG_FILE = "config.json"

# Titan pads these rows to padded_vocab_size; HF has vocab_size rows (or more, see VocabRows).
VOCAB_FQNS = ("tok_embeddings.weight", "output.weight")
MXFP4_BLOCK_BYTES = MX_BLOCK_SIZE // 2  # two E2M1 codes a byte


def hf_family(args: DecoderArgs) -> HFMapping:
    """The transformers class that holds a model of `args`, as its family maps it (titan/models/<family>/hf.py). A
    flavor that none holds is a ConfigError saying why."""
    try:
        return family_of(args).hf_mapping(args)
    except ValueError as error:
        raise ConfigError(f"{error} (--model.flavor)") from None


# ---- the transforms of a model ----

def export_transforms(args: DecoderArgs) -> list[Transform]:
    """What an export writes: each transform of the family's mapping, the first of a OneOf's options."""
    return [transform.options[0] if isinstance(transform, OneOf) else transform
            for transform in hf_family(args).transforms(args)]


def import_transforms(args: DecoderArgs, present: Collection[str]) -> list[Transform]:
    """What an import of a folder holding the HF tensors `present` reads: of a OneOf, the first option whose tensors
    are all there (the class's own layout where an option is missing, so that the folder's check names what it
    lacks)."""
    transforms = []
    for transform in hf_family(args).transforms(args):
        if isinstance(transform, OneOf):
            held = [option for option in transform.options if set(hf_tensor_names(option)) <= set(present)]
            transform = (held or transform.options)[0]
        transforms.append(transform)
    return transforms


def titan_fqns(transform: Transform) -> tuple[str, ...]:
    """The Titan tensors a transform fills on import and reads on export."""
    return transform.fqns if isinstance(transform, (Interleaved, MXFP4)) else (transform.fqn,)


def hf_tensor_names(transform: Transform) -> list[str]:
    """The Hugging Face tensors a transform reads or writes."""
    if isinstance(transform, ExpertSplit):
        return [transform.hf.format(expert=expert) for expert in range(transform.num_experts)]
    if isinstance(transform, MXFP4):
        return [f"{transform.hf}_blocks", f"{transform.hf}_scales"]
    return [transform.hf]


def hf_names(args: DecoderArgs) -> list[str]:
    """Every tensor an export writes, in Titan's state-dict order."""
    return [name for transform in export_transforms(args) for name in hf_tensor_names(transform)]


@dataclass(frozen=True)
class HFTensor:
    """A Hugging Face tensor as a folder must hold it: its shape, and whether it is a float tensor (or uint8 codes)."""

    shape: torch.Size
    floating: bool = True


def titan_shapes(args: DecoderArgs) -> dict[str, torch.Size]:
    """Shape of every tensor in a Titan state dict for `args`, read off a model built on meta."""
    with torch.device("meta"):
        model = family_of(args).model(args)
    return {fqn: tensor.shape for fqn, tensor in model.state_dict().items()}


def transform_hf_tensors(transform: Transform, shapes: Mapping[str, torch.Size],
                         vocab_rows: int) -> dict[str, HFTensor]:
    """The HF tensors of a transform, given the Titan tensors' shapes, with `vocab_rows` rows for VocabRows."""
    if isinstance(transform, VocabRows):
        return {transform.hf: HFTensor(torch.Size([vocab_rows, *shapes[transform.fqn][1:]]))}
    if isinstance(transform, (Same, RopeRows)):
        return {transform.hf: HFTensor(shapes[transform.fqn])}
    if isinstance(transform, ExpertSplit):
        return {name: HFTensor(shapes[transform.fqn][1:]) for name in hf_tensor_names(transform)}
    first = shapes[transform.fqns[0]]
    rows = len(transform.fqns) * first[1]
    if isinstance(transform, Interleaved):
        return {transform.hf: HFTensor(torch.Size([first[0], *first[2:], rows]))}
    groups = first[2] // MX_BLOCK_SIZE
    blocks, scales = hf_tensor_names(transform)
    return {blocks: HFTensor(torch.Size([first[0], rows, groups, MXFP4_BLOCK_BYTES]), floating=False),
            scales: HFTensor(torch.Size([first[0], rows, groups]), floating=False)}


def hf_tensors(transforms: list[Transform], args: DecoderArgs,
               vocab_rows: int | None = None) -> dict[str, HFTensor]:
    """Every HF tensor of `transforms`, in their order, with `vocab_rows` (default: vocab_size) embedding and output
    rows."""
    shapes = titan_shapes(args)
    tensors: dict[str, HFTensor] = {}
    for transform in transforms:
        tensors.update(transform_hf_tensors(transform, shapes, args.vocab_size if vocab_rows is None else vocab_rows))
    return tensors


def hf_shapes(args: DecoderArgs) -> dict[str, torch.Size]:
    """Shape of every tensor an export writes, in its order."""
    return {name: tensor.shape for name, tensor in hf_tensors(export_transforms(args), args).items()}


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


# ---- reads and writes of a chunk ----

@dataclass(frozen=True)
class Box:
    """A box of the Hugging Face tensor `name`: where it starts in each dim, and its size there."""

    name: str
    offsets: tuple[int, ...]
    lengths: tuple[int, ...]


@dataclass(frozen=True)
class LoadStep:
    """Reads that fill part of a chunk: one box straight into `target` (a view of the chunk), or boxes into buffers
    of `dtypes` (None: the chunk's) that `place` then puts into the chunk."""

    boxes: tuple[Box, ...]
    target: Tensor | None = None
    dtypes: tuple[torch.dtype | None, ...] = (None,)
    place: Callable[[list[Tensor]], None] | None = None


@dataclass(frozen=True)
class SaveStep:
    """A write: the box, and the chunk's values for it in HF layout (computed when the writer asks)."""

    box: Box
    data: Callable[[], Tensor]


Chunk = tuple[Tensor, tuple[int, ...]]
"""A rank's part of a Titan tensor and where it starts in the whole tensor."""


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


def rope_row_blocks(first_row: int, num_rows: int, head_dim: int) -> list[RowBlock]:
    """Where rows [first_row, first_row + num_rows) of a RopeRows tensor lie in the HF tensor, as runs of consecutive
    HF rows: at most three, since whole heads map onto their own rows."""
    rows = torch.arange(first_row, first_row + num_rows)
    hf_rows, local_rows = torch.sort(rotate_half_rows(rows, head_dim))
    breaks = (torch.diff(hf_rows) != 1).nonzero().flatten() + 1  # where one run of consecutive HF rows ends
    return [RowBlock(int(run[0]), local) for run, local in zip(hf_rows.tensor_split(breaks),
                                                               local_rows.tensor_split(breaks))]


def kept_rows(transform: Transform, first_row: int, num_rows: int, vocab_size: int) -> int:
    """How many of a chunk's rows have HF rows: VocabRows' stop at vocab_size, every other transform's don't."""
    if isinstance(transform, VocabRows):
        return max(0, min(num_rows, vocab_size - first_row))
    return num_rows


def load_steps(transform: Transform, fqn: str, chunk: Chunk, vocab_size: int) -> list[LoadStep]:
    """The reads that fill the chunk of Titan tensor `fqn` (one of transform's) from the HF tensors."""
    local, offsets = chunk
    if local.numel() == 0:
        return []
    if isinstance(transform, (Same, VocabRows)):
        rows = kept_rows(transform, offsets[0], local.size(0), vocab_size)
        return [LoadStep((Box(transform.hf, offsets, (rows, *local.shape[1:])),), target=local[:rows])] if rows else []
    if isinstance(transform, RopeRows):
        return [rope_load_step(transform.hf, block, chunk) for block in
                rope_row_blocks(offsets[0], local.size(0), transform.head_dim)]
    if isinstance(transform, ExpertSplit):
        return [LoadStep((Box(transform.hf.format(expert=offsets[0] + i), offsets[1:], tuple(matrix.shape)),),
                         target=matrix) for i, matrix in enumerate(local.unbind(0))]
    phase, stride = transform.fqns.index(fqn), len(transform.fqns)
    if isinstance(transform, Interleaved):
        box = Box(transform.hf, (offsets[0], *offsets[2:], stride * offsets[1]),
                  (local.size(0), *local.shape[2:], stride * local.size(1)))

        def place_interleaved(buffers: list[Tensor]) -> None:
            local.copy_(buffers[0][..., phase::stride].movedim(-1, 1))
        return [LoadStep((box,), place=place_interleaved)]
    return [mxfp4_load_step(transform, phase, stride, chunk)]


def rope_load_step(hf: str, block: RowBlock, chunk: Chunk) -> LoadStep:
    """A run of RopeRows' HF rows: straight into the chunk where its rows are a slice of it, else through a buffer."""
    local, offsets = chunk
    box = Box(hf, (block.hf_row, *offsets[1:]), (len(block.local_rows), *local.shape[1:]))
    start = block.contiguous_start
    if start is not None:
        return LoadStep((box,), target=local.narrow(0, start, len(block.local_rows)))

    def place(buffers: list[Tensor]) -> None:
        local.index_copy_(0, block.local_rows.to(local.device), buffers[0])
    return LoadStep((box,), place=place)


def mxfp4_load_step(transform: MXFP4, phase: int, stride: int, chunk: Chunk) -> LoadStep:
    """The blocks and scales of the chunk's experts, its rows' interleaved HF rows and the 32-column groups its
    columns lie in, dequantized, and the chunk's rows and columns of them."""
    local, (first_expert, first_row, first_column) = chunk
    num_experts, num_rows, num_columns = local.shape
    first_group = first_column // MX_BLOCK_SIZE
    num_groups = -(-(first_column + num_columns) // MX_BLOCK_SIZE) - first_group
    blocks_name, scales_name = hf_tensor_names(transform)
    starts, lengths = (first_expert, stride * first_row, first_group), (num_experts, stride * num_rows, num_groups)
    boxes = (Box(blocks_name, (*starts, 0), (*lengths, MXFP4_BLOCK_BYTES)), Box(scales_name, starts, lengths))

    def place(buffers: list[Tensor]) -> None:
        blocks, scales = buffers
        values = dequantize(scales, e2m1_values(unpack(blocks)).flatten(-2))  # (experts, rows, groups x 32) fp32
        skip = first_column - first_group * MX_BLOCK_SIZE
        local.copy_(values[:, phase::stride, skip:skip + num_columns])
    return LoadStep(boxes, dtypes=(torch.uint8, torch.uint8), place=place)


def save_steps(transform: Transform, chunks: Mapping[str, Chunk], vocab_size: int) -> list[SaveStep]:
    """The writes of a transform's HF tensors from the chunks of its Titan tensors (all of one layout, where there
    are several: they are sharded alike)."""
    if isinstance(transform, MXFP4):
        raise ValueError(f"{transform.hf}: MXFP4 is an import-only layout; exports write the class's own.")
    local, offsets = chunks[titan_fqns(transform)[0]]
    if local.numel() == 0:
        return []
    if isinstance(transform, (Same, VocabRows)):
        rows = kept_rows(transform, offsets[0], local.size(0), vocab_size)
        return [SaveStep(Box(transform.hf, offsets, (rows, *local.shape[1:])), lambda: local[:rows])] if rows else []
    if isinstance(transform, RopeRows):
        return [rope_save_step(transform.hf, block, (local, offsets))
                for block in rope_row_blocks(offsets[0], local.size(0), transform.head_dim)]
    if isinstance(transform, ExpertSplit):
        return [SaveStep(Box(transform.hf.format(expert=offsets[0] + i), offsets[1:], tuple(matrix.shape)),
                         lambda matrix=matrix: matrix) for i, matrix in enumerate(local.unbind(0))]
    stride = len(transform.fqns)
    box = Box(transform.hf, (offsets[0], *offsets[2:], stride * offsets[1]),
              (local.size(0), *local.shape[2:], stride * local.size(1)))
    # (experts, ..., rows, stride) -> (experts, ..., rows x stride): row i of tensor j at i x stride + j.
    return [SaveStep(box, lambda: torch.stack([chunks[fqn][0].movedim(1, -1) for fqn in transform.fqns],
                                              dim=-1).flatten(-2))]


def rope_save_step(hf: str, block: RowBlock, chunk: Chunk) -> SaveStep:
    local, offsets = chunk
    box = Box(hf, (block.hf_row, *offsets[1:]), (len(block.local_rows), *local.shape[1:]))
    start = block.contiguous_start
    if start is not None:
        return SaveStep(box, lambda: local.narrow(0, start, len(block.local_rows)))
    return SaveStep(box, lambda: local.index_select(0, block.local_rows.to(local.device)))


def hf_rope_scaling(args: DecoderArgs) -> dict[str, float | int | str] | None:
    """The rope_scaling entry of config.json: the family's own where its class writes its own keys, else HF's "llama3"
    or "yarn" rope type, or None for plain RoPE (always, for Qwen3)."""
    family_scaling = hf_family(args).rope_scaling
    if family_scaling is not None:
        return family_scaling(args)
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
