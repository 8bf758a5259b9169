"""One micro-batch as the model reads it."""

from dataclasses import dataclass

from torch import Tensor


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
