"""Optimizer construction from the [optimizer] section: Adam, AdamW, or Muon with AdamW beside it."""

from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import _get_fused_kernels_supported_devices

from titan.config.errors import ConfigError
from titan.config.job import Optimizer
from titan.metrics.log import logger
from titan.models.common.moe import Router
from titan.parallel.ac import model_fqn
from titan.train.bf16_state import BF16StateAdam
from titan.train.muon import GroupOf, Muon


def build_optimizer(model: nn.Module, cfg: Optimizer, group_of: GroupOf | None = None,
                    compile_update: bool = True) -> torch.optim.Optimizer:
    """Adam or AdamW over every trainable parameter in parameter groups (parameter_groups), with the kernel the
    config names, or with bfloat16 moments (BF16StateAdam) under --optimizer.state_dtype bfloat16, whose update is
    compiled unless `compile_update` is off (the dry run's fake tensors have no values to run compiled kernels on);
    or Muon (titan/train/muon.py), whose sharded matrices gather over the process groups `group_of` gives (None on
    one process)."""
    groups = parameter_groups(model, cfg)
    implementation = kernel_for_device(cfg.implementation, groups[0]["params"][0].device.type)
    if uses_muon(cfg):
        return Muon(groups, lr=cfg.lr, weight_decay=cfg.weight_decay, momentum=cfg.momentum, nesterov=cfg.nesterov,
                    ns_coefficients=ns_coefficients(cfg), ns_steps=cfg.ns_steps, ns_eps=cfg.ns_eps,
                    adjust_lr_fn=cfg.adjust_lr_fn, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                    adamw_kernel=implementation, group_of=group_of)
    if cfg.state_dtype == "bfloat16":
        logger.info("Optimizer state: Adam's moments in bfloat16 with stochastic rounding (--optimizer.state_dtype)")
        return BF16StateAdam(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                             weight_decay=cfg.weight_decay, decoupled=cfg.name == "AdamW", compiled=compile_update)
    optimizer_class = torch.optim.AdamW if cfg.name == "AdamW" else torch.optim.Adam
    return optimizer_class(
        groups,
        lr=cfg.lr,
        betas=(cfg.beta1, cfg.beta2),
        eps=cfg.eps,
        weight_decay=cfg.weight_decay,
        foreach=implementation == "foreach",
        fused=implementation == "fused",
    )


def ns_coefficients(cfg: Optimizer) -> tuple[float, float, float]:
    """Muon's Newton-Schulz (a, b, c), torch.optim.Muon's ns_coefficients."""
    return cfg.ns_a, cfg.ns_b, cfg.ns_c


def uses_muon(cfg: Optimizer) -> bool:
    """--optimizer.name Muon, or DistMuon, torchtitan's name for it."""
    return cfg.name in ("Muon", "DistMuon")


def parameter_kind(fqn: str, param: nn.Parameter, embeddings: set[int], adamw_matrices: set[int]) -> str:
    """What a parameter is to the optimizer: an embedding, a norm or bias (1-D, or a stack of experts' biases, one
    row per expert), a matrix Muon updates (a hidden layer's weight, or a stack of experts' weights), or a matrix
    AdamW updates under Muon (`adamw_matrices`: the output projection, routers and --optimizer.adamw_fqns)."""
    if id(param) in embeddings:
        return "embeddings"
    if param.ndim < 2 or fqn.endswith("bias"):
        return "norms and biases"
    return "matrices" if id(param) in adamw_matrices else "hidden matrices"


def adamw_matrix_ids(model: nn.Module, cfg: Optimizer) -> set[int]:
    """The weight matrices Muon leaves to AdamW: the output projection (its rows are the vocabulary's, not a hidden
    layer's), each MoE router (few rows, and low precision or an orthogonal update would reshuffle the routing), and
    those --optimizer.adamw_fqns names. Empty unless the optimizer is Muon."""
    if not uses_muon(cfg):
        return set()
    modules = [getattr(model, "output", None), *(module for module in model.modules() if isinstance(module, Router))]
    ids = {id(param) for module in modules if module is not None for param in module.parameters()}
    return ids | {id(param) for fqn, param in model.named_parameters()
                  if any(substring in model_fqn(fqn) for substring in cfg.adamw_fqns)}


def parameter_groups(model: nn.Module, cfg: Optimizer) -> list[dict[str, Any]]:
    """The trainable parameters grouped by algorithm, weight decay and learning-rate multiplier, in the order of their
    first parameter. Weight matrices decay; 1-D parameters (norms, biases, attention sinks) and stacked experts'
    biases (`w1_bias`: one row per expert) only with --optimizer.decay_norm_and_bias and nn.Embedding weights only
    with --optimizer.decay_embeddings. Under Muon the hidden weight matrices form Muon's groups (`"algorithm":
    "muon"`) and everything else AdamW's ("adamw"), with the same decay rules. Each group records its
    `lr_multiplier`, which the LR schedule's base rate for the group includes. Logs one line per group."""
    embeddings = {id(param) for module in model.modules() if isinstance(module, nn.Embedding)
                  for param in module.parameters(recurse=False)}
    adamw_matrices = adamw_matrix_ids(model, cfg)
    multipliers = [parse_lr_multiplier(text) for text in cfg.lr_multipliers]
    decays = {"matrices": True, "hidden matrices": True, "norms and biases": cfg.decay_norm_and_bias,
              "embeddings": cfg.decay_embeddings}
    grouped: dict[tuple[str, float, float], list[tuple[str, str, nn.Parameter]]] = {}
    for fqn, param in model.named_parameters():
        if not param.requires_grad:
            continue
        kind = parameter_kind(fqn, param, embeddings, adamw_matrices)
        algorithm = "muon" if uses_muon(cfg) and kind == "hidden matrices" else "adamw"
        weight_decay = cfg.weight_decay if decays[kind] else 0.0
        # Matched against the model's own FQN, which validation checks the substrings against.
        multiplier = next((factor for substring, factor in multipliers if substring in model_fqn(fqn)), 1.0)
        grouped.setdefault((algorithm, weight_decay, multiplier), []).append((kind, fqn, param))
    if uses_muon(cfg) and not any(algorithm == "muon" for algorithm, _, _ in grouped):
        raise ConfigError(f"--optimizer.name {cfg.name} has no weight matrix to update: every one is the output "
                          f"projection, a router or named by --optimizer.adamw_fqns {cfg.adamw_fqns}. Name fewer, "
                          f"or use --optimizer.name AdamW.")
    groups = []
    for (algorithm, weight_decay, multiplier), members in grouped.items():
        group = {"params": [param for _, _, param in members], "weight_decay": weight_decay,
                 "lr": cfg.lr * multiplier, "lr_multiplier": multiplier}
        if uses_muon(cfg):
            group["algorithm"] = algorithm
        groups.append(group)
        kinds = ", ".join(dict.fromkeys(kind for kind, _, _ in members))
        optimizer = (f"{'Muon' if algorithm == 'muon' else 'AdamW'} " if uses_muon(cfg) else "")
        logger.info(f"Optimizer group: {optimizer}{len(members)} parameters ({kinds}; first {members[0][1]}), "
                    f"weight decay {weight_decay:g}, learning rate x{multiplier:g}")
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
