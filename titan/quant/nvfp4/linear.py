"""NVFP4Linear: nn.Linear whose three matmuls run in NVFP4 as torchao 0.18's NVFP4 training recipe runs them
(NVFP4TrainingConfig, whose NVFP4Linear calls nvfp4_mm_triton in torchao/prototype/moe_training/nvfp4_training/
nvfp4_linear.py; the recipe torchtitan's NVFP4 converter uses), which is NVIDIA's recipe for NVFP4 pretraining
("Pretraining Large Language Models with NVFP4", arXiv:2509.25149).

For y = x @ W^T with x (M, K), W (N, K), grad_output g (M, N), each operand in blocks of 16 along its matmul's
contraction dim with its own tensor scale (titan/quant/nvfp4/numerics.py):
  output       x @ W^T   x in 1 x 16 blocks, W in 16 x 16 tiles; both rounded to nearest.
  grad_input   g @ W     g in 1 x 16 blocks, rounded stochastically; W in the same 16 x 16 tiles, which hold the same
                         values either way round, so the weight the backward multiplies is the forward's.
  grad_weight  g^T @ x   both contract the tokens: g^T and x^T, each run of 16 tokens first rotated by one random
                         Hadamard transform (orthogonal, so the product is unchanged while outliers spread over the 16);
                         g rounded stochastically, x to nearest.
Operands are cast to bf16 first and products rounded to bf16, as torchao's kernels take and give bf16; output and
gradients then return in the input's and the weight's dtypes. Gradients round stochastically so that they are unbiased;
the noise comes from the default generator, so torch.manual_seed makes a run repeatable.

Native: torch.nn.functional.scaled_mm with float4_e2m1fn_x2 data, E4M3 block scales and fp32 tensor scales on CUDA
SM100+ (Blackwell's block-scaled tensor cores, via cuBLAS), as torchao calls it; the quantization runs in the torch ops
of numerics.py, not in torchao's fused Triton kernels. Emulated (`emulate=True`): the same quantized values,
dequantized and multiplied in fp32, then rounded to bf16; for CPU and pre-Blackwell GPUs.
"""

from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor

from titan.quant.formats import E4M3, NVFP4_BLOCK_SIZE, NVFP4_CONTRACTION_MULTIPLE
from titan.quant.mx.blocked import to_blocked
from titan.quant.nvfp4.numerics import NVFP4, dequantize, quantize, quantize_2d, rotate
from titan.quant.quantized_linear import QuantizedLinear, in_dtype, multiply_shards

WGRAD_RHT_SIGNS = (1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1)
"""The Hadamard transform's signs: the vector NVIDIA's Transformer Engine hard-codes (get_wgrad_sign_vector).
torchao draws one per layer from the global RNG when it builds the layer; a fixed default keeps runs, ranks and
resumes alike without shifting the RNG stream that initialises the weights."""
_BLOCK_SCALED = [F.ScalingType.BlockWise1x16, F.ScalingType.TensorWise]
_SWIZZLED = [F.SwizzleType.SWIZZLE_32_4_4, F.SwizzleType.NO_SWIZZLE]


def rounding_noise(x: Tensor) -> Tensor:
    """Uniform noise in [0, 1) of x's shape for stochastic rounding, from the default generator."""
    return torch.rand(x.shape, device=x.device)


def quantize_tokens_rotated(x: Tensor, signs: tuple[int, ...], stochastic: bool) -> NVFP4:
    """x (tokens, features) as an operand of grad_weight: x^T (features, tokens) in blocks along the tokens, each run
    of 16 tokens rotated first. Tokens are zero-padded to a multiple of NVFP4_CONTRACTION_MULTIPLE, which grad_weight
    contracts; both operands pad alike and the rotation is orthogonal, so the padding adds nothing to the product."""
    x_t = F.pad(x.t(), (0, -x.shape[0] % NVFP4_CONTRACTION_MULTIPLE))  # (features, padded tokens)
    rotated = rotate(x_t, signs)
    return quantize(rotated, rounding_noise(rotated) if stochastic else None)


def blocked_scales(q: NVFP4) -> Tensor:
    """q's block scales in the layout of the block-scaled GEMMs: the 128 x 4 tiles of MX's, E4M3 for E8M0."""
    return to_blocked(q.block_scales.view(torch.uint8)).view(E4M3)


def native_nvfp4_mm(a: NVFP4, b: NVFP4) -> Tensor:
    """a (M, K) @ b (N, K)^T in bf16 on block-scaled tensor cores. scaled_mm applies the tensor scales in fp32 before
    its one rounding to bf16; torch._scaled_mm takes no second scale, and multiplying its bf16 output would round
    twice."""
    return F.scaled_mm(a.data.view(torch.float4_e2m1fn_x2), b.data.view(torch.float4_e2m1fn_x2).t(),
                       scale_a=[blocked_scales(a), a.tensor_scale], scale_recipe_a=_BLOCK_SCALED,
                       scale_b=[blocked_scales(b), b.tensor_scale], scale_recipe_b=_BLOCK_SCALED,
                       swizzle_a=_SWIZZLED, swizzle_b=_SWIZZLED, output_dtype=torch.bfloat16)


