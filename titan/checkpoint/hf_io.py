"""Hugging Face folders into and out of a (sharded) Titan model, through torch.distributed.checkpoint's Hugging Face
storage: each rank reads and writes only the rows of its own shards, and no rank ever holds the whole model.

Load (load_hf): inspect_folder checks the folder on every rank before any tensor data is read: config.json, the
index, every shard's header (through the `safetensors` package, which rejects truncated files, overlapping or
out-of-range offsets and oversized headers), and the names, shapes and dtypes of the weights, and picks the layout
the folder holds where the family's mapping allows several (GPT-OSS's experts in bf16 or MXFP4). HFLoadPlanner then
asks HuggingFaceStorageReader for the HF boxes of each local chunk (hf.load_steps): rows that are a slice of the
chunk land there directly (RoPE runs, each HF expert tensor in its slice of the stacked Titan tensor), the others
through a buffer of the box's size; vocab padding rows are zeroed, tensors without an HF counterpart (MoE's routing
bias) keep their values, and nothing but the chunk's own boxes is read.

Save (save_hf): HFSavePlanner hands each rank's rows to HuggingFaceStorageWriter in HF layout and the export dtype;
each rank writes its chunks under <folder>/sharded, then torch's consolidate_safetensors_files_on_every_rank builds
the output files, each file by one rank and one tensor at a time, and the sharded files are deleted. The peak on a
rank is its own chunks (twice: tensors and their serialised bytes) plus the largest tensor of a file it assembles.
"""

import dataclasses
import json
import shutil
from collections import Counter
from pathlib import Path
from typing import TypeVar

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors import SafetensorError, safe_open
from torch import Tensor
from torch.distributed.checkpoint import HuggingFaceStorageReader, HuggingFaceStorageWriter

# Public only as HuggingFaceStorageWriter(enable_consolidation=True), which consolidates on rank 0 alone; calling them
# directly spreads the output files over the ranks.
from torch.distributed.checkpoint._consolidate_hf_safetensors import (
    consolidate_safetensors_files,
    consolidate_safetensors_files_on_every_rank,
)
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import WriteResult
from torch.distributed.tensor import DTensor
from torch.futures import Future

from titan.checkpoint.hf import (
    HF_CONFIG_FILE,
    VOCAB_FQNS,
    Box,
    Chunk,
    HFTensor,
    LoadStep,
    SaveStep,
    check_hf_config,
    check_shapes,
    export_transforms,
    hf_config,
    hf_family,
    hf_tensors,
    hf_vocab_rows,
    import_transforms,
    load_steps,
    save_steps,
    titan_fqns,
)
from titan.config.errors import ConfigError
from titan.data.hf_tokenizer import write_hf_tokenizer
from titan.data.tokenizer import Tokenizer
from titan.metrics.log import logger
from titan.models.common.args import DecoderArgs
from titan.models.common.hf_mapping import HF_EMBEDDING, HF_OUTPUT, Transform, VocabRows
from titan.models.families import family_of
from titan.quant.float8.blockwise import expand_scales
from titan.quant.formats import E4M3

INDEX_FILE = "model.safetensors.index.json"
SHARDED_FOLDER = "sharded"
# transformers' save_pretrained default shard size ("5GB").
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9
# safetensors dtype names a weight may have: any float, converted to the model's dtype as it is read.
FLOAT_DTYPES = {"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2"}
CODE_DTYPES = {"U8"}
"""What quantized layouts store as codes (MXFP4's blocks and scales)."""
COPY_AGAIN = "Copy or download the folder again."
FP8_DTYPE = "F8_E4M3"
SCALE_SUFFIX = "_scale_inv"
"""What a blockwise FP8 weight's inverse scales are called: <weight name>_scale_inv (DeepSeek-V3's release)."""


def local_chunk(tensor: Tensor) -> Chunk:
    """This rank's part of `tensor` and where it starts in the full tensor: a DTensor's local shard (FSDP and TP
    shards are boxes, which DCP's own chunk protocol describes), or a plain tensor whole."""
    if isinstance(tensor, DTensor):
        (chunk,) = tensor.__create_chunk_list__()
        return tensor.to_local(), tuple(chunk.offsets)
    return tensor, (0,) * tensor.dim()


