"""Llama 3 as one family spec: what titan/models/families.py registers under --model.name llama3."""

from torch import nn

from titan.models.common.family import ModelFamily
from titan.models.common.flops import num_params
from titan.models.common.parallel_plan import ATTENTION_TENSOR_PARALLEL, FEED_FORWARD_TENSOR_PARALLEL, ParallelPlan
from titan.models.llama.args import LLAMA3_FLAVORS, ModelArgs, ffn_hidden_dim
from titan.models.llama.flops import flops_per_token
from titan.models.llama.hf import hf_mapping
from titan.models.llama.init import init_weights
from titan.models.llama.model import Transformer


def training_flops(args: ModelArgs, model: nn.Module, seq_len: int) -> int:
    return flops_per_token(args, num_params(model, exclude_embedding=True), seq_len)


def active_params(args: ModelArgs, model: nn.Module) -> int:
    return num_params(model, exclude_embedding=False)


def tensor_parallel_sizes(args: ModelArgs) -> list[tuple[str, int]]:
    return [("attention heads", args.n_heads), ("kv heads", args.n_kv_heads), ("FFN hidden size", ffn_hidden_dim(args))]


LLAMA3 = ModelFamily(
    name="llama3", args_type=ModelArgs, flavors=LLAMA3_FLAVORS, model=Transformer,
    init_weights=init_weights, flops_per_token=training_flops, tensor_parallel_sizes=tensor_parallel_sizes,
    num_active_params=active_params,
    parallel_plan=ParallelPlan(tensor_parallel={**ATTENTION_TENSOR_PARALLEL, **FEED_FORWARD_TENSOR_PARALLEL}),
    hf_mapping=hf_mapping)
