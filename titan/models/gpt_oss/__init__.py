"""GPT-OSS (openai/gpt-oss-20b and -120b): shapes (args), its expert, the model, weight init and FLOP counts. Its
attention and mixture of experts are the shared ones, told by data how GPT-OSS differs (AttentionSpec, MoEArgs)."""

from titan.models.gpt_oss.args import GPT_OSS_FLAVORS, GptOssArgs
from titan.models.gpt_oss.flops import flops_per_token
from titan.models.gpt_oss.init import init_weights
from titan.models.gpt_oss.model import Transformer

__all__ = [
    "GPT_OSS_FLAVORS",
    "GptOssArgs",
    "Transformer",
    "flops_per_token",
    "init_weights",
]
