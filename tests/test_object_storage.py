"""Checkpoints on object storage, against a real S3-compatible server on localhost (tests/harness/s3_server.py)
through s3fs, as on a cluster without a shared filesystem: every run here writes its logs and metrics to a local
folder of its own and its checkpoints only to the bucket. FSDP=2 async saves with keep_latest_k resumed on one
process, and the errors for a missing bucket, missing credentials and denied access. A refused marker, the object
that publishes a step, is tests/test_restarts.py's (exit 6, the unpublished step ignored by the restart after it)."""

import os
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import fsspec
import pytest
from s3fs import S3FileSystem

from titan.checkpoint.dcp import read_model_weights
from titan.checkpoint.hf_io import INDEX_FILE
from titan.checkpoint.storage import MARKER

from harness.s3_server import S3Server
from harness.train_script import losses_by_step, run_train, run_train_here

BASE = ["--training.seq_len", "64", "--training.local_batch_size", "4", "--metrics.log_freq", "1",
        "--training.mixed_precision_param", "float32", "--optimizer.lr", "2e-3", "--lr_scheduler.warmup_steps", "2"]
STEPS = 6
CHECKPOINTS = ["--training.steps", str(STEPS), "--checkpoint.enable", "--checkpoint.interval", "2",
               "--checkpoint.async_mode", "async"]


@pytest.fixture(scope="module")
def s3() -> Iterator[S3Server]:
    """The server, and this process's environment pointing at it (for the runs trained in this process)."""
    server = S3Server()
    saved = {name: os.environ.get(name) for name in server.env}
    os.environ.update(server.env)
    yield server
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    server.close()


@pytest.fixture
def bucket(s3: S3Server) -> Iterator[str]:
    """A new, empty bucket; s3fs's cached clients are dropped before and after, since tests change the
    credentials they were made with."""
    S3FileSystem.clear_instance_cache()
    name = f"titan-{uuid.uuid4().hex[:12]}"
    fsspec.filesystem("s3").mkdir(name)
    yield name
    s3.hook = None
    s3.require_authentication(False)
    S3FileSystem.clear_instance_cache()


def objects(url: str) -> list[str]:
    """Every object under `url`, relative to it, fresh from the server."""
    fs = fsspec.filesystem("s3")
    fs.invalidate_cache()
    root = url.removeprefix("s3://")
    return sorted(path.removeprefix(root + "/") for path in fs.find(root))


def complete_steps(url: str) -> list[str]:
    return [path.split("/")[0] for path in objects(url) if path.endswith(f"/{MARKER}")]


def train_here(folder: Path, url: str, *flags: str) -> subprocess.CompletedProcess:
    return run_train_here(*BASE, "--job.dump_folder", str(folder), "--checkpoint.folder", url, *flags)


def test_fsdp2_async_saves_keep_latest_k_and_resume_resharded_on_one_process(tmp_path: Path, bucket: str) -> None:
    """FSDP=2 with async saves every 2 steps and keep_latest_k 2 leaves exactly steps 4 and 6, each with its marker.
    With step 6's marker gone (a save cut off before it), one process on a new machine (a fresh local folder)
    resumes from step 4, resharded, warns about step 6, and trains steps 5 and 6 to the FSDP run's losses."""
    url = f"s3://{bucket}/run"
    fsdp = tmp_path / "fsdp"
    result = run_train(*BASE, "--job.dump_folder", str(fsdp), "--checkpoint.folder", url, *CHECKPOINTS,
                       "--checkpoint.keep_latest_k", "2", "--parallelism.data_parallel_shard_degree", "2",
                       env={"NGPU": "2"})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert not (fsdp / "checkpoint").exists()
    assert complete_steps(url) == ["step-4", "step-6"]
    assert objects(url) == sorted(f"step-{step}/{name}" for step in (4, 6)
                                  for name in (".metadata", "__0_0.distcp", "__1_0.distcp", MARKER))
    fsspec.filesystem("s3").rm_file(f"{url}/step-6/{MARKER}")

    resumed = tmp_path / "resumed"
    # twice the local batch: the FSDP run's global batch of 2 x 4 per step
    result = train_here(resumed, url, *CHECKPOINTS, "--checkpoint.keep_latest_k", "2",
                        "--training.local_batch_size", "8")
    assert result.returncode == 0, result.stdout[-3000:]
    assert f"Ignoring incomplete checkpoint {url}/step-6" in result.stdout
    assert f"Loaded {url}/step-4: step 4" in result.stdout
    want, got = losses_by_step(fsdp), losses_by_step(resumed)
    assert sorted(got) == [5, 6]
    assert [got[5], got[6]] == pytest.approx([want[5], want[6]], rel=1e-5)
    assert complete_steps(url) == ["step-4", "step-6"]
    assert "step-6/__1_0.distcp" not in objects(url), "the rewritten step 6 kept a file of the FSDP save"
    assert read_model_weights(f"{url}/step-6")["tok_embeddings.weight"].shape == (2304, 256)  # scripts/ read URLs


