"""Read and write the safetensors format, and Hugging Face's single-file or sharded folders of it.

A safetensors file is: an 8-byte little-endian u64 N, then N bytes of JSON header, then the tensor bytes.
The header maps each tensor name to {"dtype", "shape", "data_offsets": [begin, end)}, offsets counted from
the first byte after the header, and may hold a "__metadata__" map of strings to strings. Tensors are
stored contiguous, row-major, little-endian, back to back with no gaps. The header is padded with spaces so
the data starts 8-byte aligned. Written from the format description, without the `safetensors` package.
Tensor bytes are taken in the host's byte order: little-endian on every platform torch ships for.
"""

import json
import struct
from pathlib import Path
from typing import BinaryIO

import torch
from torch import Tensor

from titan.config.errors import ConfigError

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
DTYPE_NAMES: dict[torch.dtype, str] = {dtype: name for name, dtype in DTYPES.items()}

HEADER_LENGTH_BYTES = 8
HEADER_ALIGNMENT = 8
METADATA_KEY = "__metadata__"

# Hugging Face's folder layout (transformers' save_pretrained): one file, or numbered shards plus an index.
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# transformers refuses safetensors files whose "format" metadata is not a framework it knows.
HF_FILE_METADATA = {"format": "pt"}


def tensor_bytes(tensor: Tensor) -> Tensor:
    """The tensor's bytes as a flat uint8 CPU tensor, in row-major order."""
    return tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def storage_order(tensors: dict[str, Tensor]) -> list[tuple[str, Tensor]]:
    """Tensors largest element size first, then by name. With the data starting 8-byte aligned, this starts
    every tensor at a multiple of its element size, so readers can map it in place; it is also the order the
    `safetensors` package writes, so single-dtype files come out byte-identical."""
    return sorted(tensors.items(), key=lambda item: (-item[1].element_size(), item[0]))


def build_header(tensors: list[tuple[str, Tensor]], metadata: dict[str, str] | None) -> bytes:
    """The JSON header for `tensors` stored back to back in this order, padded with spaces to a multiple
    of HEADER_ALIGNMENT bytes."""
    header: dict[str, object] = {}
    if metadata is not None:
        bad = [key for key, value in metadata.items() if not (isinstance(key, str) and isinstance(value, str))]
        if bad:
            raise TypeError(f"safetensors metadata must map str to str; entries {bad} don't. Convert them "
                            f"with str() or json.dumps().")
        header[METADATA_KEY] = metadata
    offset = 0
    for name, tensor in tensors:
        if tensor.dtype not in DTYPE_NAMES:
            raise TypeError(f"Tensor {name!r} has dtype {tensor.dtype}, which safetensors can't store here. "
                            f"Supported: {sorted(str(d) for d in DTYPE_NAMES)}.")
        size = tensor.numel() * tensor.element_size()
        header[name] = {"dtype": DTYPE_NAMES[tensor.dtype], "shape": list(tensor.shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode("utf-8")
    return encoded + b" " * (-len(encoded) % HEADER_ALIGNMENT)


def save_file(tensors: dict[str, Tensor], path: str | Path, metadata: dict[str, str] | None = None) -> None:
    """Write `tensors` (any device, any strides) to one safetensors file at `path`."""
    ordered = storage_order(tensors)
    header = build_header(ordered, metadata)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header)))
        f.write(header)
        for _, tensor in ordered:
            f.write(tensor_bytes(tensor).numpy())


def read_header(f: BinaryIO, path: Path) -> tuple[dict, int]:
    """The parsed JSON header of an open safetensors file, and the file offset where the data starts."""
    file_size = path.stat().st_size
    length_bytes = f.read(HEADER_LENGTH_BYTES)
    if len(length_bytes) < HEADER_LENGTH_BYTES:
        raise ConfigError(f"{path} is too short ({file_size} bytes) to be a safetensors file.")
    (header_length,) = struct.unpack("<Q", length_bytes)
    if header_length > file_size - HEADER_LENGTH_BYTES:
        raise ConfigError(f"{path} declares a {header_length}-byte header but has only {file_size} bytes: "
                         f"the file is truncated or not safetensors.")
    try:
        header = json.loads(f.read(header_length))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{path} has a header that is not valid JSON ({e}): the file is corrupt or not "
                         f"safetensors.") from None
    return header, HEADER_LENGTH_BYTES + header_length


