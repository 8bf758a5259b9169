"""This rank's share of a sharded tensor: the one helper that the optimizer, the step and the dry run read shards
with."""

from torch import Tensor
from torch.distributed.tensor import DTensor


def local_shard(tensor: Tensor) -> Tensor:
    """This rank's shard of a sharded (DTensor) parameter, gradient or state, sharing its storage; a plain tensor is
    all of itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor
