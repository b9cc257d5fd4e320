"""Lock files that keep runs sharing a workdir from building, rebuilding or deleting the same thing at once.

Granularity: one lock per artifact a run builds (`workdir/locks/<stage>-<id>.lock`), not one per workdir. Two runs
that build different artifacts from one workdir - two fine-tuning sweeps of different tasks from one pretrained
model, a pretraining run beside the tokenization of another corpus - are independent and both go ahead; only two
runs that would build the *same* artifact conflict, and the second refuses before writing anything. Each lock also
lists the finished artifacts the holder reads while building, so a `--force` rebuild of one of them is refused
while a live run reads it, and a run refuses to read an artifact another live run is rebuilding.

Mechanism: the holder is written to a temporary file, which is then hard-linked to the lock's name - `link` fails
when the name exists and is atomic on local file systems and on NFS (EFS speaks NFSv4.1), where flock/fcntl locks
are emulated per client and their recovery after a client dies is the server's business. So the lock file never
exists half-written: a run that finds it can always name its holder. It holds the holder's pid, host, boot id,
process start time and the time it took the lock; it is removed on exit (also on an exception or Ctrl-C; a
SIGKILLed run leaves it behind, which is what the takeover is for).

Liveness: a lock written on this host is stale when its pid is gone, or is now another process (the start time in
/proc differs), or the machine rebooted since (another boot id); a stale lock is taken over and the takeover is
said. A lock written on another host cannot be checked - its pid means nothing here, and a month-long run's lock is
legitimately old, so no age bound is honest either - so it is never taken over on its own: the refusal names the
holder and the file, and `take_foreign=True` (the command line's `--break-lock`) takes it over when the user knows
that run is gone.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

UNREADABLE_GRACE_S = 60.0
"""A lock file without a readable holder (not one this module writes: its files appear whole) is left alone for this
long, then taken over as debris."""


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def _start_ticks(pid: int) -> int:
    """The process's start time in clock ticks since boot (field 22 of /proc/PID/stat), -1 if there is none."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return -1
    return int(stat.rpartition(")")[2].split()[19])  # fields after the command name start at field 3


@dataclass(frozen=True)
class Holder:
    """Who holds a lock: enough to name it in a message and to tell whether it is still alive."""

    pid: int
    host: str
    since: str
    """When it took the lock, UTC, ISO 8601 to the second."""
    boot_id: str = ""
    start_ticks: int = -1
    reads: tuple[str, ...] = field(default=())
    """Artifacts (`stage/id`) the holder reads while it builds the locked one."""

    @classmethod
    def me(cls, reads: tuple[str, ...] = ()) -> "Holder":
        pid = os.getpid()
        return cls(pid, socket.gethostname(), time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), _boot_id(),
                   _start_ticks(pid), tuple(reads))

    def describe(self) -> str:
        return f"pid {self.pid} on {self.host} since {self.since}"

    def is_mine(self) -> bool:
        me = Holder.me()
        return (self.host, self.pid, self.boot_id, self.start_ticks) == (me.host, me.pid, me.boot_id, me.start_ticks)

    def alive(self) -> bool | None:
        """True or False on this host; None for a holder on another host, whose pid cannot be checked from here."""
        if self.host != socket.gethostname():
            return None
        if self.boot_id and self.boot_id != _boot_id():
            return False
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:  # another user's process: it exists
            pass
        return self.start_ticks < 0 or _start_ticks(self.pid) == self.start_ticks

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)


class LockHeld(Exception):
    """Another live run holds the lock (or one on another host does, which cannot be checked)."""

    def __init__(self, path: Path, holder: Holder | None):
        self.path, self.holder = path, holder
        who = holder.describe() if holder else "an unreadable lock file (damaged, or not written by a run)"
        hint = (f"; if that run is gone (its host cannot be checked from here), re-run with --break-lock"
                if holder and holder.alive() is None else "")
        super().__init__(f"{who} holds {path}{hint}")


def read_holder(path: Path) -> Holder | None:
    """The lock's holder, or None when the file is missing, empty or not JSON (damaged, or debris)."""
    try:
        data = json.loads(Path(path).read_text())
        return Holder(**{**data, "reads": tuple(data.get("reads", ()))})
    except (OSError, ValueError, TypeError):
        return None


