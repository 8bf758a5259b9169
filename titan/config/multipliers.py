"""--optimizer.lr_multipliers entries: FQN_SUBSTRING=FACTOR."""


def parse_lr_multiplier(text: str) -> tuple[str, float]:
    """"FQN_SUBSTRING=FACTOR" as (substring, factor); ValueError unless the substring is non-empty and the factor a
    positive number (validation reports it with the field's name)."""
    substring, separator, factor = text.rpartition("=")
    if not separator or not substring or not float(factor) > 0:
        raise ValueError(f"{text!r} is not FQN_SUBSTRING=FACTOR with a positive FACTOR")
    return substring, float(factor)
