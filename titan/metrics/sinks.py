"""Where a step's metric record goes: console, TensorBoard, JSONL, Weights & Biases. Sinks render; they compute
nothing."""

import json
import os
import sys
from pathlib import Path
from typing import Any, Protocol

from titan.config.job import Metrics
from titan.metrics.goodput import summary
from titan.metrics.log import logger

Record = dict[str, float | int | dict[str, int] | dict[str, list[int]] | None]

# Every record has these keys, in this order; a None value means "not measurable here" (MFU on CPU). Rates are over
# the steps since the previous record, each step timed from the end of the one before to the end of its own work on
# the device, evaluations and saves left out; step_time_min_s/max_s are those steps' mean time on the fastest and
# the slowest rank (a straggler shows as a wide range); gc_pause_s is the time spent in scheduled garbage collections
# (--training.gc_freq) since the previous record; tokens_by_source is the input tokens drawn from each source of a
# --training.mixture since the run began (None for a single source). A mixture of experts adds its load over the
# logged step (titan/train/expert_balance.py; None for dense models): moe_imbalance, the most loaded expert's tokens
# over the mean in the worst MoE layer (1.0: even), and tokens_per_expert, each layer's routed tokens per expert.
# Multi-token prediction adds mtp_loss, its modules' cross entropy (the mean over depths) per valid target (None
# without MTP modules).
RECORD_KEYS = ("step", "loss", "grad_norm", "lr", "tps", "tflops", "mfu_pct", "mem_gib", "mem_reserved_gib",
               "data_wait_pct", "eta_s", "step_time_min_s", "step_time_max_s", "gc_pause_s", "tokens_by_source",
               "moe_imbalance", "tokens_per_expert", "mtp_loss")
# An evaluation's record (titan/train/evaluate.py) has these keys instead, at the training step it followed.
VALIDATION_KEYS = ("step", "val_loss", "val_perplexity", "val_tokens", "val_seconds")
# The job's goodput (titan/metrics/goodput.py), written when an attempt ends, has these keys, at its last step: the
# wall time of every attempt so far and its split into categories that tile it, the steps trained again, restarts.
GOODPUT_KEYS = ("step", "goodput_pct", "wall_s", "productive_s", "lost_s", "checkpoint_s", "evaluation_s", "startup_s",
                "restart_s", "steps_lost", "restarts", "launches")
# A skipped, rolled-back, stopping or logged-spike step's record is its line of anomalies.jsonl
# (titan/train/anomalies.py Anomaly.record), written before that step's training record. The console (the guard
# logs a warning) and metrics.jsonl (anomalies.jsonl has it) leave it out.


def is_validation(record: Record) -> bool:
    return "val_loss" in record


def is_anomaly(record: Record) -> bool:
    return "action" in record


def is_goodput(record: Record) -> bool:
    return "goodput_pct" in record


def tagged_values(record: Record) -> dict[str, Any]:
    """The record's values by tag, as TensorBoard and W&B show them: train/<key>, val/<key> for an evaluation,
    goodput/<key> for the job's goodput, anomaly/<key> for an anomaly; a dict of numbers (tokens_by_source) as one
    tag per entry. None values are left out, and so are lists (tokens_per_expert), which only the JSONL keeps whole."""
    if is_anomaly(record):
        return {f"anomaly/{key}": value for key, value in record.items() if key != "step"}
    if is_goodput(record):
        return {f"goodput/{key}": value for key, value in record.items() if key != "step"}
    prefix, strip = ("val", "val_") if is_validation(record) else ("train", "")
    tagged: dict[str, Any] = {}
    for key, value in record.items():
        if isinstance(value, dict):
            tagged.update({f"{prefix}/{key}/{name}": number for name, number in value.items()
                           if not isinstance(number, list)})
        elif key != "step" and value is not None:
            tagged[f"{prefix}/{key.removeprefix(strip)}"] = value
    return tagged


class Sink(Protocol):
    def write(self, record: Record) -> None: ...

    def close(self) -> None: ...


class ConsoleSink:
    """One line per logged step through the `titan` logger, coloured unless disabled."""

    COLORS = {"step": "\033[36m", "loss": "\033[32m", "grad_norm": "\033[35m", "tps": "\033[34m",
              "mfu_pct": "\033[33m", "mem_gib": "\033[33m"}
    RESET = "\033[39m"

    def __init__(self, color: bool) -> None:
        self.color = color

    def write(self, record: Record) -> None:
        if is_anomaly(record):
            return
        if is_validation(record):
            self.write_validation(record)
            return
        if is_goodput(record):
            logger.info(summary(record))
            return
        parts = [
            ("step", f"step {record['step']:>5}"),
            ("loss", f"loss {record['loss']:8.4f}"),
            ("grad_norm", f"grad_norm {record['grad_norm']:7.4f}"),
            ("lr", f"lr {record['lr']:.2e}"),
            ("tps", f"tps {record['tps']:,.0f}"),
            ("tflops", f"tflops {record['tflops']:.2f}"),
        ]
        if record["mfu_pct"] is not None:
            parts.append(("mfu_pct", f"mfu {record['mfu_pct']:.2f}%"))
        parts.append(("mem_gib", f"mem {record['mem_gib']:.2f}GiB"))
        if record["mem_reserved_gib"] is not None:
            parts.append(("mem_gib", f"reserved {record['mem_reserved_gib']:.2f}GiB"))
        parts.append(("data_wait_pct", f"data {record['data_wait_pct']:.1f}%"))
        fastest, slowest = f"{record['step_time_min_s']:.2f}", f"{record['step_time_max_s']:.2f}"
        parts.append(("step_time_max_s", f"step {fastest}s" if fastest == slowest else f"step {fastest}-{slowest}s"))
        parts.append(("eta_s", f"eta {format_duration(record['eta_s'])}"))
        if record["gc_pause_s"]:
            parts.append(("gc_pause_s", f"gc {1000 * record['gc_pause_s']:.0f}ms"))
        if record["tokens_by_source"]:
            total = sum(record["tokens_by_source"].values())
            shares = " ".join(f"{name} {100 * tokens / total:.0f}%"
                              for name, tokens in record["tokens_by_source"].items())
            parts.append(("tokens_by_source", f"mixture {shares}"))
        if record["moe_imbalance"] is not None:
            parts.append(("moe_imbalance", f"experts max/mean {record['moe_imbalance']:.2f}"))
        if record["mtp_loss"] is not None:
            parts.append(("loss", f"mtp_loss {record['mtp_loss']:.4f}"))
        logger.info("  ".join(self.paint(key, text) for key, text in parts))

    def write_validation(self, record: Record) -> None:
        parts = [
            ("step", f"step {record['step']:>5}"),
            ("loss", f"val_loss {record['val_loss']:8.4f}"),
            ("val_perplexity", f"val_perplexity {record['val_perplexity']:,.2f}"),
            ("val_tokens", f"{record['val_tokens']:,} tokens in {record['val_seconds']:.1f}s"),
        ]
        logger.info("  ".join(self.paint(key, text) for key, text in parts))

    def paint(self, key: str, text: str) -> str:
        color = self.COLORS.get(key)
        return f"{color}{text}{self.RESET}" if self.color and color else text

    def close(self) -> None:
        pass


