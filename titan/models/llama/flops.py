"""Parameter and FLOP counts that the throughput metrics (MFU) build on.

Convention (PaLM appendix B, as torchtitan): training FLOPs per token =
6 * N + 12 * n_layers * dim * seq_len, where N counts every weight used in a matmul, i.e. all
parameters except the token embedding (a lookup) but including the untied output projection.
6 = 2 FLOPs per multiply-add in the forward, times 3 for forward plus backward (grads of inputs and of
weights). The second term is attention's QK^T and scores @ V: each 2 * seq_len * dim FLOPs per token
per layer in the forward, times 3. The causal mask is not halved (kernels skip the masked half, but the
convention counts it), so numbers match published MFUs. Padded vocab rows count: the hardware does them.
"""

from titan.models.llama.args import ModelArgs


def flops_per_token(args: ModelArgs, num_params: int, seq_len: int) -> int:
    """Training FLOPs per token; num_params is num_params(model, exclude_embedding=True)."""
    return 6 * num_params + 12 * args.n_layers * args.dim * seq_len
