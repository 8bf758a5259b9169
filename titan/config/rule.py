"""What a config rule is, and what the rules of several stages read.

Each stage keeps its cross-field rules beside it (titan/parallel/rules.py, titan/quant/rules.py, titan/data/rules.py,
titan/checkpoint/rules.py, titan/train/rules.py); titan/validate.py, above the stages, runs them all and reports every
problem at once. A rule is one function returning a problem line, several, or None. Its parameters are named for the
JobConfig sections it reads (`model`, `parallelism`, ...), plus `world_size` (the processes of the run) or
`accelerator` (the GPU or CPU it runs on: a hardware rule) where it needs them, so that a rule's signature says what it
depends on and a test can call it on the sections alone.
"""

import dataclasses
import difflib
import re
from collections.abc import Callable
from typing import Any, TypeVar

from titan.config.domain import field_ranges
from titan.config.job import JobConfig, Model
from titan.models.families import FAMILIES

Problems = str | list[str] | None
Rule = Callable[..., Problems]
AnyRule = TypeVar("AnyRule", bound=Rule)


def check_domains(cfg: JobConfig) -> tuple[list[str], set[str]]:
    """Every numeric field against the Range declared on its type (titan/config/domain.py). Returns the problems
    and the "section.name" of each field out of its range."""
    problems: list[str] = []
    bad_fields: set[str] = set()
    defaults = JobConfig()
    for section_field in dataclasses.fields(cfg):
        section = getattr(cfg, section_field.name)
        for field_name, domain in field_ranges(type(section)).items():
            value = getattr(section, field_name)
            if value is None or domain.contains(value):
                continue
            name = f"{section_field.name}.{field_name}"
            default = getattr(getattr(defaults, section_field.name), field_name)
            problems.append(f"--{name} {value} must be {domain.describe()}. Try {default} (the default).")
            bad_fields.add(name)
    return problems, bad_fields


def needs_in_range(*fields: str) -> Callable[[AnyRule], AnyRule]:
    """Mark a rule that computes with these fields ("section.name"): validation skips it while any of them is
    out of its range, since that problem is already reported and the rule could divide by zero."""
    def mark(rule: AnyRule) -> AnyRule:
        rule.needs_in_range = fields  # type: ignore[attr-defined]
        return rule
    return mark


def about_this_machine(rule: AnyRule) -> AnyRule:
    """Mark a rule that checks this machine's files or packages, not the config: a dry run (--job.dry_run) reads no
    files, so validation skips these rules for it, and --job.print_config shows what they find as warnings. Rules
    about the GPU take the `accelerator`, the one the dry run simulates."""
    rule.about_this_machine = True  # type: ignore[attr-defined]
    return rule


def found_problems(found: Problems) -> list[str]:
    """A rule's result as a list of problem lines."""
    if isinstance(found, str):
        return [found]
    return list(found or [])


def fields_set(section: object) -> dict[str, object]:
    """The fields of a config section (cfg.chat, cfg.training, ...) set away from their defaults, by name."""
    defaults = type(section)()
    return {item.name: getattr(section, item.name) for item in dataclasses.fields(section)
            if getattr(section, item.name) != getattr(defaults, item.name)}


def flavor_args(model: Model) -> Any:
    """The shape of --model.flavor in --model.name's family, or None when the family has no such flavor
    (titan/train/rules.py check_flavor reports it, and the rules that read the shape skip)."""
    return FAMILIES[model.name].flavors.get(model.flavor)


def has_experts(args: object) -> bool:
    """Whether a flavor's args hold a mixture of experts."""
    return getattr(args, "moe", None) is not None


def flavors_with(trait: Callable[[object], bool]) -> str:
    """The registered flavors whose args have `trait`, for messages: "--model.name qwen3 --model.flavor
    debugmodel_moe, 30B-A3B or 235B-A22B; or --model.name deepseek_v3 ..."."""
    choices = []
    for name, family in FAMILIES.items():
        flavors = [flavor for flavor, args in family.flavors.items() if trait(args)]
        if flavors:
            listed = flavors[0] if len(flavors) == 1 else f"{', '.join(flavors[:-1])} or {flavors[-1]}"
            choices.append(f"--model.name {name} --model.flavor {listed}")
    return "; or ".join(choices)


def unmatched_patterns(flag: str, entries: list[tuple[str, str]], fqns: list[str], what: str, flavor: str,
                       effect: str) -> list[str]:
    """One problem per entry of `flag`, given as (the entry as written, its FQN substring), whose substring is in
    none of `fqns`, the FQNs of the flavor's `what`s: after a typo or a rename it would silently match nothing, and
    `effect` says what that leaves undone. Each problem names the closest FQNs to try."""
    # Every dotted suffix of an FQN ("wq", "attention.wq", ...) is a plausible entry to suggest.
    suffixes = sorted({".".join(fqn.split(".")[i:]) for fqn in fqns for i in range(len(fqn.split(".")))})
    kinds = sorted({re.sub(r"^layers\.\d+\.", "", fqn) for fqn in fqns})
    problems = []
    for entry, substring in entries:
        if any(substring in fqn for fqn in fqns):
            continue
        close = difflib.get_close_matches(substring, suffixes, n=3, cutoff=0.5)
        nearest = (f"Closest FQNs: {', '.join(close)}." if close else
                   f"Its {what}s (the layers.<i>. prefix left out): {', '.join(kinds)}.")
        problems.append(f"{flag} {entry!r} matches no {what} of --model.flavor {flavor}, so it would {effect}. "
                        f"{nearest}")
    return problems


def largest_divisor_at_most(limit: int, *sizes: int) -> int:
    """The largest degree up to `limit` that divides every one of `sizes` (a shape and the world size)."""
    return max(d for d in range(1, limit + 1) if all(size % d == 0 for size in sizes))
