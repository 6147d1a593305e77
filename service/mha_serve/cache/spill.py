"""The spill tier: a directory where sessions go when their model's KV cache is full and at
shutdown, one file each (record.py), under a byte budget; a server started on the directory
adopts what it holds. The directory is one live server's alone: a lock file held for the
store's life (another server on it is refused at start, naming the holder).

Writes are atomic: a file is written under a temporary name and renamed into place, so a
crash mid-write leaves the old copy or none, never a torn one (temporaries are removed at
the next start). Files are named by a hash of the session id: no id can name a path.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from .errors import SpillFull
from .record import (
    BadRecord,
    Expected,
    SessionRecord,
    check,
    decode,
    encode,
    read_header,
    record_of,
)

log = logging.getLogger(__name__)

LOCK_NAME = ".mha-serve.lock"
SUFFIX = ".session"
REFUSED_SUFFIX = ".refused"
TEMP_PREFIX = ".tmp-"


class SpillDirInUse(ValueError):
    """Another live server holds the spill directory: start-up fails, saying which (a
    configuration error: each server needs a directory of its own)."""


@dataclass
class Spilled:
    """A session in the spill directory: its file and header (its tensors stay on disk)."""

    record: SessionRecord
    path: Path
    nbytes: int

    @property
    def session_id(self) -> str:
        return self.record.session_id


class SpillStore:
    """Session files in one directory under a byte budget, oldest spilled first."""

    def __init__(
        self, directory: str | Path, budget_bytes: int, *, wall: Callable[[], float] = time.time
    ) -> None:
        if budget_bytes <= 0:
            raise ValueError(
                f"session_spill_bytes must be > 0 with a spill directory, got {budget_bytes}"
            )
        self.directory = Path(directory)
        self.budget_bytes = budget_bytes
        self.wall = wall
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ValueError(f"session_spill_dir {self.directory}: {e.strerror}") from None
        self._lock = _lock(self.directory)
        self.entries: OrderedDict[str, Spilled] = OrderedDict()
        self.nbytes = 0
        for temp in self.directory.glob(TEMP_PREFIX + "*"):  # a crash mid-write: never whole
            with contextlib.suppress(OSError):
                temp.unlink()

    def close(self) -> None:
        """Lets the directory go (another server may take it)."""
        if self._lock is not None:
            with contextlib.suppress(OSError):
                fcntl.flock(self._lock, fcntl.LOCK_UN)
            self._lock.close()
            self._lock = None

    def __contains__(self, session_id: str) -> bool:
        return session_id in self.entries

    def __len__(self) -> int:
        return len(self.entries)

    def get(self, session_id: str) -> Spilled | None:
        return self.entries.get(session_id)

    def path_for(self, session_id: str) -> Path:
        digest = hashlib.sha256(session_id.encode()).hexdigest()[:40]
        return self.directory / (digest + SUFFIX)

    def put(self, record: SessionRecord, k: torch.Tensor, v: torch.Tensor) -> list[Spilled]:
        """Writes a session (replacing its earlier file, if any); returns the spilled sessions
        expired, oldest first, to keep within the budget. SpillFull when it alone is over."""
        data = encode(record, k, v)
        if len(data) > self.budget_bytes:
            raise SpillFull(
                f"session {record.session_id!r} is {len(data)} bytes on disk, more than the "
                f"whole spill budget ({self.budget_bytes} bytes, session_spill_bytes)"
            )
        old = self.entries.pop(record.session_id, None)  # its file stays until replaced
        if old is not None:
            self.nbytes -= old.nbytes
        expired = []
        while self.nbytes + len(data) > self.budget_bytes and self.entries:
            oldest = next(iter(self.entries))
            expired.append(self.entries[oldest])
            self.remove(oldest)
        path = self.path_for(record.session_id)
        try:
            _write_atomically(path, data)  # the old copy until the rename, never a torn one
        except BaseException:
            if old is not None:
                self.entries[old.session_id] = old
                self.nbytes += old.nbytes
            raise
        self.entries[record.session_id] = Spilled(record, path, len(data))
        self.nbytes += len(data)
        return expired

    @staticmethod
    def read(
        spilled: Spilled, expected: Expected
    ) -> tuple[SessionRecord, torch.Tensor, torch.Tensor]:
        """A spilled session's record and K/V, checked whole (BadRecord says what failed).
        It stays in the store until `remove` (once adopted). Reads only its file: callable
        without the lock that guards the store's index."""
        session_id = spilled.session_id
        try:
            data = spilled.path.read_bytes()
        except OSError as e:
            raise BadRecord(f"{spilled.path}: {e.strerror}") from None
        record, k, v = decode(data, str(spilled.path), expected)
        if record.session_id != session_id:
            raise BadRecord(
                f"{spilled.path}: holds session {record.session_id!r}, not {session_id!r}"
            )
        return record, k, v

    def detach(self, session_id: str) -> Spilled | None:
        """Takes a session out of the index, its file left in place (a restore under way:
        room made meanwhile must not expire it); attach() puts it back, remove() deletes."""
        spilled = self.entries.pop(session_id, None)
        if spilled is not None:
            self.nbytes -= spilled.nbytes
        return spilled

    def attach(self, spilled: Spilled) -> None:
        """Puts a detached session back, as the newest: a call waits to bring it back
        (its restore found no room), so the sessions spilled before it expire first."""
        self.entries[spilled.session_id] = spilled
        self.nbytes += spilled.nbytes

    def delete(self, spilled: Spilled) -> None:
        """Deletes a detached session's file."""
        with contextlib.suppress(FileNotFoundError):
            spilled.path.unlink()

    def trim(self) -> list[Spilled]:
        """The oldest sessions removed until the rest fit the budget (a restart with a
        smaller session_spill_bytes than the directory holds); those removed, oldest first."""
        expired = []
        while self.nbytes > self.budget_bytes and self.entries:
            oldest = next(iter(self.entries))
            expired.append(self.entries[oldest])
            self.remove(oldest)
        return expired

    def remove(self, session_id: str) -> Spilled | None:
        """Forgets a session and deletes its file (gone already: fine)."""
        spilled = self.entries.pop(session_id, None)
        if spilled is not None:
            self.nbytes -= spilled.nbytes
            with contextlib.suppress(FileNotFoundError):
                spilled.path.unlink()
        return spilled

    def scan(
        self, expected: Callable[[SessionRecord], Expected | None]
    ) -> tuple[list[Spilled], list[tuple[Path, str, SessionRecord | None]]]:
        """At start: the session files in the directory, by their headers alone (the
        tensors are read and checked when a session comes back). expected(record): what a
        record must match here, None for a model not served here. Returns (adopted,
        refused: (path, why, its header's record where it could be read)); a refused file
        is renamed *.refused, kept for inspection."""
        found, refused = [], []
        for path in sorted(self.directory.glob("*" + SUFFIX)):
            record = None
            try:
                record = _header_of(path)
                want = expected(record)
                if want is None:
                    raise BadRecord(f"{path}: a session of model {record.model!r}, not served here")
                check(record, want, str(path))
                if path != self.path_for(record.session_id):
                    raise BadRecord(f"{path}: named for another session than {record.session_id!r}")
                found.append(Spilled(record, path, path.stat().st_size))
            except (BadRecord, OSError) as e:
                refused.append((path, str(e), record))
                with contextlib.suppress(OSError):
                    path.rename(path.with_suffix(REFUSED_SUFFIX))
        found.sort(key=lambda s: s.record.written_at)
        for spilled in found:
            self.entries[spilled.session_id] = spilled
            self.nbytes += spilled.nbytes
        return found, refused


