"""The output layer and cross entropy, whole batch against --training.loss_chunk_size chunks: speed and peak memory.

    python scripts/bench_loss.py                        # the shapes below, chunk sizes 1024 2048 4096
    python scripts/bench_loss.py --compile --repeats 5  # also time the loss compiled, as --training.compile runs it

What is measured is OutputLoss (titan/models/common/loss.py), forward and backward, from the final hidden states:
with chunk size 0 the output layer makes the whole batch's logits and the loss reads them; chunked, each chunk's
logits exist only inside its checkpointed forward and again, one chunk at a time, in the backward. Shapes: the
debug job's (8 x 2048 tokens, dim 256, vocab 2256), timed; Llama 3 8B's output layer (dim 4096, vocab 128256) at
2048 and 8192 tokens, peak only, on fake tensors (its whole-batch loss at 8192 tokens holds 6 GiB). Time is the
median seconds of forward + backward. Peak is the most tensor memory the forward + backward holds beyond the hidden
states and the output weight (which the model holds anyway), measured by MemTracker, eagerly: compiled code runs
eagerly under it.
"""

import argparse
import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from bench_common import interleaved_median_seconds, peak_tensor_bytes
from titan.models.common.args import padded_vocab_size
from titan.models.common.loss import OutputLoss

MIB = 2**20


@dataclass
class Shape:
    name: str
    batch: int
    seq_len: int
    dim: int
    vocab_size: int
    timed: bool
    """False: peak memory only, measured on fake tensors, so a shape too big to run here can be shown."""

    @property
    def padded_vocab(self) -> int:
        return padded_vocab_size(self.vocab_size, 64)


SHAPES = [Shape("debug", 8, 2048, 256, 2256, timed=True),
          Shape("Llama 3 8B output, 2k tokens", 1, 2048, 4096, 128256, timed=False),
          Shape("Llama 3 8B output, 8k tokens", 1, 8192, 4096, 128256, timed=False)]


def loss_step(loss: OutputLoss, h: torch.Tensor, output: nn.Linear, labels: torch.Tensor) -> Callable[[], None]:
    """One forward + backward of the loss on fresh gradients."""
    def step() -> None:
        h.grad, output.weight.grad = None, None
        loss(h, labels, output).backward()
    return step


def measure_shape(shape: Shape, chunk_sizes: list[int], repeats: int, compile_loss: bool,
                  device: torch.device) -> tuple[dict[str, float], dict[int, float]]:
    """Median seconds per variant ("eager 1024", "compiled 0"; none for an untimed shape) and eager peak MiB per
    chunk size (0: the whole batch at once), beyond the hidden states and the weight."""
    torch.manual_seed(0)
    with contextlib.nullcontext() if shape.timed else FakeTensorMode():
        output = nn.Linear(shape.dim, shape.padded_vocab, bias=False, device=device, dtype=torch.bfloat16)
        h = torch.randn(shape.batch, shape.seq_len, shape.dim, device=device, dtype=torch.bfloat16,
                        requires_grad=True)
        labels = torch.randint(0, shape.vocab_size, (shape.batch, shape.seq_len), device=device)
        held = h.numel() * h.element_size() + output.weight.numel() * output.weight.element_size()
        losses = {chunk_size: OutputLoss(shape.vocab_size, chunk_size) for chunk_size in [0, *chunk_sizes]}
        steps = {f"eager {chunk_size}": loss_step(loss, h, output, labels) for chunk_size, loss in losses.items()}
        peak_mib = {chunk_size: (peak_tensor_bytes(steps[f"eager {chunk_size}"]) - held) / MIB
                    for chunk_size in losses}
    if not shape.timed:
        return {}, peak_mib
    if compile_loss:
        for chunk_size in list(losses):
            compiled = OutputLoss(shape.vocab_size, chunk_size)
            compiled.logits_loss = torch.compile(compiled.logits_loss)
            steps[f"compiled {chunk_size}"] = loss_step(compiled, h, output, labels)
    return interleaved_median_seconds(steps, repeats, device), peak_mib


def print_table(shape: Shape, seconds: dict[str, float], peak_mib: dict[int, float], device: torch.device) -> None:
    """One row per chunk size; "vs whole" compares each peak with the whole batch's."""
    logits_mib = shape.batch * shape.seq_len * shape.padded_vocab * torch.bfloat16.itemsize / MIB
    print(f"\n{shape.name}: {shape.batch} x {shape.seq_len} tokens, dim {shape.dim}, vocab {shape.vocab_size} "
          f"(padded {shape.padded_vocab}), whole-batch bf16 logits {logits_mib:.0f} MiB, "
          + (f"{device}, {torch.get_num_threads()} threads" if shape.timed else "fake tensors: peak only"))
    timed_columns = sorted({name.split()[0] for name in seconds}, reverse=True)  # eager, then compiled
    print(f"{'chunk':>8}" + "".join(f" {column + ' s':>11}" for column in timed_columns)
          + f" {'peak MiB':>9} {'vs whole':>9}")
    for chunk_size, peak in peak_mib.items():
        print(f"{chunk_size or 'whole':>8}" + "".join(f" {seconds[f'{column} {chunk_size}']:11.3f}"
                                                   for column in timed_columns)
              + f" {peak:9.0f} {peak / peak_mib[0]:8.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chunk-sizes", type=int, nargs="+", default=[1024, 2048, 4096])
    parser.add_argument("--repeats", type=int, default=5, help="timed calls per variant, after two warm-up calls")
    parser.add_argument("--compile", action="store_true", help="also time the loss compiled")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    for shape in SHAPES:
        print_table(shape, *measure_shape(shape, args.chunk_sizes, args.repeats, args.compile, device), device)


if __name__ == "__main__":
    main()
