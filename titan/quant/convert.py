"""Model converters: swap eligible nn.Linear layers for low-precision ones and give eligible mixture-of-experts
experts low-precision grouped matmuls, report why each layer was converted or kept, and say what the converted model
needs at each step. A layer a recipe cannot handle is skipped here, with its reason, never left to fail inside a
kernel."""

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

from torch import nn

from titan.config.errors import ConfigError
from titan.config.job import MX, NVFP4, Float8
from titan.metrics.log import logger
from titan.models.common.moe import ExpertMatmuls, GroupedExperts, HighPrecisionMatmuls, MoE, moe_layers
from titan.quant.float8.blockwise import Float8BlockwiseLinear
from titan.quant.float8.blockwise_grouped import BLOCKWISE_GROUP_ALIGNMENT, BlockwiseExpertMatmuls
from titan.quant.float8.fsdp import apply_float8_all_gather, precompute_float8_scales
from titan.quant.float8.grouped import FLOAT8_GROUP_ALIGNMENT, Float8ExpertMatmuls
from titan.quant.float8.linear import Float8Linear
from titan.quant.formats import FLOAT8_BLOCK_SIZE, MX_BLOCK_SIZE, NVFP4_CONTRACTION_MULTIPLE
from titan.quant.mx.grouped import MX_GROUP_ALIGNMENT, MXExpertMatmuls
from titan.quant.mx.linear import MXLinear
from titan.quant.nvfp4.linear import NVFP4Linear

# A mixture of experts' router (titan/models/common/moe.py Router.gate): kept in high precision whatever the recipe.
ROUTER_SUFFIX = ".router.gate"
# Float8 matmul kernels (cuBLASLt, torch._scaled_mm) need both weight dims divisible by 16.
FLOAT8_DIM_MULTIPLE = 16

# Sizes at or below which a float8 linear is no faster than bf16 on H100, from torchao's float8 benchmarks
# (torchao/float8 README, "tensorwise scaling" and "rowwise scaling" tables): (max out, max in) pairs,
# a layer is "too small" when out <= max_out and in <= max_in for any pair.
SMALL_LINEAR_LIMITS = {
    "tensorwise": ((4096, 1024),),
    "rowwise": ((2**62, 2048), (1024, 2**62), (2048, 4096)),
}
SMALL_LINEAR_LIMITS["rowwise_with_gw_hp"] = SMALL_LINEAR_LIMITS["rowwise"]


@dataclass(frozen=True)
class LayerDecision:
    fqn: str
    out_features: int
    in_features: int
    result: str
    """What happened: the recipe it was converted to, or why it was kept in high precision."""
    converted: bool
    num_experts: int = 0
    """For a mixture of experts' experts: how many experts of out_features (hidden) x in_features (dim) SwiGLU
    weights; 0 for a linear."""
    flops_per_token: int = 0
    """Multiply-adds of its forward matmuls per token: in x out for a linear, top_k x 3 x dim x hidden for experts."""


def filter_reason(fqn: str, filter_fqns: list[str], flag: str) -> str | None:
    """The skip reason when `fqn` is a router or contains one of the `flag` substrings, else None."""
    if fqn.endswith(ROUTER_SUFFIX):
        return "skipped: a router (its logits pick the experts; low precision would change the routing)"
    matched = [pattern for pattern in filter_fqns if pattern in fqn]
    return f"skipped: matches {flag} {matched[0]!r}" if matched else None


def indivisible_reason(rows: int, cols: int, multiple: int, divisor: str) -> str | None:
    """The skip reason when a rows x cols weight's dims are not both multiples of `multiple`, which `divisor` names
    ("16 (float8 matmuls need it)"), else None."""
    if rows % multiple or cols % multiple:
        return f"skipped: {rows}x{cols} not divisible by {divisor}"
    return None


def shard_blocks_reason(rows: int, cols: int, block: int, tp_degree: int, blocks: str) -> str | None:
    """The skip reason when a rows x cols weight's `tp_degree` TP shards do not hold whole blocks of `block` along
    both dims (each is some matmul's contraction dim, and every rank quantizes its own shard), else None."""
    shard_multiple = block * tp_degree
    if rows % shard_multiple or cols % shard_multiple:
        return f"skipped: {rows}x{cols} does not split into {tp_degree} TP shards of whole {blocks}"
    return None


