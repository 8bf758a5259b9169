"""The chunked cross entropy (--training.loss_chunk_size) against the whole-micro-batch one it replaces."""

import functools
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from debug_training import train
from titan.models.llama.loss import cross_entropy_loss

VOCAB, PADDED_VOCAB = 2256, 2304  # the debug tokenizer's real and padded vocab
BATCH, SEQ = 3, 100  # 300 tokens


def make_logits(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits (BATCH, SEQ, PADDED_VOCAB) whose padded columns would dominate any softmax that let them in."""
    torch.manual_seed(0)
    logits = torch.randn(BATCH, SEQ, PADDED_VOCAB) * 3
    logits[..., VOCAB:] = 1e4
    return logits.to(dtype), torch.randint(0, VOCAB, (BATCH, SEQ))


def loss_and_grad(loss_fn: Callable[..., torch.Tensor], logits: torch.Tensor, labels: torch.Tensor,
                  scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    leaf = logits.clone().requires_grad_()
    loss = loss_fn(leaf, labels, VOCAB)
    (loss * scale).backward()
    return loss.detach(), leaf.grad


# 1: a chunk per token; 7 and 64 leave a partial last chunk; 300: one chunk; 1000: more than the tokens.
@pytest.mark.parametrize("chunk_size", [1, 7, 64, 300, 1000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_matches_full(chunk_size: int, dtype: torch.dtype) -> None:
    """Each chunk runs F.cross_entropy's kernels on the same rows, so the gradient is bit-identical (padded
    columns zero); the loss sums chunk sums, another order of the same fp32 additions."""
    logits, labels = make_logits(dtype)
    full_loss, full_grad = loss_and_grad(cross_entropy_loss, logits, labels)
    loss, grad = loss_and_grad(functools.partial(cross_entropy_loss, chunk_size=chunk_size), logits, labels)
    assert grad.dtype == dtype and not grad[..., VOCAB:].any()
    assert torch.equal(grad, full_grad)
    torch.testing.assert_close(loss, full_loss, rtol=1e-6, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scaled_loss_gradient(dtype: torch.dtype) -> None:
    """The trainer divides the loss by the accumulation steps. The chunked loss scales its gradient, already in the
    logits' dtype, so it matches exactly for a power of two and within one rounding of that dtype otherwise."""
    logits, labels = make_logits(dtype)
    chunked = functools.partial(cross_entropy_loss, chunk_size=64)
    assert torch.equal(loss_and_grad(chunked, logits, labels, 1 / 4)[1],
                       loss_and_grad(cross_entropy_loss, logits, labels, 1 / 4)[1])
    _, grad = loss_and_grad(chunked, logits, labels, 1 / 3)
    _, full_grad = loss_and_grad(cross_entropy_loss, logits, labels, 1 / 3)
    ulp = torch.finfo(dtype).eps
    torch.testing.assert_close(grad, full_grad, rtol=ulp, atol=ulp * full_grad.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_matches_eager(dtype: torch.dtype) -> None:
    """As --training.compile runs it. Inductor fuses the log-softmax backward into its own kernel, so the fp32
    gradient may round differently before the cast to the logits' dtype: equal within that dtype's rounding."""
    logits, labels = make_logits(dtype)
    chunked = functools.partial(cross_entropy_loss, chunk_size=64)
    eager_loss, eager_grad = loss_and_grad(chunked, logits, labels)
    compiled_loss, compiled_grad = loss_and_grad(torch.compile(chunked), logits, labels)
    torch.testing.assert_close(compiled_loss, eager_loss, rtol=1e-6, atol=0)
    torch.testing.assert_close(compiled_grad, eager_grad)


class LogitsShapedTensors(TorchDispatchMode):
    """Counts the tensors of a given shape that ops create (not views of existing ones)."""

    def __init__(self, shape: torch.Size) -> None:
        super().__init__()
        self.shape, self.count = shape, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor) and out.shape == self.shape and not func.is_view:
            self.count += 1
        return out


@pytest.mark.parametrize("grad_mode", ["no_grad", "logits_without_grad"])
def test_evaluation_allocates_no_gradient(grad_mode: str) -> None:
    logits, labels = make_logits(torch.bfloat16)
    with_grad = LogitsShapedTensors(logits.shape)
    with with_grad:
        expected = cross_entropy_loss(logits.clone().requires_grad_(), labels, VOCAB, chunk_size=64)
    assert with_grad.count == 2  # the clone and the gradient buffer

    without_grad = LogitsShapedTensors(logits.shape)
    # Evaluation runs under no_grad; logits that need no gradient (a frozen model) need no buffer either.
    with without_grad, torch.set_grad_enabled(grad_mode == "logits_without_grad"):
        loss = cross_entropy_loss(logits.clone().requires_grad_(grad_mode == "no_grad"), labels, VOCAB,
                                  chunk_size=64)
    assert without_grad.count == 1  # the clone
    assert not loss.requires_grad
    assert torch.equal(loss, expected.detach())


def test_training_losses_match_unchunked(tmp_path: Path) -> None:
    """256 tokens per micro-batch: the default chunk covers them at once; 100 makes two chunks and a partial one."""
    steps = ["--training.steps", "5"]
    _, full = train(tmp_path / "full", *steps, "--training.loss_chunk_size", "0")
    _, default = train(tmp_path / "default", *steps)
    trainer, chunked = train(tmp_path / "chunked", *steps, "--training.loss_chunk_size", "100")
    assert trainer.training.loss_fn.keywords["chunk_size"] == 100
    assert len(full) == 5
    torch.testing.assert_close(default, full, rtol=0, atol=1e-5)
    torch.testing.assert_close(chunked, full, rtol=0, atol=1e-5)
