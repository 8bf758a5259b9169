"""Qwen3, dense and mixture-of-experts: shapes (args), the model, weight init and FLOP counts. Its MoE layer is
the shared one (titan/models/common/moe.py)."""

from titan.models.qwen3.args import QWEN3_FLAVORS, Qwen3Args
from titan.models.qwen3.flops import flops_per_token
from titan.models.qwen3.init import init_weights
from titan.models.qwen3.model import Transformer

__all__ = [
    "QWEN3_FLAVORS",
    "Qwen3Args",
    "Transformer",
    "flops_per_token",
    "init_weights",
]
