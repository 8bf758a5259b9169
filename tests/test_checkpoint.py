"""Checkpoints on real files and real processes: exact resume (one process and FSDP=2), kill safety during an
async save, keep_latest_k, resharding across layouts, weights-only exports and seeds, and the errors a user sees.
Runs of several processes go through ./run_train.sh, but for the straight runs that resumes start from and the runs
that go on from them (resumes, resharded loads), which share one torchrun launch per world size; one process runs
train.py's main in this process (the launcher's start-up adds nothing to it), except the run that is killed."""

import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from titan.checkpoint.dcp import Checkpointer, read_model_weights
from titan.config.job import Checkpoint
from titan.train.trainer import Trainer
from titan.validate import load_job_config

from harness.debug_training import DEBUG_TOML, build_trainer
from harness.torchrun import run_cases
from harness.train_cases_harness import CONSOLE_LOG
from harness.train_script import ROOT, kill_tree, losses_by_step, run_train_here, train_to_the_end

STEPS = 10
MIDDLE = STEPS // 2
"""The step of the checkpoint that the resume and resharding tests start from."""
LOCAL_BATCH_SIZE = 4
# fp32, short sequences, a log record every step: bit-exact comparisons on CPU in seconds
BASE = ["--training.seq_len", "64", "--training.local_batch_size", str(LOCAL_BATCH_SIZE), "--metrics.log_freq", "1",
        "--training.mixed_precision_param", "float32", "--optimizer.lr", "2e-3", "--lr_scheduler.warmup_steps", "2"]
CHECKPOINT = ["--checkpoint.enable", "--checkpoint.interval", str(MIDDLE)]
DEEPSEEK_V3 = ["--model.name", "deepseek_v3", "--model.flavor", "debugmodel"]


# The straight STEPS-step runs that the resume tests start from, by name: (processes, model flags, layout flags). Each
# is trained once (straight_runs); a test copies what it needs from its folder and changes only the copy.
STRAIGHT_RUNS = {
    "one-process": (1, [], []),
    "one-process-async": (1, [], ["--checkpoint.async_mode", "async"]),
    "bf16-optimizer-state": (1, [], ["--optimizer.state_dtype", "bfloat16"]),
    "fsdp2": (2, [], ["--parallelism.data_parallel_shard_degree", "2"]),
    # Experts split over 2 EP ranks (with their optimizer state, and the routing biases): DeepSeek-V3's, with latent
    # attention, a dense first block and shared experts. EP ranks are data-parallel ranks: 2 sequences each make the
    # global batch of 4 of one process.
    "deepseek-v3-ep2": (2, DEEPSEEK_V3, ["--parallelism.expert_parallel_degree", "2",
                                         "--training.local_batch_size", "2"]),
    # Muon's momentum, sharded as its matrices (its Newton-Schulz gathers them whole on their owners each step): 2
    # sequences per rank, one process's global batch of 4.
    "muon-fsdp2": (2, ["--optimizer.name", "Muon"], ["--parallelism.data_parallel_shard_degree", "2",
                                                     "--training.local_batch_size", "2"]),
    "pp2": (2, [], ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_split_points",
                    "layers.2"]),
    "cp2": (2, [], ["--parallelism.context_parallel_degree", "2"]),
}


