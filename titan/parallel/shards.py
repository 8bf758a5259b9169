"""This rank's share of a sharded tensor: the one helper that the optimizer, the step and the dry run read shards
with."""

from torch import Tensor
from torch.distributed.tensor import DTensor


def local_shard(tensor: Tensor) -> Tensor:
    """This rank's shard of a sharded (DTensor) parameter, gradient or state, sharing its storage; a plain tensor is
    all of itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def matching_layout(grad: Tensor, param: Tensor) -> Tensor:
    """`grad` sharded as its parameter is. Under tensor parallel a gradient can come back in another layout than its
    parameter's (Partial for the sequence-parallel norms): torch's Adam lets DTensor redistribute it inside its ops,
    the optimizers that work on local shards (titan/train/bf16_state.py, muon.py) redistribute first."""
    if isinstance(grad, DTensor) and grad.placements != param.placements:
        return grad.redistribute(param.device_mesh, param.placements)
    return grad
