"""Where relative paths in a config point, so ./run_train.sh works from any directory."""

from pathlib import Path

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
