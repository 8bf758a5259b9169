"""Optimizer construction from the [optimizer] section."""

import torch
from torch import nn

from titan.config.job import Optimizer


def build_optimizer(model: nn.Module, cfg: Optimizer) -> torch.optim.Optimizer:
    """Adam or AdamW over every trainable parameter, with the kernel the config names."""
    optimizer_class = torch.optim.AdamW if cfg.name == "AdamW" else torch.optim.Adam
    params = [p for p in model.parameters() if p.requires_grad]
    return optimizer_class(
        params,
        lr=cfg.lr,
        betas=(cfg.beta1, cfg.beta2),
        eps=cfg.eps,
        weight_decay=cfg.weight_decay,
        foreach=cfg.implementation == "foreach",
        fused=cfg.implementation == "fused",
    )
