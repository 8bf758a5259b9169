"""Where checkpoint step folders live: a local folder, or an fsspec URL on object storage (s3://, gs://, ...).

Both keep the promise that a folder taken as complete is complete, each in its own way:
- Local (LocalSteps): a save writes step-<N>.partial/ and is published with one atomic rename to step-<N>/.
  Deleting a step renames it to step-<N>.deleting/ first (atomic too), so a deletion killed half-way leaves a folder
  no listing takes as complete; it is deleted after the next completed save.
- Object storage (RemoteSteps): there is no atomic rename (S3 and GCS copy every object), so a save writes step-<N>/
  in place and is published by a marker object, step-<N>/COMPLETE, written after every rank's files and DCP's
  metadata. Deleting a step removes its marker first. A step folder without its marker (a killed save, a killed
  deletion) is never taken as complete; it is deleted after the next completed save.
Credentials, endpoints and regions come from the backend's own environment (AWS_*, GOOGLE_APPLICATION_CREDENTIALS,
FSSPEC_S3_ENDPOINT_URL, ...), as the aws and gcloud tools read them.
"""

import re
import shutil
from pathlib import Path

from fsspec.core import url_to_fs
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

# FsspecWriter/FsspecReader are DCP's fsspec storage, public in the docs but not exported from the package.
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter

from titan.config.paths import is_url

STEP_FOLDER = re.compile(r"^step-(\d+)$")
PARTIAL_SUFFIX = ".partial"
DELETING_SUFFIX = ".deleting"
MARKER = "COMPLETE"
"""The object that publishes a step folder on object storage, written last."""


def storage_error_hint(error: BaseException) -> str:
    """What a failed object-storage call most likely means, and what to do about it."""
    name = type(error).__name__
    if "Credential" in name or "credential" in str(error).lower():
        return ("no credentials were found: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE) for "
                "s3://, GOOGLE_APPLICATION_CREDENTIALS for gs://, on every node")
    if isinstance(error, FileNotFoundError) and "bucket" in str(error).lower():
        return "the bucket does not exist: create it, or fix the bucket name in the URL"
    if isinstance(error, FileNotFoundError):
        return "an object is missing under the URL"
    if isinstance(error, PermissionError):
        return "access was denied: the credentials need to list, read, write and delete objects under the URL"
    return ("check the URL, the network, and for S3-compatible servers the endpoint (AWS_ENDPOINT_URL or "
            "FSSPEC_S3_ENDPOINT_URL)")


def describe_storage_error(error: BaseException) -> str:
    """'Type: message; what it likely means' of a failed object-storage call."""
    return f"{type(error).__name__}: {str(error)[:300]}; {storage_error_hint(error)}"


def build_reader(location: str) -> StorageReader:
    """DCP's reader of the checkpoint folder at `location`: a local path or an fsspec URL."""
    return FsspecReader(location) if is_url(location) else FileSystemReader(location)


class LocalSteps:
    """Step folders under a local folder, published by renaming step-<N>.partial to step-<N>."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def location(self, step: int) -> str:
        return str(self.root / f"step-{step}")

    def staging(self, step: int) -> Path:
        """Where a save of `step` writes before it is published."""
        return self.root / f"step-{step}{PARTIAL_SUFFIX}"

    def writer(self, step: int) -> StorageWriter:
        return FileSystemWriter(str(self.staging(step)))

    def clear(self, step: int) -> None:
        """Nothing to clear: a save writes into a .partial folder, and publishing replaces an older step-<N>."""

    def publish(self, step: int) -> None:
        """Rename the staged save to step-<N>. An earlier run's checkpoint of the same step (after
        --checkpoint.load_step) is renamed out of the way first and left to the purge that follows every publish."""
        final = self.root / f"step-{step}"
        if final.exists():
            self.retire(final)
        self.staging(step).rename(final)

    def retire(self, folder: Path) -> Path:
        """Rename a step folder to its .deleting name: one atomic step, after which no listing takes it as complete."""
        deleting = folder.with_name(folder.name + DELETING_SUFFIX)
        shutil.rmtree(deleting, ignore_errors=True)  # a killed deletion's leftover of the same step holds the name
        folder.rename(deleting)
        return deleting

    def export_folder(self, step: int) -> Path:
        """Where an export written as local files (a Hugging Face folder) is written before it is published."""
        return self.staging(step)

    def publish_export(self, step: int) -> None:
        self.publish(step)

    def complete_steps(self) -> list[int]:
        """Steps with a complete checkpoint, oldest first."""
        if not self.root.is_dir():
            return []
        return sorted(int(m.group(1)) for p in self.root.iterdir() if p.is_dir() and (m := STEP_FOLDER.match(p.name)))

    def incomplete(self) -> list[str]:
        """Folders of saves and deletions that did not finish."""
        if not self.root.is_dir():
            return []
        return sorted(str(p) for p in self.root.iterdir()
                      if p.is_dir() and p.name.endswith((PARTIAL_SUFFIX, DELETING_SUFFIX)))

    def delete(self, location: str) -> None:
        """A step-<N> folder is renamed before its files are removed, so that a deletion killed half-way leaves an
        incomplete folder, never a complete-looking one with files missing."""
        folder = Path(location)
        if STEP_FOLDER.match(folder.name):
            folder = self.retire(folder)
        shutil.rmtree(folder, ignore_errors=True)

    def has_file(self, location: str, name: str) -> bool:
        return (Path(location) / name).is_file()

    def exists(self, location: str) -> bool:
        return Path(location).is_dir()

    def check_access(self, rank: int) -> None:
        """Nothing to check before the first save: a local folder's errors name the path themselves."""


