"""torch.compile per transformer block."""

from torch import nn

from titan.metrics.log import logger


def apply_compile(model: nn.Module) -> None:
    """Compile each block of `model.layers` in place. nn.Module.compile keeps parameter FQNs unchanged
    (wrapping with torch.compile() would add `_orig_mod.`), and all blocks share one compiled graph,
    so compile time does not grow with depth."""
    for block in model.layers.values():
        block.compile(fullgraph=True)
    logger.info(f"Compiled {len(model.layers)} transformer blocks with torch.compile")
