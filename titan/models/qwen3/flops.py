"""Active parameters and training FLOPs per token of a Qwen3 model: Llama's convention (titan/models/llama/flops.py)
with a token's experts counted instead of all of them, and attention's width n_heads x head_dim instead of dim."""

from torch import nn

from titan.models.qwen3.args import Qwen3Args


def num_active_params(model: nn.Module, args: Qwen3Args, exclude_embedding: bool) -> int:
    """Parameters one token's forward uses, at full size: every parameter but the experts a token is not routed to
    (top_k of num_experts per MoE layer); exclude_embedding drops tok_embeddings (a lookup; a tied output counts)."""
    active = 0
    for name, param in model.named_parameters():
        if exclude_embedding and name.startswith("tok_embeddings.") and not args.tie_embeddings:
            continue
        share = args.moe.top_k / args.moe.num_experts if ".moe.experts." in name else 1.0
        active += round(param.numel() * share)
    return active


def flops_per_token(args: Qwen3Args, num_params: int, seq_len: int) -> int:
    """Training FLOPs per token: 6 x the active matmul parameters (num_active_params(..., exclude_embedding=True))
    plus attention's 12 x layers x (n_heads x head_dim) x seq_len, as Llama's convention counts it."""
    return 6 * num_params + 12 * args.n_layers * args.n_heads * args.head_dim * seq_len
