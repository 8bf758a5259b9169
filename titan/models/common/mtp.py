"""Multi-token prediction (DeepSeek-V3 section 2.2): D sequential modules after the last block, module k predicting
the token k + 1 places past each position from the previous depth's hidden states and the embedding of the token k
places ahead, through one block of the family's, the model's own embedding and output layer, and a norm of its own.

The modules train the trunk to plan ahead; inference (and the Hugging Face export) drops them. Their loss, the mean
over the depths, enters the gradient times mtp_loss_weight, while the value the model returns stays the next-token
loss, so that the reported loss compares with a run without them.
"""

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from titan.models.common.args import DecoderArgs
from titan.models.common.loss import IGNORE_INDEX
from titan.models.common.norms import RMSNorm


def future_labels(labels: Tensor, document_ids: Tensor | None, ahead: int) -> Tensor:
    """The labels `ahead` places further on (bs, seq): position i's target becomes labels[i + ahead], the token
    i + ahead + 1, IGNORE_INDEX past the sequence's end and, with document ids of the inputs (block-causal
    attention), where that token is in another document than position i. The one target past the window's last
    input, labels[seq - 1], is compared through that input's document: whether the token after it starts another
    is what the labels say (they mask a document's last target), as they do for the next-token loss."""
    shifted = F.pad(labels[:, ahead:], (0, ahead), value=IGNORE_INDEX)  # (bs, seq)
    if document_ids is None:
        return shifted
    bs, seq = document_ids.shape
    # (bs, seq): the document of each position's target, the window's last input's for those at or past its end
    target_documents = torch.cat([document_ids[:, ahead + 1:], document_ids[:, -1:].expand(bs, min(ahead + 1, seq))],
                                 dim=1)
    return shifted.masked_fill(target_documents != document_ids, IGNORE_INDEX)


class MTPModule(nn.Module):
    """One depth: the previous depth's hidden states and the embedding of the token `depth` places ahead, each
    RMS-normalised, concatenated (embedding first, as DeepSeek-V3's released modules are laid out) and projected
    back to dim, then a block; `norm` goes before the shared output layer."""

    def __init__(self, args: DecoderArgs, block: nn.Module) -> None:
        super().__init__()
        self.enorm = RMSNorm(args.dim, eps=args.norm_eps)
        self.hnorm = RMSNorm(args.dim, eps=args.norm_eps)
        self.eh_proj = nn.Linear(2 * args.dim, args.dim, bias=False)
        self.block = block
        self.norm = RMSNorm(args.dim, eps=args.norm_eps)

    def forward(self, h: Tensor, embedded: Tensor, rope_cache: Tensor, mask: Any) -> Tensor:
        """h, embedded (bs, seq, dim) -> this depth's hidden states (bs, seq, dim)."""
        combined = torch.cat([self.enorm(embedded), self.hnorm(h)], dim=-1)  # (bs, seq, 2 * dim)
        return self.block(self.eh_proj(combined), rope_cache, mask)


class MultiTokenPrediction(nn.Module):
    """args.mtp_depth modules, `depths.0` first, each with a block built by `block(args)`. Keeps `loss_sum`, the
    summed mean-over-depths loss of the training forwards since the step last read it, for the metrics."""

    def __init__(self, args: DecoderArgs, block: Callable[[Any], nn.Module]) -> None:
        super().__init__()
        self.depths = nn.ModuleDict({str(k): MTPModule(args, block(args)) for k in range(args.mtp_depth)})
        self.loss_weight = args.mtp_loss_weight
        self.register_buffer("loss_sum", torch.zeros(()), persistent=False)

    def forward(self, h: Tensor, tokens: Tensor, labels: Tensor, document_ids: Tensor | None, rope_cache: Tensor,
                mask: Any, embedding: nn.Module, output: nn.Module, output_loss: nn.Module) -> Tensor:
        """h (bs, seq, dim): the last block's hidden states, before the final norm; tokens, labels (bs, seq) as the
        model got them. Returns zero, whose gradient is mtp_loss_weight times that of the depths' mean summed loss
        (each depth's loss summed over its valid targets, as output_loss sums the model's)."""
        total = None
        for index, module in self.depths.items():
            ahead = int(index) + 1
            embedded = embedding(F.pad(tokens[:, ahead:], (0, ahead)))  # (bs, seq, dim): the tail's targets are none
            h = module(h, embedded, rope_cache, mask)
            loss = output_loss(module.norm(h), future_labels(labels, document_ids, ahead), output)
            total = loss if total is None else total + loss
        mean = total / len(self.depths)
        if self.training:
            self.loss_sum += mean.detach()
        weighted = self.loss_weight * mean
        return weighted - weighted.detach()
