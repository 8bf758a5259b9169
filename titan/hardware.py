"""The accelerator a config will run on, which the hardware rules of validation check against.

A training run targets this machine's GPU (or its CPU). A dry run (--job.dry_run) targets the GPU it simulates
(--estimate.gpu), whatever machine it runs on, so a CPU machine can check a job meant for H100s.
"""

import functools
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Accelerator:
    """A CUDA GPU by its device name and compute capability, or the CPU (both None)."""

    name: str | None
    """The name torch.cuda.get_device_name() reports, e.g. "NVIDIA H100 80GB HBM3"; None for the CPU."""
    capability: tuple[int, int] | None
    """CUDA compute capability (major, minor), e.g. (9, 0) for Hopper; None for the CPU."""
    simulated: bool = False
    """A dry run's --estimate.gpu, not a device of this machine."""

    @property
    def is_cuda(self) -> bool:
        return self.capability is not None

    def describe(self) -> str:
        """The accelerator as an error message names it, e.g. "this machine has no CUDA GPU"."""
        if not self.is_cuda:
            return "this machine has no CUDA GPU"
        major, minor = self.capability
        where = "the dry run's simulated" if self.simulated else "this"
        return f"{where} {self.name} is {major}.{minor}"


CPU = Accelerator(name=None, capability=None)

# The GPUs --estimate.gpu offers (the SXM parts), as torch.cuda names them and with their compute capability.
SIMULATED_GPUS: dict[str, Accelerator] = {
    "H100": Accelerator("NVIDIA H100 80GB HBM3", (9, 0), simulated=True),
    "H200": Accelerator("NVIDIA H200", (9, 0), simulated=True),
    "B200": Accelerator("NVIDIA B200", (10, 0), simulated=True),
}


def local_accelerator() -> Accelerator:
    """This machine's current CUDA device, or the CPU when torch sees no CUDA GPU."""
    if not torch.cuda.is_available():
        return CPU
    return Accelerator(torch.cuda.get_device_name(), torch.cuda.get_device_capability())


def simulated_accelerator(gpu: str) -> Accelerator:
    """The GPU a dry run simulates for --estimate.gpu `gpu` ("H100", "H200" or "B200")."""
    return SIMULATED_GPUS[gpu]


def target_accelerator(dry_run: bool, gpu: str) -> Accelerator:
    """The accelerator a config targets: the simulated --estimate.gpu `gpu` for a dry run, else this machine's."""
    return simulated_accelerator(gpu) if dry_run else local_accelerator()


@functools.cache
def cpu_scaled_mm_takes_rowwise_scales() -> bool:
    """Whether this torch's CPU torch._scaled_mm multiplies float8 with rowwise scales (torch 2.13's does; 2.11's
    takes per-tensor scales only and fails an internal assert otherwise), tried on a 16 x 16 product."""
    a = torch.ones(16, 16).to(torch.float8_e4m3fn)
    try:
        torch._scaled_mm(a, a.t(), scale_a=torch.ones(16, 1), scale_b=torch.ones(1, 16), out_dtype=torch.bfloat16)
    except RuntimeError:
        return False
    return True
