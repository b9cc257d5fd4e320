"""Bad input writes nothing: a run refused before its first stage leaves no workdir it created and no MLflow run,
and a plan on paper (--dry-run) writes nothing either."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import pipeline_main

REPO = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.ray]


@pytest.mark.parametrize("args, fragment", [
    (["--corpus", "/nonexistent/corpus.jsonl"], "/nonexistent/corpus.jsonl"),
    (["--only", "finetune", "--set", "finetune.trainer=deepspeed", "--set", "finetune.workers_per_trial=8",
      "--set", "finetune.batch_size=32", "--set", "finetune.init={hf}"], "one finetune trial needs 8 Ray CPUs"),
    (["--dry-run"], None),
], ids=["missing-corpus", "cluster-too-small", "dry-run"])
def test_a_refused_run_leaves_nothing(args, fragment, tmp_path, mlflow_server):
    """A fresh workdir: the corpus is checked before anything is created; the cluster (checked once Ray is up)
    before any MLflow run exists, and what the run had created (the workdir, its store) is removed with the refusal.
    The run that starts Ray runs as its own process; the others stop before Ray and run in this one."""
    hf = _hf_dir(tmp_path) if any("{hf}" in a for a in args) else None
    workdir = tmp_path / "fresh" / "wd"
    before = _runs(mlflow_server)
    argv = [*[a.format(hf=hf) for a in args], "--workdir", str(workdir)]
    if hf is None:
        res = pipeline_main(argv, {"MLFLOW_TRACKING_URI": mlflow_server})
    else:
        res = subprocess.run([sys.executable, "-m", "pipeline.run", *argv], cwd=REPO, capture_output=True, text=True,
                             timeout=600, env=dict(os.environ, MLFLOW_TRACKING_URI=mlflow_server))
    if fragment is None:
        assert res.returncode == 0 and "plan:" in res.stdout, res.stderr[-2000:]
    else:
        lines = [ln for ln in res.stderr.splitlines() if ln.startswith("error: ")]
        assert res.returncode == 2 and len(lines) == 1 and fragment in lines[0], res.stdout[-2000:] + res.stderr[-2000:]
    assert not (tmp_path / "fresh").exists()
    assert _runs(mlflow_server) == before  # not even a parent run (FAILED or left RUNNING)


def _runs(uri: str) -> set[str]:
    import mlflow

    client = mlflow.MlflowClient(uri)
    experiments = [e.experiment_id for e in client.search_experiments()]
    return {r.info.run_id for r in client.search_runs(experiments, max_results=50_000)} if experiments else set()


def _hf_dir(tmp_path: Path) -> Path:
    from tests.released import released

    return released(tmp_path / "released", "mlm")


def test_a_workdir_that_cannot_be_created_is_named(tmp_path, capsys):
    from pipeline.run import main

    (tmp_path / "file").write_text("")
    assert main(["--workdir", str(tmp_path / "file" / "wd"), "--dry-run"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"error: workdir {tmp_path / 'file' / 'wd'} cannot be created: {tmp_path / 'file'} is a file, not a "
                   f"directory (Not a directory); pass --workdir DIR you can write to"), err
