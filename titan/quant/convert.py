"""Model converters: swap eligible nn.Linear layers for low-precision ones, report why each layer was converted or
kept, and say what the converted model needs at each step. A layer a recipe cannot handle is skipped here, with its
reason, never left to fail inside a kernel."""

from collections.abc import Callable
from dataclasses import dataclass, replace

from torch import nn

from titan.config.errors import ConfigError
from titan.config.job import MX, Float8
from titan.metrics.log import logger
from titan.models.common.moe import GroupedExperts
from titan.quant.float8.fsdp import apply_float8_all_gather, precompute_float8_scales
from titan.quant.float8.linear import Float8Linear
from titan.quant.formats import MX_BLOCK_SIZE
from titan.quant.mx.linear import MXLinear

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


def filter_reason(fqn: str, filter_fqns: list[str], flag: str) -> str | None:
    """The skip reason when `fqn` is a router or contains one of the `flag` substrings, else None."""
    if fqn.endswith(ROUTER_SUFFIX):
        return "skipped: a router (its logits pick the experts; low precision would change the routing)"
    matched = [pattern for pattern in filter_fqns if pattern in fqn]
    return f"skipped: matches {flag} {matched[0]!r}" if matched else None


def float8_skip_reason(fqn: str, linear: nn.Linear, cfg: Float8) -> str | None:
    """Why `linear` must stay in high precision under `cfg`, or None if it converts."""
    out_features, in_features = linear.weight.shape
    filtered = filter_reason(fqn, cfg.filter_fqns, "--float8.filter_fqns")
    if filtered:
        return filtered
    if out_features % FLOAT8_DIM_MULTIPLE or in_features % FLOAT8_DIM_MULTIPLE:
        return f"skipped: {out_features}x{in_features} not divisible by {FLOAT8_DIM_MULTIPLE} (float8 matmuls need it)"
    limits = SMALL_LINEAR_LIMITS[cfg.recipe_name]
    if cfg.auto_filter_small_kdims and any(out_features <= o and in_features <= i for o, i in limits):
        return f"skipped: too small to gain from float8 {cfg.recipe_name} (--float8.auto_filter_small_kdims)"
    return None


def mx_skip_reason(fqn: str, linear: nn.Linear, cfg: MX, tp_degree: int) -> str | None:
    """Why `linear` must stay in high precision under `cfg` on a `tp_degree`-way TP mesh, or None if it converts."""
    out_features, in_features = linear.weight.shape
    filtered = filter_reason(fqn, cfg.filter_fqns, "--mx.filter_fqns")
    if filtered:
        return filtered
    # Both dims are contracted by some matmul (in by the output, out by grad_input), so both need whole blocks.
    if out_features % MX_BLOCK_SIZE or in_features % MX_BLOCK_SIZE:
        return f"skipped: {out_features}x{in_features} not divisible by the MX block size {MX_BLOCK_SIZE}"
    # TP splits one of the two dims; every rank quantizes its shard, so a shard must hold whole blocks too.
    shard_multiple = MX_BLOCK_SIZE * tp_degree
    if out_features % shard_multiple or in_features % shard_multiple:
        return (f"skipped: {out_features}x{in_features} does not split into {tp_degree} TP shards of whole "
                f"{MX_BLOCK_SIZE}-element MX blocks")
    return None


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
        decisions.append(LayerDecision(fqn, out_features, in_features, reason or result, converted=reason is None))
    return decisions


def apply_float8(model: nn.Module, cfg: Float8) -> list[LayerDecision]:
    """Swap every eligible nn.Linear of `model` for a Float8Linear in place; one decision per linear."""
    return swap_linears(model, lambda fqn, linear: float8_skip_reason(fqn, linear, cfg),
                        lambda linear: Float8Linear.from_linear(linear, recipe_name=cfg.recipe_name,
                                                                emulate=cfg.emulate),
                        f"float8 {cfg.recipe_name}{' (emulated)' if cfg.emulate else ''}")


