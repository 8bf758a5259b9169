"""torchao's blockwise float8 grouped matmul (torchao/prototype/moe_training/blockwise_fp8) runnable on the CPU, as the
reference for Titan's blockwise experts.

torchao quantizes for it with Triton kernels registered as torch.library ops, which have no CPU backend. Here each
op gets a CPU kernel built from torchao's own pure-torch references of the same quantizers
(torchao/prototype/blockwise_fp8_training/kernels.py torch_blockwise_scale_*), rearranged to the layouts its Triton
kernel writes (which its CUDA tests check against those references). Everything else, the token-group padding, the
emulated grouped matmul and the autograd, is torchao's code as shipped. Importing this module registers the kernels
(once per process)."""

import torch
from torch import Tensor
from torchao.prototype.blockwise_fp8_training import kernels
from torchao.prototype.moe_training.blockwise_fp8.grouped_mm import _to_fp8_blockwise_then_emulated_scaled_grouped_mm


def column_major(x: Tensor) -> Tensor:
    return x.t().contiguous().t()


def act_quant_lhs(x: Tensor, block_size: int = 128,
                  dtype: torch.dtype = torch.float8_e4m3fn) -> tuple[Tensor, Tensor]:
    """1 x 128 tiles along the last dim: data row-major, inverse scales (M, K / 128) column-major."""
    data, scale = kernels.torch_blockwise_scale_act_quant_lhs(x, block_size, dtype)
    return data, column_major(scale)


def act_quant_rhs(x: Tensor, block_size: int = 128,
                  dtype: torch.dtype = torch.float8_e4m3fn) -> tuple[Tensor, Tensor]:
    """128 x 1 tiles down the columns: data column-major, inverse scales (M / 128, K) row-major."""
    data, scale = kernels.torch_blockwise_scale_act_quant_rhs(x, block_size, dtype)
    return column_major(data), scale.contiguous()


def act_quant_transposed_lhs(x: Tensor, block_size: int = 128,
                             dtype: torch.dtype = torch.float8_e4m3fn) -> tuple[Tensor, Tensor]:
    """x^T in 1 x 128 tiles along its last dim (128 x 1 tiles of x): data (K, M) row-major, scales (K, M / 128)
    column-major."""
    return act_quant_lhs(x.t().contiguous(), block_size, dtype)


def weight_quant_rhs(x: Tensor, block_size: int = 128,
                     dtype: torch.dtype = torch.float8_e4m3fn) -> tuple[Tensor, Tensor]:
    """128 x 128 blocks: data and inverse scales column-major."""
    data, scale = kernels.torch_blockwise_scale_weight_quant(x, block_size, dtype)
    return column_major(data), column_major(scale)


def weight_quant_transposed_rhs(x: Tensor, block_size: int = 128,
                                dtype: torch.dtype = torch.float8_e4m3fn) -> tuple[Tensor, Tensor]:
    """x^T in 128 x 128 blocks: data and inverse scales column-major."""
    return weight_quant_rhs(x.t().contiguous(), block_size, dtype)


for _name, _kernel in [("triton_fp8_blockwise_act_quant_lhs", act_quant_lhs),
                       ("triton_fp8_blockwise_act_quant_rhs", act_quant_rhs),
                       ("triton_fp8_blockwise_act_quant_transposed_lhs", act_quant_transposed_lhs),
                       ("triton_fp8_blockwise_weight_quant_rhs", weight_quant_rhs),
                       ("triton_fp8_blockwise_weight_quant_transposed_rhs", weight_quant_transposed_rhs)]:
    torch.library.register_kernel(f"torchao::{_name}", "cpu", _kernel)

__all__ = ["_to_fp8_blockwise_then_emulated_scaled_grouped_mm"]
