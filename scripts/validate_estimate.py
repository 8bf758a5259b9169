"""Check the dry run's predictions against real steps of the same jobs on this machine (docs/scale.md):

    python scripts/validate_estimate.py                 # CPU: debug model and 100M, 1 and 2 gloo processes
    python scripts/validate_estimate.py --cuda          # one GPU: 100M and 1B, AC none/selective/full
    python scripts/validate_estimate.py --check debug-fsdp2 debug-tp2   # some cases; exit 1 past the tolerance

Each case is a Titan job at a world size. Its prediction is rank 0 of a fake-tensor dry run at that world size
(titan/estimate/simulate.py; one process runs every case's); its measurement is rank 0 of the same job run for real
(one process, or one torchrun launch, per world size), after two steps that create the optimizer state and warm the
caches:
- peak memory of one step, in tensor bytes: on CPU, torch's MemTracker (every storage the dispatcher sees, with the
  model and optimizer registered before the step, no allocator caching; not RSS); on CUDA,
  torch.cuda.max_memory_allocated. Both are independent of the dry run's own accounting.
- collective bytes of one step per mesh dim and kind, on 2 processes: the dry run's StepRecorder run on the real
  tensors of the gloo run (so the check is whether the fake process group and fake tensors reproduce the real
  run's traffic; the byte conventions themselves are checked by hand arithmetic in tests/test_dry_run.py).
- on CUDA also the median step time against the roofline estimate for --estimate.gpu (an optimistic bound by
  design: it ranks layouts, and the table says by how much it undershoots).
--check fails a case whose peak is off by more than --tolerance (default 10%), whose collective bytes differ, or, on
CUDA, whose predicted step time is off the measured one by more than --step-tolerance (default 30%: the roofline
leaves out host and launch overhead, which a small eager model's step is bound by; it measured 2% under on the 1B
cases and 26% under on 100M, docs/scale.md)."""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench_common import peak_tensor_bytes  # noqa: E402
from titan.estimate.roofline import Collective  # noqa: E402
from titan.exits import exit_process  # noqa: E402
from titan.metrics.log import init_logger  # noqa: E402
from titan.validate import load_job_config  # noqa: E402

GIB = 2**30
DEBUG_TOML = str(ROOT / "configs" / "debug_model.toml")
TIMED_STEPS = 10


@dataclass(frozen=True)
class Case:
    name: str
    world_size: int
    flags: tuple[str, ...]

    @property
    def cuda(self) -> bool:
        """A one-GPU case (cuda_cases), predicted on the simulated GPU; the others are predicted on the CPU."""
        return "-cuda-" in self.name


# The CPU cases of full AC recompute attention, as a GPU's eager checkpointed blocks do
# (titan/parallel/ac.py keeps_attention), where a CPU run would keep it.
FULL_AC_RECOMPUTING_ALL = ("--activation_checkpoint.save_attention", "false")


def cpu_cases() -> list[Case]:
    """Small shapes that still run every part: 2 x 512 tokens; the debug model in float32 (its config's), the
    ~100M-parameter flavor in bf16 autocast (FSDP gathering bf16), and the debug model in bf16 autocast with
    selective AC (the suite's bf16 case: seconds, where the 100M flavor's steps take minutes without native bf16)."""
    shape = ("--training.local_batch_size", "2", "--training.seq_len", "512")
    cases = []
    for model, flavor, dtype in (("debug", "debugmodel", "float32"), ("100M", "100M", "bfloat16")):
        base = ("--model.flavor", flavor, "--training.mixed_precision_param", dtype, *shape)
        for mode, extra in (("none", ()), ("full", FULL_AC_RECOMPUTING_ALL), ("selective", ())):
            cases.append(Case(f"{model}-ac-{mode}", 1, (*base, "--activation_checkpoint.mode", mode, *extra)))
        cases.append(Case(f"{model}-fsdp2", 2, (*base, "--parallelism.data_parallel_shard_degree", "2")))
        cases.append(Case(f"{model}-tp2", 2, (*base, "--parallelism.tensor_parallel_degree", "2")))
    cases.append(Case("debug-bf16-ac-selective", 1, ("--model.flavor", "debugmodel", "--training.mixed_precision_param",
                                                     "bfloat16", *shape, "--activation_checkpoint.mode",
                                                     "selective")))
    return cases


def cuda_cases() -> list[Case]:
    """One GPU: the 100M flavor at 8 x 2048 tokens, and 1B at 2 x 8192 tokens (the shipped tokenizer's vocabulary)."""
    cases = []
    for model, flavor, batch, seq_len in (("100M", "100M", 8, 2048), ("1B", "1B", 2, 8192)):
        base = ("--model.flavor", flavor, "--training.local_batch_size", str(batch), "--training.seq_len",
                str(seq_len), "--training.mixed_precision_param", "bfloat16")
        for mode in ("none", "selective", "full"):
            cases.append(Case(f"{model}-cuda-ac-{mode}", 1, (*base, "--activation_checkpoint.mode", mode)))
    return cases