def float8_skip_reason(fqn: str, linear: nn.Linear, cfg: Float8, tp_degree: int) -> str | None:
    """Why `linear` must stay in high precision under `cfg` on a `tp_degree`-way TP mesh, or None if it converts."""
    out_features, in_features = linear.weight.shape
    filtered = filter_reason(fqn, cfg.filter_fqns, "--float8.filter_fqns")
    if filtered:
        return filtered
    if cfg.recipe_name == "blockwise":
        return (indivisible_reason(out_features, in_features, FLOAT8_BLOCK_SIZE,
                                   f"{FLOAT8_BLOCK_SIZE} (blockwise float8's tiles and blocks)")
                or shard_blocks_reason(out_features, in_features, FLOAT8_BLOCK_SIZE, tp_degree,
                                       f"{FLOAT8_BLOCK_SIZE}-element blockwise float8 tiles"))
    reason = indivisible_reason(out_features, in_features, FLOAT8_DIM_MULTIPLE,
                                f"{FLOAT8_DIM_MULTIPLE} (float8 matmuls need it)")
    if reason:
        return reason
    limits = SMALL_LINEAR_LIMITS[cfg.recipe_name]
    if cfg.auto_filter_small_kdims and any(out_features <= o and in_features <= i for o, i in limits):
        return f"skipped: too small to gain from float8 {cfg.recipe_name} (--float8.auto_filter_small_kdims)"
    return None


def mx_skip_reason(fqn: str, linear: nn.Linear, cfg: MX, tp_degree: int) -> str | None:
    """Why `linear` must stay in high precision under `cfg` on a `tp_degree`-way TP mesh, or None if it converts."""
    out_features, in_features = linear.weight.shape
    # Both dims are contracted by some matmul (in by the output, out by grad_input), so both need whole blocks.
    reason = (filter_reason(fqn, cfg.filter_fqns, "--mx.filter_fqns")
              or indivisible_reason(out_features, in_features, MX_BLOCK_SIZE, f"the MX block size {MX_BLOCK_SIZE}"))
    # TP splits one of the two dims; every rank quantizes its shard, so a shard must hold whole blocks too.
    return reason or shard_blocks_reason(out_features, in_features, MX_BLOCK_SIZE, tp_degree,
                                         f"{MX_BLOCK_SIZE}-element MX blocks")


def last_blocks(model: nn.Module, fraction: float) -> set[str]:
    """The FQN prefixes ("layers.<i>.") of the last ceil(n_layers x fraction) blocks of `model` (none without a
    `layers` dict): torchtitan's rule for the blocks NVFP4 leaves in high precision."""
    names = list(getattr(model, "layers", {}))
    kept = math.ceil(len(names) * fraction)
    return {f"layers.{name}." for name in names[len(names) - kept:]} if kept else set()


def nvfp4_skip_reason(fqn: str, linear: nn.Linear, cfg: NVFP4, kept_blocks: set[str], tp_degree: int) -> str | None:
    """Why `linear` must stay in high precision under `cfg` on a `tp_degree`-way TP mesh, or None if it converts;
    `kept_blocks`: last_blocks."""
    out_features, in_features = linear.weight.shape
    filtered = filter_reason(fqn, cfg.filter_fqns, "--nvfp4.filter_fqns")
    if filtered:
        return filtered
    if any(fqn.startswith(prefix) for prefix in kept_blocks):
        return (f"skipped: one of the last {len(kept_blocks)} blocks (--nvfp4.high_precision_last_blocks_fraction "
                f"{cfg.high_precision_last_blocks_fraction})")
    # Both dims are some matmul's contraction dim, whose packed FP4 rows block-scaled GEMMs read in 16-byte units;
    # under TP, of each rank's shard.
    return (indivisible_reason(out_features, in_features, NVFP4_CONTRACTION_MULTIPLE,
                               f"{NVFP4_CONTRACTION_MULTIPLE}, the NVFP4 matmuls' contraction multiple")
            or shard_blocks_reason(out_features, in_features, NVFP4_CONTRACTION_MULTIPLE, tp_degree,
                                   f"{NVFP4_CONTRACTION_MULTIPLE}-element NVFP4 contractions"))


