"""Llama 3: shapes (args), the model, its loss, weight init and FLOP counts."""

from titan.models.llama.args import LLAMA3_FLAVORS, ModelArgs, ffn_hidden_dim, padded_vocab_size
from titan.models.llama.flops import flops_per_token, num_params
from titan.models.llama.init import init_weights
from titan.models.llama.loss import cross_entropy_loss
from titan.models.llama.model import Transformer

__all__ = [
    "LLAMA3_FLAVORS",
    "ModelArgs",
    "Transformer",
    "cross_entropy_loss",
    "ffn_hidden_dim",
    "flops_per_token",
    "init_weights",
    "num_params",
    "padded_vocab_size",
]
