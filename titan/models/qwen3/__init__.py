"""Qwen3, dense and mixture-of-experts: shapes (args), the model, its MoE layer, weight init and FLOP counts."""

from titan.models.qwen3.args import QWEN3_FLAVORS, MoEArgs, Qwen3Args, build_qwen3_args
from titan.models.qwen3.flops import flops_per_token, num_active_params
from titan.models.qwen3.init import init_weights
from titan.models.qwen3.model import Transformer, moe_layers, tie_output
from titan.models.qwen3.moe import MoE

__all__ = [
    "QWEN3_FLAVORS",
    "MoE",
    "MoEArgs",
    "Qwen3Args",
    "Transformer",
    "build_qwen3_args",
    "flops_per_token",
    "init_weights",
    "moe_layers",
    "num_active_params",
    "tie_output",
]
