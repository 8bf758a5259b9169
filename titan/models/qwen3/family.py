"""Qwen3, dense and mixture-of-experts, as one family spec: what titan/models/families.py registers under
--model.name qwen3."""

from torch import nn

from titan.models.common.family import ModelFamily
from titan.models.common.flops import num_active_params
from titan.models.common.parallel_plan import ATTENTION_TENSOR_PARALLEL, FEED_FORWARD_TENSOR_PARALLEL, ParallelPlan
from titan.models.qwen3.args import QWEN3_FLAVORS, Qwen3Args
from titan.models.qwen3.flops import flops_per_token
from titan.models.qwen3.hf import hf_mapping
from titan.models.qwen3.init import init_weights
from titan.models.qwen3.model import Transformer


def training_flops(args: Qwen3Args, model: nn.Module, seq_len: int) -> int:
    """Active parameters only: an MoE token's FLOPs come from its top_k experts (the dry run and MFU agree)."""
    active = num_active_params(model, args.moe, args.tie_embeddings, exclude_embedding=True)
    return flops_per_token(args, active, seq_len)


def active_params(args: Qwen3Args, model: nn.Module) -> int:
    return num_active_params(model, args.moe, args.tie_embeddings, exclude_embedding=False)


def tensor_parallel_sizes(args: Qwen3Args) -> list[tuple[str, int]]:
    return [("attention heads", args.n_heads), ("kv heads", args.n_kv_heads), ("FFN hidden size", args.hidden_dim)]


# Llama's plan, and each rank normalises its own heads with the QK-norms (the heads dimension, 2, is sharded).
PLAN = ParallelPlan(tensor_parallel={**ATTENTION_TENSOR_PARALLEL, "attention.q_norm": "head_norm",
                                     "attention.k_norm": "head_norm", **FEED_FORWARD_TENSOR_PARALLEL})

QWEN3 = ModelFamily(
    name="qwen3", args_type=Qwen3Args, flavors=QWEN3_FLAVORS, model=Transformer,
    init_weights=init_weights, flops_per_token=training_flops, tensor_parallel_sizes=tensor_parallel_sizes,
    num_active_params=active_params, parallel_plan=PLAN, hf_mapping=hf_mapping)
