"""The device, parallel degrees, the process group, and the one device mesh every parallelism takes its sub-mesh
from."""

import os
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from titan.config.errors import ConfigError
from titan.config.job import Comm, Parallelism
from titan.metrics.goodput import ATTEMPT_ENV, attempt_number
from titan.metrics.log import logger
from titan.parallel.degrees import resolved_shard_degree

# Mesh dimension names, outermost first: pipeline stages talk least and may span nodes; TP talks every layer and
# stays inside one.
MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


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

    pp: int
    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    ep: int = 1
    """Expert parallel: borrowed from dp_shard x cp (not a factor of the world size)."""
    force_fsdp: bool = False
    """FSDP2 also over a one-rank data-parallel mesh (--parallelism.force_fsdp, --training.enable_cpu_offload)."""

    @property
    def world_size(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp

    @property
    def dp_degree(self) -> int:
        """Ranks that read distinct data: replicas times shards."""
        return self.dp_replicate * self.dp_shard

    @property
    def dp_enabled(self) -> bool:
        """FSDP2 wraps the model: over dp_shard x cp, since context-parallel ranks hold the same parameters and
        average their gradients (HSDP when dp_replicate > 1); on one such rank only when forced."""
        return self.dp_degree * self.cp > 1 or self.force_fsdp

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    @property
    def expert_fsdp(self) -> int:
        """Ranks that FSDP-shard each expert: the dp_shard x cp ranks left over after expert parallel."""
        return self.dp_shard * self.cp // self.ep


def resolve_dims(par: Parallelism, world_size: int, cpu_offload: bool) -> ParallelDims:
    """Degrees with data_parallel_shard_degree -1 replaced by the ranks left over; FSDP forced by
    --parallelism.force_fsdp or `cpu_offload` (FSDP's). Validation has checked that the degrees divide the world
    size."""
    return ParallelDims(pp=par.pipeline_parallel_degree, dp_replicate=par.data_parallel_replicate_degree,
                        dp_shard=resolved_shard_degree(par, world_size), cp=par.context_parallel_degree,
                        tp=par.tensor_parallel_degree, ep=par.expert_parallel_degree,
                        force_fsdp=par.force_fsdp or cpu_offload)


def attempt_store() -> dict[str, Any]:
    """init_process_group's store for a restarted attempt under torchrun (--max-restarts): the agent's store, which
    outlives the attempts, under a prefix of this attempt, which every node numbers alike (titan.launch). Without it,
    gloo's connection to its peers reads the addresses the previous attempt's ranks left in the store and retries
    them until it fails ("Connection refused"). The first attempt, and a store that is not the agent's (rank 0 then
    hosts a new one), use env:// unchanged."""
    check_launcher_numbers_attempts()
    attempt = attempt_number()
    if attempt == 0 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {}
    world_size = int(os.environ["WORLD_SIZE"])
    agent_store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                                is_master=False)
    return {"store": dist.PrefixStore(f"titan/attempt_{attempt}", agent_store), "rank": int(os.environ["RANK"]),
            "world_size": world_size}


def check_launcher_numbers_attempts() -> None:
    """Plain torchrun numbers a restarted attempt by each node's own restart count, which only a failed node's agent
    increments: after a failure the nodes would join different attempts and never form a process group."""
    if ATTEMPT_ENV in os.environ:
        return
    nodes, max_restarts = (int(os.environ.get(name, "0")) for name in ("GROUP_WORLD_SIZE", "TORCHELASTIC_MAX_RESTARTS"))
    if nodes > 1 and max_restarts > 0:
        raise ConfigError(f"In-job restarts across nodes (torchrun --max-restarts {max_restarts} on {nodes} nodes) "
                          f"need Titan's launcher, which numbers each attempt alike on every node: run python -m "
                          f"titan.launch with the same flags instead of torchrun.")


def init_distributed(comm: Comm, device: torch.device, dims: ParallelDims, dump_folder: Path,
                     cpu_collectives: bool = False) -> None:
    """Join the process group (nccl on CUDA, gloo on CPU) when there is more than one process, or a group of this
    process alone when FSDP is forced onto one rank, unless this process has joined one already (one that runs
    several jobs in turn, as the parity tests' harness does). The flight recorder is turned on first: torch reads its
    settings when a group is created. `cpu_collectives` adds gloo for host tensors next to nccl (CPU offload reduces
    the gradient norm over gradients in host memory)."""
    if (dims.world_size == 1 and not dims.dp_enabled) or dist.is_initialized():
        return
    enable_flight_recorder(comm, dump_folder)
    backend = "gloo" if device.type != "cuda" else "cuda:nccl,cpu:gloo" if cpu_collectives else "nccl"
    # One process needs no rendezvous: an in-memory store, also outside torchrun.
    store = {"store": dist.HashStore(), "rank": 0, "world_size": 1} if dims.world_size == 1 else attempt_store()
    dist.init_process_group(backend=backend, timeout=timedelta(seconds=comm.init_timeout_seconds),
                            device_id=device if device.type == "cuda" else None, **store)
    logger.info(f"Joined a {backend} process group of {dims.world_size} ranks (rank {dist.get_rank()}, "
                f"local rank {os.environ.get('LOCAL_RANK', '0')})")


