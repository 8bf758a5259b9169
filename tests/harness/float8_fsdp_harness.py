"""Train small float8 models under FSDP2 on 2 gloo ranks, with and without the float8 all-gather, and save what
tests/test_float8_fsdp.py compares.

    torchrun --nproc_per_node 2 tests/harness/float8_fsdp_harness.py OUT.pt CHECKPOINT_DIR

Each variant builds the same model on meta, optionally wraps its Float8Linear weights for the float8 all-gather,
shards it, materialises it with to_empty, runs nn.init on the wrapped shards, loads one full set of weights, then
trains a few AdamW steps on per-rank batches.
"""

import os
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

# Run as a script (torchrun, titan.launch): the repository root holds titan and train.py, tests/ the harness package.
sys.path[:0] = [str(Path(__file__).resolve().parents[2]), str(Path(__file__).resolve().parents[1])]

from titan.parallel.dims import destroy_distributed  # noqa: E402
from titan.quant.float8.fsdp import (  # noqa: E402
    Float8AllGatherWeight,
    apply_float8_all_gather,
    precompute_float8_scales,
)
from titan.quant.float8.gathered import Float8GatheredWeight  # noqa: E402
from titan.quant.float8.linear import Float8Linear  # noqa: E402

from harness.torchrun import finish_rank  # noqa: E402

STEPS = 4
BATCH = 16
EVEN_DIMS = (64, 96, 48)
# 33 rows split 17 + 16 and 1 row 1 + 0 (an empty shard) over 2 ranks: FSDP pads, and the hooks must too.
UNEVEN_DIMS = (64, 33, 1)


@dataclass(frozen=True)
class Variant:
    float8_all_gather: bool
    precompute: bool
    param_dtype: torch.dtype
    dims: tuple[int, ...] = EVEN_DIMS
    mesh: str = "fsdp"
    """Mesh to shard over: "fsdp" (2 ranks) or "hsdp" (replicate 1 x shard 2: amaxes reduced over the shard dim)."""


VARIANTS = {
    "fp32": Variant(False, False, torch.float32),
    "fp32_float8_all_gather": Variant(True, False, torch.float32),
    "fp32_float8_all_gather_precompute": Variant(True, True, torch.float32),
    "bf16": Variant(False, False, torch.bfloat16),
    "bf16_float8_all_gather": Variant(True, False, torch.bfloat16),
    "bf16_float8_all_gather_precompute": Variant(True, True, torch.bfloat16),
    "uneven": Variant(False, False, torch.float32, UNEVEN_DIMS),
    "uneven_float8_all_gather_precompute": Variant(True, True, torch.float32, UNEVEN_DIMS),
    "hsdp_float8_all_gather_precompute": Variant(True, True, torch.float32, mesh="hsdp"),
}


class Mlp(nn.Module):
    """Float8Linear layers (the last with a bias, so an FSDP unit all-gathers float8 and fp32 tensors together)
    with ReLUs between them."""

    def __init__(self, dims: tuple[int, ...]) -> None:
        super().__init__()
        num_layers = len(dims) - 1
        self.layers = nn.ModuleDict({
            str(i): Float8Linear.from_linear(nn.Linear(dims[i], dims[i + 1], bias=i == num_layers - 1),
                                             recipe_name="tensorwise", emulate=False)
            for i in range(num_layers)})

    def forward(self, x: Tensor) -> Tensor:
        for i, layer in enumerate(self.layers.values()):
            x = layer(x) if i == 0 else layer(torch.relu(x))
        return x


def full_weights(dims: tuple[int, ...]) -> dict[str, Tensor]:
    """The weights every variant trains from: nn.Linear's default init under a fixed seed."""
    torch.manual_seed(0)
    return Mlp(dims).state_dict()


def build_sharded(variant: Variant, meshes: dict[str, DeviceMesh]) -> tuple[Mlp, int]:
    """The Mlp built on meta, wrapped (or not), sharded, materialised and initialised in place; and the number
    of weights apply_float8_all_gather wrapped."""
    with torch.device("meta"):
        model = Mlp(variant.dims)
    num_wrapped = apply_float8_all_gather(model) if variant.float8_all_gather else 0
    mp_policy = MixedPrecisionPolicy(param_dtype=variant.param_dtype, reduce_dtype=torch.float32)
    mesh = meshes[variant.mesh]
    for layer in model.layers.values():
        fully_shard(layer, mesh=mesh, mp_policy=mp_policy)
    fully_shard(model, mesh=mesh, mp_policy=mp_policy)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for parameter in model.parameters():
            nn.init.normal_(parameter)
    return model, num_wrapped


def wrapped_after_init(model: Mlp) -> list[bool]:
    """Whether each Float8Linear's sharded weight still carries the all-gather hooks after to_empty and init."""
    return [isinstance(layer.weight._local_tensor, Float8AllGatherWeight) for layer in model.layers.values()]


