"""QuantizedLinear: the nn.Linear shell that every low-precision converter's linear shares. Subclasses supply
`matmul`, the (tokens, in_features) @ weight^T product with their own quantization and autograd. Also the
shard-by-shard product that the block-quantized recipes (MX, blockwise float8, NVFP4) run under tensor parallelism,
and the cast that their products' outputs take."""

from collections.abc import Callable

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard

# (a's placement, b's placement) -> the product's, for the layouts of Megatron TP's colwise and rowwise linears
PRODUCT_PLACEMENTS: dict[tuple[Placement, Placement], Placement] = {
    (Replicate(), Shard(1)): Shard(1),  # colwise output, rowwise grad_input and grad_weight: split N
    (Shard(0), Replicate()): Shard(0),  # colwise grad_weight: split rows of g^T
    (Shard(1), Shard(0)): Partial(),  # rowwise output, colwise grad_input: split K, sum over ranks
}


def multiply_shards(a: Tensor, b: Tensor, local_mm: Callable[[Tensor, Tensor], Tensor], recipe: str) -> Tensor:
    """a (M, K) @ b (K, N) by `local_mm` (a block-quantized product of plain tensors), for plain tensors or DTensors
    on one TP mesh dim, multiplied shard by shard. That is the whole tensors' quantization because the converters
    convert only layers whose TP shards hold whole blocks (titan/quant/convert.py), so no block spans two ranks."""
    if not isinstance(a, DTensor):
        return local_mm(a, b)
    # A pending sum (DTensor may hand backward a Partial gradient) must be reduced first: quantization is not linear.
    a, b = (t.redistribute(placements=[Replicate()]) if t.placements[0].is_partial() else t for t in (a, b))
    placements = (a.placements[0], b.placements[0])
    if a.device_mesh.ndim != 1 or placements not in PRODUCT_PLACEMENTS:
        raise NotImplementedError(f"{recipe} matmul of DTensors placed {placements} on a {a.device_mesh.ndim}-D "
                                  f"mesh: only the layouts of colwise and rowwise tensor parallelism are supported.")
    out = local_mm(a.to_local(), b.to_local())
    return DTensor.from_local(out, a.device_mesh, [PRODUCT_PLACEMENTS[placements]], run_check=False)


def in_dtype(x: Tensor, dtype: torch.dtype) -> Tensor:
    """x in `dtype`, without the no-op `.to` when it is already: torch 2.11 compiles an autograd.Function whose forward
    returns a no-op `.to(...)` into one whose backward yields zero gradients, silently (fixed by 2.13). Every
    recipe's matmul output goes through this (tests/test_compiled_low_precision.py)."""
    return x if x.dtype == dtype else x.to(dtype)


class QuantizedLinear(nn.Linear):
    """nn.Linear whose matmuls a subclass runs in low precision; parameters stay in high precision for the
    optimizer, and FQNs, shapes and state dicts are those of the nn.Linear it replaced."""

    @classmethod
    def from_linear(cls, linear: nn.Linear, **options) -> "QuantizedLinear":
        """A `cls` sharing `linear`'s parameters (works on the meta device); `options` go to cls.__init__."""
        with torch.device("meta"):
            new = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, **options)
        new.weight = linear.weight
        new.bias = linear.bias
        return new

    def matmul(self, x_2d: Tensor) -> Tensor:
        """x_2d (tokens, in_features) @ weight^T, differentiable in both."""
        raise NotImplementedError(f"{type(self).__name__} must implement matmul")

    def forward(self, x: Tensor) -> Tensor:
        device_type = x.device.type
        if torch.is_autocast_enabled(device_type):
            # Autocast would not reach inside the subclass's autograd.Function: apply its dtype to the input here.
            x = x.to(torch.get_autocast_dtype(device_type))
        with torch.autocast(device_type, enabled=False):
            x_2d = x.reshape(-1, x.shape[-1])  # (tokens, in_features)
            out = self.matmul(x_2d)
            out = out.reshape(*x.shape[:-1], out.shape[-1])  # (..., out_features)
            if self.bias is not None:
                out = out + self.bias.to(out.dtype)
        return out
