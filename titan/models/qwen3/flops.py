"""Training FLOPs per token of a Qwen3 model: Llama's convention (titan/models/llama/flops.py)
with a token's experts counted instead of all of them, and attention's width n_heads x head_dim instead of dim."""

from titan.models.qwen3.args import Qwen3Args


def flops_per_token(args: Qwen3Args, num_params: int, seq_len: int) -> int:
    """Training FLOPs per token: 6 x the active matmul parameters (num_active_params(..., exclude_embedding=True))
    plus attention's 12 x layers x (n_heads x head_dim) x seq_len, as Llama's convention counts it."""
    return 6 * num_params + 12 * args.n_layers * args.n_heads * args.head_dim * seq_len
