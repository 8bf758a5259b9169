"""The spelling of one --training.mixture entry, DATASET[:PATH]=WEIGHT, shared by the TOML reader (which writes
tables in it), the config rules (which check it) and the data loader (which builds a source from it)."""

import math
from dataclasses import dataclass

MIXTURE_DATASETS = ("shipped", "text", "jsonl", "hf", "chat", "prepared")
"""Datasets a mixture can draw from: all of them, each read from its token store."""
SPELLING = "DATASET[:PATH]=WEIGHT, e.g. shipped=1, jsonl:data/code.jsonl=3 or chat:data/chats.jsonl=1"


@dataclass(frozen=True)
class MixtureEntry:
    dataset: str
    path: str | None
    weight: float

    @property
    def source(self) -> str:
        """The entry without its weight ("shipped", "jsonl:data/code.jsonl"): the source's name in logs, metrics
        and the checkpointed data position."""
        return self.dataset if self.path is None else f"{self.dataset}:{self.path}"


def parse_mixture_entry(text: str) -> MixtureEntry:
    """The entry `text` spells. A ValueError's message says what is wrong with it, to follow the entry's name."""
    source, sep, weight_text = text.rpartition("=")
    if not sep:
        raise ValueError(f"has no weight. Write {SPELLING}.")
    dataset, colon, path = source.partition(":")
    if dataset not in MIXTURE_DATASETS:
        raise ValueError(f"names dataset {dataset!r}, which is not one of {', '.join(MIXTURE_DATASETS)}. Write "
                         f"{SPELLING}.")
    if dataset == "shipped" and colon:
        raise ValueError("gives a path to shipped, which takes none. Write shipped=WEIGHT.")
    if dataset != "shipped" and not path:
        raise ValueError(f"needs a path: {dataset}:PATH=WEIGHT, with PATH a file, a folder or a glob.")
    try:
        weight = float(weight_text)
    except ValueError:
        weight = math.nan
    if not (math.isfinite(weight) and weight > 0):
        raise ValueError(f"has weight {weight_text!r}, which must be a positive finite number (e.g. 1 or 0.5).")
    return MixtureEntry(dataset, path or None, weight)


def format_mixture_entry(dataset: str, path: str | None, weight: int | float) -> str:
    """DATASET[:PATH]=WEIGHT; the weight as written (3, not 3.0) or as its shortest exact float."""
    return f"{dataset if path is None else f'{dataset}:{path}'}={weight!r}"
