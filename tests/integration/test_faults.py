"""Faults injected for real into the entry point: runs sharing a workdir, a killed run, a corrupt shard, a full disk.

Every run is a `python -m pipeline.run` subprocess on real files, a real local Ray and the workdir's sqlite MLflow
store; docs/faults.md lists each fault with the test here that shows it. The runs stop at the corpus or vocab stage
of 300 news articles, and those that must fail fail before Ray starts where they can.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from core import locks
from core.artifacts import ArtifactStore, verify

REPO = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.ray, pytest.mark.slow]

SMALL = ["--set", "vocab.vocab_size=600", "--set", "model.vocab_size=700"]
ENV = dict(os.environ, MLFLOW_TRACKING_URI="")  # the workdir's own sqlite store


def command(workdir: Path, corpus: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "pipeline.run", "--corpus", str(corpus), "--workdir", str(workdir), *SMALL, *args]


def pipeline(workdir: Path, corpus: Path, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run(command(workdir, corpus, *args), cwd=REPO, env=ENV, capture_output=True, text=True,
                          timeout=timeout)


def errors(stderr: str) -> list[str]:
    return [ln for ln in stderr.splitlines() if ln.startswith("error:")]


def only_artifact(workdir: Path, stage: str) -> Path:
    """The stage's one entry under artifacts/ (a build directory left beside it would show here)."""
    (path,) = (workdir / "artifacts" / stage).iterdir()
    return path


@pytest.fixture(scope="module")
def corpus_file(news_subset) -> Path:
    return news_subset(300)


