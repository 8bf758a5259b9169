"""Optimizer construction from the [optimizer] section."""

from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import _get_fused_kernels_supported_devices

from titan.config.job import Optimizer
from titan.metrics.log import logger
from titan.parallel.ac import model_fqn
from titan.train.bf16_state import BF16StateAdam


def build_optimizer(model: nn.Module, cfg: Optimizer, compile_update: bool = True) -> torch.optim.Optimizer:
    """Adam or AdamW over every trainable parameter in parameter groups (parameter_groups), with the kernel the
    config names, or with bfloat16 moments (BF16StateAdam) under --optimizer.state_dtype bfloat16, whose update is
    compiled unless `compile_update` is off (the dry run's fake tensors have no values to run compiled kernels on)."""
    groups = parameter_groups(model, cfg)
    if cfg.state_dtype == "bfloat16":
        logger.info("Optimizer state: Adam's moments in bfloat16 with stochastic rounding (--optimizer.state_dtype)")
        return BF16StateAdam(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                             weight_decay=cfg.weight_decay, decoupled=cfg.name == "AdamW", compiled=compile_update)
    optimizer_class = torch.optim.AdamW if cfg.name == "AdamW" else torch.optim.Adam
    implementation = kernel_for_device(cfg.implementation, groups[0]["params"][0].device.type)
    return optimizer_class(
        groups,
        lr=cfg.lr,
        betas=(cfg.beta1, cfg.beta2),
        eps=cfg.eps,
        weight_decay=cfg.weight_decay,
        foreach=implementation == "foreach",
        fused=implementation == "fused",
    )


def parameter_groups(model: nn.Module, cfg: Optimizer) -> list[dict[str, Any]]:
    """The trainable parameters grouped by weight decay and learning-rate multiplier, in the order of their first
    parameter. Weight matrices decay; 1-D parameters (norms, biases, attention sinks) and stacked experts' biases
    (`w1_bias`: one row per expert) only with --optimizer.decay_norm_and_bias and
    nn.Embedding weights only with --optimizer.decay_embeddings. Each group records its `lr_multiplier`, which the
    LR schedule's base rate for the group includes. Logs one line per group."""
    embeddings = {id(param) for module in model.modules() if isinstance(module, nn.Embedding)
                  for param in module.parameters(recurse=False)}
    multipliers = [parse_lr_multiplier(text) for text in cfg.lr_multipliers]
    decays = {"matrices": True, "norms and biases": cfg.decay_norm_and_bias, "embeddings": cfg.decay_embeddings}
    grouped: dict[tuple[float, float], list[tuple[str, str, nn.Parameter]]] = {}
    for fqn, param in model.named_parameters():
        if not param.requires_grad:
            continue
        if id(param) in embeddings:
            kind = "embeddings"
        else:
            kind = "norms and biases" if param.ndim < 2 or fqn.endswith("bias") else "matrices"
        weight_decay = cfg.weight_decay if decays[kind] else 0.0
        # Matched against the model's own FQN, which validation checks the substrings against.
        multiplier = next((factor for substring, factor in multipliers if substring in model_fqn(fqn)), 1.0)
        grouped.setdefault((weight_decay, multiplier), []).append((kind, fqn, param))
    groups = []
    for (weight_decay, multiplier), members in grouped.items():
        groups.append({"params": [param for _, _, param in members], "weight_decay": weight_decay,
                       "lr": cfg.lr * multiplier, "lr_multiplier": multiplier})
        kinds = ", ".join(dict.fromkeys(kind for kind, _, _ in members))
        logger.info(f"Optimizer group: {len(members)} parameters ({kinds}; first {members[0][1]}), weight decay "
                    f"{weight_decay:g}, learning rate x{multiplier:g}")
    return groups


def kernel_for_device(implementation: str, device_type: str) -> str:
    """`implementation`, or foreach where torch has no fused Adam kernel for the device: fused is the default, so a
    device without it (torch 2.13 has them for CPU, CUDA, XPU, MPS, HPU, MTIA) still trains."""
    if implementation == "fused" and device_type not in _get_fused_kernels_supported_devices():
        logger.info(f"--optimizer.implementation fused: torch has no fused Adam kernel for {device_type}; "
                    f"using foreach")
        return "foreach"
    return implementation


def parse_lr_multiplier(text: str) -> tuple[str, float]:
    """"FQN_SUBSTRING=FACTOR" as (substring, factor); ValueError unless the substring is non-empty and the factor a
    positive number (validation reports it with the field's name)."""
    substring, separator, factor = text.rpartition("=")
    if not separator or not substring or not float(factor) > 0:
        raise ValueError(f"{text!r} is not FQN_SUBSTRING=FACTOR with a positive FACTOR")
    return substring, float(factor)