@pytest.fixture(scope="module")
def straight_runs(request: pytest.FixtureRequest,
                  tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """The folder of a STRAIGHT_RUNS run, trained on first use: STEPS steps with checkpoints at MIDDLE and STEPS. The
    first use of a 2-process run trains every 2-process run that the selected tests of this module name, in one
    torchrun launch (run_cases): the ranks' start-up costs more than a run."""
    folders: dict[str, Path] = {}
    params = [getattr(getattr(item, "callspec", None), "params", {}) for item in request.session.items
              if item.module is request.module]
    asked = {p["name"] for p in params if "name" in p} | {CONTINUED[p["run"]].straight for p in params if "run" in p}

    def straight(name: str) -> Path:
        if name not in folders:
            nprocs, model, layout = STRAIGHT_RUNS[name]
            if nprocs == 1:
                folders[name] = tmp_path_factory.mktemp(f"straight-{name}")
                train_to_the_end(folders[name], *BASE, "--training.steps", str(STEPS), *CHECKPOINT, *model, *layout)
            else:
                launch_straight_runs(sorted({name} | {n for n in asked - folders.keys()
                                                      if STRAIGHT_RUNS[n][0] == nprocs}), nprocs)
        return folders[name]

    def launch_straight_runs(names: list[str], nprocs: int) -> None:
        launch = tmp_path_factory.mktemp(f"straight-{nprocs}-processes")
        runs = {}
        for name in names:
            _, model, layout = STRAIGHT_RUNS[name]
            folders[name] = launch / name
            runs[name] = (folders[name], ["--training.steps", str(STEPS), *CHECKPOINT, *model, *layout])
        launch_in_folders(launch, nprocs, runs)

    return straight


def launch_in_folders(launch: Path, nprocs: int, runs: dict[str, tuple[Path, list[str]]]) -> None:
    """Train each of `runs` (name -> its folder, which it dumps into, and flags on top of BASE) on `nprocs`
    processes, all in one torchrun launch (run_cases) that keeps its files in `launch`; each folder gets the run's
    console lines (CONSOLE_LOG)."""
    cases = {}
    for name, (folder, flags) in runs.items():
        folder.mkdir(parents=True, exist_ok=True)
        cases[name] = [str(folder), "--job.config_file", DEBUG_TOML, *BASE, "--job.dump_folder", str(folder), *flags]
    finished = run_cases("train_cases_harness.py", nprocs, launch, cases)
    assert not finished.failures, finished.failures


@dataclass(frozen=True)
class Continued:
    """A run that goes on from a straight run's checkpoint at step MIDDLE."""

    nprocs: int
    straight: str
    start: Callable[[Path, Path], None]
    """Lays out the run's folder (second argument) from the straight run's (first)."""
    flags: list[str]


def resume_from_middle(straight: Path, resumed: Path) -> None:
    """A copy of the straight run's folder as it was after step MIDDLE: its checkpoint was written mid-run,
    as a killed run would have left it; later checkpoints and later metrics are dropped."""
    shutil.copytree(straight, resumed)
    shutil.rmtree(resumed / "checkpoint" / f"step-{STEPS}")
    lines = (resumed / "metrics.jsonl").read_text().splitlines()[:MIDDLE]
    (resumed / "metrics.jsonl").write_text("\n".join(lines) + "\n")


def copy_middle_step(straight: Path, folder: Path) -> None:
    """Only the straight run's checkpoint of step MIDDLE: a run that loads it as its latest step."""
    step = f"step-{MIDDLE}"
    shutil.copytree(straight / "checkpoint" / step, folder / "checkpoint" / step)


RESUMED = ["one-process", "one-process-async", "bf16-optimizer-state", "fsdp2", "deepseek-v3-ep2", "muon-fsdp2"]
# Another layout loads the FSDP=2 run's step MIDDLE: (processes, data-parallel degree, flags).
RESHARDED = {
    "one-process": (1, 1, []),
    "tp2": (2, 1, ["--parallelism.tensor_parallel_degree", "2"]),
    "fsdp2xtp2": (4, 2, ["--parallelism.data_parallel_shard_degree", "2", "--parallelism.tensor_parallel_degree", "2"]),
    "pp2": (2, 1, ["--parallelism.pipeline_parallel_degree", "2"]),
    "cp2": (2, 1, ["--parallelism.context_parallel_degree", "2"]),
}
CONTINUED = {
    **{f"resumed-{name}": Continued(STRAIGHT_RUNS[name][0], name, resume_from_middle,
                                    ["--training.steps", str(STEPS), *CHECKPOINT, *STRAIGHT_RUNS[name][1],
                                     *STRAIGHT_RUNS[name][2]]) for name in RESUMED},
    # The data restarts (the dataloader is not loaded): step MIDDLE + 1 reads the first global batch.
    **{f"resharded-{name}": Continued(nprocs, "fsdp2", copy_middle_step,
                                      ["--training.steps", str(MIDDLE + 1), "--checkpoint.enable",
                                       "--checkpoint.interval", "100", "--checkpoint.exclude_from_loading",
                                       "dataloader", *flags]) for name, (nprocs, _, flags) in RESHARDED.items()},
}
"""The runs that go on from a straight run, by name."""


@pytest.fixture(scope="module")
def continued_runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
                   straight_runs: Callable[[str], Path]) -> Callable[[str], tuple[Path, str]]:
    """The folder of a CONTINUED run and what it logged, trained on first use: on one process here, and the first
    use of a multi-process one trains every such run of its size that the selected tests of this module name, in
    one torchrun launch, as the straight runs are."""
    done: dict[str, Path] = {}
    asked = {params["run"] for item in request.session.items if item.module is request.module
             for params in [getattr(getattr(item, "callspec", None), "params", {})] if "run" in params}

    def continued(name: str) -> tuple[Path, str]:
        if name not in done:
            names = [name] if CONTINUED[name].nprocs == 1 else sorted(
                {name} | {n for n in asked - done.keys() if CONTINUED[n].nprocs == CONTINUED[name].nprocs})
            launch = tmp_path_factory.mktemp(f"continued-{CONTINUED[name].nprocs}-processes")
            for run in names:
                done[run] = launch / run
                CONTINUED[run].start(straight_runs(CONTINUED[run].straight), done[run])
            if CONTINUED[name].nprocs == 1:
                result = train_to_the_end(done[name], *BASE, *CONTINUED[name].flags)
                (done[name] / CONSOLE_LOG).write_text(result.stdout)
            else:
                launch_in_folders(launch, CONTINUED[name].nprocs,
                                  {run: (done[run], CONTINUED[run].flags) for run in names})
        return done[name], (done[name] / CONSOLE_LOG).read_text()

    return continued