class JsonlSink:
    """Appends one JSON object per logged step to a file; unmeasurable (None) values are left out."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.file = path.open("a")

    def write(self, record: Record) -> None:
        if is_anomaly(record):
            return
        self.file.write(json.dumps({k: v for k, v in record.items() if v is not None}) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


class TensorBoardSink:
    """Scalars under `train/<key>` (`val/<key>` for an evaluation, `anomaly/<kind>` = the loss for an anomaly) at
    the record's step."""

    def __init__(self, folder: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter  # imported here: tensorboard is slow to import

        self.writer = SummaryWriter(log_dir=str(folder))

    def write(self, record: Record) -> None:
        if is_anomaly(record):
            loss = record["loss"]
            self.writer.add_scalar(f"anomaly/{record['kind']}", float(loss), record["step"])
        else:
            for tag, value in tagged_values(record).items():
                self.writer.add_scalar(tag, value, record["step"])
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def format_duration(seconds: float | None) -> str:
    """'1h02m', '3m05s' or '12s'."""
    if seconds is None:
        return "?"
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m"
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


class WandbSink:
    """Every record at its training step in one Weights & Biases run, which a resumed job continues.

    The run's project, entity, name and group come from W&B's own environment (WANDB_PROJECT, WANDB_ENTITY,
    WANDB_NAME, WANDB_RUN_GROUP; the project defaults to "titan", the name to the dump folder's), and so does where
    it goes: WANDB_MODE=offline keeps it in <dump_folder>/wandb for `wandb sync`. Its config is the job's.

    `run_id` is kept with the checkpoints (TrainState.run_id), so a resumed job logs to the same run and one that
    starts over gets a new one. W&B takes only growing steps, and a resumed job trains again the steps between its
    checkpoint and the stop, which the run already holds with the same values (resumes are exact): the sink skips
    every step up to the last one the run logged, kept in <dump_folder>/wandb/last_step_<run_id> (online, W&B's
    own count of the run's steps too). A rollback's re-run steps are skipped alike: the run keeps their first
    values."""

    def __init__(self, config: dict[str, Any], dump_folder: Path, run_id: str) -> None:
        import wandb  # an optional extra, imported only when asked for (validation checked that it is installed)

        dump_folder.mkdir(parents=True, exist_ok=True)
        self.last_step_file = dump_folder / "wandb" / f"last_step_{run_id}"
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "titan"),
                              name=os.environ.get("WANDB_NAME", dump_folder.resolve().name), dir=str(dump_folder),
                              id=run_id, resume="allow", config=config)
        logged_here = int(self.last_step_file.read_text()) if self.last_step_file.exists() else 0
        self.last_step = max(logged_here, self.run.step - 1)
        self.step_open = False
        """Whether this job has logged last_step itself, so that more records of that step join it."""

    def write(self, record: Record) -> None:
        step = int(record["step"])
        if step < self.last_step or (step == self.last_step and not self.step_open):
            return  # the run holds this step already
        self.run.log(tagged_values(record), step=step)
        if step > self.last_step:
            self.last_step, self.step_open = step, True
            self.last_step_file.parent.mkdir(parents=True, exist_ok=True)
            self.last_step_file.write_text(str(step))

    def close(self) -> None:
        self.run.finish()


def build_sinks(metrics: Metrics, dump_folder: Path, rank: int, config: dict[str, Any], run_id: str) -> list[Sink]:
    """Console on every rank (the logger decides who prints); files and W&B from rank 0 only, so one run writes one
    copy. Colour only on a terminal, so redirected logs stay free of escape codes. `config` is the job's, for W&B;
    `run_id` names the W&B run."""
    sinks: list[Sink] = [ConsoleSink(color=sys.stdout.isatty() and not metrics.disable_color_printing)]
    if rank == 0:
        sinks.append(JsonlSink(dump_folder / "metrics.jsonl"))
        if metrics.enable_tensorboard:
            sinks.append(TensorBoardSink(dump_folder / metrics.save_tb_folder))
        if metrics.enable_wandb:
            sinks.append(WandbSink(config, dump_folder, run_id))
    return sinks