def job_flags(case: Case, dump_folder: str) -> list[str]:
    return ["--job.config_file", DEBUG_TOML, "--job.dump_folder", dump_folder, "--metrics.log_freq", "1000000",
            "--training.steps", "1000", *case.flags]


def bytes_by_dim_and_kind(collectives: list[Collective]) -> dict[str, int]:
    """Payload bytes per "mesh-dim kind" (roofline.Collective's conventions)."""
    totals: dict[str, int] = {}
    for collective in collectives:
        key = f"{collective.dim} {collective.kind}"
        totals[key] = totals.get(key, 0) + collective.bytes
    return totals


def predict(world_size: int, flags: list[str], cuda: bool) -> dict:
    """Rank 0 of the dry run, simulated on the GPU for the --cuda cases and on the CPU for the others (the device
    the measurement runs on): peak bytes, collective bytes per 'dim kind', roofline step seconds."""
    from titan.estimate.report import step_estimate
    from titan.estimate.simulate import run_dry_run

    cfg = load_job_config([*flags, "--job.dry_run"], world_size)
    result = run_dry_run(cfg, world_size, rank=0, simulate_gpu=cuda)
    return {"peak": result.memory.total, "collectives": bytes_by_dim_and_kind(result.collectives),
            "step_s": step_estimate(result, cfg.estimate).step_s}


def measure(world_size: int, flags: list[str]) -> dict:
    """The real job's rank 0: peak bytes of one step, collective bytes of one step, median step seconds."""
    from titan.estimate.simulate import group_infos
    from titan.estimate.trace import StepRecorder
    from titan.train.trainer import Trainer

    trainer = Trainer(load_job_config(flags, world_size), world_size)
    batches = iter(trainer.dataloader)
    cuda = trainer.device.type == "cuda"
    for _ in range(2):
        trainer.train_step(batches)
    seconds = []
    for _ in range(TIMED_STEPS if cuda else 0):
        torch.cuda.synchronize()
        start = time.perf_counter()
        trainer.train_step(batches)
        torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        trainer.train_step(batches)
        peak = torch.cuda.max_memory_allocated()
    else:
        peak = peak_tensor_bytes(lambda: trainer.train_step(batches), *trainer.training.model_parts.parts,
                                 trainer.training.optimizer)
    recorder = StepRecorder(group_infos(trainer.training.meshes))
    if world_size > 1:
        with recorder:
            trainer.train_step(batches)
    return {"peak": peak, "collectives": bytes_by_dim_and_kind(recorder.collectives),
            "step_s": statistics.median(seconds) if seconds else None}


def start_worker(role: str, cases: list[Case], folder: Path) -> tuple[subprocess.Popen, Path]:
    """Start predict or measure for `cases` in turn, in one fresh process (a torchrun launch for a measured world
    size above 1, so measured cases share one world size): a fake and a real process group can't share a process,
    and one start-up per role and world size costs less than one per case. Returns the process and the file its
    rank 0 writes."""
    spec, out = folder / f"{role}-{cases[0].world_size}-cases.json", folder / f"{role}-{cases[0].world_size}.json"
    spec.write_text(json.dumps([{"name": case.name, "world_size": case.world_size, "cuda": case.cuda,
                                 "flags": job_flags(case, str(folder / case.name))} for case in cases]))
    worker = [str(Path(__file__).resolve()), "--worker", role, "--cases-file", str(spec), "--out", str(out)]
    if role == "measure" and cases[0].world_size > 1:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   f"--nproc_per_node={cases[0].world_size}", *worker]
    else:
        command = [sys.executable, *worker]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env={**os.environ, "LOG_RANK": "0"})
    return process, out


def finish_worker(role: str, process: subprocess.Popen, out: Path) -> dict[str, dict]:
    """The reports of a started worker, by case name."""
    output, _ = process.communicate()
    if process.returncode != 0:
        raise RuntimeError(f"{role} failed with exit code {process.returncode}:\n{output[-6000:]}")
    return json.loads(out.read_text())


def run_worker(role: str, cases_file: Path, out: Path) -> None:
    """The worker side: each case of `cases_file` in turn, rank 0 writing every report to `out`. Measured cases share
    the process group that the first one joins (as tests/harness/torchrun.py's cases do): joining a second one on
    the same rendezvous can meet the first one's keys in its store and hang."""
    from titan.parallel.dims import destroy_distributed

    reports = {}
    for spec in json.loads(cases_file.read_text()):
        if role == "predict":
            reports[spec["name"]] = predict(spec["world_size"], spec["flags"], spec["cuda"])
        else:
            reports[spec["name"]] = measure(spec["world_size"], spec["flags"])
    if int(os.environ.get("RANK", "0")) == 0:
        out.write_text(json.dumps(reports))
    destroy_distributed(wait_for_peers=True)


