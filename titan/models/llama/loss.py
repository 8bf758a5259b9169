"""Training loss over the real vocabulary."""

import torch.nn.functional as F
from torch import Tensor


def cross_entropy_loss(logits: Tensor, labels: Tensor, vocab_size: int) -> Tensor:
    """Mean next-token cross entropy over all bs * seq positions, computed in fp32.

    logits (bs, seq, padded_vocab) come from Transformer.forward; labels (bs, seq) are real ids.
    Only the first vocab_size columns enter the softmax, so padded output rows take no probability
    mass and get no gradient. Logits split along the vocab can't be sliced like this; the parallel
    code that splits them supplies its own loss.
    """
    real_logits = logits[..., :vocab_size].flatten(0, 1).float()  # (bs * seq, vocab_size)
    return F.cross_entropy(real_logits, labels.flatten(0, 1))  # labels: (bs * seq,)