@pytest.mark.parametrize("run", [f"resumed-{name}" for name in RESUMED])
def test_resume_is_bit_exact(run: str, straight_runs: Callable[[str], Path],
                             continued_runs: Callable[[str], tuple[Path, str]]) -> None:
    """STEPS steps straight vs MIDDLE + resume + the rest: identical per-step losses, so weights, optimizer, schedule,
    data order and RNG all came back (async: the background write saved step MIDDLE's state, not a later one; bfloat16
    optimizer state: its moments, and its step counts, from which the stochastic rounding's bits are hashed (no
    generator is involved), so the resumed steps round as the straight run's did)."""
    straight = straight_runs(CONTINUED[run].straight)
    resumed, logged = continued_runs(run)
    assert f"checkpoint/step-{MIDDLE}: step {MIDDLE}" in logged
    want, got = losses_by_step(straight), losses_by_step(resumed)
    assert sorted(got) == list(range(1, STEPS + 1))
    assert [got[s] for s in range(MIDDLE + 1, STEPS + 1)] == [want[s] for s in range(MIDDLE + 1, STEPS + 1)]


@pytest.mark.parametrize("name", ["pp2", "cp2", "deepseek-v3-ep2", "muon-fsdp2"])
def test_resume_on_one_process_from_another_layout(tmp_path: Path, name: str,
                                                   straight_runs: Callable[[str], Path]) -> None:
    """Saved by 2 processes in another layout at step MIDDLE, resumed by one: the same per-step losses as the 2-process
    run that went on (to reduction-order rounding), so every part of the checkpoint is layout-free (the experts
    split over 2 EP ranks load whole)."""
    _, model, _ = STRAIGHT_RUNS[name]
    straight = straight_runs(name)
    resumed = tmp_path / "resumed"
    resume_from_middle(straight, resumed)
    result = train_to_the_end(resumed, *BASE, "--training.steps", str(STEPS), *CHECKPOINT, *model)
    restored = re.search(rf"checkpoint/step-{MIDDLE}: step {MIDDLE}, (.*) restored", result.stdout)
    assert restored and {"model", "optimizer", "lr_scheduler", "dataloader"} <= set(restored.group(1).split(", "))
    want, got = losses_by_step(straight), losses_by_step(resumed)
    later = range(MIDDLE + 1, STEPS + 1)
    assert [got[s] for s in later] == pytest.approx([want[s] for s in later], rel=1e-5)
    # Every pipeline stage wrote its tensors under the full model's names, as one process does, so the exports and
    # HF conversion that read a step folder on one process work on it unchanged.
    split, whole = (read_model_weights(folder / "checkpoint" / f"step-{step}") for folder, step in
                    ((straight, MIDDLE), (resumed, STEPS)))
    assert split.keys() == whole.keys()
    assert all(split[fqn].shape == whole[fqn].shape for fqn in whole)


