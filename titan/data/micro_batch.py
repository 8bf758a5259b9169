"""From a window to a micro-batch, and the one place that decides which tokens are targets.

A window is seq_len + 1 tokens (titan/data/stream.py), with where its documents end and, for a chat store, each
token's role (titan/data/conversations.py finds them when the store is built). What trains follows in three steps,
all here:
- which tokens train: every token of a document, or by role under --chat.train_on (trained_tokens, which the
  packing reads too, to keep or drop a conversation);
- labels: each input's next token where that token trains, IGNORE_INDEX elsewhere (as_batch, in the loader);
- under block-causal attention: no target across a document's end, and each token's position and document id
  within its window (to_micro_batch, in the step, on the device), the inputs the model builds its masks from.
Context parallel then shards the micro-batch along the sequence (titan/parallel/cp.py).
"""

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from titan.data.conversations import CONTEXT, LAST_ASSISTANT
from titan.data.stream import Windows
from titan.models.common.attention import sequence_positions
from titan.models.common.loss import IGNORE_INDEX

Batch = tuple[Tensor, Tensor, Tensor]
"""(inputs, labels, document ends), each (bs, seq): token ids, the next token ids with those that are no target made
IGNORE_INDEX, and whether each input token is the last of its document."""


@dataclass(frozen=True)
class MicroBatch:
    """One micro-batch as the model reads it, this rank's context-parallel shard of each tensor (bs, seq): the token
    ids, the labels (targets that are none made IGNORE_INDEX), each token's rotary position and, for block-causal
    attention, its document id."""

    inputs: Tensor
    labels: Tensor
    positions: Tensor
    document_ids: Tensor | None

    def model_inputs(self) -> dict[str, Tensor]:
        """The model's keyword inputs besides the tokens and labels: what a pipeline hands every stage."""
        if self.document_ids is None:
            return {"positions": self.positions}
        return {"positions": self.positions, "document_ids": self.document_ids}


def trained_tokens(roles: np.ndarray, train_on: str) -> np.ndarray:
    """Which tokens of a conversation train, from their roles, under --chat.train_on `train_on`: every token
    (all), every assistant turn's (assistant) or only the last assistant turn's (last_assistant)."""
    if train_on == "all":
        return np.ones(len(roles), dtype=bool)
    if train_on == "last_assistant":
        return roles == LAST_ASSISTANT
    return roles != CONTEXT


def as_batch(windows: Windows) -> Batch:
    """The batch of windows of seq_len + 1 tokens: a label is the next token where that token trains."""
    tokens = torch.from_numpy(windows.tokens)
    labels = tokens[:, 1:].masked_fill(torch.from_numpy(~windows.trains[:, 1:]), IGNORE_INDEX)
    return tokens[:, :-1].contiguous(), labels, torch.from_numpy(windows.ends[:, :-1]).contiguous()


def document_layout(document_ends: Tensor) -> tuple[Tensor, Tensor]:
    """(positions, document ids) of a batch whose tokens (bs, seq) end their documents where `document_ends` (bs,
    seq, bool) is set, each (bs, seq) int64: a document starts right after every end and at the window's first token
    (a document cut by the window's start), its positions count from 0 there, and document ids count the documents
    of each row from 0."""
    bs, seq = document_ends.shape
    starts = torch.zeros_like(document_ends)
    starts[:, 1:] = document_ends[:, :-1]
    starts[:, 0] = True
    index = torch.arange(seq, device=document_ends.device).expand(bs, seq)
    last_start = torch.where(starts, index, 0).cummax(dim=1).values  # (bs, seq): where each token's document starts
    return index - last_start, starts.cumsum(dim=1) - 1


def mask_cross_document_targets(labels: Tensor, document_ends: Tensor) -> Tensor:
    """`labels` with the target of every input that ends its document made IGNORE_INDEX: under block-causal
    attention a document's last token (its EOS) cannot see the next document, so that document's first token (its
    BOS, where the tokenizer has one) is no target. The last token itself stays a target: ending a document is what
    the model learns from it."""
    return labels.masked_fill(document_ends, IGNORE_INDEX)


def to_micro_batch(inputs: Tensor, labels: Tensor, document_ends: Tensor, block_causal: bool) -> MicroBatch:
    """A (bs, seq) batch of the loader as the whole model reads it: under block-causal attention each document's
    positions and id, and no target across a document's end; otherwise positions over the whole sequence."""
    if not block_causal:
        return MicroBatch(inputs, labels, sequence_positions(inputs), None)
    positions, document_ids = document_layout(document_ends)
    return MicroBatch(inputs, mask_cross_document_targets(labels, document_ends), positions, document_ids)