def expert_skip_reason(fqn: str, experts: GroupedExperts, moe_fqns: list[str], flag: str,
                       alignment: int) -> str | None:
    """Why `experts` must stay in high precision, or None if they convert: they are not named by `flag`
    (`moe_fqns`), or a weight's two sizes (each is contracted, one in the forward and one in the input's gradient)
    are not multiples of the recipe's `alignment`. The weights are read by name (GroupedExperts.weight_names)."""
    if not any(pattern in fqn for pattern in moe_fqns):
        return f"skipped: not matched by {flag}" + (f" {' '.join(moe_fqns)}" if moe_fqns else " (empty)")
    for name in experts.weight_names:
        _, out_features, in_features = getattr(experts, name).shape
        reason = indivisible_reason(out_features, in_features, alignment, f"{alignment} (the grouped kernels need it)")
        if reason is not None:
            return reason
    return None


def convert_experts(model: nn.Module, moe_fqns: list[str], flag: str, alignment: int, matmuls: ExpertMatmuls,
                    result: str) -> list[LayerDecision]:
    """Give the experts of every MoE layer that expert_skip_reason keeps (for `flag`'s `moe_fqns` and the recipe's
    `alignment`) the grouped `matmuls`; experts an earlier converter took are left alone."""
    decisions = []
    for fqn, moe in high_precision_experts(model).items():
        reason = expert_skip_reason(f"{fqn}.experts", moe.experts, moe_fqns, flag, alignment)
        if reason is None:
            moe.experts.matmuls = matmuls
        decisions.append(expert_decision(fqn, moe, reason or result, converted=reason is None))
    return decisions


def high_precision_experts(model: nn.Module) -> dict[str, MoE]:
    """The MoE layers of `model` whose experts no converter has taken yet, by FQN."""
    return {fqn: moe for fqn, moe in moe_layers(model).items() if isinstance(moe.experts.matmuls, HighPrecisionMatmuls)}


def expert_decision(fqn: str, moe: MoE, result: str, converted: bool) -> LayerDecision:
    """The report's row for the experts of the MoE layer `moe` at `fqn`."""
    experts = moe.experts
    flops = sum(getattr(experts, name)[0].numel() for name in experts.weight_names)  # multiply-adds of one expert
    return LayerDecision(f"{fqn}.experts", experts.hidden_dim, experts.dim, result, converted,
                         num_experts=experts.num_experts, flops_per_token=moe.top_k * flops)


def swap_linears(model: nn.Module, skip_reason: Callable[[str, nn.Linear], str | None],
                 build: Callable[[nn.Linear], nn.Linear], result: str) -> list[LayerDecision]:
    """Replace every plain nn.Linear of `model` that `skip_reason` keeps (returns None for) with build(linear);
    linears an earlier converter swapped are not plain nn.Linear and are left alone."""
    decisions = []
    for fqn, module in list(model.named_modules()):
        if type(module) is not nn.Linear:
            continue
        out_features, in_features = module.weight.shape
        reason = skip_reason(fqn, module)
        if reason is None:
            parent_fqn, _, name = fqn.rpartition(".")
            setattr(model.get_submodule(parent_fqn), name, build(module))
        decisions.append(LayerDecision(fqn, out_features, in_features, reason or result, converted=reason is None,
                                       flops_per_token=out_features * in_features))
    return decisions


def float8_group_alignment(cfg: Float8) -> int:
    """Rows per token-block step of the float8 experts, and what their weights' dims must be multiples of."""
    return BLOCKWISE_GROUP_ALIGNMENT if cfg.recipe_name == "blockwise" else FLOAT8_GROUP_ALIGNMENT


def apply_float8(model: nn.Module, cfg: Float8, tp_degree: int) -> list[LayerDecision]:
    """Swap every eligible nn.Linear of `model` for a Float8Linear (Float8BlockwiseLinear for the blockwise recipe)
    and give eligible experts float8 grouped matmuls, in place; one decision per linear and per MoE layer's experts."""
    emulated = " (emulated)" if cfg.emulate else ""
    blockwise = cfg.recipe_name == "blockwise"

    def build(linear: nn.Linear) -> nn.Linear:
        if blockwise:
            return Float8BlockwiseLinear.from_linear(linear, emulate=cfg.emulate)
        return Float8Linear.from_linear(linear, recipe_name=cfg.recipe_name, emulate=cfg.emulate)

    if blockwise:
        # No blockwise grouped kernel runs here (titan/quant/float8/blockwise_grouped.py): say so, natively too.
        matmuls = BlockwiseExpertMatmuls()
        grouped = (f"float8 blockwise grouped, token groups padded to {BLOCKWISE_GROUP_ALIGNMENT}, emulated: bf16 "
                   f"grouped matmuls of the dequantized values (no blockwise grouped kernel; slower than bf16)")
    else:
        matmuls = Float8ExpertMatmuls(cfg.recipe_name, cfg.emulate)
        grouped = f"float8 {cfg.recipe_name} grouped, token groups padded to {FLOAT8_GROUP_ALIGNMENT}{emulated}"
    linears = swap_linears(model, lambda fqn, linear: float8_skip_reason(fqn, linear, cfg, tp_degree), build,
                           f"float8 {cfg.recipe_name}{emulated}")
    experts = convert_experts(model, cfg.moe_fqns_prototype, "--float8.moe_fqns_prototype",
                              float8_group_alignment(cfg), matmuls, grouped)
    return linears + experts


