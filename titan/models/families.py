"""The model families Titan trains, one spec each (titan/models/common/family.py), by --model.name: the one place the
family-independent stages learn which families exist. A new family is its folder and one entry here."""

import torch
from torch import nn

from titan.models.common.args import DecoderArgs
from titan.models.common.family import ModelFamily
from titan.models.deepseek_v3.family import DEEPSEEK_V3
from titan.models.gpt_oss.family import GPT_OSS
from titan.models.llama.family import LLAMA3
from titan.models.qwen3.family import QWEN3

FAMILIES: dict[str, ModelFamily] = {family.name: family for family in (LLAMA3, QWEN3, DEEPSEEK_V3, GPT_OSS)}


def family_of(args: DecoderArgs) -> ModelFamily:
    """The family whose args `args` are."""
    for family in FAMILIES.values():
        if type(args) is family.args_type:
            return family
    raise ValueError(f"{type(args).__name__} are no registered family's args: register the family's spec in "
                     f"titan/models/families.py (docs/models.md).")


def module_fqns(family: str, flavor: str, kind: type[nn.Module]) -> list[str]:
    """FQNs of the `kind` modules of a flavor, from a build on the meta device (no memory, milliseconds even for the
    largest): what a converter's --*.filter_fqns entries (nn.Linear) and --*.moe_fqns_prototype entries
    (GroupedExperts) are matched against."""
    with torch.device("meta"):
        model = FAMILIES[family].model(FAMILIES[family].flavors[flavor])
    return [name for name, module in model.named_modules() if isinstance(module, kind)]
