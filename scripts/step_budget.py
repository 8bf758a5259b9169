"""Titan's eager transformer block beside torchtitan's on the same job, as a GPU runs them, counted on this CPU: per
block and for the step's blocks, kernels launched, bytes moved by kernels other than matmuls and attention, matmul
and attention FLOPs (selective AC's recompute included) and the roofline's predicted time (titan/estimate/budget.py).

    python scripts/step_budget.py --job 1B                        # against the stored torchtitan budget
    python scripts/step_budget.py --job 1B --against torchtitan   # priced live: pip install -e ".[torchtitan]"
    python scripts/step_budget.py --job 1B --against torchtitan --refresh   # and rewrite the stored budget
    python scripts/step_budget.py --job 1B --before               # also Titan before issue 51, and each lever off

--kernels lists each budget's kernels by op, --json prints the budgets as JSON, --gpu prices another card. The
figures are predictions from counts and an H100's measured rates, not measurements. The stored budget holds
torchtitan's kernels (STORED), so that CI compares without torchtitan installed; the torchtitan block is built by
scripts/torchtitan_llama3_1b.py's model config, the one gpu_check.py trains."""

import sys

SHIM_FLAG = "--in-shim"

if __name__ == "__main__" and SHIM_FLAG not in sys.argv:
    # The simulated GPU's shim must be loaded before torch is: build it (which imports torch), then start again.
    import os
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from titan.estimate.cuda_shim import build_cuda_shim

    os.execv(sys.executable, [sys.executable, __file__, SHIM_FLAG, str(build_cuda_shim()), *sys.argv[1:]])

if __name__ == "__main__":
    import ctypes
    import os

    ctypes.CDLL(sys.argv[sys.argv.index(SHIM_FLAG) + 1], mode=os.RTLD_GLOBAL)

import argparse  # noqa: E402
import json  # noqa: E402
import traceback  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402
from unittest import mock  # noqa: E402

import torch  # noqa: E402
from torch import Tensor  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from levers import LEVERS, levers_off  # noqa: E402
from titan.estimate.budget import (  # noqa: E402
    JOBS,
    BlockBudget,
    BudgetJob,
    bf16_parameters,
    block_budget,
    flex_region,
    on_simulated_gpu,
    record_block,
    titan_block_kernels,
)
from titan.estimate.roofline import GPUS, OpCost  # noqa: E402
from titan.models.common.args import padded_vocab_size  # noqa: E402
from titan.models.llama.args import LLAMA3_FLAVORS  # noqa: E402

STORED = Path(__file__).with_name("step_budget_torchtitan.json")
"""torchtitan 0.3.0's block kernels per job, as --refresh wrote them: {job: {"n_layers": n, "ops": [OpCost fields]}}."""
TORCHTITAN = "torchtitan 0.3.0"


def torchtitan_block_kernels(job: BudgetJob, gpu: str) -> list[OpCost]:
    """torchtitan 0.3.0's Llama 3 block of `job` (scripts/torchtitan_llama3_1b.py's model config: fused QKV, complex
    RoPE, nn.RMSNorm), wrapped by its SelectiveAC as its trainer wraps it, parameters in bf16, FlexAttention as its
    compiled region (flex_region), visible and saved as its compile options and save list make it."""
    from torch.nn.attention.flex_attention import create_block_mask
    from torchtitan.distributed.activation_checkpoint import SelectiveAC, _get_default_save_ops
    from torchtitan.models.common.attention import FlexAttention

    from torchtitan_llama3_1b import titan_model_config

    visible = bool(FlexAttention.inductor_configs.get("wrap_inductor_compiled_regions"))
    save_ops = _get_default_save_ops()
    saved = visible and torch.ops.higher_order.inductor_compiled_code in save_ops
    assert not saved or torch.ops.aten._scaled_dot_product_flash_attention.default in save_ops

    def compiled_flex(q: Tensor, k: Tensor, v: Tensor, **kwargs: object) -> tuple[Tensor, None]:
        return flex_region(q, k, v, visible=saved)[0], None

    # Its FlexAttention asserts a BlockMask, which the stand-in does not read: a small real one.
    mask = create_block_mask(lambda b, h, q, kv: kv <= q, None, None, 128, 128, device="cpu")
    config = titan_model_config(LLAMA3_FLAVORS[job.flavor], padded_vocab_size(job.vocab_size, multiple_of=64))
    with torch.device("meta"):
        block = config.layers[0].build()
    with on_simulated_gpu(gpu) as fake_mode:
        block.to_empty(device="cuda")
        with fake_mode:
            bf16_parameters(block)
            wrapped = SelectiveAC(SelectiveAC.Config())._wrap_block(block, base_fqn="layers.0")
            x = torch.empty(job.local_batch_size, job.seq_len, config.dim, device="cuda", dtype=torch.bfloat16,
                            requires_grad=True)
            with mock.patch.object(FlexAttention, "_compiled_flex_attn", compiled_flex):
                return record_block(lambda: wrapped(x, mask, None))


def stored_kernels(job: str) -> tuple[int, list[OpCost]]:
    """(n_layers, kernels) of torchtitan's block of `job` from STORED."""
    entry = json.loads(STORED.read_text())[job]
    return entry["n_layers"], [OpCost(**op) for op in entry["ops"]]


