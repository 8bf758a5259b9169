"""The validation loop: the mean loss over a held-out set, forward only, under the training layout.

Every rank runs the same number of batches (the validation loader stops before the first incomplete global batch),
so the one all-reduce at the end can never wait on a rank that ran out of data. Evaluation touches no random state,
no optimizer state and no data position of the training stream, so training after it is exactly training without it.
"""

import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from titan.data.loader import batch_to
from titan.data.micro_batch import Batch


@dataclass(frozen=True)
class EvalResult:
    loss: float
    """Mean cross entropy per valid target over every evaluated batch of every rank."""
    num_batches: int
    """Batches each data-parallel rank evaluated."""
    tokens: int
    """Tokens evaluated over all data-parallel ranks."""
    seconds: float

    @property
    def perplexity(self) -> float:
        """exp(loss); inf once the loss is too large for a float (an untrained model is far from that)."""
        return math.exp(self.loss) if self.loss < 709 else math.inf

    def record(self, step: int) -> dict[str, float | int]:
        """The metric record of this evaluation, logged at training step `step`."""
        return {"step": step, "val_loss": self.loss, "val_perplexity": self.perplexity, "val_tokens": self.tokens,
                "val_seconds": self.seconds}


def evaluate(batches: Iterable[Batch],
             batch_loss: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
             global_sum: Callable[[torch.Tensor], torch.Tensor], tokens_per_batch: int, device: torch.device,
             compiled: bool) -> EvalResult:
    """Mean loss per valid target over `batches`, this rank's share of each global validation batch.

    `batch_loss(inputs, labels, document_ends)` is this rank's (summed loss, valid targets) of one batch (both zero on
    ranks whose loss another rank computes, such as pipeline stages before the last); `global_sum` adds a tensor over
    the ranks that hold loss shares. `tokens_per_batch` counts one batch over all data-parallel ranks.

    Without gradients, except for a `compiled` model: its blocks then run the graphs compiled for training instead
    of compiling forward-only ones (which, for tensor-parallel blocks, fail inside torch 2.13's DTensor subclass
    wrapper: "'Tensor' object has no attribute 'elem'"). No backward runs, so each batch's graph is freed with its
    loss and no gradient changes.
    """
    start = time.perf_counter()
    sums = torch.zeros(2, device=device)  # (summed loss, valid targets): one all-reduce and one host read for both
    num_batches = 0
    with torch.enable_grad() if compiled else torch.no_grad():
        for batch in batches:
            loss_sum, num_targets = batch_loss(*batch_to(batch, device))
            sums += torch.stack([loss_sum.detach(), num_targets])
            num_batches += 1
    total, num_targets = global_sum(sums).tolist()
    loss = total / max(num_targets, 1)
    return EvalResult(loss=loss, num_batches=num_batches, tokens=num_batches * tokens_per_batch,
                      seconds=time.perf_counter() - start)