def has_nccl(backend: str) -> bool:
    """Whether a process group's backend string includes NCCL: "nccl", or "cuda:nccl,cpu:gloo" when gloo serves
    host tensors beside it (init_distributed's cpu_collectives)."""
    return any(entry.rpartition(":")[2] == "nccl" for entry in backend.split(","))


def flight_recorder_env(comm: Comm, dump_folder: Path) -> dict[str, str]:
    """torch's flight-recorder settings for --comm.trace_buf_size and --comm.save_traces_folder. torch 2.11 to 2.13
    read the buffer size as TORCH_FR_BUFFER_SIZE, and warn from every rank that the older name
    TORCH_NCCL_TRACE_BUFFER_SIZE is deprecated if it is set, so only the new name is. The dump file's prefix goes
    under both names, which those versions read without a warning. NCCL also dumps by itself when one of its
    collectives times out, which is what a hang before the watchdog watches (setup and the first step) ends in, to
    rank_<r> in the traces folder."""
    env = {"TORCH_FR_BUFFER_SIZE": str(comm.trace_buf_size)}
    if comm.trace_buf_size > 0:
        prefix = str(dump_folder / comm.save_traces_folder / "rank_")
        env.update(TORCH_NCCL_DUMP_ON_TIMEOUT="1", TORCH_NCCL_DEBUG_INFO_TEMP_FILE=prefix,
                   TORCH_FR_DUMP_TEMP_FILE=prefix)
    return env


def enable_flight_recorder(comm: Comm, dump_folder: Path) -> None:
    """Set the flight recorder's environment for the process groups created after this, replacing (with a
    warning) values set outside Titan, since the config fields are the ones that say where dumps go."""
    env = flight_recorder_env(comm, dump_folder)
    for name, value in env.items():
        if os.environ.get(name, value) != value:
            logger.warning(f"{name}={os.environ[name]} from the environment is replaced by {value} "
                           f"(--comm.trace_buf_size, --comm.save_traces_folder)")
        os.environ[name] = value
    if comm.trace_buf_size > 0:
        (dump_folder / comm.save_traces_folder).mkdir(parents=True, exist_ok=True)


def build_host_group() -> dist.ProcessGroup | None:
    """A gloo group of every rank, for agreeing on host facts (a signal, a time limit): a collective on NCCL runs
    on the GPU's stream, so reading its result would wait for every kernel queued before it. The default group
    when it is gloo already; None on a single process."""
    if not dist.is_initialized():
        return None
    if dist.get_backend() == "gloo":
        return dist.group.WORLD
    return dist.new_group(backend="gloo")


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


@dataclass(frozen=True)
class Meshes:
    """The one (pp, dp_replicate, dp_shard, cp, tp) device mesh and every sub-mesh a stage uses, each built once.
    The flattened ones are kept here, not sliced from the root again: torch deprecates slicing flattened dims."""

    root: DeviceMesh
    dp: DeviceMesh
    """dp_replicate x dp_shard, flattened: ranks that read distinct data."""
    fsdp: DeviceMesh
    """dp_shard x cp flattened, or (dp_replicate, that) for HSDP: ranks that shard parameters."""
    loss: DeviceMesh
    """pp x dp_replicate x dp_shard x cp flattened: ranks whose losses make up the global mean."""
    dp_cp: DeviceMesh
    """dp_replicate x dp_shard x cp flattened: ranks that hold the same layers and see different tokens."""
    ep: DeviceMesh | None = None
    """Expert parallel: the ranks among dp_shard x cp that split the experts (the innermost of them)."""
    expert_fsdp: DeviceMesh | None = None
    """Expert parallel: the ranks that FSDP-shard each expert (the rest of dp_shard x cp, with dp_replicate
    outside for HSDP)."""
    fsdp_tp: DeviceMesh | None = None
    """dp_shard x cp x tp flattened, under FSDP and TP together: the ranks that hold pieces of one weight matrix,
    which Muon gathers over (titan/train/muon.py)."""

    def shard_group(self, mesh: DeviceMesh, dims: tuple[int, ...]) -> dist.ProcessGroup:
        """The process group over `dims` of `mesh`, a sharded parameter's: one of its dims, or FSDP's and TP's
        together (fsdp_tp), the only pair a parameter is sharded over."""
        if len(dims) == 1:
            return mesh.get_group(dims[0])
        names = tuple(mesh.mesh_dim_names[dim] for dim in dims)
        assert names == ("dp_shard_cp", "tp") and self.fsdp_tp is not None, f"no process group over {names}"
        return self.fsdp_tp.get_group()

    @property
    def pp(self) -> DeviceMesh:
        return self.root["pp"]

    @property
    def cp(self) -> DeviceMesh:
        return self.root["cp"]

    @property
    def tp(self) -> DeviceMesh:
        return self.root["tp"]

    def all(self) -> tuple[DeviceMesh, ...]:
        """Every mesh whose groups run collectives."""
        optional = tuple(mesh for mesh in (self.ep, self.expert_fsdp, self.fsdp_tp) if mesh is not None)
        return (*(self.root[name] for name in MESH_DIMS), self.dp, self.fsdp, self.loss, self.dp_cp, *optional)


