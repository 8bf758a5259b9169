"""Training step time and peak memory: causal SDPA against block-causal attention (SDPA with a dense mask, and on
CUDA FlexAttention), eager and compiled.

    python scripts/bench_attention.py                          # every shape below
    python scripts/bench_attention.py --shapes debug-8k --steps 4

Each row trains the flavor at batch 1 on the shipped corpus for --warmup steps (compiling, if asked), then times
--steps more steps of the trainer's own train_step, and reports the median step. Peak memory: on CUDA the allocator's
peak over the timed steps; on CPU the most tensor memory one eager step holds (MemTracker; compiled code runs
eagerly under it, so compiled rows show none). FlexAttention only runs on CUDA: torch has no FlexAttention backward
on CPU.
"""

import argparse
import statistics
import tempfile
import time

import torch
import torch._dynamo

from bench_common import DEBUG_TOML, peak_tensor_bytes
from titan.train.trainer import Trainer
from titan.validate import load_job_config

# The debug and 100M flavors stop at 2048 tokens (their rotary tables); 1B covers 8192.
SHAPES = {"debug-2k": ("debugmodel", 2048), "100M-2k": ("100M", 2048), "1B-8k": ("1B", 8192)}
VARIANTS = {"causal sdpa": ("causal", "sdpa"), "block-causal sdpa": ("block_causal", "sdpa"),
            "block-causal flex": ("block_causal", "flex")}
MIB = 2**20


def build(flavor: str, seq_len: int, mask: str, backend: str, compiled: bool, folder: str) -> Trainer:
    argv = ["--job.config_file", DEBUG_TOML, "--job.dump_folder", folder, "--model.flavor", flavor,
            "--training.seq_len", str(seq_len), "--training.local_batch_size", "1", "--training.steps", "1000",
            "--model.attn_mask_type", mask, "--model.attn_backend", backend, "--metrics.log_freq", "1000"]
    if compiled:
        argv.append("--training.compile")
    if torch.cuda.is_available():
        argv += ["--training.mixed_precision_param", "bfloat16"]
    return Trainer(load_job_config(argv, world_size=1), world_size=1)


def measure(trainer: Trainer, warmup: int, steps: int, compiled: bool) -> tuple[float, float | None]:
    """(median step seconds, peak MiB or None)."""
    batches = iter(trainer.dataloader)
    cuda = trainer.device.type == "cuda"
    for _ in range(warmup):
        trainer.train_step(batches)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    seconds = []
    for _ in range(steps):
        start = time.perf_counter()
        trainer.train_step(batches)  # reads the loss on the host: the step has finished
        seconds.append(time.perf_counter() - start)
    if cuda:
        peak = torch.cuda.max_memory_allocated() / MIB
    elif compiled:
        peak = None
    else:
        peak = peak_tensor_bytes(lambda: trainer.train_step(batches), trainer.training.model,
                                 trainer.training.optimizer) / MIB
    trainer.dataloader.close()
    return statistics.median(seconds), peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--modes", nargs="+", default=["eager", "compiled"], choices=["eager", "compiled"])
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    device = torch.cuda.get_device_name() if cuda else f"CPU, {torch.get_num_threads()} threads"
    print(f"{device}, torch {torch.__version__}, batch 1, median of {args.steps} steps after {args.warmup}")
    print(f"{'shape':>9} {'mode':>9} {'attention':>18} {'step s':>8} {'tokens/s':>9} {'peak MiB':>9}")
    for shape in args.shapes:
        flavor, seq_len = SHAPES[shape]
        for mode in args.modes:
            for variant, (mask, backend) in VARIANTS.items():
                if backend == "flex" and not cuda:
                    continue
                torch._dynamo.reset()
                with tempfile.TemporaryDirectory() as folder:
                    trainer = build(flavor, seq_len, mask, backend, mode == "compiled", folder)
                    step, peak = measure(trainer, args.warmup, args.steps, mode == "compiled")
                peak_text = f"{peak:9.0f}" if peak is not None else f"{'-':>9}"
                print(f"{shape:>9} {mode:>9} {variant:>18} {step:8.3f} {seq_len / step:9.0f} {peak_text}",
                      flush=True)
                del trainer
                if cuda:
                    torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