# ---- inspecting a folder before loading ----

def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ConfigError(f"{path} is not readable JSON ({error}). {COPY_AGAIN}") from None


def read_config(folder: Path, args: DecoderArgs) -> dict:
    """config.json ({} if the folder has none), checked to describe a model of Titan's family and shape."""
    path = folder / HF_CONFIG_FILE
    if not path.is_file():
        return {}
    config = read_json(path)
    family = hf_family(args)
    architectures = config.get("architectures") or [family.architecture]
    if config.get("model_type", family.model_type) != family.model_type or family.architecture not in architectures:
        raise ConfigError(f"{path} describes a {config.get('model_type')!r} model ({architectures}), not a "
                          f"{family.name} ({family.architecture}). Point --checkpoint.initial_load_path at a "
                          f"{family.name} folder, or pick the --model.name and --model.flavor of this one.")
    check_hf_config(config, args, path)
    return config


def weight_files(folder: Path) -> dict[Path, set[str] | None]:
    """The safetensors files to read, each with the tensor names the index puts in it (None without an index)."""
    if not folder.is_dir():
        raise ConfigError(f"Hugging Face folder {folder} does not exist. Pass a folder written by save_pretrained "
                          f"or by Titan (--checkpoint.last_save_in_hf, scripts/convert_to_hf.py).")
    present = sorted(folder.glob("*.safetensors"))
    index_path = folder / INDEX_FILE
    if not index_path.is_file():
        if len(present) != 1:
            raise ConfigError(f"{folder} has {len(present)} .safetensors files and no {INDEX_FILE}: expected one "
                              f"model.safetensors, or shards with their index. {COPY_AGAIN}")
        return {present[0]: None}
    weight_map = read_json(index_path).get("weight_map")
    if not isinstance(weight_map, dict):
        raise ConfigError(f"{index_path} has no weight_map. {COPY_AGAIN}")
    files: dict[Path, set[str] | None] = {}
    for name, file_name in weight_map.items():
        files.setdefault(folder / file_name, set()).add(name)
    missing = [path.name for path in files if not path.is_file()]
    if missing:
        raise ConfigError(f"{index_path} lists {missing}, which {'is' if len(missing) == 1 else 'are'} not in "
                          f"{folder}. Copy the missing shards, or the whole folder again.")
    stray = [path.name for path in present if path not in files]
    if stray:
        raise ConfigError(f"{folder} holds {stray}, which {INDEX_FILE} doesn't list (left over from another "
                          f"model?). Remove {'it' if len(stray) == 1 else 'them'} or copy the folder again.")
    return files


def read_headers(files: dict[Path, set[str] | None]) -> dict[str, tuple[Path, torch.Size, str]]:
    """HF name -> (file, shape, safetensors dtype) of every tensor, from the headers alone."""
    tensors: dict[str, tuple[Path, torch.Size, str]] = {}
    for path, listed in files.items():
        try:
            with safe_open(path, framework="pt") as f:
                for name in f.keys():
                    view = f.get_slice(name)
                    tensors[name] = (path, torch.Size(view.get_shape()), view.get_dtype())
        except (SafetensorError, OSError) as error:
            raise ConfigError(f"{path} is not a valid safetensors file ({error}): it is truncated or corrupt. "
                              f"{COPY_AGAIN}") from None
        held = {name for name, (file, _, _) in tensors.items() if file == path}
        if listed is not None and listed - held:
            raise ConfigError(f"{path.parent / INDEX_FILE} puts {sorted(listed - held)[:8]} in {path.name}, which "
                              f"doesn't hold them: the index is stale or the shard is from another model. "
                              f"{COPY_AGAIN}")
    return tensors


