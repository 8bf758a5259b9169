"""The one model builder of the tests: any registered family's model from its args, built on meta, materialised on
the CPU and initialised from a seed as the trainer does; and, for comparisons with another implementation, the same
model with weights that init leaves too regular to show a misplaced one."""

import torch
from torch import nn

from titan.models.common.args import DecoderArgs
from titan.models.families import family_of
from titan.parallel.init import build_full_model


def build_model(args: DecoderArgs, seed: int = 0) -> nn.Module:
    """The family's model of `args` on the CPU, as the trainer builds a single process's weights
    (titan/parallel/init.py build_full_model): built on meta, materialised, then initialised from
    torch.manual_seed(seed), in training mode."""
    return build_full_model(family_of(args), args, torch.device("cpu"), seed)


def build_for_comparison(args: DecoderArgs, seed: int, routing_bias: bool = False) -> nn.Module:
    """build_model, then every norm weight drawn around 1, every router weight wider, and the projections' biases and
    attention sinks (where a family has them) nonzero, in eval mode; with `routing_bias`, each mixture of experts'
    routing bias (expert_bias) drawn nonzero too. Init's norms of exactly 1 would hide a norm weight in the wrong
    place or channel order, a zero bias a misplaced one, and a router near 0 gives top-k choices that a rounding
    difference between two implementations could flip."""
    model = build_model(args, seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(1.0, 0.3)
            elif "router" in name:
                param.normal_(0.0, 0.5)
            elif name.endswith(("bias", "sinks")):
                param.normal_(0.0, 0.5)
        if routing_bias:
            for name, buffer in model.named_buffers():
                if name.endswith("expert_bias"):
                    buffer.normal_(0.0, 0.3)
    return model.eval()
