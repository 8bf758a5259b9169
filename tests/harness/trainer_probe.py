"""Probes of Titan's training loop (Trainer.run) under torchrun, for what losses can't show in the parallel tests:
tests/harness/parallel_harness.py runs them in the parity cases' launches (a case whose flags start with its
PROBE_CASE), and tests/test_train.py counts host reads with counting_host_reads.

Each probe's result holds rank 0's view: which parameters were sharded by FSDP right after the first forward, each
process group's collective timeout after setup and after training, and the local gradient shards of the last step;
and every rank's host reads during the run (HostReads, which the single-process loop tests count too).
"""

import contextlib
import os
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from titan.parallel.dims import MESH_DIMS
from titan.train.preemption import Stopper
from titan.train.readback import Readback
from titan.train.trainer import Trainer
from titan.validate import load_job_config

ROOT = str(Path(__file__).resolve().parents[2])
DEVICE_MESH = os.path.join("torch", "distributed", "device_mesh.py")

# Tensor methods that hand values to Python. .cpu() and .to() are counted apart: whether they read depends on where
# they copy to.
READ_METHODS = frozenset(getattr(torch.Tensor, name) for name in (
    "item", "tolist", "numpy", "__bool__", "__float__", "__int__", "__index__", "__array__"))


class HostReads:
    """Every read of tensor values by the host while it is entered, whatever the tensors' device, since on a GPU each
    one waits for the device's queue to drain. Counted, with where they are made:
    - Python reading values: .item(), .tolist(), .numpy(), bool(), float(), int(), a tensor as a Python index,
      np.asarray, .cpu(), and .to() the CPU named as such, by a string or a torch.device made while counting (the
      devices a run takes from tensors, x.to(y.device) or its own device, are the GPU on a GPU). These run no op
      on a CPU tensor, so a TorchFunctionMode sees them;
    - ops that hand a value to the host (torch's data_dependent_output tag: the _local_scalar_dense behind
      f-strings, torch.equal), ops whose output size depends on values (dynamic_output_shape: nonzero, boolean
      masks, unique; not aten.index with integer indices, nor repeat_interleave given its output size, whose sizes
      follow from shapes), and copies from another device to the CPU: a TorchDispatchMode sees them.
    A read inside another counts once; reads inside `exempt()` are not counted, nor DeviceMesh's (its rank tables
    are CPU tensors on every device)."""

    def __init__(self) -> None:
        self.host_devices: list[torch.device] = []
        """The CPU devices made while counting (torch.device("cpu")), told apart from the others by identity."""
        self.reads: list[str] = []
        """Where each read was made: "path:line function <- its caller", the innermost frames outside torch and this
        module."""
        self.depth = 0
        """Reads and exempt regions entered: only reads at depth 0 are counted."""
        self.modes = contextlib.ExitStack()

    def __enter__(self) -> "HostReads":
        self.modes.enter_context(PythonReads(self))
        self.modes.enter_context(OpReads(self))
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.modes.close()

    @contextlib.contextmanager
    def exempt(self) -> Iterator[None]:
        """A region whose reads are not counted (a Readback, which the loop reads when it is ready to)."""
        self.depth += 1
        try:
            yield
        finally:
            self.depth -= 1

    def read(self, run: Callable[[], object]) -> object:
        """Count one read, made by `run`, unless inside another or an exempt region."""
        if self.depth == 0:
            self.record(traceback.extract_stack())
        with self.exempt():
            return run()

    def record(self, stack: traceback.StackSummary) -> None:
        """Add where a read was made, unless DeviceMesh made it."""
        if any(frame.filename.endswith(DEVICE_MESH) for frame in stack):
            return
        frames = [frame for frame in stack
                  if frame.filename != __file__ and f"{os.sep}torch{os.sep}" not in frame.filename]
        self.reads.append(" <- ".join(f"{frame.filename.removeprefix(ROOT + os.sep)}:{frame.lineno} {frame.name}"
                                      for frame in reversed(frames[-2:])))

    def to_cpu(self, func: Callable, args: tuple, kwargs: dict) -> bool:
        """Whether `func` is .cpu(), or .to() the CPU named as such (a string, or one of host_devices)."""
        if func is torch.Tensor.cpu:
            return True
        if func is not torch.Tensor.to:
            return False
        target = kwargs.get("device", next((arg for arg in args[1:] if isinstance(arg, (str, torch.device))), None))
        if isinstance(target, str):
            return torch.device(target).type == "cpu"
        return any(target is device for device in self.host_devices)


class PythonReads(TorchFunctionMode):
    """HostReads' view of the Tensor methods that read (READ_METHODS, .cpu(), .to() the CPU)."""

    def __init__(self, counter: HostReads) -> None:
        super().__init__()
        self.counter = counter

    def __torch_function__(self, func: Callable, types: tuple, args: tuple = (), kwargs: dict | None = None) -> object:
        kwargs = kwargs or {}
        if func in READ_METHODS or self.counter.to_cpu(func, args, kwargs):
            return self.counter.read(lambda: func(*args, **kwargs))
        result = func(*args, **kwargs)
        if func is torch.device and result.type == "cpu":
            self.counter.host_devices.append(result)
        return result