def apply_mx(model: nn.Module, cfg: MX, tp_degree: int) -> list[LayerDecision]:
    """Swap every eligible nn.Linear of `model` for an MXLinear and give eligible experts MXFP8 grouped matmuls, in
    place; one decision per linear and per MoE layer's experts."""
    emulated = " (emulated)" if cfg.emulate else ""
    linears = swap_linears(model, lambda fqn, linear: mx_skip_reason(fqn, linear, cfg, tp_degree),
                           lambda linear: MXLinear.from_linear(linear, recipe_name=cfg.recipe_name,
                                                               emulate=cfg.emulate),
                           f"mx {cfg.recipe_name}{emulated}")
    experts = convert_experts(model, cfg.moe_fqns_prototype, "--mx.moe_fqns_prototype", MX_GROUP_ALIGNMENT,
                              MXExpertMatmuls(cfg.emulate, cfg.recipe_name),
                              f"mx {cfg.recipe_name} grouped, token groups padded to {MX_GROUP_ALIGNMENT}{emulated}")
    return linears + experts


def apply_nvfp4(model: nn.Module, cfg: NVFP4, tp_degree: int) -> list[LayerDecision]:
    """Swap every eligible nn.Linear of `model` for an NVFP4Linear in place; one decision per linear, and one per
    MoE layer's experts, which stay in high precision."""
    kept_blocks = last_blocks(model, cfg.high_precision_last_blocks_fraction)
    linears = swap_linears(model, lambda fqn, linear: nvfp4_skip_reason(fqn, linear, cfg, kept_blocks, tp_degree),
                           lambda linear: NVFP4Linear.from_linear(linear, emulate=cfg.emulate),
                           f"nvfp4{' (emulated)' if cfg.emulate else ''}")
    # torchao 0.18 has no NVFP4 grouped training recipe to match (its grouped NVFP4 matmuls are forward-only).
    kept = ("skipped: no NVFP4 grouped-matmul training recipe (torchao 0.18 has none); --model.converters mx or "
            "float8 convert experts")
    return linears + [expert_decision(fqn, moe, kept, converted=False)
                      for fqn, moe in high_precision_experts(model).items()]


def check_disjoint_converters(model: nn.Module, float8: Float8, mx: MX, tp_degree: int) -> None:
    """Raise a ConfigError naming the linears and experts that float8 and mx would both convert: a layer takes one
    recipe."""
    linears = [fqn for fqn, module in model.named_modules() if type(module) is nn.Linear
               and float8_skip_reason(fqn, module, float8, tp_degree) is None
               and mx_skip_reason(fqn, module, mx, tp_degree) is None]
    experts = [f"{fqn}.experts" for fqn, moe in moe_layers(model).items()
               if expert_skip_reason(f"{fqn}.experts", moe.experts, float8.moe_fqns_prototype, "",
                                     float8_group_alignment(float8)) is None
               and expert_skip_reason(f"{fqn}.experts", moe.experts, mx.moe_fqns_prototype, "",
                                      MX_GROUP_ALIGNMENT) is None]
    problems = []
    if linears:
        problems.append(f"--model.converters float8 and mx would both convert {len(linears)} linear layers "
                        f"({listed(linears)}). Each layer takes one recipe: add FQN substrings to --float8.filter_fqns "
                        f"or --mx.filter_fqns so that they split the layers, e.g. --float8.filter_fqns output "
                        f"feed_forward --mx.filter_fqns output attention.")
    if experts:
        problems.append(f"--model.converters float8 and mx would both convert the experts of {len(experts)} MoE "
                        f"layers ({listed(experts)}). Each takes one recipe: split them between "
                        f"--float8.moe_fqns_prototype and --mx.moe_fqns_prototype (e.g. --float8.moe_fqns_prototype "
                        f"layers.0. --mx.moe_fqns_prototype layers.1.), or give one of them no value.")
    if problems:
        raise ConfigError(problems)


