"""MX benchmarks: the quantize kernel's bandwidth, linear speed, and the loss-curve comparison.

    python scripts/bench_mx.py --quantize                  # MX quantize GB/s along rows and columns
    python scripts/bench_mx.py --linears                   # Llama 3 8B linear shapes, fwd+bwd time
    python scripts/bench_mx.py --loss-curve --steps 200    # debug model, mxfp8 vs high precision

Quantize: the Triton kernel on a CUDA GPU, and the torch path eager and compiled everywhere. Linears: native MX
matmuls on SM100+ GPUs, emulated elsewhere (said in the header; emulated times measure quantization overhead,
not MX speed). High precision means bf16 on a GPU and fp32 on a CPU. Everything after `--` is a Titan flag on top
of configs/debug_model.toml (--loss-curve).
"""

import argparse

import torch
from torch import nn

from bench_common import add_linears_options, final_loss, high_precision, linear_seconds, median_seconds
from titan.metrics.log import init_logger
from titan.quant.formats import E4M3, MX_BLOCK_SIZE
from titan.quant.mx.linear import MXLinear
from titan.quant.mx.numerics import torch_quantize
from titan.quant.rules import MX_MIN_CAPABILITY

HBM_BYTES_PER_SECOND = {"H100": 3.35e12, "H200": 4.8e12, "B200": 8.0e12}
"""Peak memory bandwidth of the SXM parts (NVIDIA data sheets), to put the kernel's GB/s in proportion."""


def mx_native() -> bool:
    """Whether this machine multiplies MX blocks natively (the rule --mx.emulate is checked against)."""
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= MX_MIN_CAPABILITY


def peak_bandwidth(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for gpu, peak in HBM_BYTES_PER_SECOND.items() if gpu in name), None)


def bench_quantize(rows: int, cols: int, repeats: int) -> None:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16
    x = torch.randn(rows, cols, device=device, dtype=dtype)
    # read x once, write one byte per element and one scale byte per block
    moved_bytes = x.numel() * x.element_size() + x.numel() + x.numel() // MX_BLOCK_SIZE
    peak = peak_bandwidth(device)
    print(f"MX quantize (E4M3, blocks of {MX_BLOCK_SIZE}) of a {rows}x{cols} {dtype} tensor on {device}"
          + (f" ({torch.cuda.get_device_name(device)}, peak {peak / 1e9:,.0f} GB/s)" if peak else ""))
    print(f"{'implementation':<18} {'blocks along':<15} {'us':>10} {'GB/s':>10}"
          + (f" {'% of peak':>10}" if peak else ""))
    implementations = [("torch eager", torch_quantize),
                       ("torch compiled", torch.compile(torch_quantize, dynamic=False))]
    if device.type == "cuda":
        from titan.quant.kernels.mx_quantize import triton_quantize

        implementations.append(("triton", triton_quantize))
    for name, quantize in implementations:
        for dim, label in ((-1, "rows (dim -1)"), (0, "columns (dim 0)")):
            seconds = median_seconds(lambda: quantize(x, MX_BLOCK_SIZE, E4M3, dim), repeats, device)
            gigabytes_per_second = moved_bytes / seconds / 1e9
            line = f"{name:<18} {label:<15} {seconds * 1e6:10.1f} {gigabytes_per_second:10.1f}"
            if peak:
                line += f" {100 * gigabytes_per_second * 1e9 / peak:9.1f}%"
            print(line)


def bench_linears(tokens: int, repeats: int, compile_modules: bool) -> None:
    device, dtype = high_precision()
    native = mx_native()
    mode = "native" if native else "emulated (no SM100+ GPU: quantization overhead, not MX speed)"
    print(f"linear fwd+bwd, {tokens} tokens, {dtype} high precision, device {device}, mx {mode}, "
          f"compile {compile_modules}")
    print(f"{'shape':<8} {'in x out':>13} {'high prec ms':>13} {'mxfp8 ms':>10} {'speedup':>8}")

    def mx_linears(reference: nn.Linear) -> list[nn.Module]:
        return [MXLinear.from_linear(reference, recipe_name="mxfp8", emulate=not native)]

    for name, in_features, out_features, (high, mx) in linear_seconds(tokens, repeats, compile_modules, mx_linears):
        print(f"{name:<8} {f'{in_features}x{out_features}':>13} {high * 1e3:13.2f} {mx * 1e3:10.2f} "
              f"{high / mx:7.2f}x")


def loss_curve(flags: list[str], steps: int) -> None:
    reference = final_loss(flags, steps, "/tmp/titan_mx_curve/high_precision")
    native = mx_native()
    mx_flags = ["--model.converters", "mx"] + ([] if native else ["--mx.emulate"])
    loss = final_loss([*flags, *mx_flags], steps, "/tmp/titan_mx_curve/mxfp8")
    print(f"debug model, {steps} steps: high precision final loss {reference:.4f}")
    print(f"mxfp8{'' if native else ' (emulated)'} final loss {loss:.4f}  difference {loss - reference:+.4f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quantize", action="store_true", help="MX quantize kernel bandwidth")
    add_linears_options(parser)
    parser.add_argument("--loss-curve", action="store_true", help="final loss of mxfp8 vs high precision")
    parser.add_argument("--shape", type=int, nargs=2, metavar=("ROWS", "COLS"), help="tensor shape for --quantize",
                        default=(16384, 8192) if torch.cuda.is_available() else (2048, 1024))
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--steps", type=int, default=200, help="training steps for --loss-curve")
    parser.add_argument("titan_flags", nargs="*", help="Titan flags after --")
    args = parser.parse_args()
    init_logger()
    if args.quantize:
        bench_quantize(*args.shape, args.repeats)
    if args.linears:
        bench_linears(args.tokens, args.repeats, args.compile)
    if args.loss_curve:
        loss_curve(args.titan_flags, args.steps)


if __name__ == "__main__":
    main()
