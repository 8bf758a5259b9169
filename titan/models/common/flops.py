"""Parameter counts that the FLOP counts of every family (and the throughput metrics' MFU) build on."""

from torch import nn

from titan.models.common.moe import MoEArgs


def num_params(model: nn.Module, exclude_embedding: bool) -> int:
    """Parameter count of a Transformer at full (unsharded) size; exclude_embedding drops tok_embeddings."""
    return sum(
        param.numel()
        for name, param in model.named_parameters()
        if not (exclude_embedding and name.startswith("tok_embeddings."))
    )


def num_active_params(model: nn.Module, moe: MoEArgs | None, tie_embeddings: bool, exclude_embedding: bool) -> int:
    """Parameters one token's forward uses, at full size: every parameter but the routed experts a token is not sent
    to (top_k of num_experts per MoE layer; shared experts serve every token); exclude_embedding drops tok_embeddings
    (a lookup; a tied output counts)."""
    active = 0
    for name, param in model.named_parameters():
        if exclude_embedding and name.startswith("tok_embeddings.") and not tie_embeddings:
            continue
        share = moe.top_k / moe.num_experts if moe is not None and ".moe.experts." in name else 1.0
        active += round(param.numel() * share)
    return active
