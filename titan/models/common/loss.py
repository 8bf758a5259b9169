"""Training loss: the cross entropy of the output layer's logits over the real vocabulary, summed over the valid
targets, computed from the last hidden states a chunk of tokens at a time so that a batch's full logits never exist.

The sum, not the mean: once some targets are masked (IGNORE_INDEX), a mean per micro-batch weighs tokens
differently across micro-batches and ranks. The training step divides the sums by the number of valid targets over
all data-parallel ranks and accumulation steps of the step (titan/train/step.py).
"""

from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

IGNORE_INDEX = -100
"""A label that is no target: the loss skips it and it counts for no valid target."""

LogitsLoss = Callable[[Tensor, Tensor], Tensor]
"""The summed loss of logits (..., padded_vocab) against labels (...), over the real vocabulary."""


def num_valid_targets(labels: Tensor) -> Tensor:
    """How many labels are targets (not IGNORE_INDEX), as an int64 tensor on the labels' device."""
    return (labels != IGNORE_INDEX).sum()


def cross_entropy_sum(logits: Tensor, labels: Tensor, vocab_size: int) -> Tensor:
    """The next-token cross entropy summed over the valid targets, computed in fp32. Only the first vocab_size
    columns of the logits (..., padded_vocab) enter the softmax, so padded output rows take no probability mass
    and get no gradient. Logits split along the vocab can't be sliced like this; the parallel code that splits
    them supplies its own loss."""
    real_logits = logits[..., :vocab_size].flatten(0, -2).float()  # (tokens, vocab_size)
    return F.cross_entropy(real_logits, labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")


def cross_entropy_loss(logits: Tensor, labels: Tensor, vocab_size: int) -> Tensor:
    """The mean of cross_entropy_sum over the valid targets: the loss a user of the model's logits reads."""
    return cross_entropy_sum(logits, labels, vocab_size) / num_valid_targets(labels)


class OutputLoss(nn.Module):
    """The summed cross entropy of the output layer's logits from the last hidden states, chunk_size tokens at a
    time (0: all at once). Each chunk's projection and loss run under activation checkpointing, so the forward
    keeps no logits and the backward recomputes them one chunk at a time: at 8,192 tokens and a 128k vocabulary
    the whole batch's logits would be 2 GiB in bf16 per sequence, and as much again for their gradient. The price
    is the output layer's forward once more in the backward.

    A module of the model, without parameters, so that a later stage can change how tokens are chunked or how the
    loss reads the logits (tensor parallel does), or compile the loss (compile_logits_loss)."""

    def __init__(self, vocab_size: int, chunk_size: int) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.chunk_size = chunk_size
        self.logits_loss: LogitsLoss = partial(cross_entropy_sum, vocab_size=vocab_size)

    def forward(self, h: Tensor, labels: Tensor, output: nn.Module) -> Tensor:
        """h (bs, seq, dim) after the final norm and labels (bs, seq) -> the summed loss of output(h)."""
        if self.chunk_size == 0:
            return self.chunk_loss(h, labels, output)
        losses = [checkpoint(self.chunk_loss, h_chunk, labels_chunk, output, use_reentrant=False)
                  for h_chunk, labels_chunk in self.token_chunks(h, labels)]
        return sum(losses[1:], losses[0])  # not from a zero: under loss parallel the losses are DTensors

    def token_chunks(self, h: Tensor, labels: Tensor) -> list[tuple[Tensor, Tensor]]:
        """(hidden states, labels) of each chunk of chunk_size tokens, batch rows one after another."""
        return list(zip(h.flatten(0, 1).split(self.chunk_size), labels.flatten().split(self.chunk_size)))

    def chunk_loss(self, h: Tensor, labels: Tensor, output: nn.Module) -> Tensor:
        """The summed loss of these tokens' logits."""
        return self.logits_loss(output(h), labels)

    def compile_logits_loss(self, backend: str = "inductor") -> None:
        """Compile the loss of each chunk's logits (--compile.enable) with torch.compile's `backend`: inductor fuses
        the fp32 upcast into the cross entropy, so not even a chunk's fp32 logits are stored."""
        self.logits_loss = torch.compile(self.logits_loss, backend=backend)