class RemoteSteps:
    """Step folders under an fsspec URL, published by a marker object written last."""

    def __init__(self, root: str, export_staging: Path) -> None:
        """`export_staging`: a local folder (under --job.dump_folder) where exports written as local files, such as a
        Hugging Face folder, are assembled before their upload."""
        self.root = root.rstrip("/")
        self.fs, self.path = url_to_fs(self.root)
        self.export_staging = export_staging

    def location(self, step: int) -> str:
        return f"{self.root}/step-{step}"

    def writer(self, step: int) -> StorageWriter:
        return FsspecWriter(self.location(step))

    def clear(self, step: int) -> None:
        """Delete what an earlier save of this step left (a killed save, or a checkpoint of the same step before
        --checkpoint.load_step), so that no stale rank file survives into the new one. Rank 0 calls it before DCP's
        planning collective, which every rank's writes follow."""
        self.delete(self.location(step))

    def publish(self, step: int) -> None:
        self.fs.pipe_file(f"{self.location(step)}/{MARKER}", f"step {step}\n".encode())

    def listing(self) -> list[str]:
        """The names under the root, fresh: fsspec caches listings, which other ranks' writes make stale."""
        self.fs.invalidate_cache()
        try:
            entries = self.fs.ls(self.path, detail=False)
        except FileNotFoundError:
            # Nothing under the root: an object store has no empty folders, and another rank's access probe, the
            # only object there before the first save, may be deleted between an exists() and an ls().
            return []
        return [entry.rstrip("/").rsplit("/", 1)[-1] for entry in entries]

    def complete_steps(self) -> list[int]:
        self.fs.invalidate_cache()
        markers = self.fs.glob(f"{self.path}/step-*/{MARKER}")
        names = (marker.rsplit("/", 2)[-2] for marker in markers)
        return sorted(int(m.group(1)) for name in names if (m := STEP_FOLDER.match(name)))

    def incomplete(self) -> list[str]:
        complete = {f"step-{step}" for step in self.complete_steps()}
        return sorted(f"{self.root}/{name}" for name in self.listing()
                      if STEP_FOLDER.match(name) and name not in complete)

    def delete(self, location: str) -> None:
        """The marker first, so that a deletion killed half-way leaves an incomplete folder, never a complete-looking
        one with files missing."""
        _, path = url_to_fs(location)
        self.fs.invalidate_cache()
        if self.fs.exists(f"{path}/{MARKER}"):
            self.fs.rm_file(f"{path}/{MARKER}")
        if self.fs.exists(path):
            self.fs.rm(path, recursive=True)

    def has_file(self, location: str, name: str) -> bool:
        _, path = url_to_fs(location)
        return self.fs.exists(f"{path}/{name}")

    def exists(self, location: str) -> bool:
        _, path = url_to_fs(location)
        return self.fs.exists(path)

    def export_folder(self, step: int) -> Path:
        return self.export_staging / f"step-{step}"

    def publish_export(self, step: int) -> None:
        """Upload the export, publish it, and only then delete the local copy: a failed upload leaves it in place."""
        self.clear(step)
        self.fs.put(f"{self.export_folder(step)}/", f"{self.path}/step-{step}/", recursive=True)
        self.publish(step)
        shutil.rmtree(self.export_folder(step))

    def check_access(self, rank: int) -> None:
        """Write, list and delete a probe object, so that missing credentials, a missing bucket or a permission
        error stop the run before step 1 instead of at its first save. Every rank writes its own files, so every
        rank checks."""
        probe = f"{self.path}/.titan-access-check/rank-{rank}"
        self.fs.pipe_file(probe, b"")
        self.fs.ls(self.path, detail=False)
        self.fs.rm_file(probe)


def build_step_folders(location: str, export_staging: Path) -> LocalSteps | RemoteSteps:
    return RemoteSteps(location, export_staging) if is_url(location) else LocalSteps(Path(location))
