"""Parameter counts that the FLOP counts of every family (and the throughput metrics' MFU) build on."""

from torch import nn


def num_params(model: nn.Module, exclude_embedding: bool) -> int:
    """Parameter count of a Transformer at full (unsharded) size; exclude_embedding drops tok_embeddings."""
    return sum(
        param.numel()
        for name, param in model.named_parameters()
        if not (exclude_embedding and name.startswith("tok_embeddings."))
    )
