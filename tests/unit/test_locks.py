"""Lock files: one holder at a time, stale holders taken over and said so, other hosts never guessed at."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from core import locks
from core.locks import Holder, LockHeld

REPO = Path(__file__).resolve().parents[2]


def plant(path: Path, holder: Holder) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(holder.to_json())


@pytest.fixture
def live_process():
    """Another process of this host that is alive for the test's duration."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield proc
    proc.kill()
    proc.wait()


@pytest.fixture
def dead_pid() -> int:
    """The pid of a process of this host that has exited."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def holder_of(pid: int, **changes) -> Holder:
    return dataclasses.replace(Holder.me(), pid=pid, **{"start_ticks": locks._start_ticks(pid), **changes})


def test_acquire_writes_the_holder_and_release_removes_it(tmp_path):
    path = tmp_path / "locks" / "corpus-abc.lock"
    lock = locks.acquire(path, reads=("vocab/x",))
    held = locks.read_holder(path)
    assert held == lock.holder and held.pid == os.getpid() and held.host == socket.gethostname()
    assert held.reads == ("vocab/x",) and held.since.endswith("Z") and lock.took_over is None
    with pytest.raises(LockHeld):  # one holder, even within one process
        locks.acquire(path)
    lock.release()
    assert not path.exists()


def test_a_live_holder_is_refused_by_name(tmp_path, live_process):
    path = tmp_path / "x.lock"
    holder = holder_of(live_process.pid)
    plant(path, holder)
    with pytest.raises(LockHeld) as e:
        locks.acquire(path)
    assert f"pid {live_process.pid} on {socket.gethostname()} since {holder.since}" in str(e.value)
    assert str(path) in str(e.value) and "--break-lock" not in str(e.value)
    assert locks.read_holder(path) == holder  # untouched


@pytest.mark.parametrize("stale", ["dead pid", "pid reused", "rebooted"])
def test_a_stale_holder_on_this_host_is_taken_over_and_said_so(tmp_path, dead_pid, stale):
    path = tmp_path / "x.lock"
    old = {"dead pid": holder_of(dead_pid),
           "pid reused": holder_of(os.getpid(), start_ticks=locks._start_ticks(os.getpid()) - 1),
           "rebooted": holder_of(os.getpid(), boot_id="another-boot")}[stale]
    plant(path, old)
    lock = locks.acquire(path)
    assert lock.took_over == old and locks.read_holder(path) == lock.holder
    assert f"took over the stale lock {path} of pid {old.pid}" in lock.takeover_note()


def test_another_hosts_lock_is_kept_unless_broken_explicitly(tmp_path):
    path = tmp_path / "x.lock"
    foreign = dataclasses.replace(Holder.me(), host="node-7", pid=1, since="2026-01-01T00:00:00Z")
    plant(path, foreign)
    with pytest.raises(LockHeld) as e:
        locks.acquire(path)
    assert "pid 1 on node-7 since 2026-01-01T00:00:00Z" in str(e.value) and "--break-lock" in str(e.value)
    lock = locks.acquire(path, take_foreign=True)
    assert lock.took_over == foreign


STOP_AT_EVERY_FILE_CALL = """
import os, signal, sys
from pathlib import Path
from core import locks
CALLS = {"open", "write", "writelines", "link", "rename", "replace", "unlink", "fsync", "close", "flush", "truncate"}
def stop(frame, event, arg):  # after each file-system call returns, wait for the test to look
    if event == "c_return" and getattr(arg, "__name__", "") in CALLS:
        os.kill(os.getpid(), signal.SIGSTOP)
