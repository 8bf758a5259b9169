"""Measure, on this CUDA GPU, the share of its datasheet peaks that a training step's kernels reach: the achieved
ceilings titan/estimate/roofline.py scales its roofline by (GPUSpec's *_efficiency fields, docs/scale.md).

    python scripts/bench_roofline.py                  # Llama 3 1B and 8B shapes, 16,384 tokens
    python scripts/bench_roofline.py --flavor 70B --tokens 8192

- matmul: every linear of one block, forward (x W^T) and both backward products, bf16 through cuBLAS: total FLOPs
  over total time, as a share of the dense bf16 peak.
- attention: causal SDPA forward + backward (flash) at the flavor's heads and head dim, with the roofline's FLOP
  convention (titan/estimate/trace.py attention_flops: the causal half; backward 2.5x forward).
- hbm: eager elementwise kernels over 1 GiB (bf16 multiply, fp32 -> bf16 cast, in-place fp32 add): bytes read plus
  written over time, as a share of the datasheet bandwidth.
Each is the median of 20 timed repeats (CUDA events) after 3 warm-ups."""

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from titan.estimate.roofline import GPUS  # noqa: E402
from titan.estimate.trace import attention_flops  # noqa: E402
from titan.models.llama.args import LLAMA3_FLAVORS, ffn_hidden_dim  # noqa: E402


def median_ms(fn: Callable[[], object], repeats: int = 20) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def matmul_share(flavor: str, tokens: int, peak: float) -> float:
    args = LLAMA3_FLAVORS[flavor]
    head_dim = args.dim // args.n_heads
    hidden = ffn_hidden_dim(args)
    linears = [(args.dim, args.dim), (args.dim, args.n_kv_heads * head_dim), (args.dim, args.n_kv_heads * head_dim),
               (args.dim, args.dim), (args.dim, hidden), (args.dim, hidden), (hidden, args.dim)]
    flops, ms = 0.0, 0.0
    for fan_in, fan_out in linears:
        x = torch.randn(tokens, fan_in, device="cuda", dtype=torch.bfloat16)
        weight = torch.randn(fan_out, fan_in, device="cuda", dtype=torch.bfloat16)
        grad = torch.randn(tokens, fan_out, device="cuda", dtype=torch.bfloat16)
        for product in (lambda: x @ weight.t(), lambda: grad @ weight, lambda: grad.t() @ x):
            flops += 2.0 * tokens * fan_in * fan_out
            ms += median_ms(product)
    return flops / (ms / 1e3) / peak


def attention_share(flavor: str, tokens: int, peak: float) -> tuple[float, float]:
    args = LLAMA3_FLAVORS[flavor]
    head_dim = args.dim // args.n_heads
    seq_len = min(8192, tokens)
    shape = (tokens // seq_len, args.n_heads, seq_len, head_dim)
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    grad = torch.randn_like(out)
    forward_ms = median_ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))
    step_ms = median_ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(grad))
    flops = 3.5 * attention_flops(q, k, causal=True)  # forward + backward (2.5x), the roofline's convention
    return flops / (step_ms / 1e3) / peak, forward_ms


def hbm_share(bandwidth: float) -> float:
    numel = 2**29  # 1 GiB of bf16
    a, b = (torch.randn(numel, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    wide = torch.randn(numel // 2, device="cuda")
    kernels = [(lambda: a * b, 3 * 2 * numel), (lambda: wide.to(torch.bfloat16), 6 * numel // 2),
               (lambda: wide.add_(1.0), 8 * numel // 2)]
    total_bytes = sum(nbytes for _, nbytes in kernels)
    total_ms = sum(median_ms(kernel) for kernel, _ in kernels)
    return total_bytes / (total_ms / 1e3) / bandwidth


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--flavor", nargs="+", default=["1B", "8B"], choices=sorted(LLAMA3_FLAVORS))
    parser.add_argument("--tokens", type=int, default=16384, help="tokens per micro-batch")
    parser.add_argument("--gpu", default="H100", choices=sorted(GPUS), help="the spec whose peaks are the 100%%")
    args = parser.parse_args()
    gpu = GPUS[args.gpu]
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; shares of the {gpu.name} datasheet peaks "
          f"({gpu.peak_bf16_flops / 1e12:.0f} TFLOP/s bf16, {gpu.hbm_bandwidth / 1e12:.2f} TB/s)")
    print(f"hbm (elementwise, 1 GiB): {hbm_share(gpu.hbm_bandwidth):.3f}")
    for flavor in args.flavor:
        matmul = matmul_share(flavor, args.tokens, gpu.peak_bf16_flops)
        attention, forward_ms = attention_share(flavor, args.tokens, gpu.peak_bf16_flops)
        print(f"{flavor}, {args.tokens} tokens: matmul {matmul:.3f}, attention {attention:.3f} "
              f"(forward alone {forward_ms:.2f} ms)")


if __name__ == "__main__":
    main()
