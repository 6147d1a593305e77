"""The server's directories under $TMPDIR (transport/run_dirs.py): marked with their owner,
and removed by the next server to start once their owner is gone (a server killed with
SIGKILL never removes its own), never anything else. Over real processes: a real owner
that exits, and a real `mha-serve --frontend-workers 2` killed, then another started."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mha_serve.transport.run_dirs import MARKER, make_run_dir, remove_stale_run_dirs
from tests.helpers import ServerProcess

WAIT_S = 60.0

# A process that makes a run dir (as the server does), says where, and exits.
OWNER = """
from mha_serve.transport.run_dirs import make_run_dir
print(make_run_dir(), flush=True)
"""


def dead_owners_dir(tmp: Path) -> Path:
    done = subprocess.run(
        [sys.executable, "-c", OWNER],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "TMPDIR": str(tmp)},
    )
    assert done.returncode == 0, done.stderr
    return Path(done.stdout.strip())  # (its owner has exited and been reaped)


def marked(path: Path, **owner) -> Path:
    path.mkdir()
    (path / MARKER).write_text(json.dumps(owner))
    return path


def test_only_the_marked_dirs_of_gone_owners_are_removed(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr("tempfile.tempdir", None)  # (tempfile caches $TMPDIR)
    gone = dead_owners_dir(tmp_path)
    assert gone.name.startswith("mha-serve-") and (gone / MARKER).exists()
    (gone / "engine.sock").touch()
    live = make_run_dir()  # this process's: alive
    mine = json.loads((live / MARKER).read_text())
    # this process's pid, but not its start time: the pid was taken by another process
    reused = marked(tmp_path / "mha-serve-reused", **{**mine, "start": mine["start"] + 1})
    unmarked = tmp_path / "mha-serve-unmarked"  # not ours (or its server still starting)
    unmarked.mkdir()
    other_name = tmp_path / "not-mha-serve"  # a dead owner's marker, not our name
    (other_name / "x").mkdir(parents=True)
    (other_name / MARKER).write_text((gone / MARKER).read_text())
    elsewhere = marked(  # a pid of another pid namespace (another container): cannot tell
        tmp_path / "mha-serve-elsewhere", **{**mine, "pidns": "pid:[1]"}
    )
    target = tmp_path / "target"  # a link named as ours, to a dead owner's dir: never followed
    target.mkdir()
    (target / MARKER).write_text((gone / MARKER).read_text())
    (tmp_path / "mha-serve-link").symlink_to(target)
    broken = tmp_path / "mha-serve-broken"  # a marker that is not one
    broken.mkdir()
    (broken / MARKER).write_text("{")

    removed = remove_stale_run_dirs()

    assert sorted(removed) == sorted([gone, reused])
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == sorted(
        [live.name, unmarked.name, other_name.name, elsewhere.name, "target", "mha-serve-link"]
        + [broken.name]
    )
    assert (target / MARKER).exists() and (other_name / "x").exists()
    assert remove_stale_run_dirs() == []  # nothing more: the live one stays


def _children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        found += [int(c) for c in (task / "children").read_text().split()]
    return found


def _until(predicate, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not predicate():
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.05)


@pytest.mark.slow
def test_a_killed_servers_dirs_are_removed_by_the_next_server(tmp_path):
    """SIGKILL to the engine process leaves its run dir and its metrics dir in $TMPDIR; the
    next server started there removes them as it starts, and its own at its end."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    unmarked = tmp / "mha-serve-unmarked"  # not the server's: stays
    unmarked.mkdir()
    env = {"TMPDIR": str(tmp)}
    killed = ServerProcess("--frontend-workers", "2", env=env, log_path=tmp_path / "a.log")
    try:
        killed.wait_serving()
        frontends = _children(killed.proc.pid)
        left = [d for d in killed.run_dirs() if d != unmarked.name]
        killed.proc.kill()
        killed.proc.wait(WAIT_S)
        # its frontends exit once the engine is gone (they are no longer our children)
        _until(lambda: not any(Path(f"/proc/{p}").exists() for p in frontends), "frontends exit")
    finally:
        killed.stop()
    assert killed.left_behind == sorted([*left, unmarked.name])  # nothing removed them
    assert sorted(d.startswith("mha-serve-metrics-") for d in left) == [False, True], left

    following = ServerProcess("--frontend-workers", "2", env=env, log_path=tmp_path / "b.log")
    try:
        following.wait_serving()
        now = following.run_dirs()
        log = following.log()
    finally:
        code = following.stop()
    assert code == 0, following.log()
    assert not set(left) & set(now), log
    assert len(now) == 3 and "mha-serve-unmarked" in now, now  # its own two, and the decoy
    assert all(f"removed {tmp / d}" in log for d in left), log
    assert following.left_behind == ["mha-serve-unmarked"]  # its own removed at its end
