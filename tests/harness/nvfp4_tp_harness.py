"""NVFP4 linears under tensor parallel (sequence parallel, as Titan's TP plans run them) against torchao 0.18's rule
for its NVFP4 tensor-parallel styles, on 2 gloo ranks: a colwise and a rowwise NVFP4Linear, each rank's output,
input gradient and weight gradient against the same NVFP4 matmuls applied to the operands that rule gives each rank.

The rule (torchao/prototype/moe_training/nvfp4_training/nvfp4_tensor_parallel.py): an operand that the styles gather
(FP4 codes, all-gathered) is quantized with the whole tensor's amax (all-reduced); every other operand with its own
shard's: the weight shards always, a colwise layer's output gradient (its columns), a rowwise layer's input (its
columns). So a colwise layer sees the whole input and its weight rows; a rowwise one its input columns and weight
columns, and the whole output gradient. The stochastic rounding of gradients draws noise of the local shape; here
it is a constant 1/2 (round to the nearer value, ties up), so that every product is deterministic.

    torchrun --nproc_per_node 2 tests/harness/nvfp4_tp_harness.py RESULT.pt
"""

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

sys.path[:0] = [str(Path(__file__).resolve().parents[2]), str(Path(__file__).resolve().parents[1])]

from titan.quant.nvfp4 import linear as nvfp4_linear  # noqa: E402
from titan.quant.nvfp4.linear import (  # noqa: E402
    WGRAD_RHT_SIGNS,
    NVFP4Linear,
    grad_input_mm,
    grad_weight_mm,
    output_mm,
)

from harness.torchrun import save_every_rank_and_finish  # noqa: E402

TOKENS, IN, OUT = 64, 128, 96


def whole_operands() -> tuple[Tensor, Tensor, Tensor]:
    """The same input (tokens, in), weight (out, in) and output gradient (tokens, out) on every rank, bf16 values,
    with a few large entries so that a shard's amax differs from the whole tensor's."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(TOKENS, IN, generator=generator)
    weight = torch.randn(OUT, IN, generator=generator) * 0.1
    grad = torch.randn(TOKENS, OUT, generator=generator)
    x[3, 5], weight[70, 100], grad[40, 90] = 40.0, 3.0, 60.0
    return x.bfloat16().float(), weight.bfloat16().float(), grad.bfloat16().float()


def run(style: str, mesh: dist.DeviceMesh, rank: int) -> dict[str, Tensor]:
    x, weight, grad = whole_operands()
    linear = NVFP4Linear(IN, OUT, bias=False, emulate=True)
    with torch.no_grad():
        linear.weight.copy_(weight)
    # Sequence parallel: the colwise input arrives sharded along the tokens and is gathered; the rowwise output is
    # reduce-scattered along the tokens (its gradient arrives sharded and is gathered).
    plan = (ColwiseParallel(input_layouts=Shard(0)) if style == "colwise"
            else RowwiseParallel(output_layouts=Shard(0)))
    parallelize_module(linear, mesh, plan)
    x_local = (x.chunk(2)[rank] if style == "colwise" else x.chunk(2, dim=1)[rank]).clone().requires_grad_()
    out = linear(x_local)
    grad_local = grad.chunk(2, dim=1)[rank] if style == "colwise" else grad.chunk(2)[rank]
    out.backward(grad_local)
    bf16 = torch.bfloat16
    if style == "colwise":  # whole x; weight rows and output-gradient columns of this rank
        w_shard, g_shard = weight.chunk(2)[rank].to(bf16), grad.chunk(2, dim=1)[rank].to(bf16)
        want_out = output_mm(x.to(bf16), w_shard.t(), emulate=True)
        # grad_input: the ranks' partial products summed, then this rank's tokens
        partials = [grad_input_mm(grad.chunk(2, dim=1)[r].to(bf16), weight.chunk(2)[r].to(bf16), emulate=True)
                    for r in range(2)]
        want_grad_input = (partials[0].float() + partials[1].float()).chunk(2)[rank]
        want_grad_weight = grad_weight_mm(g_shard.t(), x.to(bf16), WGRAD_RHT_SIGNS, emulate=True)
    else:  # x columns and weight columns of this rank; the whole output gradient
        partials = [output_mm(x.chunk(2, dim=1)[r].to(bf16), weight.chunk(2, dim=1)[r].to(bf16).t(), emulate=True)
                    for r in range(2)]
        want_out = (partials[0].float() + partials[1].float()).chunk(2)[rank]
        w_shard = weight.chunk(2, dim=1)[rank].to(bf16)
        want_grad_input = grad_input_mm(grad.to(bf16), w_shard, emulate=True)
        want_grad_weight = grad_weight_mm(grad.to(bf16).t(), x.chunk(2, dim=1)[rank].to(bf16), WGRAD_RHT_SIGNS,
                                          emulate=True)
    # The same products with one process's amaxes, to show that the shards' differ.
    one_process = output_mm(x.to(bf16), weight.to(bf16).t(), emulate=True)
    results = {"out": out, "want_out": want_out, "grad_input": x_local.grad, "want_grad_input": want_grad_input,
               "grad_weight": linear.weight.grad.to_local(), "want_grad_weight": want_grad_weight,
               "one_process_out": one_process}
    # clone(): collectives' outputs are AsyncCollectiveTensors, which torch.save would pickle as such.
    return {name: tensor.detach().float().clone() for name, tensor in results.items()}


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    nvfp4_linear.rounding_noise = lambda x: torch.full(x.shape, 0.5, device=x.device)
    results = {style: run(style, mesh, rank) for style in ("colwise", "rowwise")}
    save_every_rank_and_finish(results, sys.argv[1])


if __name__ == "__main__":
    main()
