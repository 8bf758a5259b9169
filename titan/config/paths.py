"""Where relative paths in a config point, so ./run_train.sh works from any directory."""

from pathlib import Path

import fsspec

PROJECT_ROOT = Path(__file__).resolve().parents[2]


def resolve_path(path: str) -> Path:
    """`path` as given if it exists (absolute, or relative to the working directory), else relative
    to the project root (the folder holding the titan package), else `path` unchanged so the caller's
    error names what the user typed."""
    given = Path(path).expanduser()
    if given.exists() or given.is_absolute():
        return given
    in_project = PROJECT_ROOT / given
    return in_project if in_project.exists() else given


BACKEND_EXTRAS = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs"}
"""Titan's optional extra that installs each protocol's fsspec backend (pyproject.toml)."""


def is_url(location: str) -> bool:
    """Whether a checkpoint location is an fsspec URL (s3://bucket/run, gs://...) rather than a local path."""
    return "://" in location and not location.startswith("file://")


def checkpoint_root(folder: str, dump_folder: Path) -> str:
    """Where --checkpoint.folder points: a URL as given, a local folder under --job.dump_folder (an absolute one as
    given)."""
    return folder.rstrip("/") if is_url(folder) else str(dump_folder / folder)


def missing_backend(url: str) -> str | None:
    """Why `url`'s protocol cannot be opened here (unknown, or its fsspec backend not installed), or None."""
    protocol = url.split("://", 1)[0]
    try:
        fsspec.get_filesystem_class(protocol)
    except ValueError:
        return f"fsspec knows no protocol {protocol!r}: use s3://, gs:// or another fsspec URL, or a local path."
    except ImportError:
        extra = BACKEND_EXTRAS.get(protocol)
        install = f"pip install -e \".[{extra}]\"" if extra else f"install fsspec's backend for {protocol}://"
        return f"{protocol}:// needs fsspec's {protocol} backend, an optional extra: {install}."
    return None
