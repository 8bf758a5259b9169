"""The output layer and loss a chunk of tokens at a time (OutputLoss, --training.loss_chunk_size) against the whole
micro-batch's logits, and the loss's normalization by the valid targets of the whole step."""

from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from titan.data.micro_batch import Batch
from titan.models.common.loss import IGNORE_INDEX, OutputLoss, cross_entropy_sum
from titan.train.step import TrainingStep

from harness.debug_training import train

VOCAB, PADDED_VOCAB, DIM = 2256, 2304, 32  # the debug tokenizer's real and padded vocab
BATCH, SEQ = 3, 100  # 300 tokens


def make_inputs(dtype: torch.dtype) -> tuple[torch.Tensor, nn.Linear, torch.Tensor]:
    """Hidden states (BATCH, SEQ, DIM), an output layer whose padded rows would dominate any softmax that let them
    in, and labels with some targets ignored."""
    torch.manual_seed(0)
    output = nn.Linear(DIM, PADDED_VOCAB, bias=False, dtype=dtype)
    with torch.no_grad():
        output.weight[VOCAB:] = 1e2
    labels = torch.randint(0, VOCAB, (BATCH, SEQ))
    labels[:, ::7] = IGNORE_INDEX
    return torch.randn(BATCH, SEQ, DIM, dtype=dtype), output, labels


def loss_and_grads(chunk_size: int, h: torch.Tensor, output: nn.Linear, labels: torch.Tensor,
                   loss: OutputLoss | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(summed loss, its gradient w.r.t. h, w.r.t. the output weight)."""
    output.zero_grad()
    leaf = h.clone().requires_grad_()
    value = (loss or OutputLoss(VOCAB, chunk_size))(leaf, labels, output)
    value.backward()
    return value.detach(), leaf.grad, output.weight.grad.clone()


def test_whole_batch_is_the_summed_cross_entropy_of_the_logits() -> None:
    h, output, labels = make_inputs(torch.float32)
    loss = OutputLoss(VOCAB, 0)(h, labels, output)
    valid = labels != IGNORE_INDEX
    want = nn.functional.cross_entropy(output(h)[valid][:, :VOCAB], labels[valid], reduction="sum")
    torch.testing.assert_close(loss, want)
    torch.testing.assert_close(loss, cross_entropy_sum(output(h), labels, VOCAB))


# 1: a chunk per token; 7 and 64 leave a partial last chunk; 300: one chunk; 1000: more than the tokens.
@pytest.mark.parametrize("chunk_size", [1, 7, 64, 300, 1000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_matches_whole(chunk_size: int, dtype: torch.dtype) -> None:
    """Chunks recompute the same per-token logits and losses; sums and weight gradients add the same terms in
    another order, so they agree to the dtype's rounding, and padded output rows get no gradient."""
    h, output, labels = make_inputs(dtype)
    whole = loss_and_grads(0, h, output, labels)
    chunked = loss_and_grads(chunk_size, h, output, labels)
    assert not chunked[2][VOCAB:].any()
    rtol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(chunked[0], whole[0], rtol=1e-5, atol=0)
    for got, want in zip(chunked[1:], whole[1:]):
        torch.testing.assert_close(got, want, rtol=rtol, atol=rtol * want.abs().max().item())


def test_compiled_chunk_loss_matches_eager() -> None:
    """As --training.compile runs it: each chunk's loss of the logits compiled."""
    h, output, labels = make_inputs(torch.float32)
    compiled = OutputLoss(VOCAB, 64)
    compiled.logits_loss = torch.compile(compiled.logits_loss)
    for got, want in zip(loss_and_grads(64, h, output, labels, compiled), loss_and_grads(64, h, output, labels)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


class LargestTensor(TorchDispatchMode):
    """The most elements of any tensor that ops create."""

    def __init__(self) -> None:
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(tensor, torch.Tensor):
                self.numel = max(self.numel, tensor.numel())
        return out


@pytest.mark.parametrize("chunk_size", [0, 64])
def test_full_logits_never_exist_when_chunked(chunk_size: int) -> None:
    """Forward and backward: chunked, no tensor is larger than a chunk's logits; whole, the logits are there."""
    h, output, labels = make_inputs(torch.float32)
    largest = LargestTensor()
    with largest:
        loss_and_grads(chunk_size, h, output, labels)
    if chunk_size == 0:
        assert largest.numel == BATCH * SEQ * PADDED_VOCAB
    else:
        assert largest.numel == chunk_size * PADDED_VOCAB


def test_training_losses_match_unchunked(tmp_path: Path) -> None:
    """256 tokens per micro-batch: the default chunk covers them at once; 100 makes two chunks and a partial one."""
    steps = ["--training.steps", "5"]
    _, full = train(tmp_path / "full", *steps, "--training.loss_chunk_size", "0")
    _, default = train(tmp_path / "default", *steps)
    trainer, chunked = train(tmp_path / "chunked", *steps, "--training.loss_chunk_size", "100")
    assert trainer.training.model.output_loss.chunk_size == 100
    assert len(full) == 5
    torch.testing.assert_close(default, full, rtol=0, atol=1e-5)
    torch.testing.assert_close(chunked, full, rtol=0, atol=1e-5)


def step_gradients(training: TrainingStep, batches: list[Batch]) -> tuple[float, dict[str, torch.Tensor]]:
    """(the step's mean loss, every parameter's gradient) of one step over `batches`, without updating."""
    training.optimizer.zero_grad()
    loss_sum, _ = training.compute_gradients([training.micro_batch(*batch) for batch in batches])
    grads = {name: p.grad.clone() for name, p in training.model.named_parameters()}
    training.optimizer.zero_grad()
    return training.global_mean(loss_sum).item(), grads


def test_uneven_valid_targets_weigh_every_target_the_same(tmp_path: Path) -> None:
    """Two accumulation micro-batches with very different numbers of valid targets (one has nearly all of its
    targets ignored) give the loss and gradients of one batch holding both: the loss is summed and divided by the
    valid targets of the whole step, not averaged per micro-batch."""
    trainer, _ = train(tmp_path / "run", "--training.steps", "1", "--training.local_batch_size", "2",
                       "--training.global_batch_size", "4", "--training.loss_chunk_size", "50")
    training = trainer.training
    torch.manual_seed(1)
    tokens = torch.randint(3, 2000, (4, 65))
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    # Their targets masked as next-document starts: the first micro-batch keeps 10 of 128.
    ends = torch.zeros_like(inputs, dtype=torch.bool)
    ends[:2, 5:] = True
    one_batch = training.grad_accumulation_steps
    assert one_batch == 2
    loss, grads = step_gradients(training, [(inputs[:2], labels[:2], ends[:2]), (inputs[2:], labels[2:], ends[2:])])
    training.grad_accumulation_steps = 1
    whole_loss, whole_grads = step_gradients(training, [(inputs, labels, ends)])
    assert abs(loss - whole_loss) < 1e-5
    for name, grad in grads.items():
        torch.testing.assert_close(grad, whole_grads[name], rtol=1e-4, atol=1e-6, msg=name)
