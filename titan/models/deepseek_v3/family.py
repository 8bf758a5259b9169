"""DeepSeek-V3 as one family spec: what titan/models/families.py registers under --model.name deepseek_v3."""

from torch import nn

from titan.models.common.family import ModelFamily
from titan.models.common.flops import num_active_params
from titan.models.common.parallel_plan import ParallelPlan
from titan.models.deepseek_v3.args import DEEPSEEK_V3_FLAVORS, DeepSeekV3Args
from titan.models.deepseek_v3.flops import flops_per_token
from titan.models.deepseek_v3.hf import hf_mapping
from titan.models.deepseek_v3.init import init_weights
from titan.models.deepseek_v3.model import Transformer


def active_params(args: DeepSeekV3Args, model: nn.Module) -> int:
    return num_active_params(model, args.moe, args.tie_embeddings, exclude_embedding=False)


def tensor_parallel_sizes(args: DeepSeekV3Args) -> list[tuple[str, int]]:
    return [("attention heads", args.n_heads), ("dense FFN hidden size", args.hidden_dim)]


# Every flavor has experts, which Titan's tensor parallel does not split (config validation rejects the degree for
# them), so the plan has no tensor-parallel entries; expert parallel and FSDP find the experts under moe.experts.
PLAN = ParallelPlan(tensor_parallel={})

DEEPSEEK_V3 = ModelFamily(
    name="deepseek_v3", args_type=DeepSeekV3Args, flavors=DEEPSEEK_V3_FLAVORS,
    model=Transformer, init_weights=init_weights, flops_per_token=flops_per_token,
    tensor_parallel_sizes=tensor_parallel_sizes, num_active_params=active_params,
    parallel_plan=PLAN, hf_mapping=hf_mapping)
