"""Training FLOPs per token of a GPT-OSS model: Llama's convention (titan/models/llama/flops.py) with a token's
experts counted instead of all of them, and each block's attention over the keys it reads: the whole sequence, or
its sliding window."""

from titan.models.gpt_oss.args import GptOssArgs


def flops_per_token(args: GptOssArgs, num_params: int, seq_len: int) -> int:
    """6 x the active matmul parameters (without the embedding) plus, per block, 12 x (n_heads x head_dim) x the keys a
    query reads: seq_len, or at most the window in a sliding-window block."""
    keys = [seq_len if spec.window is None else min(seq_len, spec.window)
            for spec in (args.layer_attention(layer_id) for layer_id in range(args.n_layers))]
    return 6 * num_params + 12 * args.n_heads * args.head_dim * sum(keys)
