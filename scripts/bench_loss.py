"""Cross entropy speed and memory, unchunked against --training.loss_chunk_size chunks.

    python scripts/bench_loss.py                        # the shapes below, chunk sizes 1024 2048 4096
    python scripts/bench_loss.py --compile --repeats 5  # also time the loss under torch.compile

Shapes: the debug job's (8 x 2048 tokens, vocab 2048) and Llama 3's 128256-token vocab at 2048 tokens, bf16 logits,
timed; and the 128k vocab at 8192 tokens, its peak only, on fake tensors (its unchunked loss needs 14 GiB).
Time is the median seconds of the loss's forward + backward. Peak is the most tensor memory its forward + backward
holds, measured eagerly by MemTracker: the logits (the loss views them), the logits' gradient and the loss's own
fp32 temporaries. "- logits" leaves out the logits, which the model made and holds anyway. The peak is always the
eager code's, since compiled code runs eagerly under MemTracker. (--training.compile runs the unchunked loss, which,
compiled, stores no fp32 logits: see --training.loss_chunk_size.)
"""

import argparse
import contextlib
import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from bench_common import interleaved_median_seconds, peak_tensor_bytes
from torch._subclasses.fake_tensor import FakeTensorMode

from titan.models.llama.loss import cross_entropy_loss

MIB = 2**20


@dataclass
class Shape:
    name: str
    batch: int
    seq_len: int
    vocab_size: int
    padded_vocab: int
    timed: bool
    """False: peak memory only, measured on fake tensors, so a shape too big to run here can be shown."""


SHAPES = [Shape("debug", 8, 2048, 2048, 2048, timed=True),
          Shape("llama3 128k vocab", 1, 2048, 128256, 128256, timed=True),
          Shape("llama3 128k vocab, 8k tokens", 1, 8192, 128256, 128256, timed=False)]


def loss_step(loss_fn: Callable[..., torch.Tensor], logits: torch.Tensor, labels: torch.Tensor,
              vocab_size: int) -> Callable[[], None]:
    """One forward + backward of loss_fn on fresh gradients."""
    def step() -> None:
        logits.grad = None
        loss_fn(logits, labels, vocab_size).backward()
    return step


def measure_shape(shape: Shape, chunk_sizes: list[int], repeats: int, compile_loss: bool,
                  device: torch.device) -> tuple[dict[str, float], dict[int, float]]:
    """Median seconds per variant ("eager 1024", "compiled 0"; none for an untimed shape) and eager peak MiB per
    chunk size (0: unchunked)."""
    torch.manual_seed(0)
    with contextlib.nullcontext() if shape.timed else FakeTensorMode():
        logits = torch.randn(shape.batch, shape.seq_len, shape.padded_vocab, device=device, dtype=torch.bfloat16,
                             requires_grad=True)
        labels = torch.randint(0, shape.vocab_size, (shape.batch, shape.seq_len), device=device)
        loss_fns = {chunk_size: functools.partial(cross_entropy_loss, chunk_size=chunk_size)
                    for chunk_size in [0, *chunk_sizes]}
        steps = {f"eager {chunk_size}": loss_step(loss_fn, logits, labels, shape.vocab_size)
                 for chunk_size, loss_fn in loss_fns.items()}
        peak_mib = {chunk_size: peak_tensor_bytes(steps[f"eager {chunk_size}"]) / MIB for chunk_size in loss_fns}
    if not shape.timed:
        return {}, peak_mib
    if compile_loss:
        steps |= {f"compiled {chunk_size}": loss_step(torch.compile(loss_fn), logits, labels, shape.vocab_size)
                  for chunk_size, loss_fn in loss_fns.items()}
    return interleaved_median_seconds(steps, repeats, device), peak_mib


def print_table(shape: Shape, seconds: dict[str, float], peak_mib: dict[int, float], device: torch.device) -> None:
    """One row per chunk size; "- logits" and "vs none" compare the memory the loss adds to the logits."""
    logits_mib = shape.batch * shape.seq_len * shape.padded_vocab * torch.bfloat16.itemsize / MIB
    print(f"\n{shape.name}: {shape.batch} x {shape.seq_len} tokens, vocab {shape.vocab_size} (padded "
          f"{shape.padded_vocab}), bf16 logits {logits_mib:.0f} MiB, "
          + (f"{device}, {torch.get_num_threads()} threads" if shape.timed else "fake tensors: peak only"))
    timed_columns = sorted({name.split()[0] for name in seconds}, reverse=True)  # eager, then compiled
    print(f"{'chunk':>8}" + "".join(f" {column + ' s':>11}" for column in timed_columns)
          + f" {'peak MiB':>9} {'- logits MiB':>13} {'vs none':>8}")
    for chunk_size, peak in peak_mib.items():
        own_mib = peak - logits_mib
        print(f"{chunk_size or 'none':>8}" + "".join(f" {seconds[f'{column} {chunk_size}']:11.3f}"
                                                  for column in timed_columns)
              + f" {peak:9.0f} {own_mib:13.0f} {own_mib / (peak_mib[0] - logits_mib):7.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chunk-sizes", type=int, nargs="+", default=[1024, 2048, 4096])
    parser.add_argument("--repeats", type=int, default=5, help="timed calls per variant, after two warm-up calls")
    parser.add_argument("--compile", action="store_true", help="also time the loss under torch.compile")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    for shape in SHAPES:
        print_table(shape, *measure_shape(shape, args.chunk_sizes, args.repeats, args.compile, device), device)


if __name__ == "__main__":
    main()
