"""Model converters: swap eligible nn.Linear layers for low-precision ones, and report why each layer was
converted or kept. A layer a recipe cannot handle is skipped here, with its reason, never left to fail
inside a kernel."""

from dataclasses import dataclass

from torch import nn

from titan.config.job import Float8
from titan.metrics.log import logger
from titan.quant.float8.linear import Float8Linear

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


def float8_skip_reason(fqn: str, linear: nn.Linear, cfg: Float8) -> str | None:
    """Why `linear` must stay in high precision under `cfg`, or None if it converts."""
    out_features, in_features = linear.weight.shape
    matched = [pattern for pattern in cfg.filter_fqns if pattern in fqn]
    if matched:
        return f"skipped: matches --float8.filter_fqns {matched[0]!r}"
    if out_features % FLOAT8_DIM_MULTIPLE or in_features % FLOAT8_DIM_MULTIPLE:
        return f"skipped: {out_features}x{in_features} not divisible by {FLOAT8_DIM_MULTIPLE} (float8 matmuls need it)"
    limits = SMALL_LINEAR_LIMITS[cfg.recipe_name]
    if cfg.auto_filter_small_kdims and any(out_features <= o and in_features <= i for o, i in limits):
        return f"skipped: too small to gain from float8 {cfg.recipe_name} (--float8.auto_filter_small_kdims)"
    return None


def apply_float8(model: nn.Module, cfg: Float8) -> list[LayerDecision]:
    """Swap every eligible nn.Linear of `model` for a Float8Linear in place; one decision per linear."""
    decisions = []
    for fqn, module in list(model.named_modules()):
        if type(module) is not nn.Linear:
            continue
        out_features, in_features = module.weight.shape
        reason = float8_skip_reason(fqn, module, cfg)
        if reason is None:
            parent_fqn, _, name = fqn.rpartition(".")
            parent = model.get_submodule(parent_fqn)
            setattr(parent, name, Float8Linear.from_linear(module, cfg.recipe_name, cfg.emulate))
            result = f"float8 {cfg.recipe_name}{' (emulated)' if cfg.emulate else ''}"
        else:
            result = reason
        decisions.append(LayerDecision(fqn, out_features, in_features, result, converted=reason is None))
    return decisions


def format_report(decisions: list[LayerDecision]) -> str:
    """The conversion report as a table: one row per linear layer."""
    width = max([len(d.fqn) for d in decisions] + [5])
    lines = [f"{'layer':<{width}}  {'out x in':>13}  result"]
    lines += [f"{d.fqn:<{width}}  {f'{d.out_features}x{d.in_features}':>13}  {d.result}" for d in decisions]
    converted = sum(d.converted for d in decisions)
    lines.append(f"{converted} of {len(decisions)} linear layers converted")
    return "\n".join(lines)


def apply_converters(model: nn.Module, converters: list[str], float8: Float8,
                     print_after_conversion: bool) -> list[LayerDecision]:
    """Run each converter named in --model.converters on `model` (on the meta device) and log the report."""
    decisions: list[LayerDecision] = []
    if "float8" in converters:
        decisions += apply_float8(model, float8)
    if decisions:
        logger.info(f"Model conversion report:\n{format_report(decisions)}")
    if print_after_conversion:
        logger.info(f"Model after conversion:\n{model}")
    return decisions