def compare(case: Case, predicted: dict, measured: dict, tolerance: float, step_tolerance: float
            ) -> tuple[str, list[str]]:
    """One table row, and the problems --check reports."""
    error = predicted["peak"] / measured["peak"] - 1
    problems = []
    if abs(error) > tolerance:
        problems.append(f"{case.name}: predicted peak {predicted['peak'] / GIB:.3f} GiB is {100 * error:+.1f}% off "
                        f"the measured {measured['peak'] / GIB:.3f} GiB (tolerance {100 * tolerance:.0f}%).")
    step_error = predicted["step_s"] / measured["step_s"] - 1 if measured["step_s"] is not None else 0.0
    if abs(step_error) > step_tolerance:
        problems.append(f"{case.name}: predicted step time {1e3 * predicted['step_s']:.1f} ms is "
                        f"{100 * step_error:+.1f}% off the measured {1e3 * measured['step_s']:.1f} ms (tolerance "
                        f"{100 * step_tolerance:.0f}%).")
    if measured["collectives"] != predicted["collectives"]:
        problems.append(f"{case.name}: collective bytes per step differ: predicted {predicted['collectives']}, "
                        f"measured {measured['collectives']}.")
    traffic = ", ".join(f"{key} {nbytes / 2**20:.1f} MiB" for key, nbytes in sorted(measured["collectives"].items()))
    row = (f"{case.name:<20} {case.world_size:>5} {predicted['peak'] / GIB:>10.3f} {measured['peak'] / GIB:>10.3f} "
           f"{100 * error:>+7.1f}%")
    if measured["step_s"] is not None:
        row += (f" {1e3 * predicted['step_s']:>10.1f} {1e3 * measured['step_s']:>10.1f} "
                f"{predicted['step_s'] / measured['step_s']:>7.2f}")
    if traffic:
        row += f"  {traffic} ({'same' if measured['collectives'] == predicted['collectives'] else 'DIFFERENT'})"
    return row, problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("cases", nargs="*", help="case names (default: every case of the device)")
    parser.add_argument("--cuda", action="store_true", help="the one-GPU cases (peak and step time)")
    parser.add_argument("--check", action="store_true", help="exit 1 if a case is past the tolerance")
    parser.add_argument("--tolerance", type=float, default=0.10, help="largest relative peak error for --check")
    parser.add_argument("--step-tolerance", type=float, default=0.30,
                        help="largest relative step-time error for --check, on CUDA (where step times are measured)")
    parser.add_argument("--worker", choices=["predict", "measure"], help=argparse.SUPPRESS)
    parser.add_argument("--cases-file", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        init_logger()
        run_worker(args.worker, args.cases_file, args.out)
        return 0
    cases = cuda_cases() if args.cuda else cpu_cases()
    known = {case.name: case for case in cpu_cases() + cuda_cases()}
    unknown = [name for name in args.cases if name not in known]
    if unknown:
        parser.error(f"unknown case(s) {', '.join(unknown)}; known: {', '.join(known)}")
    cases = [known[name] for name in args.cases] or cases
    header = f"{'case':<20} {'ranks':>5} {'pred GiB':>10} {'meas GiB':>10} {'error':>8}"
    if args.cuda:
        header += f" {'pred ms':>10} {'meas ms':>10} {'ratio':>7}"
    rows, problems = [header + "  collectives per step (rank 0)"], []
    groups = [[case for case in cases if case.world_size == size] for size in sorted({c.world_size for c in cases})]
    with tempfile.TemporaryDirectory() as tmp:
        prediction = start_worker("predict", cases, Path(tmp))
        # On a GPU the predictions finish first, so that they never overlap a timed step; on the CPU, which times no
        # step, they run beside the measurements.
        predicted = finish_worker("predict", *prediction) if any(case.cuda for case in cases) else None
        measured = {}
        for group in groups:
            measured.update(finish_worker("measure", *start_worker("measure", group, Path(tmp))))
        predicted = predicted or finish_worker("predict", *prediction)
    for case in (case for group in groups for case in group):
        row, found = compare(case, predicted[case.name], measured[case.name], args.tolerance, args.step_tolerance)
        rows.append(row)
        problems += found
    print("\n".join(rows))
    within = f"{100 * args.tolerance:.0f}%" + (f", step time {100 * args.step_tolerance:.0f}%" if args.cuda else "")
    print("\n".join(problems) if problems else f"All {len(cases)} cases within {within}.")
    return 1 if args.check and problems else 0


if __name__ == "__main__":
    exit_process(main())
