"""Training FLOPs per token of a DeepSeek-V3 model: Llama's convention (titan/models/llama/flops.py) over the active
parameters, with latent attention's score and value widths, and the multi-token prediction modules' extra passes."""

from torch import nn

from titan.models.common.flops import num_active_params
from titan.models.deepseek_v3.args import DeepSeekV3Args


def flops_per_token(args: DeepSeekV3Args, model: nn.Module, seq_len: int) -> int:
    """6 x the active matmul parameters (the MTP modules' among them), plus the output layer's again for every MTP
    depth (each runs it once more), plus attention's 6 x blocks x seq_len x n_heads x (qk_head_dim + v_head_dim):
    QK^T over the query-key width and the scores times V over the value width, in every block and MTP module."""
    active = num_active_params(model, args.moe, args.tie_embeddings, exclude_embedding=True)
    output = model.output.weight.numel()
    blocks = args.n_layers + args.mtp_depth
    attention = 6 * blocks * seq_len * args.n_heads * (args.qk_head_dim + args.v_head_dim)
    return 6 * (active + args.mtp_depth * output) + attention
