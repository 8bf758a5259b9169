"""GPT-OSS as one family spec: what titan/models/families.py registers under --model.name gpt_oss."""

from torch import nn

from titan.models.common.family import ModelFamily
from titan.models.common.flops import num_active_params
from titan.models.common.parallel_plan import ParallelPlan
from titan.models.gpt_oss.args import GPT_OSS_FLAVORS, GptOssArgs
from titan.models.gpt_oss.flops import flops_per_token
from titan.models.gpt_oss.hf import hf_mapping
from titan.models.gpt_oss.init import init_weights
from titan.models.gpt_oss.model import Transformer


def training_flops(args: GptOssArgs, model: nn.Module, seq_len: int) -> int:
    active = num_active_params(model, args.moe, args.tie_embeddings, exclude_embedding=True)
    return flops_per_token(args, active, seq_len)


def active_params(args: GptOssArgs, model: nn.Module) -> int:
    """OpenAI's count (the model card's 3.6B and 5.1B): every parameter a token's forward multiplies by, its top_k
    experts among them, the unembedding too; the embedding, a lookup, not."""
    return num_active_params(model, args.moe, args.tie_embeddings, exclude_embedding=True)


def tensor_parallel_sizes(args: GptOssArgs) -> list[tuple[str, int]]:
    return [("attention heads", args.n_heads), ("kv heads", args.n_kv_heads)]


# Every block has experts, which Titan's tensor parallel does not split (config validation rejects the degree for
# them), so the plan has no tensor-parallel entries; expert parallel and FSDP find the experts under moe.experts.
PLAN = ParallelPlan(tensor_parallel={})

GPT_OSS = ModelFamily(
    name="gpt_oss", args_type=GptOssArgs, flavors=GPT_OSS_FLAVORS, model=Transformer, init_weights=init_weights,
    flops_per_token=training_flops, tensor_parallel_sizes=tensor_parallel_sizes, num_active_params=active_params,
    parallel_plan=PLAN, hf_mapping=hf_mapping)
