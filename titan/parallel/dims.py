"""The device, parallel degrees, the process group, and the one device mesh every parallelism takes its sub-mesh from."""

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from titan.config.job import Comm, Parallelism
from titan.metrics.log import logger

# Mesh dimension names, outermost first: replicas span nodes, TP stays inside one.
MESH_DIMS = ("dp_replicate", "dp_shard", "tp")


def build_device() -> torch.device:
    """CUDA device LOCAL_RANK when a GPU is visible (torchrun sets LOCAL_RANK), otherwise the CPU."""
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")


@dataclass(frozen=True)
class ParallelDims:
    """Resolved degrees (no -1) whose product is the world size."""

    dp_replicate: int
    dp_shard: int
    tp: int

    @property
    def world_size(self) -> int:
        return self.dp_replicate * self.dp_shard * self.tp

    @property
    def dp_degree(self) -> int:
        """Ranks that read distinct data: replicas times shards."""
        return self.dp_replicate * self.dp_shard

    @property
    def dp_enabled(self) -> bool:
        """FSDP2 wraps the model (HSDP when dp_replicate > 1)."""
        return self.dp_degree > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1


def resolve_dims(par: Parallelism, world_size: int) -> ParallelDims:
    """Degrees with data_parallel_shard_degree -1 replaced by the ranks left over. Validation has checked
    that they divide the world size."""
    shard = par.data_parallel_shard_degree
    if shard == -1:
        shard = world_size // (par.data_parallel_replicate_degree * par.tensor_parallel_degree)
    return ParallelDims(dp_replicate=par.data_parallel_replicate_degree, dp_shard=shard, tp=par.tensor_parallel_degree)


def init_distributed(comm: Comm, device: torch.device, world_size: int) -> None:
    """Join the process group (nccl on CUDA, gloo on CPU) when there is more than one process."""
    if world_size == 1:
        return
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend=backend, timeout=timedelta(seconds=comm.init_timeout_seconds),
                            device_id=device if device.type == "cuda" else None)
    logger.info(f"Joined a {backend} process group of {world_size} ranks (rank {dist.get_rank()}, "
                f"local rank {os.environ.get('LOCAL_RANK', '0')})")


def destroy_distributed(wait_for_peers: bool) -> None:
    """Leave the process group so the process exits cleanly (gloo aborts otherwise).

    wait_for_peers: meet every rank at a barrier first, for runs that finished normally. A rank that tore the
    group down while its peer was still busy (saving a checkpoint, writing results) has been aborted by gloo
    ("terminate called without an active exception"). Not after an error: a peer may never arrive.
    """
    if dist.is_initialized():
        if wait_for_peers:
            dist.barrier()
        dist.destroy_process_group()


def set_collective_timeout(mesh: DeviceMesh | None, seconds: int) -> None:
    """Give the default process group and every group of `mesh` this collective timeout: the init timeout for
    setup and the first step, then a shorter one, since setup can be slow and a hang later should fail fast.
    FSDP, TP and the loss average run on the mesh's groups, and those init_device_mesh creates for a dimension
    smaller than the world start with torch's 30-minute default. torch has no public setter; _set_pg_timeout
    is what torchtitan uses too."""
    if mesh is None:
        return
    timeout = timedelta(seconds=seconds)
    for group in (None, *(mesh[name].get_group() for name in (*MESH_DIMS, "dp"))):
        dist.distributed_c10d._set_pg_timeout(timeout, group)


def build_mesh(dims: ParallelDims, device: torch.device) -> DeviceMesh | None:
    """A (dp_replicate, dp_shard, tp) mesh, plus a flattened "dp" dimension for data loading and loss
    averaging; None on a single process."""
    if dims.world_size == 1:
        return None
    mesh = init_device_mesh(device.type, (dims.dp_replicate, dims.dp_shard, dims.tp), mesh_dim_names=MESH_DIMS)
    # DeviceMesh has no public flatten yet; torchtitan uses _flatten the same way.
    mesh["dp_replicate", "dp_shard"]._flatten("dp")
    logger.info(f"Device mesh: dp_replicate {dims.dp_replicate} x dp_shard {dims.dp_shard} x tp {dims.tp} "
                f"on {dims.world_size} ranks")
    return mesh


def fsdp_mesh(mesh: DeviceMesh, dims: ParallelDims) -> DeviceMesh:
    """2-D (replicate, shard) mesh for HSDP, the shard dimension alone for plain FSDP."""
    return mesh["dp_replicate", "dp_shard"] if dims.dp_replicate > 1 else mesh["dp_shard"]


def data_parallel_rank(mesh: DeviceMesh | None) -> tuple[int, int]:
    """(rank, degree) among the ranks that read distinct data; TP ranks of one group share a batch."""
    if mesh is None:
        return 0, 1
    dp = mesh["dp"]
    return dp.get_local_rank(), dp.size()