def read_tensor(f: BinaryIO, data_start: int, name: str, entry: dict, path: Path) -> Tensor:
    """Read one tensor described by its header `entry` from an open safetensors file."""
    if entry["dtype"] not in DTYPES:
        raise ConfigError(f"Tensor {name!r} in {path} has dtype {entry['dtype']}, which this reader doesn't "
                         f"support. Supported: {sorted(DTYPES)}.")
    dtype, shape = DTYPES[entry["dtype"]], entry["shape"]
    begin, end = entry["data_offsets"]
    numel = 1
    for size in shape:
        numel *= size
    if end - begin != numel * dtype.itemsize:
        raise ConfigError(f"Tensor {name!r} in {path} has {end - begin} bytes, but shape {shape} of "
                         f"{entry['dtype']} needs {numel * dtype.itemsize}: the file is corrupt.")
    if numel == 0:
        return torch.empty(shape, dtype=dtype)  # torch.frombuffer rejects empty buffers
    buffer = bytearray(end - begin)
    f.seek(data_start + begin)
    if f.readinto(buffer) != len(buffer):
        raise ConfigError(f"Tensor {name!r} in {path} ends past the end of the file: the file is truncated.")
    return torch.frombuffer(buffer, dtype=dtype).reshape(shape)


def load_file_with_metadata(path: str | Path) -> tuple[dict[str, Tensor], dict[str, str]]:
    """Every tensor in the safetensors file at `path` (on CPU, in file order), and its metadata ({} if none)."""
    path = Path(path)
    with open(path, "rb") as f:
        header, data_start = read_header(f, path)
        metadata = header.pop(METADATA_KEY, None) or {}
        tensors = {name: read_tensor(f, data_start, name, entry, path)
                   for name, entry in sorted(header.items(), key=lambda item: item[1]["data_offsets"][0])}
    return tensors, metadata


def load_file(path: str | Path) -> dict[str, Tensor]:
    """Every tensor in the safetensors file at `path`, on CPU."""
    return load_file_with_metadata(path)[0]


def load_folder(folder: str | Path) -> dict[str, Tensor]:
    """All tensors of a Hugging Face folder: the shards named in model.safetensors.index.json's weight_map,
    or else the single model.safetensors."""
    folder = Path(folder)
    index_path, single_path = folder / INDEX_FILE, folder / SINGLE_FILE
    if not index_path.is_file():
        if not single_path.is_file():
            raise ConfigError(f"{folder} has neither {SINGLE_FILE} nor {INDEX_FILE}. Pass a folder written "
                                    f"by save_pretrained or scripts/convert_to_hf.py.")
        return load_file(single_path)
    weight_map: dict[str, str] = json.loads(index_path.read_text())["weight_map"]
    tensors: dict[str, Tensor] = {}
    for shard in sorted(set(weight_map.values())):
        if not (folder / shard).is_file():
            raise ConfigError(f"{index_path} lists {shard}, which is not in {folder}. Copy the missing shard "
                              f"or the whole folder again.")
        in_shard = load_file(folder / shard)
        wanted = [name for name, file in weight_map.items() if file == shard]
        missing = [name for name in wanted if name not in in_shard]
        if missing:
            raise ConfigError(f"{index_path} maps {missing} to {shard}, but that file doesn't hold them. "
                             f"The folder is incomplete or the index is stale.")
        tensors.update((name, in_shard[name]) for name in wanted)
    return tensors


def split_shards(tensors: dict[str, Tensor], max_shard_bytes: int) -> list[dict[str, Tensor]]:
    """Group tensors, in order, into shards of at most max_shard_bytes; a larger tensor gets a shard of its own."""
    shards: list[dict[str, Tensor]] = [{}]
    shard_bytes = 0
    for name, tensor in tensors.items():
        size = tensor.numel() * tensor.element_size()
        if shards[-1] and shard_bytes + size > max_shard_bytes:
            shards.append({})
            shard_bytes = 0
        shards[-1][name] = tensor
        shard_bytes += size
    return shards


def save_folder(tensors: dict[str, Tensor], folder: str | Path, max_shard_bytes: int) -> list[Path]:
    """Write `tensors` into `folder` as Hugging Face does: model.safetensors if they fit in max_shard_bytes,
    else model-00001-of-0000N.safetensors shards plus model.safetensors.index.json. Returns the files written."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    shards = split_shards(tensors, max_shard_bytes)
    if len(shards) == 1:
        save_file(tensors, folder / SINGLE_FILE, metadata=HF_FILE_METADATA)
        return [folder / SINGLE_FILE]
    written: list[Path] = []
    weight_map: dict[str, str] = {}
    for number, shard in enumerate(shards, start=1):
        file_name = f"model-{number:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, folder / file_name, metadata=HF_FILE_METADATA)
        weight_map.update((name, file_name) for name in shard)
        written.append(folder / file_name)
    total_size = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total_size}, "weight_map": weight_map}
    (folder / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    return [*written, folder / INDEX_FILE]