@dataclasses.dataclass(frozen=True)
class FP8Blocks:
    """A folder's blockwise FP8 weights (DeepSeek-V3's release, transformers' FineGrainedFP8Config): E4M3 weights
    with an fp32 inverse scale per block, `<name>_scale_inv` of shape (ceil(rows / block rows), ceil(cols / block
    columns)), which the import multiplies out."""

    block: tuple[int, int]
    """config.json's quantization_config weight_block_size: (rows, columns) per scale."""
    scales: dict[str, str]
    """Each FP8 weight's name -> its scale's."""


@dataclasses.dataclass(frozen=True)
class Inspected:
    """What an import of a checked folder reads."""

    transforms: list[Transform]
    """The transforms that fill the Titan tensors (hf.import_transforms, plus the output of a tied model)."""
    fp8: FP8Blocks | None
    """The folder's blockwise FP8 weights, dequantized as they are read; None where it holds none."""


def fp8_blocks(config: dict, tensors: dict[str, tuple[Path, torch.Size, str]], folder: Path) -> FP8Blocks | None:
    """The blockwise FP8 weights of a folder, checked against config.json's quantization_config (quant_method fp8,
    fmt e4m3, weight_block_size): every FP8 weight has its `_scale_inv`, of the grid its shape and the block size
    give; or None for a folder without (an unquantized one, or GPT-OSS's MXFP4 experts, which transforms read). One
    ConfigError names every problem."""
    quantization = config.get("quantization_config") or {}
    scale_names = sorted(name for name in tensors if name.endswith(SCALE_SUFFIX))
    if quantization.get("quant_method") != "fp8":
        if scale_names:
            raise ConfigError(f"{folder} holds blockwise FP8 scales ({scale_names[:2]} ...), but its "
                              f"{HF_CONFIG_FILE} has no quantization_config with quant_method \"fp8\" that says their "
                              f"block size. Copy the config.json of the release the weights come from.")
        return None
    where = f"{folder / HF_CONFIG_FILE} quantization_config"
    block = quantization.get("weight_block_size")
    problems = []
    if quantization.get("fmt", "e4m3") != "e4m3":
        problems.append(f"{where} has fmt {quantization['fmt']!r}: Titan reads E4M3 weights (fmt \"e4m3\", "
                        f"DeepSeek-V3's) only.")
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(n, int) and n > 0 for n in block)):
        raise ConfigError([*problems, f"{where} has weight_block_size {block!r}: blockwise FP8 weights need the "
                                      f"[rows, columns] of their scales' blocks ([128, 128] in DeepSeek-V3's)."])
    weights = {name: f"{name}{SCALE_SUFFIX}" for name, (_, _, dtype) in tensors.items() if dtype == FP8_DTYPE}
    missing = [name for name, scale in weights.items() if scale not in tensors]
    if missing:
        problems.append(f"{folder} has {len(missing)} FP8 weights without their scales: {missing[:8]}"
                        f"{' ...' if len(missing) > 8 else ''} (each needs <name>{SCALE_SUFFIX}).")
    orphans = [name for name in scale_names if name.removesuffix(SCALE_SUFFIX) not in weights]
    if orphans:
        problems.append(f"{folder} has scales of no FP8 weight: {orphans[:8]} (their weights are missing or not "
                        f"{FP8_DTYPE}).")
    for name, scale in weights.items():
        shape = tensors[name][1]
        if len(shape) != 2:
            problems.append(f"{folder} FP8 weight {name} has shape {list(shape)}: blockwise FP8 weights are matrices.")
        if scale not in tensors or len(shape) != 2:
            continue
        grid = [-(-size // step) for size, step in zip(shape, block)]
        if list(tensors[scale][1]) != grid:
            problems.append(f"{folder} scale {scale} has shape {list(tensors[scale][1])}, where weight_block_size "
                            f"{block} and the weight's {list(shape)} give {grid}.")
    if problems:
        raise ConfigError([*problems, COPY_AGAIN])
    logger.info(f"{folder} holds {len(weights)} blockwise FP8 weights (E4M3, {block[0]} x {block[1]} blocks): "
                f"Titan dequantizes them as it reads them.")
    return FP8Blocks((block[0], block[1]), weights)


def inspect_folder(folder: Path, args: DecoderArgs) -> Inspected:
    """Check a Hugging Face folder against `args` without reading tensor data, and return what an import reads. One
    ConfigError names every problem and its file."""
    config = read_config(folder, args)
    tensors = skip_extra_layers(read_headers(weight_files(folder)), args, folder)
    fp8 = fp8_blocks(config, tensors, folder)
    if fp8 is not None:  # the scales are no model tensors: their weights are
        scales = set(fp8.scales.values())
        tensors = {name: value for name, value in tensors.items() if name not in scales}
    transforms = import_transforms(args, tensors)
    # Tied checkpoints (Meta's Llama 3.2 1B and 3B, Qwen3 0.6B to 4B) store only the embedding. A tied Qwen3's
    # state dict lists output.weight too (the same tensor, or a copy where the caller built it apart); Titan's Llama
    # trains an output of its own, which starts as a copy.
    if args.tie_embeddings or (config.get("tie_word_embeddings") and HF_OUTPUT not in tensors):
        transforms = [t for t in transforms if not (isinstance(t, VocabRows) and t.fqn == "output.weight")]
        transforms.append(VocabRows("output.weight", HF_EMBEDDING))
    vocab_rows = hf_vocab_rows(config, args)
    if vocab_rows > args.vocab_size:
        logger.info(f"{folder} holds {vocab_rows} vocabulary rows; Titan reads the first {args.vocab_size}, the "
                    f"tokenizer's, and drops the others, which no token id reaches.")
    expected = hf_tensors(transforms, args, vocab_rows)
    check_shapes({name: shape for name, (_, shape, _) in tensors.items()},
                 {name: tensor.shape for name, tensor in expected.items()}, f"Hugging Face folder {folder}",
                 files={name: file.name for name, (file, _, _) in tensors.items()})
    wrong_dtypes = [f"{name} is {dtype} in {file.name}" for name, (file, _, dtype) in tensors.items()
                    if dtype not in dtypes_of(expected[name])]
    if wrong_dtypes:
        raise ConfigError(f"Hugging Face folder {folder} has weights whose dtype their layout does not hold: "
                          f"{'; '.join(wrong_dtypes[:8])}. {COPY_AGAIN}")
    return Inspected(transforms, fp8)


def dtypes_of(tensor: HFTensor) -> set[str]:
    """The safetensors dtypes a tensor may have: any float, converted to the model's dtype as it is read, or uint8
    codes for a quantized layout's."""
    return FLOAT_DTYPES if tensor.floating else CODE_DTYPES


T = TypeVar("T")


def skip_extra_layers(tensors: dict[str, T], args: DecoderArgs, folder: Path) -> dict[str, T]:
    """`tensors` (HF name -> anything) without those of layers numbered n_layers and up, where the family's mapping
    says what they hold and that its transformers class skips them (DeepSeek-V3's MTP layer); logs what it skipped."""
    extra = hf_family(args).extra_layers
    if extra is None:
        return tensors
    skipped = {name for name in tensors if layer_number(name) is not None and layer_number(name) >= args.n_layers}
    if skipped:
        layers = sorted({layer_number(name) for name in skipped})
        logger.info(f"{folder} has {len(skipped)} tensors in layers {layers} past the model's {args.n_layers}: "
                    f"{extra}. Titan skips them.")
    return {name: value for name, value in tensors.items() if name not in skipped}


def layer_number(name: str) -> int | None:
    """N of an HF name model.layers.N...., else None."""
    parts = name.split(".")
    return int(parts[2]) if len(parts) > 2 and parts[:2] == ["model", "layers"] and parts[2].isdigit() else None


# ---- loading ----

def dequantized(step: LoadStep, fp8: FP8Blocks, dtype: torch.dtype) -> LoadStep:
    """`step` reading an FP8 weight's box: its E4M3 values, and the inverse scales of the blocks the box touches (a
    shard's box may start or end inside a block), multiplied out in fp32 and handed on as `dtype` values."""
    (box,) = step.boxes  # every transform of a plain weight reads one box of it
    (first_row, first_column), (rows, columns) = box.offsets, box.lengths
    block_rows, block_columns = fp8.block
    first_scale = (first_row // block_rows, first_column // block_columns)
    last_scale = (-(-(first_row + rows) // block_rows), -(-(first_column + columns) // block_columns))
    scale_box = Box(fp8.scales[box.name], first_scale, (last_scale[0] - first_scale[0], last_scale[1] - first_scale[1]))
    into_block = (first_row - first_scale[0] * block_rows, first_column - first_scale[1] * block_columns)

    def place(buffers: list[Tensor]) -> None:
        data, scale_inv = buffers
        values = (data.float() * expand_scales(scale_inv, data.shape, block_rows, block_columns, into_block)).to(dtype)
        if step.target is not None:
            step.target.copy_(values)
        else:
            step.place([values])
    return LoadStep((box, scale_box), dtypes=(E4M3, torch.float32), place=place)


class HFLoadPlanner(DefaultLoadPlanner):
    """Reads, for every local chunk of the Titan state dict, the HF boxes that hold it (hf.load_steps), FP8 ones
    dequantized."""

    def __init__(self, state_dict: dict[str, Tensor], inspected: Inspected, args: DecoderArgs) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)  # the plan is built here, flat
        self.reads: list[ReadItem] = []
        self.steps: dict[MetadataIndex, tuple[LoadStep, int, Tensor]] = {}
        self.buffers: dict[int, list[Tensor | None]] = {}  # a step's buffers as they are read, by id(step)
        fp8 = inspected.fp8
        for transform in inspected.transforms:
            # A pipeline stage's state dict holds its own layers only.
            for fqn in (fqn for fqn in titan_fqns(transform) if fqn in state_dict):
                local, offsets = local_chunk(state_dict[fqn])
                for step in load_steps(transform, fqn, (local, offsets), args.vocab_size):
                    if fp8 is not None and step.boxes[0].name in fp8.scales:
                        step = dequantized(step, fp8, local.dtype)
                    self.add_reads(fqn, step, local)

    def add_reads(self, fqn: str, step: LoadStep, local: Tensor) -> None:
        for i, box in enumerate(step.boxes):
            # The destination index names the chunk (fqn) and the HF box it reads, unique among all reads.
            dest = MetadataIndex(f"{fqn}<-{box.name}", torch.Size(box.offsets))
            self.reads.append(ReadItem(type=LoadItemType.TENSOR, dest_index=dest,
                                       dest_offsets=torch.Size([0] * len(box.lengths)),
                                       storage_index=MetadataIndex(box.name, [0] * len(box.lengths)),
                                       storage_offsets=torch.Size(box.offsets), lengths=torch.Size(box.lengths)))
            self.steps[dest] = (step, i, local)
        if step.target is None:
            self.buffers[id(step)] = [None] * len(step.boxes)

    def create_local_plan(self) -> LoadPlan:
        return LoadPlan(self.reads)

    def resolve_tensor(self, read_item: ReadItem) -> Tensor:
        """Where the reader copies a box: the chunk itself where the step reads into it, else a buffer."""
        step, i, local = self.steps[read_item.dest_index]
        if step.target is not None:
            return step.target
        return torch.empty(read_item.lengths, dtype=step.dtypes[i] or local.dtype, device=local.device)

    def commit_tensor(self, read_item: ReadItem, tensor: Tensor) -> None:
        step, i, _ = self.steps[read_item.dest_index]
        if step.target is not None:
            return
        buffers = self.buffers[id(step)]
        buffers[i] = tensor
        if all(buffer is not None for buffer in buffers):
            step.place(buffers)
            del self.buffers[id(step)]


class BlockReader(HuggingFaceStorageReader):
    """HuggingFaceStorageReader that maps a file for one read at a time. The stock reader keeps each file mapped while
    it serves all of that file's reads, and every page a read touches stays in the rank's resident memory until then:
    for a column-sharded (TP) tensor that is all of its pages, and read-ahead maps neighbouring rows too. Mapping
    per read bounds the pages held to one row block, at most the largest tensor."""

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        for item in plan.items:
            boxes = tuple(slice(offset, offset + length) for offset, length in zip(item.storage_offsets, item.lengths))
            target = planner.resolve_tensor(item)
            with safe_open(self.storage_data[item.storage_index].relative_path, framework="pt") as f:
                target.copy_(f.get_slice(item.storage_index.fqn)[boxes])
            planner.commit_tensor(item, target)
        done: Future[None] = Future()
        done.set_result(None)
        return done


def load_hf(folder: Path, state_dict: dict[str, Tensor], args: DecoderArgs) -> None:
    """Fill `state_dict` (Titan FQN -> tensor or DTensor: this rank's share of the model) in place from the Hugging
    Face folder. Every rank calls this; each reads only its own rows. Entries without an HF tensor (a routing bias
    the class lacks, multi-token prediction modules) keep what they hold: the caller's initialised values."""
    inspected = inspect_folder(folder, args)
    loaded = {fqn for transform in inspected.transforms for fqn in titan_fqns(transform)}
    kept = sorted(fqn for fqn in state_dict if fqn not in loaded and fqn not in VOCAB_FQNS)
    if kept:
        logger.info(f"{len(kept)} tensors have no Hugging Face counterpart and keep their initial values: "
                    f"{kept[:4]}{' ...' if len(kept) > 4 else ''}")
    with torch.no_grad():
        dcp.load(state_dict, storage_reader=BlockReader(str(folder)),
                 planner=HFLoadPlanner(state_dict, inspected, args), no_dist=not dist.is_initialized())
        for fqn, tensor in state_dict.items():
            if fqn in VOCAB_FQNS:
                local, offsets = local_chunk(tensor)
                local[max(0, args.vocab_size - offsets[0]):].zero_()  # padding rows: no HF row, never trained


def read_hf_weights(folder: Path, args: DecoderArgs) -> dict[str, Tensor]:
    """The whole model as a float32 Titan state dict on this process, from a Hugging Face folder (the scripts); what
    the folder lacks (load_hf) as the family's init (seed 0) fills it."""
    family = family_of(args)
    with torch.device("meta"):
        model = family.model(args)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    family.init_weights(model, "cpu")
    state_dict = model.state_dict()
    load_hf(folder, state_dict, args)
    return state_dict


# ---- saving ----

class HFSavePlanner(DefaultSavePlanner):
    """Writes every local chunk of the Titan state dict as HF boxes (hf.save_steps) in `dtype`."""

    def __init__(self, state_dict: dict[str, Tensor], args: DecoderArgs, dtype: torch.dtype) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)  # the plan is built here, flat
        self.dtype = dtype
        self.writes: list[WriteItem] = []
        self.steps: dict[MetadataIndex, SaveStep] = {}
        transforms = export_transforms(args)
        shapes = {name: tensor.shape for name, tensor in hf_tensors(transforms, args).items()}
        for transform in transforms:
            if titan_fqns(transform)[0] not in state_dict:  # another pipeline stage's (its tensors are one block's)
                continue
            chunks = {fqn: local_chunk(state_dict[fqn]) for fqn in titan_fqns(transform)}
            for step in save_steps(transform, chunks, args.vocab_size):
                chunk = ChunkStorageMetadata(offsets=torch.Size(step.box.offsets), sizes=torch.Size(step.box.lengths))
                index = MetadataIndex(step.box.name, chunk.offsets)
                # A replicated tensor (a norm under TP) gives every rank the same index; DCP keeps one writer.
                self.writes.append(WriteItem(index=index, type=WriteItemType.SHARD, tensor_data=TensorWriteData(
                    chunk=chunk, properties=TensorProperties(dtype=dtype), size=shapes[step.box.name])))
                self.steps[index] = step

    def create_local_plan(self) -> SavePlan:
        self.plan = SavePlan(self.writes)
        return self.plan

    def resolve_data(self, write_item: WriteItem) -> Tensor:
        # MetadataIndex ignores the plan's index hint in == and hash.
        return self.steps[write_item.index].data().to(self.dtype).contiguous()


class ShardedHFWriter(HuggingFaceStorageWriter):
    """HuggingFaceStorageWriter(save_distributed=True) that takes several chunks of one tensor from one rank.

    The writer puts a rank's chunks into a safetensors file keyed by tensor name, so one file holds one chunk per
    tensor. A wq/wk shard that starts or ends inside a head has up to three (hf.rope_row_blocks), so the n-th chunk of
    each tensor goes to the rank's n-th file; consolidation reads chunks from any number of files.
    """

    def __init__(self, path: Path, fqn_to_index_mapping: dict[str, int]) -> None:
        super().__init__(str(path), fqn_to_index_mapping=fqn_to_index_mapping, save_distributed=True)

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        plans = super().prepare_global_plan(plans)
        return [dataclasses.replace(plan, storage_data={**plan.storage_data, "num_ranks": len(plans)})
                for plan in plans]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        layers: list[list[WriteItem]] = []
        seen: Counter[str] = Counter()
        for item in plan.items:
            layer = seen[item.index.fqn]
            seen[item.index.fqn] += 1
            if layer == len(layers):
                layers.append([])
            layers[layer].append(item)
        results: list[WriteResult] = []
        for layer, items in enumerate(layers):
            # shard_index counts ranks from 1; layers after the first take numbers past every rank's.
            shard_index = plan.storage_data["shard_index"] + layer * plan.storage_data["num_ranks"]
            storage_data = {**plan.storage_data, "shard_index": shard_index}
            results += super().write_data(dataclasses.replace(plan, items=items, storage_data=storage_data),
                                          planner).wait()
        written: Future[list[WriteResult]] = Future()
        written.set_result(results)
        return written


def file_indices(args: DecoderArgs, dtype: torch.dtype, max_shard_bytes: int) -> dict[str, int]:
    """HF name -> output file number (from 1), in HF order, starting a new file before one would pass
    max_shard_bytes (a larger tensor gets a file of its own), as save_pretrained shards."""
    indices: dict[str, int] = {}
    index, file_bytes = 1, 0
    for name, tensor in hf_tensors(export_transforms(args), args).items():
        size = tensor.shape.numel() * dtype.itemsize
        if file_bytes and file_bytes + size > max_shard_bytes:
            index, file_bytes = index + 1, 0
        indices[name] = index
        file_bytes += size
    return indices


def save_hf(state_dict: dict[str, Tensor], folder: Path, args: DecoderArgs, dtype: torch.dtype, tokenizer: Tokenizer,
            max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> None:
    """Write the Titan state dict (this rank's share, FQN -> tensor or DTensor) as a Hugging Face folder of the args'
    family: safetensors files in `dtype` with their index, config.json and the tokenizer files. Every rank calls this.
    A tied output, a routing bias the class lacks, and what the family's mapping does not export are left out
    (hf.export_transforms); the last is logged."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    for prefix, why in hf_family(args).not_exported.items():
        left_out = [fqn for fqn in state_dict if fqn.startswith(prefix)]
        if left_out:
            logger.info(f"The Hugging Face export leaves out the {len(left_out)} tensors under {prefix}*: {why}.")
    indices = file_indices(args, dtype, max_shard_bytes)
    sharded = folder / SHARDED_FOLDER
    with torch.no_grad():
        dcp.save(state_dict, storage_writer=ShardedHFWriter(sharded, indices),
                 planner=HFSavePlanner(state_dict, args, dtype), no_dist=not dist.is_initialized())
    if dist.is_initialized():
        # Each rank assembles some output files; rank 0 writes the index. Ends with a barrier, so every file is
        # complete before rank 0 cleans up.
        consolidate_safetensors_files_on_every_rank(str(sharded), str(folder), indices)
    else:
        consolidate_safetensors_files(str(sharded), str(folder), indices)
    if rank == 0:
        shutil.rmtree(sharded)
        config = hf_config(args, dtype, bos_token_id=tokenizer.bos_id, eos_token_id=tokenizer.eos_id)
        (folder / HF_CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
        write_hf_tokenizer(tokenizer, folder)
