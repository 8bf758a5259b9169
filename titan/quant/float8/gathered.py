"""Float8GatheredWeight: a weight that FSDP2's float8 all-gather (titan/quant/float8/fsdp.py) delivers already cast,
e4m3 with one tensorwise scale, so that Float8Linear multiplies those bytes instead of casting the weight again.

It sits below linear.py, which reads it, and fsdp.py, which builds it, so that neither imports the other's caller.
"""

from typing import Any

import torch
from torch import Tensor
from torch.utils._pytree import tree_flatten, tree_map_only

from titan.quant.float8.casts import dequantize

aten = torch.ops.aten

# Views that keep the float8 bytes and the scale: FSDP as_strides the gathered buffer to the weight's size,
# nn.Parameter detaches it, and Float8Linear transposes it for the forward's weight^T.
FLOAT8_VIEW_OPS = {aten.as_strided.default, aten.detach.default, aten.t.default}


def mutated_args(func: torch._ops.OpOverload, args: tuple, kwargs: dict) -> list[Any]:
    """The arguments `func` writes to (self of an in-place op, out= tensors, lists of a _foreach_ op)."""
    written = []
    for position, argument in enumerate(func._schema.arguments):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        if argument.name in kwargs:
            written += tree_flatten(kwargs[argument.name])[0]
        elif position < len(args):
            written += tree_flatten(args[position])[0]
    return written


class Float8GatheredWeight(torch.Tensor):
    """The all-gathered weight: float8 e4m3 `_data` and its fp32 0-dim `_scale`, posing as a `dtype` tensor of
    the weight's shape (autograd checks the weight's gradient against that dtype). Float8Linear reads data and
    scale directly; any other op sees the dequantized weight."""

    _data: Tensor
    _scale: Tensor

    @staticmethod
    def __new__(cls, data: Tensor, scale: Tensor, dtype: torch.dtype) -> "Float8GatheredWeight":
        return torch.Tensor._make_wrapper_subclass(
            cls, data.size(), strides=data.stride(), storage_offset=data.storage_offset(), dtype=dtype,
            device=data.device)

    def __init__(self, data: Tensor, scale: Tensor, dtype: torch.dtype) -> None:
        self._data = data
        self._scale = scale

    def __repr__(self) -> str:
        return f"Float8GatheredWeight(data={self._data!r}, scale={self._scale!r}, dtype={self.dtype})"

    def __tensor_flatten__(self) -> tuple[list[str], torch.dtype]:
        return ["_data", "_scale"], self.dtype

    @staticmethod
    def __tensor_unflatten__(inner_tensors: dict[str, Tensor], dtype: torch.dtype, outer_size: torch.Size,
                             outer_stride: tuple[int, ...]) -> "Float8GatheredWeight":
        return Float8GatheredWeight(inner_tensors["_data"], inner_tensors["_scale"], dtype)

    @classmethod
    def __torch_dispatch__(cls, func: torch._ops.OpOverload, types: tuple, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func in FLOAT8_VIEW_OPS:
            weight = args[0]
            return cls(func(weight._data, *args[1:], **kwargs), weight._scale, weight.dtype)
        if any(isinstance(written, cls) for written in mutated_args(func, args, kwargs)):
            raise RuntimeError(f"{func} would write to an all-gathered float8 weight, which FSDP discards after "
                               f"use; write to the sharded parameter instead.")

        def high_precision(weight: Float8GatheredWeight) -> Tensor:
            return dequantize(weight._data, weight._scale, weight.dtype)

        return func(*tree_map_only(cls, high_precision, args), **tree_map_only(cls, high_precision, kwargs))