class OpReads(TorchDispatchMode):
    """HostReads' view of the ops that read: data-dependent outputs and sizes, and copies to the CPU."""

    def __init__(self, counter: HostReads) -> None:
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func: torch._ops.OpOverload, types: tuple, args: tuple = (),
                           kwargs: dict | None = None) -> object:
        kwargs = kwargs or {}
        if reads_values(func, args, kwargs):
            return self.counter.read(lambda: func(*args, **kwargs))
        result = func(*args, **kwargs)
        if copies_to_host(func, args, result):
            self.counter.read(lambda: None)
        return result


def reads_values(func: torch._ops.OpOverload, args: tuple, kwargs: dict) -> bool:
    """Whether the op hands a value to the host, or sizes its output by values."""
    if torch.Tag.data_dependent_output in func.tags:
        return True
    if torch.Tag.dynamic_output_shape not in func.tags:
        return False
    if func is torch.ops.aten.index.Tensor:
        return any(index is not None and index.dtype in (torch.bool, torch.uint8) for index in args[1])
    if func is torch.ops.aten.repeat_interleave.Tensor:
        return kwargs.get("output_size") is None
    return True


def copies_to_host(func: torch._ops.OpOverload, args: tuple, result: object) -> bool:
    """Whether `func` copied a tensor from another device to the CPU (copy_ into a CPU tensor, a device's .cpu())."""
    if func is torch.ops.aten._to_copy.default:
        source = args[0]
    elif func is torch.ops.aten.copy_.default:
        source = args[1]
    else:
        return False
    return result.device.type == "cpu" and source.device.type != "cpu"


@contextlib.contextmanager
def counting_host_reads(trainer: Trainer, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[HostReads, list[int]]]:
    """HostReads over what runs inside, with the trainer's Readbacks (queued in the loop, read once the next step is
    queued) exempt and counted apart, and the Stopper's agreement at each step boundary exempt (an all-reduce of
    host memory on the host group, never of the device's): yields the counter and the trainer's step at each
    Readback read."""
    with HostReads() as reads:
        read_at: list[int] = []
        real_init, real_values, real_agree = Readback.__init__, Readback.values, Stopper.agree

        def agree(stopper: Stopper, values: list[float]) -> list[float]:
            with reads.exempt():
                return real_agree(stopper, values)

        def queue(readback: Readback, values: torch.Tensor) -> None:
            with reads.exempt():
                real_init(readback, values)

        def read(readback: Readback) -> list[float]:
            read_at.append(trainer.step)
            with reads.exempt():
                return real_values(readback)

        monkeypatch.setattr(Readback, "__init__", queue)
        monkeypatch.setattr(Readback, "values", read)
        monkeypatch.setattr(Stopper, "agree", agree)
        yield reads, read_at


def fsdp_sharded(module: nn.Module) -> bool:
    """Whether `module`'s first parameter is FSDP's shard (a DTensor on a mesh with the flattened dp_shard x cp
    dimension FSDP shards over) rather than the gathered parameter (a plain tensor, or a DTensor on the tp mesh
    alone)."""
    param = next(module.parameters())
    return isinstance(param, DTensor) and "dp_shard_cp" in (param.device_mesh.mesh_dim_names or ())


def group_timeouts(trainer: Trainer) -> dict[str, float]:
    """Collective timeout in seconds of the default process group and of each mesh dimension's group."""
    groups = {"default": dist.distributed_c10d._get_default_group()}
    groups.update({name: trainer.training.meshes.root[name].get_group() for name in MESH_DIMS})
    groups.update({"dp": trainer.training.meshes.dp.get_group(), "fsdp": trainer.training.meshes.fsdp.get_group(),
                   "loss": trainer.training.meshes.loss.get_group()})
    return {name: group._get_backend(trainer.device).options._timeout.total_seconds()
            for name, group in groups.items()}


def run_case(flags: list[str], world_size: int) -> dict:
    trainer = Trainer(load_job_config(flags, world_size), world_size)
    setup_timeouts = group_timeouts(trainer)
    after_forward: list[dict] = []

    def record(model: nn.Module, args: tuple, output: torch.Tensor) -> None:
        after_forward.append({"blocks": [fsdp_sharded(block) for block in model.layers.values()],
                              "root": fsdp_sharded(model.tok_embeddings)})

    trainer.training.model.register_forward_hook(record)  # runs after FSDP's own post-forward hooks, registered earlier
    with pytest.MonkeyPatch.context() as monkeypatch, counting_host_reads(trainer, monkeypatch) as (reads, _):
        trainer.run()
    gradients = {fqn: param.grad.to_local() for fqn, param in trainer.training.model.named_parameters()}
    host_reads: list[list[str]] = [[] for _ in range(world_size)]
    dist.all_gather_object(host_reads, reads.reads)
    return {"after_forward": after_forward[0], "setup_timeouts": setup_timeouts,
            "train_timeouts": group_timeouts(trainer), "gradients": gradients, "host_reads": host_reads}

