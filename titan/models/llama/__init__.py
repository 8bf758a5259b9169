"""Llama 3: shapes (args), the model, weight init and FLOP counts."""

from titan.models.llama.args import LLAMA3_FLAVORS, ModelArgs, ffn_hidden_dim
from titan.models.llama.flops import flops_per_token
from titan.models.llama.init import init_weights
from titan.models.llama.model import Transformer

__all__ = [
    "LLAMA3_FLAVORS",
    "ModelArgs",
    "Transformer",
    "ffn_hidden_dim",
    "flops_per_token",
    "init_weights",
]