def nvfp4_mm(a: NVFP4, b: NVFP4, emulate: bool) -> Tensor:
    """a (M, K) @ b (N, K)^T in bf16, both in blocks along K. Emulated, the exact NVFP4 values are multiplied and
    summed in fp32 and rounded once to bf16, as the tensor cores do up to the order of the sum."""
    if emulate:
        return (dequantize(a) @ dequantize(b).t()).to(torch.bfloat16)
    return native_nvfp4_mm(a, b)


def output_mm(x: Tensor, weight_t: Tensor, emulate: bool) -> Tensor:
    """x (M, K) @ weight^T (K, N): x in 1 x 16 blocks, the weight in its 16 x 16 tiles, both to nearest."""
    return nvfp4_mm(quantize(x), quantize_2d(weight_t.t()), emulate)


def grad_input_mm(grad: Tensor, weight: Tensor, emulate: bool) -> Tensor:
    """grad (M, N) @ weight (N, K): grad rounded stochastically, the weight's tiles transposed, as in forward."""
    return nvfp4_mm(quantize(grad, rounding_noise(grad)), quantize_2d(weight.t()), emulate)


def grad_weight_mm(grad_t: Tensor, x: Tensor, rht_signs: tuple[int, ...], emulate: bool) -> Tensor:
    """grad^T (N, tokens) @ x (tokens, K): both along the tokens, rotated, grad rounded stochastically."""
    return nvfp4_mm(quantize_tokens_rotated(grad_t.t(), rht_signs, stochastic=True),
                    quantize_tokens_rotated(x, rht_signs, stochastic=False), emulate)


class NVFP4Matmul(torch.autograd.Function):
    """x (M, K) @ weight (N, K)^T with all three matmuls in NVFP4 (module docstring). Saves the bf16 input and weight
    and quantizes them again in backward: the same values as in forward, since they round to nearest.

    Under tensor parallel (sequence parallel, as Titan's TP always is) the operands are DTensors, and each rank
    quantizes the local tensors it multiplies (titan/quant/quantized_linear.py multiply_shards), each with the tensor
    scale of its own amax. That is torchao 0.18's NVFP4 tensor-parallel rule (NVFP4ColwiseParallel,
    NVFP4RowwiseParallel): a gathered operand is quantized with the whole tensor's amax (here the input of a colwise
    linear and the output gradient of a rowwise one arrive gathered, where torchao all-reduces their amaxes and
    gathers FP4 codes), a sharded one with its shard's (the weights, a colwise output gradient, a rowwise input)."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, rht_signs: tuple[int, ...], emulate: bool) -> Tensor:
        x_bf16, weight_bf16 = x.to(torch.bfloat16), weight.to(torch.bfloat16)
        ctx.save_for_backward(x_bf16, weight_bf16)
        ctx.rht_signs, ctx.emulate, ctx.dtypes = rht_signs, emulate, (x.dtype, weight.dtype)
        out = multiply_shards(x_bf16, weight_bf16.t(), partial(output_mm, emulate=emulate), "NVFP4")
        return in_dtype(out, x.dtype)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, Tensor, None, None]:
        x, weight = ctx.saved_tensors
        grad = grad.to(torch.bfloat16)
        grad_input = multiply_shards(grad, weight, partial(grad_input_mm, emulate=ctx.emulate), "NVFP4")
        grad_weight = multiply_shards(grad.t(), x, partial(grad_weight_mm, rht_signs=ctx.rht_signs,
                                                           emulate=ctx.emulate), "NVFP4")
        x_dtype, weight_dtype = ctx.dtypes
        return grad_input.to(x_dtype), grad_weight.to(weight_dtype), None, None


class NVFP4Linear(QuantizedLinear):
    """nn.Linear with NVFP4 matmuls; the parameters stay in high precision for the optimizer."""

    def __init__(self, in_features: int, out_features: int, bias: bool, emulate: bool,
                 device: torch.device | None = None, dtype: torch.dtype | None = None,
                 rht_signs: tuple[int, ...] = WGRAD_RHT_SIGNS) -> None:
        if in_features % NVFP4_CONTRACTION_MULTIPLE or out_features % NVFP4_CONTRACTION_MULTIPLE:
            raise ValueError(f"NVFP4Linear needs in_features and out_features divisible by "
                             f"{NVFP4_CONTRACTION_MULTIPLE}, since each is some matmul's contraction dim (got "
                             f"{out_features}x{in_features}); keep this layer in high precision.")
        if len(rht_signs) != NVFP4_BLOCK_SIZE or any(sign not in (-1, 1) for sign in rht_signs):
            raise ValueError(f"NVFP4Linear's rht_signs must be {NVFP4_BLOCK_SIZE} values of 1 or -1 (got "
                             f"{rht_signs}); the default is Transformer Engine's.")
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.emulate = emulate
        self.rht_signs = tuple(rht_signs)

    def matmul(self, x_2d: Tensor) -> Tensor:
        return NVFP4Matmul.apply(x_2d, self.weight, self.rht_signs, self.emulate)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, nvfp4{', emulated' if self.emulate else ''}"
