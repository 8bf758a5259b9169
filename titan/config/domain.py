"""The values each numeric config field accepts, declared once on the field's type.

A field typed `Count` (or another alias below) carries a `Range` in its `Annotated` metadata. `validate()`
reads it to reject out-of-range values, and the same Range writes the "(default: ...; must be ...)" hint of
`--help`, so the two can never disagree. Float fields must always be finite: NaN compares false with every
bound, so it is rejected explicitly.
"""

import math
import re
import typing
from dataclasses import dataclass, replace
from typing import Annotated, Any

import tyro


@dataclass(frozen=True)
class Range:
    """Numbers of type `kind` from `low` to `high` (None: unbounded on that side; `*_open`: the bound itself
    excluded), plus the `special` values outside the range that mean something (-1 for "the rest" or "the latest")."""

    kind: type = float
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    special: tuple[int, ...] = ()

    def contains(self, value: float) -> bool:
        if value in self.special:
            return True
        if isinstance(value, float) and not math.isfinite(value):
            return False
        if self.low is not None and (value < self.low or (self.low_open and value == self.low)):
            return False
        return self.high is None or not (value > self.high or (self.high_open and value == self.high))

    def describe(self) -> str:
        """'a finite number > 0', 'an integer >= 1, or -1', 'a number in [0, 1)'."""
        integer = self.kind is int
        noun = "an integer" if integer else "a number" if None not in (self.low, self.high) else "a finite number"
        low, high = (None if b is None else str(int(b)) if integer else f"{b:g}" for b in (self.low, self.high))
        if low is not None and high is not None:
            bounds = f" in {'(' if self.low_open else '['}{low}, {high}{')' if self.high_open else ']'}"
        elif low is not None:
            bounds = f" {'>' if self.low_open else '>='} {low}"
        elif high is not None:
            bounds = f" {'<' if self.high_open else '<='} {high}"
        else:
            bounds = ""
        special = "".join(f", or {value}" for value in self.special)
        return f"{noun}{bounds}{special}"


def bounded(kind: type, domain: Range, optional: bool = False) -> Any:
    """The field type `kind` (or `kind | None`) annotated with `domain`, for validation and for `--help`."""
    domain = replace(domain, kind=kind)
    hint = f"must be {domain.describe()}"
    field_type = kind | None if optional else kind
    help_hint = tyro.conf.arg(help_behavior_hint=lambda default: f"(default: {default}; {hint})")
    return Annotated[field_type, domain, help_hint]


Count = bounded(int, Range(low=1))
"""Steps, sizes, frequencies, degrees: 1 or more."""
OptionalCount = bounded(int, Range(low=1), optional=True)
"""A count, or None where the field says what None derives."""
CountOrAuto = bounded(int, Range(low=1, special=(-1,)))
"""A count, or -1 for "derive it" (documented on each field)."""
NonNegativeInt = bounded(int, Range(low=0))
StepOrLatest = bounded(int, Range(low=0, special=(-1,)))
Seed = bounded(int, Range(low=0, high=2**64 - 1))
"""torch.manual_seed takes a 64-bit seed."""
PositiveFloat = bounded(float, Range(low=0, low_open=True))
OptionalPositiveFloat = bounded(float, Range(low=0, low_open=True), optional=True)
NonNegativeFloat = bounded(float, Range(low=0))
FiniteFloat = bounded(float, Range())
Decay = bounded(float, Range(low=0, high=1, high_open=True))
"""An exponential moving-average factor: 1 would never forget, so it is excluded (as torch's Adam does)."""
Fraction = bounded(float, Range(low=0, high=1))
OptionalFraction = bounded(float, Range(low=0, high=1), optional=True)


def field_ranges(section_cls: type) -> dict[str, Range]:
    """Field name -> the Range declared on its type, for the fields of a config section that declare one."""
    return {name: domain for name, hint in typing.get_type_hints(section_cls, include_extras=True).items()
            for domain in getattr(hint, "__metadata__", ()) if isinstance(domain, Range)}


DURATION = re.compile(r"(?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s)?")
"""Hours, minutes and seconds, each optional but in this order: 3h50m, 90m, 45s, 1h."""


def parse_duration(text: str) -> int | None:
    """Seconds in a duration spelled as DURATION (3h50m, 90m, 45s, 1h); None if it is spelled otherwise or is 0.
    The one parser of --job.time_limit: validation checks the text with it, the stopper uses the seconds,
    the config keeps the text."""
    match = DURATION.fullmatch(text.strip())
    if match is None or not any(match.groups()):
        return None
    hours, minutes, seconds = (int(part or 0) for part in match.groups())
    return (hours * 60 + minutes) * 60 + seconds or None
