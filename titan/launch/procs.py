"""The launcher's rank processes as Linux's /proc shows them: their pids and their states."""

import os
from pathlib import Path


def stat_fields(stat: Path) -> list[str] | None:
    """The fields of a /proc/<pid>/stat file after "pid (name)": state, ppid, ...; None once the process is gone."""
    try:
        return stat.read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None


def process_state(pid: int) -> str | None:
    """The state letter of a process (R, S, T stopped, Z exited and not yet reaped), None if it is gone."""
    fields = stat_fields(Path(f"/proc/{pid}/stat"))
    return fields[0] if fields else None


def child_pids(parent: int | None = None) -> list[int]:
    """The processes `parent` (default: this one) started, its ranks, from /proc (Linux, where schedulers send stop
    signals)."""
    me = os.getpid() if parent is None else parent
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        fields = stat_fields(stat)
        if fields is not None and int(fields[1]) == me:  # None: it exited while we looked
            children.append(int(stat.parent.name))
    return children