def test_muons_momentum_saved_sharded_loads_whole_on_one_process(tmp_path: Path,
                                                                  straight_runs: Callable[[str], Path]) -> None:
    """Muon's momentum, saved by FSDP 2 as two row shards of each matrix, loads on one process as the whole saved
    tensor, every element in place (its losses after the resume: test_resume_on_one_process_from_another_layout)."""
    _, model, _ = STRAIGHT_RUNS["muon-fsdp2"]
    folder = tmp_path / "one-process"
    copy_middle_step(straight_runs("muon-fsdp2"), folder)
    step = str(folder / "checkpoint" / f"step-{MIDDLE}")
    metadata = dcp.FileSystemReader(step).read_metadata().state_dict_metadata
    keys = [key for key in metadata if key.endswith(".momentum_buffer")]
    assert keys and all(len(metadata[key].chunks) == 2 for key in keys), "saved as one shard per rank"
    saved = {key: torch.empty(metadata[key].size, dtype=metadata[key].properties.dtype) for key in keys}
    dcp.load(saved, storage_reader=dcp.FileSystemReader(step), no_dist=True)
    flags = [*BASE, *model, "--job.dump_folder", str(folder), "--training.steps", str(STEPS), *CHECKPOINT]
    trainer = Trainer(load_job_config(flags, world_size=1), world_size=1)
    loaded = {fqn: state["momentum_buffer"] for fqn, state in optimizer_state_by_fqn(trainer).items()
              if "momentum_buffer" in state}
    assert len(loaded) == len(keys)
    for fqn, momentum in loaded.items():
        assert torch.equal(momentum, saved[f"optimizer.state.{fqn}.momentum_buffer"]), fqn
        assert momentum.abs().sum() > 0, fqn


def test_killed_during_async_save_resumes_from_last_complete(tmp_path: Path) -> None:
    """SIGKILL while a background save is writing: the half-written folder is never loaded; the rerun (the same
    command) resumes from the newest complete step, warns about the partial one, deletes it, and logs the losses
    of an uninterrupted run."""
    folder = tmp_path / "run"
    flags = ["--training.steps", str(STEPS), "--checkpoint.enable", "--checkpoint.interval", "2",
             "--checkpoint.async_mode", "async"]
    command = [str(ROOT / "run_train.sh"), *BASE, "--job.dump_folder", str(folder), *flags]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               env={**os.environ, "PYTHON": sys.executable})
    checkpoints = folder / "checkpoint"
    killed_during = None
    deadline = time.monotonic() + 300
    try:
        while killed_during is None and time.monotonic() < deadline and process.poll() is None:
            partial = [p for p in checkpoints.glob("step-*.partial")] if checkpoints.is_dir() else []
            if partial and any(checkpoints.glob("step-*[0-9]")):
                kill_tree(process.pid)
                killed_during = partial[0]
            time.sleep(0.002)
    finally:
        if process.poll() is None:
            kill_tree(process.pid)
        process.wait()
    assert killed_during is not None, "never saw a save in progress"
    time.sleep(1)  # nothing may write after the kill
    assert killed_during.is_dir()
    complete = sorted(int(p.name.split("-")[1]) for p in checkpoints.glob("step-*[0-9]"))
    assert complete, "a complete checkpoint exists before the killed save"
    last = complete[-1]
    result = train_to_the_end(folder, *BASE, *flags)
    assert "Ignoring incomplete checkpoint" in result.stdout
    assert f"step-{last}: step {last}" in result.stdout
    assert f"Training finished after {STEPS} steps" in result.stdout
    assert not list(checkpoints.glob("*.partial"))
    assert (checkpoints / f"step-{STEPS}" / ".metadata").is_file()
    straight = tmp_path / "straight"
    train_to_the_end(straight, *BASE, "--training.steps", str(STEPS))
    want, got = losses_by_step(straight), losses_by_step(folder)
    assert [got[s] for s in range(last + 1, STEPS + 1)] == [want[s] for s in range(last + 1, STEPS + 1)]


def test_keep_latest_k(tmp_path: Path) -> None:
    train_to_the_end(tmp_path, *BASE, "--training.steps", "8", "--checkpoint.enable", "--checkpoint.interval", "2",
                     "--checkpoint.keep_latest_k", "2")
    assert sorted(p.name for p in (tmp_path / "checkpoint").iterdir()) == ["step-6", "step-8"]


STEP_FILES = [".metadata", "__0_0.distcp", "__1_0.distcp", "sharded/shard-0.safetensors"]
"""A stand-in for the files of a step folder, with a subfolder as a Hugging Face export's has."""


def write_step(folder: Path, label: str) -> None:
    """A step folder as a save writes it, every file holding `label`."""
    shutil.rmtree(folder, ignore_errors=True)
    for name in STEP_FILES:
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(label)