def _header_of(path: Path) -> SessionRecord:
    """A file's header without reading its tensors."""
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise BadRecord(f"{path}: {len(head)} bytes is too short for a session file")
        size = int.from_bytes(head, "little")
        return read_header(head + f.read(min(size, 1 << 16)), str(path))


def _write_atomically(path: Path, data: bytes) -> None:
    temp = path.with_name(f"{TEMP_PREFIX}{secrets.token_hex(8)}")
    try:
        with temp.open("wb") as f:
            f.write(data)
        os.replace(temp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            temp.unlink()
        raise


def _lock(directory: Path):
    """The directory's lock file, held (flock) for the store's life; SpillDirInUse if another
    live process holds it (a dead one's lock went with it)."""
    f = (directory / LOCK_NAME).open("a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "unknown"
        f.close()
        raise SpillDirInUse(
            f"session_spill_dir {directory} is in use by another live mha-serve ({holder}); "
            "give each server a directory of its own"
        ) from None
    f.seek(0)
    f.truncate()
    f.write(f"pid {os.getpid()} on {os.uname().nodename}\n")
    f.flush()
    return f


class SpillTier:
    """The SessionTable's view of a SpillStore: records built from its sessions, checked
    against the models served here (what each one's record must match)."""

    def __init__(self, store: SpillStore, expected: Mapping[str, Expected]) -> None:
        self.store = store
        self.expected = expected  # model -> what its records must match

    def __contains__(self, session_id: str) -> bool:
        return session_id in self.store

    @property
    def budget_bytes(self) -> int:
        return self.store.budget_bytes

    @property
    def nbytes(self) -> int:
        return self.store.nbytes

    def put(
        self, s, k: torch.Tensor, v: torch.Tensor, *, idle_s: float, first_position: int
    ) -> list[Spilled]:
        """Writes session s (the table's Session) with K/V positions first_position..;
        returns the spilled sessions expired to keep the budget."""
        record = record_of(
            s,
            self.expected[s.model],
            first_position=first_position,
            idle_s=idle_s,
            written_at=self.store.wall(),
        )
        return self.store.put(record, k, v)

    def get(self, session_id: str) -> Spilled | None:
        return self.store.get(session_id)

    def read(self, spilled: Spilled) -> tuple[SessionRecord, torch.Tensor, torch.Tensor]:
        """Its record and K/V, checked whole (BadRecord says what failed); I/O, no lock."""
        want = self.expected.get(spilled.record.model)
        if want is None:
            raise BadRecord(f"{spilled.path}: model {spilled.record.model!r} is not served here")
        return self.store.read(spilled, want)

    def remove(self, session_id: str) -> None:
        self.store.remove(session_id)

    def trim(self) -> list[Spilled]:
        return self.store.trim()

    def detach(self, session_id: str) -> Spilled | None:
        return self.store.detach(session_id)

    def attach(self, spilled: Spilled) -> None:
        self.store.attach(spilled)

    def delete(self, spilled: Spilled) -> None:
        self.store.delete(spilled)

    def idle_s(self, spilled: Spilled) -> float:
        """Its idle time now: when written, plus the time since (across a restart too)."""
        return spilled.record.idle_s + max(0.0, self.store.wall() - spilled.record.written_at)

    def scan(self) -> tuple[list[Spilled], list[tuple[Path, str, SessionRecord | None]]]:
        return self.store.scan(lambda record: self.expected.get(record.model))

    def close(self) -> None:
        self.store.close()
