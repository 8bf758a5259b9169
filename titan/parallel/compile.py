"""torch.compile per transformer block, and of the loss."""

from collections.abc import Callable

import torch
import torch._inductor.config
from torch import nn

from titan.metrics.log import logger


def apply_compile(model: nn.Module, emulate_precision_casts: bool) -> None:
    """Compile each block of `model.layers` in place. nn.Module.compile keeps parameter FQNs unchanged
    (wrapping with torch.compile() would add `_orig_mod.`), and all blocks share one compiled graph,
    so compile time does not grow with depth. emulate_precision_casts makes inductor round intermediates
    as eager does; without it, float8 rowwise + RMSNorm has given NaN losses (torch >= 2.6)."""
    torch._inductor.config.emulate_precision_casts = emulate_precision_casts
    for block in model.layers.values():
        block.compile(fullgraph=True)
    casts = ", emulating eager precision casts" if emulate_precision_casts else ""
    logger.info(f"Compiled {len(model.layers)} transformer blocks with torch.compile{casts}")


def compile_loss(loss_fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """The loss compiled whole: inductor fuses the float32 upcast into the cross entropy, so no float32 copy of the
    logits is kept (what --training.loss_chunk_size does in eager mode)."""
    return torch.compile(loss_fn)