def set_collective_timeout(meshes: Meshes | None, seconds: int) -> None:
    """Give the default process group and every group of `meshes` this collective timeout: the init timeout for
    setup and the first step, then a shorter one, since setup can be slow and a hang later should fail fast.
    FSDP, TP and the loss average run on the mesh's groups, and those init_device_mesh creates for a dimension
    smaller than the world start with torch's 30-minute default. torch has no public setter; _set_pg_timeout
    is what torchtitan uses too."""
    if meshes is None:
        return
    timeout = timedelta(seconds=seconds)
    groups = {None, *(group for mesh in meshes.all() for group in mesh.get_all_groups())}
    for group in groups:
        dist.distributed_c10d._set_pg_timeout(timeout, group)


def build_meshes(dims: ParallelDims, device: torch.device) -> Meshes | None:
    """The named 5-D mesh and its flattened views; None on a single process, unless FSDP is forced onto it.
    DeviceMesh has no public flatten yet; torchtitan uses _flatten and _unflatten the same way."""
    if dims.world_size == 1 and not dims.dp_enabled:
        return None
    root = init_device_mesh(device.type, (dims.pp, dims.dp_replicate, dims.dp_shard, dims.cp, dims.tp),
                            mesh_dim_names=MESH_DIMS)
    dp = root["dp_replicate", "dp_shard"]._flatten("dp")
    loss = root["pp", "dp_replicate", "dp_shard", "cp"]._flatten("loss")
    dp_cp = root["dp_replicate", "dp_shard", "cp"]._flatten("dp_cp")
    if dims.dp_replicate > 1:
        # (replicate, shard x cp) from the flattened replicate x shard x cp, whose rank order it keeps.
        fsdp = dp_cp._unflatten(0, (dims.dp_replicate, dims.dp_shard * dims.cp), ("dp_replicate", "dp_shard_cp"))
    else:
        fsdp = root["dp_shard", "cp"]._flatten("dp_shard_cp")
    ep, expert_fsdp = build_expert_meshes(dims, dp_cp)
    fsdp_tp = root["dp_shard", "cp", "tp"]._flatten("dp_shard_cp_tp") if dims.tp_enabled and dims.dp_enabled else None
    logger.info(f"Device mesh: pp {dims.pp} x dp_replicate {dims.dp_replicate} x dp_shard {dims.dp_shard} x cp "
                f"{dims.cp} x tp {dims.tp} on {dims.world_size} ranks"
                + (f"; experts: ep {dims.ep} x fsdp {dims.expert_fsdp} of the dp_shard x cp ranks" if ep else ""))
    return Meshes(root=root, dp=dp, fsdp=fsdp, loss=loss, dp_cp=dp_cp, ep=ep, expert_fsdp=expert_fsdp,
                  fsdp_tp=fsdp_tp)


def build_expert_meshes(dims: ParallelDims, dp_cp: DeviceMesh) -> tuple[DeviceMesh | None, DeviceMesh | None]:
    """(ep, expert_fsdp) under expert parallel, else (None, None): the dp_replicate x dp_shard x cp ranks
    unflattened to (dp_replicate, expert_fsdp, ep), EP innermost as torchtitan lays it out, so that the ranks that
    exchange tokens every layer are neighbours. expert_fsdp is (dp_replicate, expert_fsdp) for HSDP."""
    if not dims.ep_enabled:
        return None, None
    experts = dp_cp._unflatten(0, (dims.dp_replicate, dims.expert_fsdp, dims.ep), ("dp_replicate", "efsdp", "ep"))
    fsdp = experts["dp_replicate", "efsdp"] if dims.dp_replicate > 1 else experts["efsdp"]
    return experts["ep"], fsdp


def data_parallel_rank(meshes: Meshes | None) -> tuple[int, int]:
    """(rank, degree) among the ranks that read distinct data; the pipeline, context and tensor-parallel ranks of
    one data-parallel rank share its batches."""
    if meshes is None:
        return 0, 1
    return meshes.dp.get_local_rank(), meshes.dp.size()
