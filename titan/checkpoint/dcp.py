"""Save and resume training state with torch.distributed.checkpoint (DCP).

Layout: <dump_folder>/<checkpoint.folder>/step-<N>/ (or <url>/step-<N>/ when --checkpoint.folder is an fsspec URL)
holds one DCP checkpoint (.metadata plus one .distcp file per rank). Rank 0 publishes a step once every rank's files
and the metadata are written: locally by renaming step-<N>.partial/, on object storage with a COMPLETE marker
written last (titan/checkpoint/storage.py). A run killed mid-save or mid-deletion leaves an incomplete folder,
which resume ignores (with a warning) and the next completed save deletes.

State (top-level keys of the DCP state dict):
  model         parameters by FQN, as sharded DTensors under FSDP/TP, so DCP reshards on load
  optimizer     optimizer state by parameter FQN (torch.distributed.checkpoint.state_dict)
  lr_scheduler  the schedule's state, pickled
  train_state   step, tokens seen, data-parallel degree, world size, spike window and skip count, pickled
  dataloader    stream: the global data stream's position, pickled (the same on every rank, so DCP writes it once)
  rng           rank_<r>: each rank's torch (and CUDA) RNG state, pickled
Weights-only checkpoints (seed checkpoints, --checkpoint.last_save_model_only exports) hold only `model`.
With --checkpoint.last_save_in_hf the last step's folder is a Hugging Face folder instead (titan/checkpoint/hf_io.py),
written into the same .partial folder and renamed the same way (for a URL: assembled under
<dump_folder>/checkpoint_staging, uploaded, then marked).
"""

import pickle
import warnings
from collections.abc import Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from titan.checkpoint.hf_io import INDEX_FILE, load_hf, save_hf
from titan.checkpoint.storage import build_reader, build_step_folders, describe_storage_error
from titan.config.dtypes import to_dtype
from titan.config.errors import ConfigError
from titan.config.job import CHECKPOINT_PARTS, Checkpoint
from titan.config.paths import checkpoint_root, is_url
from titan.data.tokenizer import Tokenizer
from titan.exits import EXIT_SAVE_FAILED, KnownStop
from titan.metrics.goodput import attempt_number
from titan.metrics.log import logger

# Single-process runs have no process group and pass no_dist=True on purpose; DCP still warns about it per call.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")

MODEL_KEY = "model"
"""Top-level key of the model's state dict: its tensors are `model.<fqn>` in a checkpoint's metadata."""
DATA_KEY = "stream"
"""Key of the data position in the `dataloader` part (older checkpoints held one position per data-parallel rank,
under dp_rank_<r>)."""


class CheckpointError(ConfigError):
    """A checkpoint that cannot be loaded into this run: wrong shapes, or missing or corrupt files. Exits with 2
    like a config mistake, since the fix is the user's (the right folder, step or model)."""


class SaveFailed(KnownStop):
    """Writing a checkpoint failed once training had started: the folder was writable before step 1 (check_access),
    so this is an outage of the storage, not a mistake. Exit code 6, which titan.launch restarts from the newest
    complete checkpoint when --max-restarts allows."""

    exit_code = EXIT_SAVE_FAILED


@dataclass
class TrainState:
    """What the loop needs to continue where it stopped. Saved as a pickled dict: fields added later need defaults,
    so older checkpoints still load."""

    step: int = 0
    tokens_seen: int = 0
    dp_degree: int = 1
    world_size: int = 1
    spike_losses: list[float] = field(default_factory=list)
    """The spike detector's window (titan/train/anomalies.py), so a resumed run judges spikes as the uninterrupted
    one would."""
    num_skipped: int = 0
    """Steps skipped or rolled back so far, counted against --training.max_skipped_steps."""
    run_id: str = ""
    """The run's id for experiment trackers (the W&B run), kept so that a resumed run continues the same one; empty
    in checkpoints from before it was kept."""