def listed(fqns: list[str]) -> str:
    """The first four FQNs, and how many more."""
    return ", ".join(fqns[:4]) + (f" and {len(fqns) - 4} more" if len(fqns) > 4 else "")


def merge_decisions(decisions: list[LayerDecision]) -> list[LayerDecision]:
    """One decision per linear: the converter that took it, or every converter's reason for skipping it."""
    by_fqn: dict[str, LayerDecision] = {}
    for decision in decisions:
        earlier = by_fqn.get(decision.fqn)
        if earlier is None or decision.converted:
            by_fqn[decision.fqn] = decision
        elif not earlier.converted:
            by_fqn[decision.fqn] = replace(earlier, result=f"{earlier.result}; {decision.result}")
    return list(by_fqn.values())


def format_report(decisions: list[LayerDecision]) -> str:
    """The conversion report as a table: one row per linear layer and per MoE layer's experts (experts x out x in),
    and the share of the weight matmuls' FLOPs per token that runs in low precision (attention's score matmuls have
    no weights: they stay in high precision and out of the share)."""
    def shape(d: LayerDecision) -> str:
        sizes = f"{d.out_features}x{d.in_features}"
        return f"{d.num_experts}x{sizes}" if d.num_experts else sizes

    width = max([len(d.fqn) for d in decisions] + [5])
    shape_width = max([len(shape(d)) for d in decisions] + [8])
    lines = [f"{'layer':<{width}}  {'out x in':>{shape_width}}  result"]
    lines += [f"{d.fqn:<{width}}  {shape(d):>{shape_width}}  {d.result}" for d in decisions]
    linears = [d for d in decisions if not d.num_experts]
    experts = [d for d in decisions if d.num_experts]
    summary = f"{sum(d.converted for d in linears)} of {len(linears)} linear layers converted"
    if experts:
        summary += f", and the experts of {sum(d.converted for d in experts)} of {len(experts)} MoE layers"
    low_precision = sum(d.flops_per_token for d in decisions if d.converted)
    share = 100 * low_precision / sum(d.flops_per_token for d in decisions)
    per_token = " (a token's top_k experts' among them)" if experts else ""
    lines.append(f"{summary}: {share:.1f}% of the weight matmuls' FLOPs per token{per_token} run in low precision")
    return "\n".join(lines)


@dataclass(frozen=True)
class Conversion:
    """What apply_converters did to a model, and what the converted model needs after each optimizer step."""

    decisions: list[LayerDecision]
    precompute_float8_scales: bool
    """Whether the float8 weights that FSDP all-gathers get their global amaxes in one all-reduce after each
    optimizer step (--float8.precompute_float8_dynamic_scale_for_fsdp), instead of one per weight at each
    all-gather."""

    def after_optimizer_step(self, model: nn.Module) -> None:
        """The per-step work of the converted layers of `model` (this rank's share), after optimizer.step()."""
        if self.precompute_float8_scales:
            precompute_float8_scales(model)


def apply_converters(model: nn.Module, converters: list[str], float8: Float8, mx: MX, nvfp4: NVFP4, tp_degree: int,
                     fsdp_enabled: bool, print_after_conversion: bool) -> Conversion:
    """Run each converter named in --model.converters on `model` (on the meta device) and log the report. With
    `fsdp_enabled` and --float8.enable_fsdp_float8_all_gather, FSDP (applied later) all-gathers the float8 weights
    in float8."""
    if "float8" in converters and "mx" in converters:
        check_disjoint_converters(model, float8, mx, tp_degree)
    decisions: list[LayerDecision] = []
    if "float8" in converters:
        decisions += apply_float8(model, float8, tp_degree)
    if "mx" in converters:
        decisions += apply_mx(model, mx, tp_degree)
    if "nvfp4" in converters:
        decisions += apply_nvfp4(model, nvfp4, tp_degree)
    decisions = merge_decisions(decisions)
    if decisions:
        logger.info(f"Model conversion report:\n{format_report(decisions)}")
    float8_all_gather = "float8" in converters and float8.enable_fsdp_float8_all_gather and fsdp_enabled
    if float8_all_gather:
        apply_float8_all_gather(model)
    if print_after_conversion:
        logger.info(f"Model after conversion:\n{model}")
    return Conversion(decisions, precompute_float8_scales=float8_all_gather
                      and float8.precompute_float8_dynamic_scale_for_fsdp)