def whole_step(folder: Path) -> str | None:
    """The label of the save a step folder holds when every file is there from that one save, else None."""
    files = sorted(str(path.relative_to(folder)) for path in folder.rglob("*") if path.is_file())
    labels = {(folder / name).read_text() for name in files}
    return labels.pop() if files == sorted(STEP_FILES) and len(labels) == 1 else None


class Killed(BaseException):
    """Stands for SIGKILL: raised in place of a file operation and handled by nothing on the way out, so the files
    stay as a kill at that moment leaves them."""


def killed_at(moment: int, action: Callable[[], None], monkeypatch: pytest.MonkeyPatch) -> bool:
    """Run `action`, killed in place of its file operation number `moment` (renames and removals, from 0); returns
    whether it was killed (False: it made fewer operations and ran to its end)."""
    made = 0

    def counted(operation: Callable[..., None]) -> Callable[..., None]:
        def run(*args: Any, **kwargs: Any) -> None:
            nonlocal made
            if made == moment:
                raise Killed
            made += 1
            operation(*args, **kwargs)
        return run

    with monkeypatch.context() as patch:
        for name in ("rename", "unlink", "rmdir"):
            patch.setattr(os, name, counted(getattr(os, name)))
        try:
            action()
        except Killed:
            return True
    return False


def local_checkpointer(dump_folder: Path, keep_latest_k: int) -> Checkpointer:
    """A rank-0 checkpointer of a local folder, with nothing to save: enough to publish, purge and choose a resume."""
    return Checkpointer(Checkpoint(enable=True, keep_latest_k=keep_latest_k), dump_folder, model=None, optimizer=None,
                        lr_scheduler=None, dataloader=None, device=torch.device("cpu"), dp_degree=1,
                        model_fqns=set(), tokenizer=None)


