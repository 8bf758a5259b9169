"""./run_train.sh end to end, as a user runs it: real torchrun, real processes, exit codes and messages."""

import json
import math
import re
import subprocess
from pathlib import Path

import pytest

from titan.config.check import load_job_config
from titan.config.load import to_toml

from harness.train_script import losses_by_step, losses_of, run_train, run_train_here

ROOT = Path(__file__).resolve().parents[1]


def test_run_train_sh_trains_and_writes_metrics(tmp_path: Path) -> None:
    result = run_train("--training.steps", "10", "--job.dump_folder", str(tmp_path))
    assert result.returncode == 0, result.stdout + result.stderr
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 10]
    assert records[-1]["loss"] < records[0]["loss"]
    assert (tmp_path / "config.toml").is_file()
    assert "Training finished after 10 steps" in result.stdout


def test_config_mistakes_exit_2_without_traceback(tmp_path: Path) -> None:
    result = run_train("--training.global_batch_size", "12", "--model.converters", "int3",
                       "--job.dump_folder", str(tmp_path))
    output = result.stdout + result.stderr
    assert result.returncode == 2, output
    assert "--training.global_batch_size 12" in output and "'int3'" in output
    assert "Traceback" not in output


def test_unknown_flag_exits_2_with_suggestion(tmp_path: Path) -> None:
    result = run_train("--training.stepz", "5", "--job.dump_folder", str(tmp_path))
    assert result.returncode == 2
    assert "--training.steps" in result.stderr and "Traceback" not in result.stderr


def test_data_error_exits_2_naming_field(tmp_path: Path) -> None:
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    result = run_train("--training.dataset", "text", "--training.dataset_path", str(empty),
                       "--job.dump_folder", str(tmp_path / "out"))
    output = result.stdout + result.stderr
    assert result.returncode == 2 and "--training.dataset_path" in output, output
    assert "Traceback" not in output


def test_diverging_run_stops_with_hint(tmp_path: Path) -> None:
    # An absurd learning rate blows the weights up: the guard must stop at the first non-finite loss.
    result = run_train("--training.steps", "20", "--optimizer.lr", "1e30", "--lr_scheduler.warmup_steps", "0",
                       "--training.seq_len", "64", "--job.dump_folder", str(tmp_path))
    output = result.stdout + result.stderr
    assert result.returncode == 3, output
    assert "Stopping:" in output and "at step 2;" in output and "--optimizer.lr" in output
    assert "Traceback" not in output


def test_help_lists_fields(run_train_help: subprocess.CompletedProcess) -> None:
    result = run_train_help
    assert result.returncode == 0
    assert "--training.local_batch_size" in result.stdout and "Peak learning rate" in result.stdout


SHORT = ["--training.steps", "5", "--training.seq_len", "64", "--metrics.log_freq", "1"]


def test_ngpu2_tensor_parallel_matches_ngpu1(tmp_path: Path) -> None:
    # NGPU=1's run in this process: the launcher's start adds nothing to one process (test_run_train_sh_* runs it).
    one = run_train_here(*SHORT, "--job.dump_folder", str(tmp_path / "one"))
    assert one.returncode == 0, one.stdout + one.stderr
    two = run_train(*SHORT, "--job.dump_folder", str(tmp_path / "tp2"), "--parallelism.tensor_parallel_degree", "2",
                    env={"NGPU": "2"})
    assert two.returncode == 0, two.stdout + two.stderr
    assert "Applied tensor parallel (degree 2" in two.stdout
    got, ref = losses_of(tmp_path / "tp2"), losses_of(tmp_path / "one")
    assert len(got) == len(ref) == 5
    for g, r in zip(got, ref):
        assert abs(g - r) <= 1e-5 * abs(r), (got, ref)


def test_ngpu2_wrong_degrees_is_a_config_error(tmp_path: Path) -> None:
    result = run_train("--parallelism.tensor_parallel_degree", "4", "--job.dump_folder", str(tmp_path),
                       env={"NGPU": "2"})
    output = result.stdout + result.stderr
    assert result.returncode == 2, output
    assert "must multiply to the world size 2" in output and "Traceback" not in output



@pytest.mark.parametrize("layout", [["--parallelism.data_parallel_shard_degree", "2"],
                                    ["--parallelism.pipeline_parallel_degree", "2"]], ids=["fsdp2", "pp2"])
def test_ngpu2_nonfinite_loss_stops_both_ranks_at_the_same_step(tmp_path: Path, layout: list[str]) -> None:
    """A real divergence (lr 1e30, no clipping) under FSDP=2, where each rank reads its own batch, and under PP=2,
    where only the last stage computes the loss: both ranks see the global loss and gradient norm, stop at the same
    step with exit code 3 and the hint, and that step is never checkpointed."""
    result = run_train(*SHORT, "--training.local_batch_size", "2", "--optimizer.lr", "1e30",
                       "--lr_scheduler.warmup_steps", "0", "--training.max_norm", "0", *layout, "--checkpoint.enable",
                       "--checkpoint.interval", "1", "--job.dump_folder", str(tmp_path), env={"NGPU": "2"})
    output = result.stdout + result.stderr
    assert result.returncode == 3, output
    messages = dict(re.findall(r"\[rank(\d)\] ERROR (Stopping: .*)", output))
    assert messages.keys() == {"0", "1"}, output
    step = int(re.search(r" at step (\d+);", messages["0"]).group(1))
    for message in messages.values():
        assert f" at step {step};" in message and "--optimizer.lr" in message
        assert "--training.max_norm 1.0" in message  # the hint for a run without clipping
    assert max(losses_by_step(tmp_path)) == step - 1
    assert sorted(int(p.name.split("-")[1]) for p in (tmp_path / "checkpoint").iterdir()) == list(range(1, step))
    assert "Traceback" not in output

MX_COMMAND = ["--model.print_after_conversion", "--training.compile", "--training.steps", "8", "--training.seq_len",
              "64", "--metrics.log_freq", "1", "--model.converters", "mx", "--mx.recipe_name", "mxfp8", "--mx.emulate"]


def test_ngpu2_mx_command_trains(tmp_path: Path) -> None:
    """The MX command users paste, shortened (8 steps of 64 tokens), with --mx.filter_fqns "output": the report lists
    the output projection as skipped and the loss falls. Without the flag it is the same job (the default filter),
    so that variant is checked by its resolved config rather than by a second run. NGPU=2 without degrees is FSDP
    over both ranks, the launcher's default layout."""
    with_filter, without = MX_COMMAND + ["--mx.filter_fqns", "output"], MX_COMMAND
    assert to_toml(load_job_config(without, world_size=2)) == to_toml(load_job_config(with_filter, world_size=2))
    result = run_train(*with_filter, "--job.dump_folder", str(tmp_path), env={"NGPU": "2"})
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Applied FSDP2 over (2,) ranks" in result.stdout
    assert "skipped: matches --mx.filter_fqns 'output'" in result.stdout
    assert "42 of 43 linear layers converted" in result.stdout
    assert "MXLinear(in_features=256, out_features=768, bias=False, mx=mxfp8, emulated)" in result.stdout
    losses = losses_of(tmp_path)
    assert len(losses) == 8 and all(math.isfinite(loss) for loss in losses) and losses[-1] < losses[0]
