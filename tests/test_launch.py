"""./run_train.sh end to end, as a user runs it: real torchrun, real processes, exit codes and messages."""

import json
import re
import subprocess
from pathlib import Path

import pytest
import torch

from titan.config.load import parse_args, to_toml

from harness.train_script import TRAIN, losses_by_step, run_train

ROOT = Path(__file__).resolve().parents[1]


def test_run_train_sh_trains_and_writes_metrics(tmp_path: Path) -> None:
    result = run_train("--training.steps", "5", "--training.seq_len", "64", "--job.dump_folder", str(tmp_path))
    assert result.returncode == 0, result.stdout + result.stderr
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    goodput = records.pop()  # the job's goodput, written when it ends
    assert goodput["step"] == 5 and goodput["restarts"] == 0 and goodput["productive_s"] > 0
    assert [r["step"] for r in records] == [1, 5]
    assert records[-1]["loss"] < records[0]["loss"]
    assert (tmp_path / "config.toml").is_file()
    assert "Training finished after 5 steps" in result.stdout


def test_config_mistakes_exit_2_without_traceback(tmp_path: Path) -> None:
    result = run_train("--training.global_batch_size", "12", "--model.converters", "int3",
                       "--job.dump_folder", str(tmp_path))
    output = result.stdout + result.stderr
    assert result.returncode == 2, output
    assert "--training.global_batch_size 12" in output and "'int3'" in output
    assert "Traceback" not in output


def test_unknown_flag_exits_2_with_suggestion(tmp_path: Path) -> None:
    result = run_train("--training.stepz", "5", "--job.dump_folder", str(tmp_path))
    output = result.stdout + result.stderr
    assert result.returncode == 2
    assert "--training.stepz is not a Titan flag. Did you mean --training.steps?" in output
    assert "Traceback" not in output


def test_data_error_exits_2_naming_field(tmp_path: Path) -> None:
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    result = run_train("--training.dataset", "text", "--training.dataset_path", str(empty),
                       "--job.dump_folder", str(tmp_path / "out"), env={"MAX_RESTARTS": "2"})
    output = result.stdout + result.stderr
    assert result.returncode == 2 and "--training.dataset_path" in output, output
    assert "Restart 1" not in output  # a mistake is not retried
    assert "Traceback" not in output


def test_diverging_run_stops_with_hint(tmp_path: Path) -> None:
    # An absurd learning rate blows the weights up: the guard must stop at the first non-finite loss.
    result = run_train("--training.steps", "20", "--optimizer.lr", "1e30", "--lr_scheduler.warmup_steps", "0",
                       "--training.seq_len", "64", "--job.dump_folder", str(tmp_path))
    output = result.stdout + result.stderr
    assert result.returncode == 3, output
    assert "Stopping:" in output and "at step 2;" in output and "--optimizer.lr" in output
    assert "Traceback" not in output


def test_print_config_prints_the_job_on_a_machine_that_cannot_run_it(tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture) -> None:
    """--job.print_config on the 8B job, whose tokenizer, data and GPU this machine lacks: the resolved TOML on
    stdout and exit 0, each missing thing a warning after it, and nothing built (no dump folder). The output is a job
    file: read back, it is the same job, which runs instead of printing."""
    dump = tmp_path / "never_made"
    code = TRAIN.main(["--job.config_file", str(ROOT / "configs" / "llama3_8b.toml"), "--job.print_config",
                       "--job.dump_folder", str(dump)])
    output = capsys.readouterr().out
    assert code == 0, output
    warnings = [line for line in output.splitlines() if line.startswith("# Warning: on this machine, ")]
    assert any("--model.tokenizer_path" in line for line in warnings), output
    assert any("--training.dataset_path 'data/fineweb-edu'" in line for line in warnings), output
    assert any("--model.attn_backend flex needs a CUDA GPU" in line for line in warnings) != torch.cuda.is_available()
    assert not dump.exists()
    printed = tmp_path / "job.toml"
    printed.write_text(output)
    again = parse_args(["--job.config_file", str(printed)])
    assert not again.job.print_config and again.job.dump_folder == str(dump) and again.model.flavor == "8B"
    assert to_toml(again).replace(str(printed), "") == to_toml(parse_args(
        ["--job.config_file", str(ROOT / "configs" / "llama3_8b.toml"), "--job.dump_folder", str(dump)]
    )).replace(str(ROOT / "configs" / "llama3_8b.toml"), "")


def test_help_lists_fields(run_train_help: subprocess.CompletedProcess) -> None:
    result = run_train_help
    assert result.returncode == 0
    assert "--training.local_batch_size" in result.stdout and "Peak learning rate" in result.stdout


SHORT = ["--training.steps", "5", "--training.seq_len", "64", "--metrics.log_freq", "1"]


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
    step with exit code 3 and the hint, and that step is never checkpointed. A restart budget does not retry it."""
    result = run_train(*SHORT, "--training.local_batch_size", "2", "--optimizer.lr", "1e30",
                       "--lr_scheduler.warmup_steps", "0", "--training.max_norm", "0", *layout, "--checkpoint.enable",
                       "--checkpoint.interval", "1", "--job.dump_folder", str(tmp_path),
                       env={"NGPU": "2", "MAX_RESTARTS": "2"})
    output = result.stdout + result.stderr
    assert result.returncode == 3, output
    assert "exited with code 3, which ends the job without a restart (--max-restarts 2)" in output
    assert "Restart 1" not in output
    messages = dict(re.findall(r"\[rank(\d)\] ERROR (Stopping: .*)", output))
    assert messages.keys() == {"0", "1"}, output
    step = int(re.search(r" at step (\d+);", messages["0"]).group(1))
    for message in messages.values():
        assert f" at step {step};" in message and "--optimizer.lr" in message
        assert "--training.max_norm 1.0" in message  # the hint for a run without clipping
    assert max(losses_by_step(tmp_path)) == step - 1
    assert sorted(int(p.name.split("-")[1]) for p in (tmp_path / "checkpoint").iterdir()) == list(range(1, step))
    assert "Traceback" not in output