def apply_mx(model: nn.Module, cfg: MX, tp_degree: int) -> list[LayerDecision]:
    """Swap every eligible nn.Linear of `model` for an MXLinear in place; one decision per linear."""
    return swap_linears(model, lambda fqn, linear: mx_skip_reason(fqn, linear, cfg, tp_degree),
                        lambda linear: MXLinear.from_linear(linear, recipe_name=cfg.recipe_name, emulate=cfg.emulate),
                        f"mx {cfg.recipe_name}{' (emulated)' if cfg.emulate else ''}")


def check_disjoint_converters(model: nn.Module, float8: Float8, mx: MX, tp_degree: int) -> None:
    """Raise a ConfigError naming the linears that float8 and mx would both convert: a layer takes one recipe."""
    both = [fqn for fqn, module in model.named_modules() if type(module) is nn.Linear
            and float8_skip_reason(fqn, module, float8) is None and mx_skip_reason(fqn, module, mx, tp_degree) is None]
    if both:
        shown = ", ".join(both[:4]) + (f" and {len(both) - 4} more" if len(both) > 4 else "")
        raise ConfigError([f"--model.converters float8 and mx would both convert {len(both)} linear layers ({shown}). "
                           f"Each layer takes one recipe: add FQN substrings to --float8.filter_fqns or "
                           f"--mx.filter_fqns so that they split the layers, e.g. --float8.filter_fqns output "
                           f"feed_forward --mx.filter_fqns output attention."])


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


def experts_note(model: nn.Module) -> str:
    """The report's line on a mixture of experts' experts, which are stacked weights rather than linears: they stay
    in high precision (no grouped low-precision matmul here yet)."""
    experts = [fqn for fqn, module in model.named_modules() if isinstance(module, GroupedExperts)]
    if not experts:
        return ""
    return (f"\nThe experts of {len(experts)} MoE layers ({experts[0]}, ...) stay in high precision: grouped "
            f"expert matmuls have no float8 or MX recipe here.")


def format_report(decisions: list[LayerDecision]) -> str:
    """The conversion report as a table: one row per linear layer."""
    width = max([len(d.fqn) for d in decisions] + [5])
    lines = [f"{'layer':<{width}}  {'out x in':>13}  result"]
    lines += [f"{d.fqn:<{width}}  {f'{d.out_features}x{d.in_features}':>13}  {d.result}" for d in decisions]
    converted = sum(d.converted for d in decisions)
    lines.append(f"{converted} of {len(decisions)} linear layers converted")
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


def apply_converters(model: nn.Module, converters: list[str], float8: Float8, mx: MX, tp_degree: int,
                     fsdp_enabled: bool, print_after_conversion: bool) -> Conversion:
    """Run each converter named in --model.converters on `model` (on the meta device) and log the report. With
    `fsdp_enabled` and --float8.enable_fsdp_float8_all_gather, FSDP (applied later) all-gathers the float8 weights
    in float8."""
    if "float8" in converters and "mx" in converters:
        check_disjoint_converters(model, float8, mx, tp_degree)
    decisions: list[LayerDecision] = []
    if "float8" in converters:
        decisions += apply_float8(model, float8)
    if "mx" in converters:
        decisions += apply_mx(model, mx, tp_degree)
    decisions = merge_decisions(decisions)
    if decisions:
        logger.info(f"Model conversion report:\n{format_report(decisions)}{experts_note(model)}")
    float8_all_gather = "float8" in converters and float8.enable_fsdp_float8_all_gather and fsdp_enabled
    if float8_all_gather:
        apply_float8_all_gather(model)
    if print_after_conversion:
        logger.info(f"Model after conversion:\n{model}")
    return Conversion(decisions, precompute_float8_scales=float8_all_gather
                      and float8.precompute_float8_dynamic_scale_for_fsdp)