sys.setprofile(stop)
locks.acquire(Path(sys.argv[1])).release()
sys.setprofile(None)
"""


def test_a_lock_file_is_never_seen_half_written(tmp_path):
    """A run that finds the lock reads its holder: a process taking and releasing the lock is stopped after every
    file-system call it makes (open, write, link, unlink, ...), and at each stop the lock's name is either absent
    or holds a whole holder. Every interleaving a reader could hit is looked at, none is left to chance."""
    path, half, stops, present = tmp_path / "x.lock", [], 0, 0
    proc = subprocess.Popen([sys.executable, "-c", STOP_AT_EVERY_FILE_CALL, str(path)], cwd=REPO,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        while True:
            _, status = os.waitpid(proc.pid, os.WUNTRACED)
            if not os.WIFSTOPPED(status):
                break
            stops += 1
            if path.exists():
                present += 1
                text = path.read_text()
                try:
                    assert Holder(**json.loads(text)).pid == proc.pid
                except (ValueError, TypeError, AssertionError):
                    half.append(text)
            os.kill(proc.pid, signal.SIGCONT)
    finally:
        proc.returncode = os.waitstatus_to_exitcode(status) if not os.WIFSTOPPED(status) else None
        if proc.returncode is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0 and not path.exists()
    assert present >= 1 and stops > present, (stops, present)  # seen while held, and absent before and after
    assert not half, f"{len(half)} of {stops} stops found the lock file without its holder, e.g. {half[0]!r}"


def test_an_unreadable_lock_is_left_alone_then_taken_over_as_debris(tmp_path):
    path = tmp_path / "x.lock"
    path.write_text("")
    with pytest.raises(LockHeld, match="unreadable lock file"):
        locks.acquire(path)
    old = time.time() - locks.UNREADABLE_GRACE_S - 1
    os.utime(path, (old, old))
    assert "unreadable" in locks.acquire(path).takeover_note()


def test_release_leaves_a_lock_someone_else_took_over(tmp_path, live_process):
    path = tmp_path / "x.lock"
    lock = locks.acquire(path)
    path.unlink()
    plant(path, holder_of(live_process.pid))
    lock.release()
    assert locks.read_holder(path).pid == live_process.pid


TAKE = """
import sys, time
from core import locks
try:
    lock = locks.acquire(locks.Path(sys.argv[1]))
except locks.LockHeld:
    print("refused"); sys.exit(0)
print("took", bool(lock.took_over)); time.sleep(1.5); lock.release()
"""


def test_of_many_processes_taking_over_one_stale_lock_exactly_one_wins(tmp_path, dead_pid):
    path = tmp_path / "x.lock"
    plant(path, holder_of(dead_pid))
    procs = [subprocess.Popen([sys.executable, "-c", TAKE, str(path)], cwd=REPO, stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": str(REPO)}) for _ in range(6)]
    outs = sorted(p.communicate(timeout=60)[0].strip() for p in procs)
    assert outs == ["refused"] * 5 + ["took True"], outs
    assert not path.exists()


def test_wait_gets_the_lock_when_its_holder_releases_it(tmp_path):
    path = tmp_path / "x.lock"
    holder = subprocess.Popen([sys.executable, "-c", TAKE, str(path)], cwd=REPO, stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": str(REPO)})
    while not path.exists():
        time.sleep(0.05)
    with pytest.raises(LockHeld):
        locks.wait(path, timeout=0.3)
    started = time.monotonic()
    lock = locks.wait(path, timeout=30)
    assert time.monotonic() - started > 0.3 and lock.took_over is None
    assert holder.communicate(timeout=30)[0].strip() == "took False"


def test_holders_lists_live_and_foreign_ones(tmp_path, live_process, dead_pid):
    plant(tmp_path / "a.lock", holder_of(live_process.pid))
    plant(tmp_path / "b.lock", holder_of(dead_pid))
    plant(tmp_path / "c.lock", dataclasses.replace(Holder.me(), host="node-7"))
    assert sorted(p.name for p in locks.holders(tmp_path)) == ["a.lock", "c.lock"]


def test_a_takeover_never_removes_a_lock_a_live_run_took_first(tmp_path, dead_pid, live_process):
    """Between reading a stale holder and removing it, another run may have taken the lock over: its lock stays."""
    path = tmp_path / "x.lock"
    live = holder_of(live_process.pid)
    plant(path, live)
    locks._remove_stale(path, seen=holder_of(dead_pid))
    assert locks.read_holder(path) == live and [p.name for p in tmp_path.iterdir()] == ["x.lock"]


def test_remove_stale_removes_only_dead_holders_locks(tmp_path, live_process, dead_pid):
    plant(tmp_path / "a.lock", holder_of(live_process.pid))
    dead = holder_of(dead_pid)
    plant(tmp_path / "b.lock", dead)
    plant(tmp_path / "c.lock", dataclasses.replace(Holder.me(), host="node-7"))
    notes = locks.remove_stale(tmp_path)
    assert notes == [f"removed the stale lock {tmp_path / 'b.lock'} of {dead.describe()} (no longer running)"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.lock", "c.lock"]