def load_schedule_position(lr_scheduler: torch.optim.lr_scheduler.LambdaLR, saved: dict[str, Any]) -> None:
    """The saved schedule's position (its step count), but the config's base learning rates (--optimizer.lr times
    each group's multiplier), which a checkpoint of another grouping or peak rate must not replace; each group's
    learning rate is then set for that position, as the schedule's own step would."""
    base_lrs = lr_scheduler.base_lrs
    lrs = [base_lr * factor(saved["last_epoch"]) for base_lr, factor in zip(base_lrs, lr_scheduler.lr_lambdas)]
    lr_scheduler.load_state_dict({**saved, "base_lrs": base_lrs, "_last_lr": lrs})
    for group, lr in zip(lr_scheduler.optimizer.param_groups, lrs):
        group["lr"] = lr


def rng_state(device: torch.device) -> dict[str, Any]:
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    torch.set_rng_state(state["cpu"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


RESUME_FIX = "Delete the folder to resume from the previous step, or choose one with --checkpoint.load_step."
INITIAL_LOAD_FIX = ("--checkpoint.initial_load_path must be a Titan checkpoint step folder (e.g. "
                    "outputs/checkpoint/step-1000) or a seed checkpoint; for a Hugging Face folder add "
                    "--checkpoint.initial_load_in_hf.")
EXPORT_FIX = "Pass a step folder written by Titan's checkpointer or scripts/convert_from_hf.py."


def read_metadata(folder: str, fix: str) -> dict[str, Any]:
    """DCP's key -> storage metadata of a checkpoint folder (a path or URL); a CheckpointError naming the folder,
    with `fix`, if unreadable."""
    try:
        return build_reader(folder).read_metadata().state_dict_metadata
    except Exception as error:  # noqa: BLE001 - any failure to read means the same thing to the user
        raise CheckpointError([f"Checkpoint {folder} has no readable metadata ({root_cause(folder, error)}), so it is "
                               f"not a complete checkpoint. {fix}"]) from error


def root_cause(location: str, error: BaseException) -> str:
    """'Type: message' of what went wrong at `location`; for DCP's CheckpointException, the first rank's original
    error rather than every rank's traceback; for a URL, what the storage error most likely means."""
    failures = getattr(error, "failures", None)
    if failures:
        # DCP keeps each rank's failure as (exception, traceback summary).
        error = next(iter(failures.values()))[0]
    if is_url(location):
        return describe_storage_error(error)
    return f"{type(error).__name__}: {str(error)[:300]}"


def check_model_shapes(folder: str, metadata: dict[str, Any], model_state: dict[str, torch.Tensor],
                       model_fqns: set[str]) -> None:
    """Raise a CheckpointError listing every parameter of this rank's `model_state` whose shape differs or that the
    checkpoint lacks, and every saved parameter that is not in the whole model (`model_fqns`: a pipeline rank holds
    only its stages' parameters)."""
    prefix = f"{MODEL_KEY}."
    saved = {key.removeprefix(prefix): tuple(value.size) for key, value in metadata.items()
             if key.startswith(prefix) and isinstance(value, TensorStorageMetadata)}
    expected = {fqn: tuple(tensor.shape) for fqn, tensor in model_state.items()}
    problems = [f"{fqn} is {saved[fqn]} in the checkpoint but {shape} in the model"
                for fqn, shape in expected.items() if fqn in saved and saved[fqn] != shape]
    problems += [f"{fqn} {shape} is missing from the checkpoint" for fqn, shape in expected.items() if fqn not in saved]
    problems += [f"{fqn} {shape} is in the checkpoint but not in the model" for fqn, shape in saved.items()
                 if fqn not in model_fqns]
    if problems:
        shown = "; ".join(problems[:8]) + (f"; and {len(problems) - 8} more" if len(problems) > 8 else "")
        raise CheckpointError([f"Checkpoint {folder} was saved from a different model: {shown}. Use the "
                               f"--model.flavor, --model.tokenizer_path and --model.vocab_size_multiple_of it was "
                               f"trained with, or another --checkpoint.folder."])


def check_optimizer_state(folder: str, metadata: dict[str, Any], current: dict[str, dict[str, Any]],
                          optimizer: str) -> None:
    """Raise a CheckpointError where the checkpoint's optimizer state is another optimizer's: a parameter of this
    rank whose state (`current`, by FQN: the names this optimizer keeps) the checkpoint holds under other names
    (AdamW's exp_avg and exp_avg_sq where Muon keeps a momentum_buffer, or the other way)."""
    saved: dict[str, set[str]] = {}
    for key in metadata:
        if key.startswith("optimizer.state."):
            fqn, _, name = key.removeprefix("optimizer.state.").rpartition(".")
            saved.setdefault(fqn, set()).add(name)
    other = {fqn: (sorted(saved[fqn]), sorted(state)) for fqn, state in current.items()
             if fqn in saved and not set(state) <= saved[fqn]}
    if other:
        fqn, (found, kept) = next(iter(other.items()))
        raise CheckpointError([f"Checkpoint {folder} holds another optimizer's state: {', '.join(found)} for "
                               f"{fqn}, where this run's {optimizer} keeps {', '.join(kept)} (and {len(other) - 1} "
                               f"more parameters), as after a change of --optimizer.name. Load the rest without it: "
                               f"--checkpoint.exclude_from_loading optimizer (this run's optimizer then starts "
                               f"afresh)."])


def save_model_weights(state_dict: dict[str, torch.Tensor], folder: Path) -> None:
    """Write a weights-only checkpoint, {"model": state_dict}, from one process without a process group: a
    folder --checkpoint.initial_load_path can start from (scripts/convert_from_hf.py)."""
    dcp.save({MODEL_KEY: dict(state_dict)}, checkpoint_id=str(folder), no_dist=True)


def read_model_weights(step_folder: str | Path) -> dict[str, torch.Tensor]:
    """The full model state dict (plain CPU tensors in their saved dtypes) of a step folder (a path or an fsspec URL),
    read on one process without a process group and without touching the optimizer state (scripts/convert_to_hf.py,
    generate.py)."""
    folder = str(step_folder)
    if not is_url(folder) and not Path(folder).is_dir():
        raise CheckpointError([f"Checkpoint folder {folder} does not exist. Pass a step folder such as "
                               f"<dump_folder>/checkpoint/step-20."])
    prefix = f"{MODEL_KEY}."
    weights = {key.removeprefix(prefix): torch.empty(entry.size, dtype=entry.properties.dtype)
               for key, entry in read_metadata(folder, EXPORT_FIX).items()
               if key.startswith(prefix) and isinstance(entry, TensorStorageMetadata)}
    if not weights:
        raise CheckpointError([f"Checkpoint {folder} holds no model weights. {EXPORT_FIX}"])
    read_into({MODEL_KEY: weights}, folder, no_dist=True, fix=EXPORT_FIX)
    return weights


def read_into(state: dict[str, Any], folder: str, no_dist: bool, fix: str) -> None:
    """dcp.load into `state` in place; missing or corrupt files become a CheckpointError naming the folder."""
    try:
        dcp.load(state, storage_reader=build_reader(folder), no_dist=no_dist)
    except (Exception, CheckpointException) as error:  # CheckpointException (per-rank failures) is a BaseException
        raise CheckpointError([f"Checkpoint {folder} could not be read ({root_cause(folder, error)}): its files are "
                               f"missing or corrupt. {fix}"]) from error


class Checkpointer:
    """Saves every `interval` steps and at the end, resumes at startup. Every rank calls every method."""

    def __init__(self, cfg: Checkpoint, dump_folder: Path, model: nn.Module, optimizer: torch.optim.Optimizer,
                 lr_scheduler: torch.optim.lr_scheduler.LRScheduler, dataloader: Any, device: torch.device,
                 dp_degree: int, model_fqns: set[str], tokenizer: Tokenizer) -> None:
        """`model` is this rank's share of the model by FQN (all of it without pipeline parallel); `model_fqns` are
        the parameter FQNs of the whole model; `tokenizer` goes into Hugging Face exports."""
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.model_fqns = model_fqns
        self.root = checkpoint_root(cfg.folder, dump_folder)
        self.dump_folder = dump_folder
        self.steps = build_step_folders(self.root, export_staging=dump_folder / "checkpoint_staging")
        self.model, self.optimizer, self.lr_scheduler, self.dataloader = model, optimizer, lr_scheduler, dataloader
        self.device = device
        self.dp_degree = dp_degree
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world_size = dist.get_world_size() if dist.is_initialized() else 1
        self.pending: tuple[int, Future] | None = None
        # DCP's background thread runs its own collectives; a separate gloo group keeps them off the training
        # group, whose collectives (NCCL on GPUs) must be issued in the same order on every rank.
        background = cfg.enable and cfg.async_mode != "disabled"
        self.process_group = dist.new_group(backend="gloo") if background and dist.is_initialized() else None
        self.stager = (DefaultStager(StagingOptions(use_pinned_memory=True, use_shared_memory=False,
                                                    use_async_staging=False, use_non_blocking_copy=True))
                       if cfg.enable and cfg.async_mode == "async_with_pinned_mem" else None)
        if cfg.enable:
            self.check_access()

    def check_access(self) -> None:
        """Fail before step 1 if this rank cannot write to --checkpoint.folder (object storage: credentials, bucket,
        permissions)."""
        try:
            self.steps.check_access(self.rank)
        except Exception as error:  # noqa: BLE001 - whatever the backend raises, the fix is the user's
            problem = (f"--checkpoint.folder {self.root} is not writable from rank {self.rank} "
                       f"({root_cause(self.root, error)})")
            attempt = attempt_number()
            if attempt > 0:  # it was when the job started: an outage, which a later restart may outlast
                outage = f"{problem}, though it was when this job started (this is restart {attempt})."
                raise SaveFailed(outage) from error
            raise CheckpointError([f"{problem}."]) from error

    def location(self, step: int) -> str:
        """Where the checkpoint of `step` is, once published."""
        return self.steps.location(step)

    def start_state(self) -> TrainState:
        """Step 0 on this run's layout: no checkpoint, or weights only."""
        return TrainState(dp_degree=self.dp_degree, world_size=self.world_size)

    # ---- saving ----

    def training_state(self, train_state: TrainState) -> dict[str, Any]:
        return {
            MODEL_KEY: get_model_state_dict(self.model),
            "optimizer": get_optimizer_state_dict(self.model, self.optimizer),
            "lr_scheduler": pickle.dumps(self.lr_scheduler.state_dict()),
            "train_state": pickle.dumps(asdict(train_state)),
            "dataloader": {DATA_KEY: pickle.dumps(self.dataloader.state_dict())},
            "rng": {f"rank_{self.rank}": pickle.dumps(rng_state(self.device))},
        }

    def export_state(self) -> dict[str, Any]:
        """Weights only, in --checkpoint.export_dtype."""
        dtype = to_dtype(self.cfg.export_dtype)
        return {MODEL_KEY: {fqn: tensor.to(dtype) for fqn, tensor in get_model_state_dict(self.model).items()}}

    def should_save(self, step: int, last_step: int) -> bool:
        return self.cfg.enable and (step % self.cfg.interval == 0 or step == last_step)

    def save(self, train_state: TrainState, last_step: int, blocking: bool = False) -> None:
        """Write the checkpoint of `train_state.step`: blocking, or blocking only for the copy to host memory.
        `blocking` writes the files before returning whatever --checkpoint.async_mode says (a run stopping early)."""
        self.wait()  # one save in flight at a time, so files and renames never interleave
        step = train_state.step
        if step == last_step and self.cfg.last_save_in_hf:
            self.save_hf(step)
            return
        model_only = step == last_step and self.cfg.last_save_model_only
        state = self.export_state() if model_only else self.training_state(train_state)
        if self.rank == 0:
            self.steps.clear(step)
        writer = self.steps.writer(step)
        kind = "weights-only export" if model_only else "checkpoint"
        if blocking or self.cfg.async_mode == "disabled":
            with self.reporting_save_failure(step):
                dcp.save(state, storage_writer=writer, no_dist=not dist.is_initialized())
            self.finish(step)
            logger.info(f"Saved {kind} of step {step} to {self.location(step)}")
            return
        # Staging (the copy to host memory) happens inside async_save (the pinned stager is built with
        # use_async_staging=False), so training may change the parameters as soon as it returns.
        upload = dcp.async_save(state, storage_writer=writer, process_group=self.process_group,
                                async_stager=self.stager, no_dist=not dist.is_initialized())
        self.pending = (step, upload)
        logger.info(f"Saving {kind} of step {step} in the background to {self.location(step)}")

    @contextmanager
    def reporting_save_failure(self, step: int) -> Iterator[None]:
        """Turn a failed write of `step` into SaveFailed naming where it went and what is still there: nothing was
        published, and older checkpoints are only deleted after a newer one is."""
        try:
            yield
        except (Exception, CheckpointException) as error:  # CheckpointException (per-rank failures) is a BaseException
            steps = self.steps.complete_steps()
            kept = (f"the newest complete checkpoint, {self.location(steps[-1])}, is intact, and rerunning the same "
                    f"command resumes from it" if steps else "no earlier checkpoint exists")
            raise SaveFailed(f"Saving the checkpoint of step {step} to {self.location(step)} failed "
                             f"({root_cause(self.root, error)}). It was not published: {kept}.") from error

    def save_hf(self, step: int) -> None:
        """Export the last step as a Hugging Face folder, every rank writing its own shards. Blocking: it is the last
        save of the run, and the consolidation into output files runs on every rank. For a URL the folder is
        assembled locally, then rank 0 uploads it; a failed upload leaves the local folder, named in the error."""
        folder = self.steps.export_folder(step)
        save_hf(get_model_state_dict(self.model), folder, self.model.args, to_dtype(self.cfg.export_dtype),
                self.tokenizer)
        if dist.is_initialized():
            dist.barrier()  # every rank's output files are written before rank 0 publishes them
        if self.rank == 0:
            with self.reporting_save_failure(step):
                self.steps.publish_export(step)
            self.purge(keep_step=step)
        logger.info(f"Saved the last step {step} as a Hugging Face folder ({self.cfg.export_dtype}) in "
                    f"{self.location(step)}")

    def poll(self) -> None:
        """Finish a background save whose files are all written (call once per step)."""
        if self.pending is not None and self.pending[1].done():
            self.wait()

    def wait(self) -> None:
        """Block until the background save, if any, is written and renamed."""
        if self.pending is None:
            return
        step, future = self.pending
        self.pending = None
        with self.reporting_save_failure(step):
            future.result()  # re-raises a failed write here, on the training thread
        self.finish(step)
        logger.info(f"Checkpoint of step {step} complete")

    def finish(self, step: int) -> None:
        """Rank 0 publishes the finished step folder (an atomic rename, or the marker written last on object
        storage), then purges old checkpoints.

        DCP writes the metadata only after every rank reported its files written, so once this rank's save
        returned, the folder is complete.
        """
        if self.rank != 0:
            return
        with self.reporting_save_failure(step):
            self.steps.publish(step)
        self.purge(keep_step=step)

    def purge(self, keep_step: int) -> None:
        """Delete the folders of killed saves and all but the newest --checkpoint.keep_latest_k steps."""
        for folder in self.steps.incomplete():
            self.steps.delete(folder)
        steps = self.steps.complete_steps()
        if self.cfg.keep_latest_k > 0:
            for step in steps[:-self.cfg.keep_latest_k]:
                if step != keep_step:
                    self.steps.delete(self.location(step))
                    logger.info(f"Deleted checkpoint of step {step} (--checkpoint.keep_latest_k "
                                f"{self.cfg.keep_latest_k})")

    # ---- loading ----

    def resume_folder(self) -> str | None:
        """The step folder to resume from: --checkpoint.load_step, else the latest complete one, else None."""
        for folder in self.steps.incomplete():
            logger.warning(f"Ignoring incomplete checkpoint {folder} (a save or a deletion that did not finish); it "
                           f"will be deleted after the next save.")
        steps = self.steps.complete_steps()
        if self.cfg.load_step >= 0:
            if self.cfg.load_step not in steps:
                raise CheckpointError([f"--checkpoint.load_step {self.cfg.load_step} has no complete checkpoint in "
                                       f"{self.root} (complete steps: {steps or 'none'})."])
            return self.location(self.cfg.load_step)
        return self.location(steps[-1]) if steps else None

    def is_hf_export(self, folder: str) -> bool:
        """Whether a step folder is a --checkpoint.last_save_in_hf export rather than a DCP checkpoint."""
        return self.steps.has_file(folder, INDEX_FILE)

    def load(self) -> TrainState:
        """Restore the latest checkpoint (or the initial weights); returns where training continues. Without
        --checkpoint.enable only --checkpoint.initial_load_path is read: a run that saves nothing (a fine-tuning
        experiment) still starts from the weights it names."""
        if not self.cfg.enable:
            if self.cfg.initial_load_path is not None:
                return self.load_initial(self.cfg.initial_load_path)
            return self.start_state()
        folder = self.resume_folder()
        if folder is not None and self.is_hf_export(folder):
            self.load_hf_weights(folder)
            logger.warning(f"{folder} is a Hugging Face export (--checkpoint.last_save_in_hf): it holds weights only, "
                           f"so training starts again at step 0 from them.")
            return self.start_state()
        if folder is not None:
            return self.load_folder(folder, exclude=set(self.cfg.exclude_from_loading), fix=RESUME_FIX)
        if self.cfg.initial_load_path is not None:
            return self.load_initial(self.cfg.initial_load_path)
        logger.info(f"No checkpoint in {self.root}: training starts from step 0")
        return self.start_state()

    def load_initial(self, path: str) -> TrainState:
        if self.cfg.initial_load_in_hf:
            self.load_hf_weights(path)
            return self.start_state()
        # A run's checkpoint folder (another run's --checkpoint.folder) stands for its latest complete step.
        run_steps = build_step_folders(path, export_staging=self.dump_folder / "checkpoint_staging")
        if complete := run_steps.complete_steps():
            path = run_steps.location(complete[-1])
        elif unfinished := run_steps.incomplete():
            raise CheckpointError([f"--checkpoint.initial_load_path {path} is a run's checkpoint folder without a "
                                   f"complete step: it holds only {', '.join(Path(f).name for f in unfinished)}, a "
                                   f"save (or deletion) that did not finish, whose files may be missing. Point it at a "
                                   f"complete step of another run, or let that run save one first."])
        if self.cfg.initial_load_model_only:
            self.load_folder(path, exclude=set(CHECKPOINT_PARTS) - {MODEL_KEY}, fix=INITIAL_LOAD_FIX)
            return self.start_state()
        return self.load_folder(path, exclude=set(), fix=INITIAL_LOAD_FIX)

    def load_hf_weights(self, folder: str) -> None:
        """Load a local Hugging Face folder into the (sharded) model: each rank reads only its own rows."""
        if is_url(folder):
            raise CheckpointError([f"{folder} is a Hugging Face folder on object storage, which Titan reads only from "
                                   f"a local (or shared) filesystem: copy it there first (e.g. aws s3 cp --recursive "
                                   f"or gcloud storage cp -r) and pass that folder."])
        state = get_model_state_dict(self.model)
        load_hf(Path(folder), state, self.model.args)
        set_model_state_dict(self.model, state)
        logger.info(f"Loaded Hugging Face weights from {folder}")

    def load_folder(self, folder: str, exclude: set[str], fix: str) -> TrainState:
        """Load every part of `folder` that it holds and `exclude` does not name; `fix` ends read errors."""
        metadata = read_metadata(folder, fix)
        saved_parts = {key.split(".", 1)[0] for key in metadata}
        model_state = get_model_state_dict(self.model)
        check_model_shapes(folder, metadata, model_state, self.model_fqns)
        train_state = self.start_state()
        parts = [part for part in (MODEL_KEY, "optimizer", "lr_scheduler", "train_state")
                 if part in saved_parts - exclude]
        state: dict[str, Any] = {MODEL_KEY: model_state} if MODEL_KEY in parts else {}
        current_optimizer = get_optimizer_state_dict(self.model, self.optimizer) if "optimizer" in parts else None
        if current_optimizer is not None:
            # Only the per-parameter state (moments, step counts, by FQN) is read: the parameter groups and their
            # hyperparameters are the config's, and a checkpoint grouped otherwise (another --optimizer.lr_multipliers,
            # or from before parameter groups) has different ones.
            check_optimizer_state(folder, metadata, current_optimizer["state"], type(self.optimizer).__name__)
            state["optimizer"] = {"state": current_optimizer["state"]}
        for part in ("lr_scheduler", "train_state"):
            if part in parts:
                state[part] = b""
        self.read(folder, state, fix)
        if MODEL_KEY in state:
            set_model_state_dict(self.model, state[MODEL_KEY])
        if current_optimizer is not None:
            set_optimizer_state_dict(self.model, self.optimizer, {"state": state["optimizer"]["state"],
                                                                  "param_groups": current_optimizer["param_groups"]})
        if "lr_scheduler" in state:
            load_schedule_position(self.lr_scheduler, pickle.loads(state["lr_scheduler"]))
        if "train_state" in state:
            saved = TrainState(**pickle.loads(state["train_state"]))
            train_state = replace(saved, dp_degree=self.dp_degree, world_size=self.world_size)
            state.update(self.load_data_and_rng(folder, metadata, saved, exclude, fix))
        skipped = sorted(saved_parts & exclude)
        logger.info(f"Loaded {folder}: step {train_state.step}, {', '.join(sorted(state))} restored"
                    + (f"; not restored: {', '.join(skipped)}" if skipped else ""))
        return train_state

    def restore_latest(self, before_step: int) -> TrainState | None:
        """Roll back to the newest complete checkpoint of a step before `before_step` (once a background save in
        flight has finished): its model, optimizer, schedule, RNG and train state, but not its data position, since
        training goes on with the data after the step that made it roll back. None if there is none, or it holds
        weights only (a seed)."""
        self.wait()
        if dist.is_initialized():
            # Rank 0 renames the finished folder; every rank must see it before choosing what to load.
            dist.barrier()
        steps = [step for step in self.steps.complete_steps() if step < before_step]
        if not steps:
            return None
        folder = self.location(steps[-1])
        if self.is_hf_export(folder):
            return None  # a weights-only Hugging Face export: nothing to roll back to
        if "train_state" not in {key.split(".", 1)[0] for key in read_metadata(folder, RESUME_FIX)}:
            return None
        return self.load_folder(folder, exclude={"dataloader"}, fix=RESUME_FIX)

    def load_data_and_rng(self, folder: str, metadata: dict[str, Any], saved: TrainState, exclude: set[str],
                          fix: str) -> dict[str, Any]:
        """The data position is global, so it resumes on any layout; the RNG states are per rank, so they are
        restored only on the world size they were saved with (the model has no dropout: losses don't depend on
        them). Returns the parts restored."""
        state: dict[str, Any] = {}
        data_key = f"dataloader.{DATA_KEY}"
        if "dataloader" not in exclude and data_key in metadata:
            state["dataloader"] = {DATA_KEY: b""}
        elif "dataloader" not in exclude and any(key.startswith("dataloader.") for key in metadata):
            logger.warning("The checkpoint holds a data position per data-parallel rank (written before the data "
                           "order became global), which this version cannot continue: the data order restarts.")
        if "rng" not in exclude and saved.world_size == self.world_size:
            state["rng"] = {f"rank_{self.rank}": b""}
        state = {part: value for part, value in state.items() if any(k.startswith(part + ".") for k in metadata)}
        if not state:
            return state
        self.read(folder, state, fix)
        if "dataloader" in state:
            self.dataloader.load_state_dict(pickle.loads(state["dataloader"][DATA_KEY]))
        if "rng" in state:
            set_rng_state(pickle.loads(state["rng"][f"rank_{self.rank}"]), self.device)
        return state

    def read(self, folder: str, state: dict[str, Any], fix: str) -> None:
        read_into(state, folder, no_dist=not dist.is_initialized(), fix=fix)

    def save_seed(self) -> None:
        """Write the freshly initialised weights as step 0 (weights only)."""
        self.steps.clear(0)
        with self.reporting_save_failure(0):
            dcp.save({MODEL_KEY: get_model_state_dict(self.model)}, no_dist=not dist.is_initialized(),
                     storage_writer=self.steps.writer(0))
        self.finish(0)
        logger.info(f"Wrote the seed checkpoint {self.location(0)}")

    def close(self) -> None:
        self.wait()
        if self.stager is not None:
            self.stager.close()
        if self.process_group is not None:
            dist.destroy_process_group(self.process_group)