@pytest.fixture(scope="module")
def race(corpus_file, tmp_path_factory):
    """Two identical `--until corpus` runs started at once on one fresh workdir; the one that goes ahead is killed
    (SIGKILL, its whole process group: Ray with it) once its build directory exists, and a third run resumes."""
    workdir = tmp_path_factory.mktemp("wd")
    procs = [subprocess.Popen(command(workdir, corpus_file, "--until", "corpus"), cwd=REPO, env=ENV,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
             for _ in range(2)]
    deadline = time.time() + 300
    while all(p.poll() is None for p in procs) and time.time() < deadline:
        time.sleep(0.05)
    (loser,) = [p for p in procs if p.poll() is not None]
    (winner,) = [p for p in procs if p is not loser]
    building = workdir / "artifacts" / "corpus"
    while not list(building.glob(".tmp-*")) and winner.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    leftover = list(building.glob(".tmp-*"))
    os.killpg(winner.pid, signal.SIGKILL)
    winner.wait()
    assert leftover, "the first run finished before it could be killed mid-stage:\n" + winner.stdout.read()[-2000:]
    lock_files = list((workdir / "locks").glob("*.lock"))
    resumed = pipeline(workdir, corpus_file, "--until", "corpus")
    return dict(workdir=workdir, winner=winner, loser=loser, loser_out=loser.communicate(), leftover=leftover[0],
                lock_files=lock_files, resumed=resumed)


def test_two_identical_runs_at_once_the_second_refuses_naming_the_holder(race):
    """The second run exits 2 with one line naming the first (pid, host, since) before it writes anything: it does
    not wait for the first and then find everything cached."""
    out, err = race["loser_out"]
    assert race["loser"].returncode == 2, out[-2000:] + err[-2000:]
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in out + err, err
    corpus_id = race["leftover"].name.split("-")[1]
    assert lines[0].startswith(f"error: artifact corpus/{corpus_id} is being built by another run: pid "
                               f"{race['winner'].pid} on {socket.gethostname()} since "), lines
    assert f"locks/corpus-{corpus_id}.lock" in lines[0] and "running ->" not in out
    assert [p.name for p in race["lock_files"]] == [f"corpus-{corpus_id}.lock"]  # the killed run's


def test_a_killed_runs_lock_and_build_directory_are_taken_over_and_removed(race):
    res, workdir = race["resumed"], race["workdir"]
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    (lock,) = race["lock_files"]
    assert (f"took over the stale lock {lock} of pid {race['winner'].pid} on {socket.gethostname()}"
            in res.stdout), res.stdout[-3000:]
    assert f"removed 1 leftover build directory of dead runs: {race['leftover']}" in res.stdout
    assert "Traceback" not in res.stderr
    art = ArtifactStore(workdir).find("corpus", only_artifact(workdir, "corpus").name)
    verify(art, digests=True)
    assert not list((workdir / "locks").iterdir())  # released on exit


STORE = """
import os, sys, time
from pathlib import Path
from core.lineage import Lineage
barrier = Path(sys.argv[1]) / "ready"
with open(barrier, "a") as f:
    f.write("x")
while barrier.stat().st_size < int(sys.argv[2]):  # every process imported MLflow: open the store together
    time.sleep(0.001)
lineage = Lineage(Path(sys.argv[1]))
lineage.start("run", {"preset": "debug"}, ["corpus"]).end()
"""


def test_the_mlflow_store_is_created_once_by_runs_starting_together(tmp_path):
    """Runs open a workdir's new sqlite store at the same instant: one creates the schema, the others wait for it
    (without the lock all but one die in MLflow's migrations, e.g. alembic's "Online migration expected to match
    one row")."""
    n = 2
    procs = [subprocess.Popen([sys.executable, "-c", STORE, str(tmp_path), str(n)], cwd=REPO, env=ENV,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for _ in range(n)]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(o[-1500:] for o in outs)
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow/mlflow.db")
    (exp,) = [e for e in client.search_experiments() if e.name == "deberta-pipeline"]
    assert len(client.search_runs([exp.experiment_id])) == n


@pytest.fixture
def finished(race, tmp_path) -> Path:
    """A copy of the workdir's finished corpus artifact (no MLflow store: a run creates its own)."""
    assert race["resumed"].returncode == 0
    shutil.copytree(race["workdir"] / "artifacts", tmp_path / "wd" / "artifacts",
                    ignore=shutil.ignore_patterns(".tmp-*"))  # shown by the test of leftovers
    return tmp_path / "wd"


def test_a_corrupt_shard_is_named_with_the_fix(finished, corpus_file):
    """Truncated: the consuming stage's run refuses (sizes are always checked). Same size, other bytes: `--verify`
    finds it (digests). Both before Ray starts: one line, exit 2, nothing written."""
    corpus = only_artifact(finished, "corpus")
    shard = sorted((corpus / "train").glob("*.parquet"))[0]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    res = pipeline(finished, corpus_file, "--until", "vocab", timeout=120)
    assert res.returncode == 2 and errors(res.stderr) == [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert errors(res.stderr) == [f"error: artifact corpus/{corpus.name}: {shard} has {len(data) // 2} bytes, its "
                                  f"manifest says {len(data)} (truncated or overwritten); rebuild it with --force "
                                  f"corpus"], res.stderr
    shard.write_bytes(data[:100] + bytes([data[100] ^ 0xFF]) + data[101:])
    res = pipeline(finished, corpus_file, "--until", "corpus", "--verify", timeout=120)
    assert res.returncode == 2, res.stdout[-2000:] + res.stderr[-2000:]
    assert errors(res.stderr) == [f"error: artifact corpus/{corpus.name}: {shard} does not match its manifest's "
                                  f"sha256 (changed since it was written); rebuild it with --force corpus"]
    assert not (finished / "artifacts" / "vocab").exists() and not (finished / "mlflow").exists()


@pytest.fixture
def live_holder(tmp_path):
    """holder(reads) -> Holder: a live process of this host, as a lock's holder."""
    proc = subprocess.Popen(["sleep", "60"])
    yield lambda reads=(): locks.Holder(proc.pid, socket.gethostname(), "2026-01-01T00:00:00Z",
                                        locks._boot_id(), locks._start_ticks(proc.pid), tuple(reads))
    proc.kill()
    proc.wait()


def test_force_never_touches_what_a_live_run_reads_or_rebuilds(finished, corpus_file, live_holder):
    """A live run building vocab from the corpus artifact: `--force corpus` refuses. A live run rebuilding the corpus
    artifact: a run that would read it refuses. Both name the other run, exit 2, and delete nothing."""
    corpus = only_artifact(finished, "corpus")
    reader = finished / "locks" / "vocab-0123456789abcdef.lock"
    reader.parent.mkdir()
    reader.write_text(live_holder([f"corpus/{corpus.name}"]).to_json())
    res = pipeline(finished, corpus_file, "--until", "corpus", "--force", "corpus", timeout=120)
    assert res.returncode == 2 and errors(res.stderr) == [
        f"error: --force corpus: artifact corpus/{corpus.name} is being read by {locks.read_holder(reader).describe()}"
        f" ({reader}); wait for that run to finish"], res.stderr
    reader.unlink()
    (finished / "locks" / f"corpus-{corpus.name}.lock").write_text(live_holder().to_json())
    res = pipeline(finished, corpus_file, "--until", "vocab", timeout=120)
    assert res.returncode == 2 and len(errors(res.stderr)) == 1, res.stderr
    assert errors(res.stderr)[0].startswith(f"error: stage vocab reads artifact corpus/{corpus.name}, which another "
                                            f"run is rebuilding: pid ")
    assert (corpus / "_SUCCESS").is_file() and not (finished / "artifacts" / "vocab").exists()


def test_a_full_disk_is_one_line_naming_the_file_and_a_rerun_resumes(race, corpus_file, tmpfs_mount, tmp_path):
    """The whole workdir - artifacts, scratch, the sqlite store - on a 24 MB tmpfs with 256 KB left when the vocab
    stage writes its sample: one `error:` line naming the sample file, no partial artifact, the store intact; with
    the space back the same command reuses the corpus artifact and builds the vocabulary."""
    disk = tmpfs_mount("24m")
    workdir = disk.path / "wd"
    copy = disk.run(["sh", "-c", f"mkdir -p {workdir} && cp -a {race['workdir'] / 'artifacts'} {workdir}/"])
    store = disk.run([sys.executable, "-c", f"from core.lineage import Lineage; Lineage(__import__('pathlib')"
                      f".Path('{workdir}'))"], cwd=REPO, env=ENV, capture_output=True, text=True)
    assert copy.returncode == 0 and store.returncode == 0, store.stderr[-2000:]
    free = shutil.disk_usage(disk.outside()).free
    with open(disk.outside("filler"), "wb") as f:
        os.posix_fallocate(f.fileno(), 0, free - 256 * 1024)

    full = disk.run(command(workdir, corpus_file, "--until", "vocab"), cwd=REPO, env=ENV, capture_output=True,
                    text=True, timeout=600)
    assert full.returncode == 1, full.stdout[-2000:] + full.stderr[-2000:]
    (line,) = errors(full.stderr)
    assert line.startswith(f"error: stage vocab failed: no space left on device writing {workdir}/scratch/vocab/")
    assert line.endswith("/train-sample.txt; free space there and re-run: finished stages are reused"), line
    vocab_id = line.split("/scratch/vocab/")[1].split("/")[0]
    assert "Traceback" not in full.stderr
    assert [p.name for p in disk.outside("wd/artifacts/vocab").iterdir()] == []  # nothing partial visible
    shutil.copy(disk.outside("wd/mlflow/mlflow.db"), tmp_path / "mlflow.db")  # sqlite opens no /proc/PID/root path
    db = sqlite3.connect(tmp_path / "mlflow.db")
    assert db.execute("PRAGMA integrity_check").fetchone() == ("ok",)
    assert ("FAILED",) in db.execute("SELECT status FROM runs").fetchall()  # the failure is in the lineage
    db.close()

    disk.outside("filler").unlink()
    again = disk.run(command(workdir, corpus_file, "--until", "vocab"), cwd=REPO, env=ENV, capture_output=True,
                     text=True, timeout=600)
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-2000:]
    assert "[corpus] cached" in again.stdout and "[vocab] done" in again.stdout
    assert (disk.outside(f"wd/artifacts/vocab/{vocab_id}") / "_SUCCESS").is_file()