def store_kernels(job: str, n_layers: int, ops: list[OpCost]) -> None:
    stored = json.loads(STORED.read_text()) if STORED.exists() else {}
    stored[job] = {"n_layers": n_layers, "ops": [vars(op) for op in ops]}
    # One kernel a line, so that a refresh's diff shows which kernels changed.
    entries = [f'"{name}": {{"n_layers": {entry["n_layers"]}, "ops": [\n'
               + ",\n".join(json.dumps(op, sort_keys=True) for op in entry["ops"]) + "]}"
               for name, entry in sorted(stored.items())]
    STORED.write_text("{" + ",\n".join(entries) + "}\n")


def budgets(job_name: str, against: str, refresh: bool, before: bool, gpu: str) -> list[BlockBudget]:
    """Titan's budget (then, with `before`, with every lever off and with each off alone) and torchtitan's."""
    job = JOBS[job_name]
    n_layers = LLAMA3_FLAVORS[job.flavor].n_layers
    result = [block_budget("titan", gpu, n_layers, titan_block_kernels(job, gpu))]
    if before:
        with levers_off(LEVERS):
            result.append(block_budget("titan before issue 51", gpu, n_layers, titan_block_kernels(job, gpu)))
        for name in LEVERS:
            with levers_off([name]):
                result.append(block_budget(f"titan, {name} off", gpu, n_layers, titan_block_kernels(job, gpu)))
    if against == "torchtitan":
        ops = torchtitan_block_kernels(job, gpu)
        if refresh:
            store_kernels(job_name, n_layers, ops)
        result.append(block_budget(TORCHTITAN, gpu, n_layers, ops))
    else:
        stored_layers, ops = stored_kernels(job_name)
        result.append(block_budget(f"{TORCHTITAN} (stored)", gpu, stored_layers, ops))
    return result


def table(job_name: str, rows: list[BlockBudget], kernels: bool) -> str:
    job = JOBS[job_name]
    n_layers = rows[0].n_layers
    lines = [f"Step budget: the {job_name} job's eager block on {rows[0].gpu} ({job.local_batch_size} x {job.seq_len} "
             f"tokens, bf16, selective AC, FlexAttention), counted on the CPU; times are roofline predictions", "",
             f"| | kernels | non-matmul GB | matmul TFLOP | attention TFLOP | block ms | {n_layers} blocks ms |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for row in rows:
        lines.append(f"| {row.framework} | {row.kernels} | {row.non_matmul_bytes / 1e9:.2f} | "
                     f"{row.matmul_flops / 1e12:.2f} | {row.attention_flops / 1e12:.2f} | {row.seconds * 1e3:.2f} | "
                     f"{row.step_seconds * 1e3:.1f} |")
    titan, torchtitan = rows[0], rows[-1]
    lines += ["", f"titan / torchtitan, predicted step time of the blocks: {titan.seconds / torchtitan.seconds:.3f} "
                  f"(speed {torchtitan.seconds / titan.seconds:.3f})"]
    if kernels:
        for row in rows:
            lines += ["", f"{row.framework}: " + ", ".join(f"{name} {count}"
                                                         for name, count in row.kernels_by_op.items())]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(SHIM_FLAG, help=argparse.SUPPRESS)
    parser.add_argument("--job", choices=sorted(JOBS), default="1B", help="the job to price (gpu_check.py's)")
    parser.add_argument("--against", choices=["stored", "torchtitan"], default="stored",
                        help="torchtitan's budget as stored beside this script, or priced live (needs torchtitan "
                             "0.3.0: the [torchtitan] extra)")
    parser.add_argument("--refresh", action="store_true",
                        help="with --against torchtitan, rewrite the stored budget")
    parser.add_argument("--before", action="store_true", help="also Titan with every lever off, and each alone")
    parser.add_argument("--gpu", choices=sorted(GPUS), default="H100", help="the card whose rates price the kernels")
    parser.add_argument("--kernels", action="store_true", help="list each budget's kernels by op")
    parser.add_argument("--json", action="store_true", help="print the budgets as a JSON list instead of a table")
    args = parser.parse_args()
    if args.refresh and args.against != "torchtitan":
        parser.error("--refresh rewrites the stored budget from a live one: add --against torchtitan")
    rows = budgets(args.job, args.against, args.refresh, args.before, args.gpu)
    print(json.dumps([row.to_dict() for row in rows]) if args.json else table(args.job, rows, args.kernels))


def exit_code(run: Callable[[], None]) -> int:
    """run()'s exit status: 0, a SystemExit's code (argparse's 2), or 1 after printing an exception's traceback."""
    try:
        run()
        return 0
    except SystemExit as stop:
        return stop.code if isinstance(stop.code, int) else 1
    except Exception:  # any failure: its traceback, then the status
        traceback.print_exc()
        return 1


if __name__ == "__main__":
    code = exit_code(main)
    sys.stdout.flush()
    sys.stderr.flush()
    # The simulated GPU's autograd device threads are never joined: interpreter teardown would abort on them.
    os._exit(code)