def record_gathered_weights(model: Mlp, seen: list[tuple[str, torch.dtype, int]]) -> None:
    """Log, as each Float8Linear runs, the type of the unsharded weight FSDP handed it, the dtype of the bytes
    the all-gather filled and their number."""
    def hook(module: nn.Module, args: tuple) -> None:
        weight = module.weight
        data = weight._data if isinstance(weight, Float8GatheredWeight) else weight
        seen.append((type(weight).__name__, data.dtype, data.untyped_storage().nbytes()))

    for layer in model.layers.values():
        layer.register_forward_pre_hook(hook)


def batch(step: int, rank: int, in_features: int, out_features: int) -> tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(1000 * step + rank)
    return (torch.randn(BATCH, in_features, generator=generator),
            torch.randn(BATCH, out_features, generator=generator))


def num_valid_precomputed(model: Mlp) -> int:
    """Weights whose precomputed amax the next all-gather will use (set, and the weight not written since)."""
    locals_ = [layer.weight._local_tensor for layer in model.layers.values()]
    return sum(isinstance(w, Float8AllGatherWeight) and w.amax_slot.amax is not None for w in locals_)


def train(variant: Variant, model: Mlp, rank: int) -> dict:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    seen: list[tuple[str, torch.dtype, int]] = []
    record_gathered_weights(model, seen)
    result = {"losses": [], "valid_precomputed_before_forward": [], "valid_precomputed_after_step": []}
    for step in range(STEPS):
        x, y = batch(step, rank, variant.dims[0], variant.dims[-1])
        result["valid_precomputed_before_forward"].append(num_valid_precomputed(model))
        loss = (model(x).float() - y).pow(2).mean()
        loss.backward()
        if step == 0:
            result["first_grads"] = {name: p.grad.full_tensor() for name, p in model.named_parameters()}
            result["grad_local_shapes_match"] = all(
                isinstance(p.grad, DTensor) and p.grad.to_local().shape == p.to_local().shape
                for p in model.parameters())
        optimizer.step()
        optimizer.zero_grad()
        result["valid_precomputed_after_step"].append(num_valid_precomputed(model))
        if variant.precompute:
            precompute_float8_scales(model)
        dist.all_reduce(loss.detach(), op=dist.ReduceOp.AVG)
        result["losses"].append(loss.item())
    result["gathered"] = seen[: len(model.layers)]  # the first step's forward
    result["valid_precomputed_at_end"] = num_valid_precomputed(model)
    return result


def state_dict_checks(model: Mlp) -> dict:
    """What model.state_dict() and DCP's full state dict hold."""
    sharded = model.state_dict()
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {
        "valid_precomputed_after_state_dict": num_valid_precomputed(model),
        "sharded_local_types": sorted({type(v.to_local()).__name__ for v in sharded.values()}),
        "full_types": sorted({type(v).__name__ for v in full.values()}),
        "full_dtypes": sorted({str(v.dtype) for v in full.values()}),
        "weights": {name: value.clone() for name, value in full.items()},
    }


def checkpoint_round_trip(variant: Variant, model: Mlp, meshes: dict[str, DeviceMesh], rank: int,
                          directory: str) -> dict:
    """Save `model` with DCP, load it in place into a fresh wrapped model, and compare a forward of both."""
    dcp.save(model.state_dict(), checkpoint_id=directory)
    fresh, _ = build_sharded(variant, meshes)
    state_dict = fresh.state_dict()
    dcp.load(state_dict, checkpoint_id=directory)
    x, _ = batch(STEPS, rank, variant.dims[0], variant.dims[-1])
    with torch.no_grad():
        return {"loaded_weights": get_model_state_dict(fresh, options=StateDictOptions(full_state_dict=True)),
                "forward_equal": torch.equal(model(x), fresh(x)),
                "still_wrapped": wrapped_after_init(fresh)}


def main() -> None:
    out, checkpoint_dir = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    meshes = {"fsdp": init_device_mesh("cpu", (world_size,)),
              "hsdp": init_device_mesh("cpu", (1, world_size), mesh_dim_names=("replicate", "shard"))}
    results = {}
    for name, variant in VARIANTS.items():
        model, num_wrapped = build_sharded(variant, meshes)
        wrapped = wrapped_after_init(model)
        set_model_state_dict(model, full_weights(variant.dims), options=StateDictOptions(full_state_dict=True))
        result = {"num_wrapped": num_wrapped, "wrapped_after_init": wrapped, **train(variant, model, rank),
                  **state_dict_checks(model)}
        if variant.float8_all_gather:
            result.update(checkpoint_round_trip(variant, model, meshes, rank, os.path.join(checkpoint_dir, name)))
        results[name] = result
    if rank == 0:
        torch.save(results, out)
    destroy_distributed(wait_for_peers=True)


if __name__ == "__main__":
    main()
    finish_rank()
