"""Expert parallel against one process's experts, on 2 gloo ranks: each rank routes its own tokens, the EP experts
exchange them, and outputs and gradients must equal what the whole set of experts computes locally.

    torchrun --nproc_per_node 2 tests/harness/ep_harness.py RESULT.pt
"""

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

# Run as a script (torchrun, titan.launch): the repository root holds titan and train.py, tests/ the harness package.
sys.path[:0] = [str(Path(__file__).resolve().parents[2]), str(Path(__file__).resolve().parents[1])]

from titan.models.common.moe import GroupedExperts  # noqa: E402
from titan.parallel.ep import ExpertParallelExperts  # noqa: E402

from harness.torchrun import save_every_rank_and_finish  # noqa: E402

NUM_EXPERTS, DIM, HIDDEN = 4, 8, 16
# Tokens per expert of each rank, sorted by expert as MoE.forward hands them over. "empty": experts 1 and 2 get no
# token from anyone; "one_sided": rank 1 sends nothing to rank 0's experts, and rank 1's experts get nothing from
# rank 0; "random": whatever a seeded draw gives.
ROUTINGS = {
    "empty": [[3, 0, 0, 5], [2, 0, 0, 1]],
    "one_sided": [[4, 2, 0, 0], [0, 0, 3, 6]],
    "random": [torch.randint(0, 6, (NUM_EXPERTS,), generator=torch.Generator().manual_seed(r)).tolist()
               for r in range(2)],
}


def run(routing: list[list[int]], mesh: dist.DeviceMesh, rank: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)  # the same whole experts and upstream gradients on every rank
    whole = GroupedExperts(NUM_EXPERTS, DIM, HIDDEN)
    for weight in (whole.w1, whole.w2, whole.w3):
        torch.nn.init.normal_(weight, std=0.5)
    inputs = [torch.randn(sum(counts), DIM) for counts in routing]
    upstream = [torch.randn(sum(counts), DIM) for counts in routing]
    parallel = ExpertParallelExperts(GroupedExperts(NUM_EXPERTS, DIM, HIDDEN), mesh)
    with torch.no_grad():
        for name in ("w1", "w2", "w3"):
            getattr(parallel, name).to_local().copy_(getattr(whole, name).chunk(2)[rank])
    x = inputs[rank].clone().requires_grad_()
    out = parallel(x, torch.tensor(routing[rank]))
    (out * upstream[rank]).sum().backward()
    # The reference: every rank's tokens through the whole experts, one rank after the other.
    reference_inputs = [tokens.clone().requires_grad_() for tokens in inputs]
    reference = [whole(tokens, torch.tensor(counts)) for tokens, counts in zip(reference_inputs, routing)]
    sum((ref * up).sum() for ref, up in zip(reference, upstream)).backward()
    # 1/ep: expert parallel scales expert gradients as one of the EP ranks' data-parallel shares (ep.py).
    grads = {name: getattr(parallel, name).grad.full_tensor() * 2 for name in ("w1", "w2", "w3")}
    # clone(): the all-to-all's outputs are AsyncCollectiveTensors, which torch.save would pickle as such.
    return {"out": out.detach().clone(), "want_out": reference[rank].detach(), "x_grad": x.grad.clone(),
            "want_x_grad": reference_inputs[rank].grad,
            **{f"{name}_grad": grad for name, grad in grads.items()},
            **{f"want_{name}_grad": getattr(whole, name).grad for name in ("w1", "w2", "w3")}}


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("ep",))
    results = {name: run(routing, mesh, rank) for name, routing in ROUTINGS.items()}
    save_every_rank_and_finish(results, sys.argv[1])


if __name__ == "__main__":
    main()
