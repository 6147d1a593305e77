"""The server's own directories under $TMPDIR (with frontend workers: the engine process's
run directory `mha-serve-*` and the metric files' `mha-serve-metrics-*`), each marked with
its owner, and the sweep at start that removes those of owners that are gone (a server
killed with SIGKILL never removes its own). Standard library only (main.py runs it first).

Only a directory named `mha-serve-*` in $TMPDIR, of this user, not a link, that holds the
marker file whose process is gone is removed: never another server's that still runs (its
pid alive, or of another pid namespace, where this process cannot tell), nor anything the
server did not make.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

PREFIX = "mha-serve-"
MARKER = "mha-serve.owner"  # {"pid": ..., "start": ..., "pidns": ...}


def make_run_dir(prefix: str = PREFIX) -> Path:
    """A new directory under $TMPDIR, marked as this process's."""
    path = Path(tempfile.mkdtemp(prefix=prefix))
    (path / MARKER).write_text(json.dumps(_owner(os.getpid())))
    return path


def remove_stale_run_dirs(tmp: str | None = None) -> list[Path]:
    """Removes the marked directories of processes that are gone; the ones removed."""
    tmp = tmp or tempfile.gettempdir()
    removed = []
    try:
        entries = list(os.scandir(tmp))
    except OSError:
        return removed
    for entry in entries:
        if not entry.name.startswith(PREFIX):
            continue
        try:
            if not entry.is_dir(follow_symlinks=False):
                continue
            if entry.stat(follow_symlinks=False).st_uid != os.getuid():
                continue
            owner = json.loads((Path(entry.path) / MARKER).read_text())
            pid = int(owner["pid"])
        except (OSError, ValueError, KeyError, TypeError):
            continue  # not one of ours (or not marked yet: its server is starting)
        if _gone(pid, owner):
            shutil.rmtree(entry.path, ignore_errors=True)
            log.info("removed %s: its server (pid %d) is gone", entry.path, pid)
            removed.append(Path(entry.path))
    return removed


def _owner(pid: int) -> dict:
    return {"pid": pid, "start": _start_ticks(pid), "pidns": _pid_namespace()}


def _gone(pid: int, owner: dict) -> bool:
    if owner.get("pidns") != _pid_namespace():
        return False  # its pid means another process here: cannot tell
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False  # alive, another user's
    # Alive: the owner, or a process that took its pid since (its start time differs).
    start = owner.get("start")
    return start is not None and _start_ticks(pid) not in (None, start)


def _start_ticks(pid: int) -> int | None:
    """The process's start time since boot in clock ticks (/proc/PID/stat), or None."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rpartition(")")[2].split()  # (the name in parentheses may hold spaces)
    return int(fields[19])  # field 22 of stat(5); fields[0] is field 3


def _pid_namespace() -> str | None:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None