@dataclass
class Lock:
    """A lock this process holds; `took_over` is the dead holder it replaced, if any."""

    path: Path
    holder: Holder
    took_over: Holder | None = None
    took_over_unreadable: bool = False

    def release(self) -> None:
        """Remove the lock file if it is still ours (never one a later run took over)."""
        current = read_holder(self.path)
        if current is not None and current == self.holder:
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()

    def takeover_note(self) -> str:
        if self.took_over is not None:
            return f"took over the stale lock {self.path} of {self.took_over.describe()} (no longer running)"
        if self.took_over_unreadable:
            return f"took over the stale lock {self.path} (unreadable, older than {UNREADABLE_GRACE_S:.0f} s)"
        return ""


def _written(path: Path, holder: Holder) -> Path:
    """A new file beside `path` holding `holder`, on disk: what `_create` links to the lock's name."""
    tmp = path.with_name(f"{path.name}.new-{uuid.uuid4().hex[:8]}")
    fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    try:
        os.write(fd, holder.to_json().encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    return tmp


def _create(path: Path, written: Path) -> bool:
    """Give the written holder file the lock's name; False if the name exists. `link` fails when the name exists,
    like O_EXCL, and is atomic on local file systems and NFS, so the lock file never exists half-written."""
    try:
        os.link(written, path)
    except FileExistsError:
        return False
    return True


def _stale(path: Path, holder: Holder | None, take_foreign: bool) -> bool:
    if holder is None:
        try:
            return time.time() - path.stat().st_mtime > UNREADABLE_GRACE_S
        except FileNotFoundError:
            return True
    alive = holder.alive()
    return alive is False or (alive is None and take_foreign)


def _remove_stale(path: Path, seen: Holder | None) -> None:
    """Remove the stale lock `seen` - only that one: it is renamed aside first (atomic, so of two runs taking over
    at once one wins) and put back if a live run had replaced it in the meantime."""
    aside = path.with_name(f"{path.name}.stale-{uuid.uuid4().hex[:8]}")
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return
    if read_holder(aside) != seen:  # someone took it over first: theirs is live, give it back
        with contextlib.suppress(FileNotFoundError, FileExistsError):
            os.link(aside, path)
    with contextlib.suppress(FileNotFoundError):
        aside.unlink()


def acquire(path: Path, reads: tuple[str, ...] = (), take_foreign: bool = False) -> Lock:
    """Take the lock at `path` now, taking over a stale one; LockHeld when a live run (or another host) holds it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    me = Holder.me(reads)
    took_over, unreadable = None, False
    written = _written(path, me)
    try:
        for _ in range(10):  # each round either creates the file or removes a stale one
            if _create(path, written):
                return Lock(path, me, took_over, unreadable)
            holder = read_holder(path)
            if holder is not None and holder.is_mine():
                raise LockHeld(path, holder)  # this process holds it already: a planning error, not a race
            if not _stale(path, holder, take_foreign):
                raise LockHeld(path, holder)
            _remove_stale(path, holder)
            took_over, unreadable = holder, holder is None
        raise LockHeld(path, read_holder(path))
    finally:
        written.unlink()


def wait(path: Path, timeout: float, poll: float = 0.2) -> Lock:
    """Take the lock at `path`, waiting up to `timeout` seconds for a live holder to release it."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return acquire(path)
        except LockHeld:
            if time.monotonic() > deadline:
                raise
            time.sleep(poll)


def holders(directory: Path) -> dict[Path, Holder]:
    """The live-or-unknown holders of the lock files in `directory` (stale ones left out)."""
    out = {}
    for p in sorted(Path(directory).glob("*.lock")) if Path(directory).is_dir() else ():
        holder = read_holder(p)
        if holder is not None and holder.alive() is not False:
            out[p] = holder
    return out


def remove_stale(directory: Path) -> list[str]:
    """Remove the lock files in `directory` whose holder is dead on this host (each taken over first, so a lock a
    live run took meanwhile stays); one note per lock removed."""
    notes = []
    for path in sorted(Path(directory).glob("*.lock")) if Path(directory).is_dir() else ():
        holder = read_holder(path)
        if holder is None or holder.alive() is not False:
            continue
        try:
            lock = acquire(path)
        except LockHeld:
            continue
        lock.release()
        if lock.took_over is not None:
            notes.append(f"removed the stale lock {path} of {lock.took_over.describe()} (no longer running)")
    return notes
