"""torch.compile per transformer block, and of the loss."""

from torch import nn

from titan.metrics.log import logger


def apply_compile(model: nn.Module, emulate_precision_casts: bool, fullgraph: bool = True,
                  backend: str = "inductor") -> None:
    """Compile each block of `model.layers` and the loss of the logits in place. nn.Module.compile keeps parameter
    FQNs unchanged (wrapping with torch.compile() would add `_orig_mod.`), and all blocks share one compiled graph,
    so compile time does not grow with depth. `fullgraph`: one graph per block, no graph breaks (off for blocks
    that read sizes on the host). `backend`: torch.compile's (--compile.backend). emulate_precision_casts makes
    inductor round intermediates as eager does; without it, float8 rowwise + RMSNorm has given NaN losses
    (torch >= 2.6).

    The loss compiles per chunk of logits (OutputLoss.compile_logits_loss)."""
    import torch._inductor.config  # here, not at the top: importing inductor costs every process's start-up ~0.7 s

    torch._inductor.config.emulate_precision_casts = emulate_precision_casts
    for block in model.layers.values():
        block.compile(fullgraph=fullgraph, backend=backend)
    if model.output is not None:
        model.output_loss.compile_logits_loss(backend)
    casts = ", emulating eager precision casts" if emulate_precision_casts else ""
    logger.info(f"Compiled {len(model.layers)} transformer blocks and the loss with torch.compile ({backend}{casts})")
