"""Optimizer construction from the [optimizer] section."""

import torch
from torch import nn
from torch.optim.optimizer import _get_fused_kernels_supported_devices

from titan.config.job import Optimizer
from titan.metrics.log import logger


def build_optimizer(model: nn.Module, cfg: Optimizer) -> torch.optim.Optimizer:
    """Adam or AdamW over every trainable parameter, with the kernel the config names."""
    optimizer_class = torch.optim.AdamW if cfg.name == "AdamW" else torch.optim.Adam
    params = [p for p in model.parameters() if p.requires_grad]
    implementation = kernel_for_device(cfg.implementation, params[0].device.type)
    return optimizer_class(
        params,
        lr=cfg.lr,
        betas=(cfg.beta1, cfg.beta2),
        eps=cfg.eps,
        weight_decay=cfg.weight_decay,
        foreach=implementation == "foreach",
        fused=implementation == "fused",
    )


def kernel_for_device(implementation: str, device_type: str) -> str:
    """`implementation`, or foreach where torch has no fused Adam kernel for the device: fused is the default, so a
    device without it (torch 2.13 has them for CPU, CUDA, XPU, MPS, HPU, MTIA) still trains."""
    if implementation == "fused" and device_type not in _get_fused_kernels_supported_devices():
        logger.info(f"--optimizer.implementation fused: torch has no fused Adam kernel for {device_type}; "
                    f"using foreach")
        return "foreach"
    return implementation
