"""Values a step computed on the device, brought to the host without making the host wait for the device.

Reading a CUDA tensor (.item(), .tolist(), .cpu()) blocks the host until every kernel queued before it has run: the
GPU's queue drains and the next step's launches, FSDP's prefetching all-gathers included, start late. A Readback
instead queues a copy into pinned host memory behind the step's kernels and records an event after it; the trainer
reads it once the next step's work is queued (titan/train/trainer.py), when waiting on that event costs nothing
because the GPU is busy with work that comes after it. On CPU the copy runs at once and the event is not needed.
"""

import torch
from torch import Tensor


class Readback:
    """A 1-D tensor's values on their way to host memory: queued by the constructor, read by values()."""

    def __init__(self, values: Tensor) -> None:
        on_cuda = values.device.type == "cuda"
        self.host = torch.empty(values.shape, dtype=values.dtype, pin_memory=on_cuda)
        self.host.copy_(values, non_blocking=on_cuda)
        self.event: torch.cuda.Event | None = None
        if on_cuda:
            self.event = torch.cuda.Event()
            self.event.record()

    def values(self) -> list[float]:
        """The values, once the copy has landed (waiting for it if it has not yet)."""
        if self.event is not None:
            self.event.synchronize()
        return self.host.tolist()