@pytest.mark.parametrize("case, expected", [
    ("missing bucket", "the bucket does not exist"),
    ("no credentials", "no credentials were found"),
    ("access denied", "access was denied"),
])
def test_storage_errors_exit_2_before_step_1_naming_the_url(tmp_path: Path, bucket: str, s3: S3Server,
                                                            monkeypatch: pytest.MonkeyPatch, case: str,
                                                            expected: str) -> None:
    url = f"s3://{bucket}/run"
    if case == "missing bucket":
        url = f"s3://{bucket}-missing/run"
    elif case == "no credentials":
        for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
            monkeypatch.delenv(name)
        S3FileSystem.clear_instance_cache()  # the bucket's client was made with them
    else:
        s3.require_authentication(True)
    result = train_here(tmp_path, url, *CHECKPOINTS)
    assert result.returncode == 2, result.stdout[-3000:]
    assert f"--checkpoint.folder {url} is not writable from rank 0" in result.stdout
    assert expected in result.stdout
    assert "Traceback" not in result.stdout and not (tmp_path / "metrics.jsonl").exists()


def test_urls_the_config_cannot_open_are_config_errors(tmp_path: Path) -> None:
    result = run_train_here("--job.dump_folder", str(tmp_path), "--checkpoint.enable",
                            "--checkpoint.folder", "nosuch://bucket/run",
                            "--checkpoint.initial_load_path", "oss://bucket/run/step-10")
    assert result.returncode == 2
    assert "--checkpoint.folder 'nosuch://bucket/run': fsspec knows no protocol 'nosuch'" in result.stdout
    assert ("--checkpoint.initial_load_path 'oss://bucket/run/step-10': oss:// needs fsspec's oss backend"
            in result.stdout)


def test_hugging_face_export_is_uploaded_then_marked(tmp_path: Path, bucket: str) -> None:
    """--checkpoint.last_save_in_hf with a URL: the folder is assembled locally, uploaded, marked complete, and the
    local copy deleted; what arrives is, byte for byte, the export the same run writes to a local folder (which
    tests/test_hf.py loads with transformers)."""
    url = f"s3://{bucket}/run"
    export = ["--training.steps", "2", "--checkpoint.enable", "--checkpoint.last_save_in_hf"]
    assert train_here(tmp_path / "run", url, *export).returncode == 0
    assert complete_steps(url) == ["step-2"]
    assert not any((tmp_path / "run" / "checkpoint_staging").iterdir())
    local_run = tmp_path / "local"
    assert run_train_here(*BASE, "--job.dump_folder", str(local_run), *export).returncode == 0
    local = local_run / "checkpoint" / "step-2"
    fs = fsspec.filesystem("s3")
    uploaded = {path: fs.cat(f"{url}/{path}") for path in objects(url) if path != f"step-2/{MARKER}"}
    assert {INDEX_FILE, "config.json"} <= {path.removeprefix("step-2/") for path in uploaded}
    assert uploaded == {f"step-2/{path.relative_to(local)}": path.read_bytes()
                        for path in local.rglob("*") if path.is_file()}
