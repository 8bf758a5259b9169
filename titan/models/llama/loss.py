"""Training loss over the real vocabulary, whole or a chunk of tokens at a time."""

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

LossFn = Callable[[Tensor, Tensor], Tensor]
"""A batch's mean token loss from its logits (bs, seq, padded_vocab) and labels (bs, seq), over the real vocabulary:
cross_entropy_loss with the vocabulary bound, or a parallel layout's equivalent."""


def cross_entropy_loss(logits: Tensor, labels: Tensor, vocab_size: int, chunk_size: int = 0) -> Tensor:
    """Mean next-token cross entropy over all bs * seq positions, computed in fp32.

    logits (bs, seq, padded_vocab) come from Transformer.forward; labels (bs, seq) are real ids.
    Only the first vocab_size columns enter the softmax, so padded output rows take no probability
    mass and get no gradient. Logits split along the vocab can't be sliced like this; the parallel
    code that splits them supplies its own loss.

    chunk_size 0 upcasts all logits to fp32 at once; otherwise fp32 logits exist for chunk_size tokens at a time
    (ChunkedCrossEntropy), with the same loss and gradient. Chunks save memory in eager mode only: under
    torch.compile, AOTAutograd saves the unchunked loss's per-row max and log-sum-exp instead of its fp32
    log-softmax, and Inductor fuses the rest, so no fp32 logits are stored and chunks only add work.
    """
    if chunk_size == 0:
        real_logits = logits[..., :vocab_size].flatten(0, 1).float()  # (bs * seq, vocab_size)
        return F.cross_entropy(real_logits, labels.flatten(0, 1))  # labels: (bs * seq,)
    # Decided here: inside Function.forward grad mode is always off.
    need_grad = torch.is_grad_enabled() and logits.requires_grad
    return ChunkedCrossEntropy.apply(logits, labels, vocab_size, chunk_size, need_grad)


class ChunkedCrossEntropy(torch.autograd.Function):
    """cross_entropy_loss a chunk of tokens at a time, with the logits' gradient computed during the forward.

    The gradient of the mean loss, (softmax - onehot) / num_tokens, is final once a chunk's softmax is known, so
    each chunk writes it, in the logits' dtype, into one buffer shaped like the logits, and backward only scales
    it by the incoming gradient. The fp32 upcast, log-softmax and fp32 gradient exist for one chunk at a time
    instead of for the whole micro-batch. Each chunk runs the kernels F.cross_entropy runs, so the gradient is
    the one the unchunked loss produces after its backward casts it to the logits' dtype: bit for bit when
    grad_output is 1 or a power of two, else within one rounding of that dtype (the scaling comes after the cast).
    The loss sums the chunks' sums, the same fp32 additions in another order.
    """

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, logits: Tensor, labels: Tensor, vocab_size: int,
                chunk_size: int, need_grad: bool) -> Tensor:
        flat_logits = logits.flatten(0, 1)  # (bs * seq, padded_vocab)
        flat_labels = labels.flatten(0, 1)  # (bs * seq,)
        num_tokens = flat_labels.numel()
        grad = None
        if need_grad:
            grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
            grad[..., vocab_size:] = 0  # padded columns: no probability mass, so no gradient
        loss_sum = torch.zeros((), dtype=torch.float32, device=logits.device)
        for start in range(0, num_tokens, chunk_size):
            rows = slice(start, start + chunk_size)
            log_probs = torch.log_softmax(flat_logits[rows, :vocab_size].float(), dim=-1)  # (chunk, vocab_size)
            loss_sum += F.nll_loss(log_probs, flat_labels[rows], reduction="sum")
            if grad is not None:
                grad.flatten(0, 1)[rows, :vocab_size] = mean_loss_grad(log_probs, flat_labels[rows], num_tokens)
        if grad is not None:
            ctx.save_for_backward(grad)
        return loss_sum / num_tokens

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad_output: Tensor) -> tuple[Tensor | None, ...]:
        (grad,) = ctx.saved_tensors
        # In place: the buffer is this graph's own. A second backward (retain_graph) fails torch's saved-tensor
        # version check instead of scaling twice.
        return grad.mul_(grad_output), None, None, None, None


def mean_loss_grad(log_probs: Tensor, labels: Tensor, num_tokens: int) -> Tensor:
    """The gradient of the mean cross entropy over num_tokens w.r.t. these rows' logits, (softmax - onehot) /
    num_tokens, by the kernels and the values of F.cross_entropy's backward: NLL's mean reduction writes
    -1 / num_tokens at each label, and log-softmax's backward turns that into the logits' gradient.

    Computing softmax - onehot directly would save the chunk-sized nll_grad, but torch.exp rounds differently from
    the exp inside log-softmax's backward, so the gradient would drift from the unchunked one by fp32 roundings."""
    label_grad = -(torch.ones((), dtype=torch.float32, device=log_probs.device) / num_tokens)
    nll_grad = torch.zeros_like(log_probs).scatter_(1, labels.unsqueeze(1), label_grad.expand(labels.numel(), 1))
    return torch._log_softmax_backward_data(nll_grad, log_probs, 1, torch.float32)