def test_a_local_step_killed_at_any_moment_of_its_deletion_is_never_taken_as_complete(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Publishing step 4 over an older step 4 (a rerun after --checkpoint.load_step 2) deletes the old one, and
    keep_latest_k 1 then deletes step 2. Killed at every rename and removal of both: every folder named step-<N> holds
    one save's every file, resume picks such a folder, and the next save of step 4 leaves only itself."""
    moment = 0
    while True:
        root = tmp_path / f"killed-at-{moment}"
        checkpoints = root / "checkpoint"
        for folder, label in [("step-2", "old"), ("step-4", "old"), ("step-4.partial", "new")]:
            write_step(checkpoints / folder, label)
        killed = killed_at(moment, lambda: local_checkpointer(root, keep_latest_k=1).finish(4), monkeypatch)
        for folder in checkpoints.iterdir():
            if re.fullmatch(r"step-\d+", folder.name):
                assert whole_step(folder) is not None, f"killed at operation {moment}: {folder.name} is half deleted"
        resumed = local_checkpointer(root, keep_latest_k=1).resume_folder()
        assert resumed is not None and whole_step(Path(resumed)) is not None
        write_step(checkpoints / "step-4.partial", "newer")
        local_checkpointer(root, keep_latest_k=1).finish(4)
        assert [folder.name for folder in checkpoints.iterdir()] == ["step-4"]
        assert whole_step(checkpoints / "step-4") == "newer"
        if not killed:
            break  # every moment was tried
        moment += 1


def loss_on_first_batch(weights: dict[str, torch.Tensor], dp_degree: int, tmp_path: Path) -> float:
    """The loss of `weights` on the first global batch that a run with `dp_degree` data-parallel ranks reads,
    computed on one process (whose batch of LOCAL_BATCH_SIZE x dp_degree is that global batch) with a plain,
    unsharded model."""
    trainer = build_trainer(tmp_path, *BASE, "--training.local_batch_size", str(LOCAL_BATCH_SIZE * dp_degree))
    trainer.training.model.load_state_dict(weights)
    with torch.no_grad():
        loss_sum, num_targets = trainer.training.evaluation_loss(*next(iter(trainer.dataloader)))
    return (loss_sum / num_targets).item()


@pytest.mark.parametrize("run", [f"resharded-{name}" for name in RESHARDED])
def test_resharded_load(tmp_path: Path, run: str, continued_runs: Callable[[str], tuple[Path, str]]) -> None:
    """Saved with FSDP=2 (the straight fsdp2 run's step MIDDLE), loaded by another layout: the model part is restored,
    the first step's loss is the saved weights' loss on that step's batch (a run that kept its seed init would be ~1
    nat off), and training goes on."""
    folder, logged = continued_runs(run)
    restored = re.search(rf"checkpoint/step-{MIDDLE}: step {MIDDLE}, (.*) restored", logged)
    assert restored and "model" in restored.group(1).split(", "), logged
    assert f"Training finished after {MIDDLE + 1} steps" in logged
    saved = read_model_weights(folder / "checkpoint" / f"step-{MIDDLE}")
    # the data restarted (dataloader not loaded): step MIDDLE + 1 read the first global batch
    _, dp_degree, _ = RESHARDED[run.removeprefix("resharded-")]
    want = loss_on_first_batch(saved, dp_degree, tmp_path / "reference")
    assert losses_by_step(folder)[MIDDLE + 1] == pytest.approx(want, rel=1e-5)
    continued = read_model_weights(folder / "checkpoint" / f"step-{MIDDLE + 1}")
    assert saved.keys() == continued.keys()
    assert any(not torch.equal(saved[fqn], continued[fqn]) for fqn in saved), "the last step trained the loaded weights"



# A one-process run of 4 steps with checkpoints at steps 2 and 4, which the tests below start from (each from a
# copy of its folder): one launch instead of one per test.
SOURCE_FLAGS = ["--training.steps", "4", "--checkpoint.enable", "--checkpoint.interval", "2"]


@pytest.fixture(scope="module")
def source_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("source")
    train_to_the_end(folder, *BASE, *SOURCE_FLAGS)
    return folder


def copy_of(source: Path, folder: Path) -> Path:
    """A copy of a run's folder (checkpoints, metrics, config), to change or train on."""
    shutil.copytree(source, folder)
    return folder


def test_load_step_resumes_from_that_step_not_the_latest(tmp_path: Path, source_run: Path) -> None:
    """With checkpoints at steps 2 and 4, --checkpoint.load_step 2 loads step 2 and trains steps 3 and 4 again,
    with the losses they had the first time (the latest, step 4, would leave nothing to train)."""
    run = copy_of(source_run, tmp_path / "run")
    result = train_to_the_end(run, *BASE, *SOURCE_FLAGS, "--checkpoint.load_step", "2")
    assert "checkpoint/step-2: step 2" in result.stdout
    records = [(r["step"], r["loss"]) for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
               if "loss" in r]
    assert [step for step, _ in records] == [1, 2, 3, 4, 3, 4]
    assert records[4:] == records[2:4]

def optimizer_state_by_fqn(trainer: Trainer) -> dict[str, dict[str, torch.Tensor]]:
    names = {id(param): fqn for fqn, param in trainer.training.model.named_parameters()}
    return {names[id(param)]: state for param, state in trainer.training.optimizer.state.items()}


ONE_GROUP = ["--optimizer.decay_norm_and_bias", "--optimizer.decay_embeddings"]  # as before parameter groups
GROUPED = ["--optimizer.lr_multipliers", "tok_embeddings=0.5"]


@pytest.mark.parametrize("saved, loaded", [(ONE_GROUP, GROUPED), (GROUPED, ONE_GROUP)],
                         ids=["one-group-to-grouped", "grouped-to-one-group"])
def test_resume_across_parameter_groupings(tmp_path: Path, saved: list[str], loaded: list[str]) -> None:
    """A checkpoint loads into another grouping of the parameters: each parameter's optimizer state as saved (the
    same as a load with the saved grouping gives), while the groups' weight decay and learning rates are the new
    config's, at the saved step of the schedule. Training then goes on."""
    run = tmp_path / "run"
    train_to_the_end(run, *BASE, *SOURCE_FLAGS, *saved)
    flags = [*BASE, "--job.dump_folder", str(run), "--training.steps", "6", "--checkpoint.enable",
             "--checkpoint.interval", "2", "--checkpoint.load_step", "4"]
    same = Trainer(load_job_config([*flags, *saved], world_size=1), world_size=1)
    other = Trainer(load_job_config([*flags, *loaded], world_size=1), world_size=1)
    assert other.step == 4 and len(same.training.optimizer.param_groups) != len(other.training.optimizer.param_groups)
    want, got = optimizer_state_by_fqn(same), optimizer_state_by_fqn(other)
    assert want.keys() == got.keys()
    for fqn in want:
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(got[fqn][key], want[fqn][key]), (fqn, key)
    factor = other.training.lr_scheduler.lr_lambdas[0](4)
    names = {id(param): fqn for fqn, param in other.training.model.named_parameters()}
    for group in other.training.optimizer.param_groups:
        multiplier = 0.5 if loaded == GROUPED and "tok_embeddings" in names[id(group["params"][0])] else 1.0
        assert group["lr"] == 2e-3 * multiplier * factor
        for param in group["params"]:
            name = names[id(param)]
            undecayed = loaded == GROUPED and ("norm" in name or name == "tok_embeddings.weight")
            assert group["weight_decay"] == (0.0 if undecayed else 0.1), names[id(param)]
    other.run()
    assert other.step == 6


def test_another_optimizers_state_is_refused_by_name(tmp_path: Path, source_run: Path) -> None:
    """AdamW's checkpoint into a Muon run: a config error naming --checkpoint.exclude_from_loading optimizer, not a
    crash inside DCP; with that flag the weights load and Muon starts afresh."""
    run = copy_of(source_run, tmp_path / "run")
    flags = [*BASE, "--job.dump_folder", str(run), "--training.steps", "5", "--checkpoint.enable",
             "--optimizer.name", "Muon"]
    result = run_train_here(*flags)
    output = result.stdout + result.stderr
    assert result.returncode == 2, output
    assert ("holds another optimizer's state: exp_avg, exp_avg_sq, step for layers.0.attention.wq.weight, where "
            "this run's Muon keeps momentum_buffer") in output
    assert "--checkpoint.exclude_from_loading optimizer" in output and "Traceback" not in output
    result = run_train_here(*flags, "--checkpoint.exclude_from_loading", "optimizer")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "not restored: optimizer" in result.stdout


def test_model_shape_mismatch_names_parameters(tmp_path: Path, source_run: Path) -> None:
    run = copy_of(source_run, tmp_path / "run")
    result = run_train_here(*BASE, "--job.dump_folder", str(run), "--training.steps", "6", "--checkpoint.enable",
                            "--model.vocab_size_multiple_of", "512")
    output = result.stdout + result.stderr
    assert result.returncode == 2, output
    assert "was saved from a different model: tok_embeddings.weight is (2304, 256) in the checkpoint but " \
           "(2560, 256) in the model; output.weight is (2304, 256) in the checkpoint but (2560, 256)" in output
    assert "--model.flavor" in output and "Traceback" not in output


def test_corrupt_checkpoint_names_the_folder(tmp_path: Path, source_run: Path) -> None:
    run = copy_of(source_run, tmp_path / "run")
    step = run / "checkpoint" / "step-4"  # the latest, which a resume reads
    data = next(step.glob("*.distcp"))
    data.write_bytes(data.read_bytes()[:1000])
    result = run_train_here(*BASE, "--job.dump_folder", str(run), "--training.steps", "6", "--checkpoint.enable")
    output = result.stdout + result.stderr
    assert result.returncode == 2, output
    assert f"Checkpoint {step} could not be read" in output and "Traceback" not in output
    (step / ".metadata").unlink()
    result = run_train_here(*BASE, "--job.dump_folder", str(run), "--training.steps", "6", "--checkpoint.enable")
    assert result.returncode == 2 and f"Checkpoint {step} has no readable metadata" in result.stdout


def test_seed_checkpoint_starts_every_layout_identically(tmp_path: Path) -> None:
    seed = tmp_path / "seed"
    result = train_to_the_end(seed, *BASE, "--checkpoint.enable", "--checkpoint.create_seed_checkpoint",
                              "--training.seed", "7")
    assert "Wrote the seed checkpoint" in result.stdout and "step     1" not in result.stdout
    seed_weights = read_model_weights(seed / "checkpoint" / "step-0")
    metadata = dcp.FileSystemReader(str(seed / "checkpoint" / "step-0")).read_metadata().state_dict_metadata
    assert {key.split(".")[0] for key in metadata} == {"model"}
    # a differently seeded FSDP=2 run starting from the seed: its step-1 loss is the seed run's
    run, reference = tmp_path / "from_seed", tmp_path / "reference"
    shutil.copytree(seed / "checkpoint" / "step-0", run / "checkpoint" / "step-0")
    # Data in document order: the shuffle's order depends on the seed, which the two runs do not share.
    fsdp2 = ["--training.steps", "1", "--parallelism.data_parallel_shard_degree", "2", "--training.no_shuffle"]
    launch_in_folders(tmp_path / "launch", 2, {"from_seed": (run, [*fsdp2, "--checkpoint.enable"]),
                                                "reference": (reference, [*fsdp2, "--training.seed", "7"])})
    assert losses_by_step(run)[1] == pytest.approx(losses_by_step(reference)[1], rel=1e-6)
    assert seed_weights["output.weight"].shape == (2304, 256)


def test_last_save_model_only_exports_weights_in_dtype(tmp_path: Path) -> None:
    train_to_the_end(tmp_path, *BASE, "--training.steps", "3", "--checkpoint.enable", "--checkpoint.interval", "2",
                     "--checkpoint.last_save_model_only", "--checkpoint.export_dtype", "bfloat16")
    reader = dcp.FileSystemReader(str(tmp_path / "checkpoint" / "step-3"))
    metadata = reader.read_metadata().state_dict_metadata
    assert {key.split(".")[0] for key in metadata} == {"model"}
    assert metadata["model.output.weight"].properties.dtype == torch.bfloat16
    full = dcp.FileSystemReader(str(tmp_path / "checkpoint" / "step-2")).read_metadata().state_dict_metadata
    assert "optimizer" in {key.split(".")[0] for key in full}


def test_initial_load_path_starts_from_other_weights(tmp_path: Path, source_run: Path) -> None:
    source = source_run
    run = tmp_path / "run"
    result = train_to_the_end(run, *BASE, "--training.steps", "2", "--checkpoint.enable",
                              "--checkpoint.initial_load_path", str(source / "checkpoint" / "step-4"))
    assert "model restored; not restored: dataloader, lr_scheduler, optimizer, rng, train_state" in result.stdout
    losses = losses_by_step(run)
    assert sorted(losses) == [1, 2]  # a fresh schedule and step count, from the trained weights
    assert losses[1] < losses_by_step(source)[1] - 0.1


def test_checkpoint_config_errors() -> None:
    from titan.config.errors import ConfigError

    with pytest.raises(ConfigError) as error:
        load_job_config(["--checkpoint.create_seed_checkpoint", "--checkpoint.exclude_from_loading", "optimiser",
                         "--checkpoint.initial_load_path", "/nonexistent/step-3", "--checkpoint.keep_latest_k", "-1"],
                        world_size=2)
    message = str(error.value)
    for field in ("--checkpoint.create_seed_checkpoint", "--checkpoint.exclude_from_loading has unknown part(s) "
                  "'optimiser'", "--checkpoint.initial_load_path '/nonexistent/step-3' is not a folder",
                  "--checkpoint.keep_latest_k -1"):
        assert field in message


@pytest.fixture(scope="module")
def hf_export(source_run: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, float]:
    """The source run's step 4 exported to HF safetensors (float32), and the first loss of a run started from the
    DCP step folder itself."""
    hf_folder = tmp_path_factory.mktemp("hf") / "export"
    export = subprocess.run([sys.executable, str(ROOT / "scripts" / "convert_to_hf.py"),
                             str(source_run / "checkpoint" / "step-4"), str(hf_folder), "--dtype", "float32"],
                            capture_output=True, text=True, timeout=300)
    assert export.returncode == 0, export.stdout + export.stderr
    from_dcp = tmp_path_factory.mktemp("from_dcp")
    train_to_the_end(from_dcp, *BASE, "--training.steps", "1", "--checkpoint.enable", "--checkpoint.initial_load_path",
                     str(source_run / "checkpoint" / "step-4"))
    return hf_folder, losses_by_step(from_dcp)[1]


@pytest.mark.parametrize("nprocs, layout", [(1, []), (2, ["--parallelism.pipeline_parallel_degree", "2"])],
                         ids=["one-process", "pp2"])
def test_initial_load_from_hugging_face_safetensors(tmp_path: Path, hf_export: tuple[Path, float], nprocs: int,
                                                    layout: list[str]) -> None:
    """Export a trained step to HF safetensors (float32) and start a run from it with initial_load_in_hf (on one
    process, or on two pipeline stages that each load their own tensors): the first loss equals a run started from
    the DCP step folder itself."""
    hf_folder, from_dcp_loss = hf_export
    from_hf = tmp_path / "from_hf"
    result = train_to_the_end(from_hf, *BASE, "--training.steps", "1", "--checkpoint.enable",
                              "--checkpoint.initial_load_in_hf", "--checkpoint.initial_load_path", str(hf_folder),
                              *layout, nprocs=nprocs)
    assert "Loaded Hugging Face weights" in result.stdout
    assert losses_by_step(from_hf)[1] == pytest.approx(from_dcp_loss, rel=1e-6 if layout else 0)
