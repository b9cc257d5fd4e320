"""The entry point against a real `mlflow server`: lineage runs, caching, and clear errors."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.ray, pytest.mark.slow]

SMALL = ["--set", "vocab.vocab_size=600", "--set", "model.vocab_size=700",
         "--set", "tokenize.max_seq_len=64", "--until", "tokenize"]


def pipeline(args: list[str], env_extra: dict[str, str] | None = None, timeout: int = 900):
    env = dict(os.environ, **(env_extra or {}))
    return subprocess.run([sys.executable, "-m", "pipeline.run", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def small_corpus(news_subset) -> Path:
    """The first 300 real news articles, as a user's JSONL corpus."""
    return news_subset(300)


@pytest.fixture(scope="module")
def two_runs(small_corpus, mlflow_server, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("wd")
    env = {"MLFLOW_TRACKING_URI": mlflow_server}
    args = ["--corpus", str(small_corpus), "--workdir", str(workdir), *SMALL]
    first = pipeline(args, env)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    second = pipeline(args, env)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    return workdir, first, second


def _runs(uri: str, parent_id: str):
    """The child runs of one invocation's parent run (other tests share the server)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    exp = client.get_experiment_by_name("deberta-pipeline")
    runs = client.search_runs([exp.experiment_id], filter_string=f"tags.mlflow.parentRunId = '{parent_id}'",
                              order_by=["attributes.start_time ASC"], max_results=500)
    return client, runs


def _parent_id(stdout: str) -> str:
    match = re.search(r"\(parent run ([0-9a-f]+)\)", stdout)
    assert match, stdout[-2000:]
    return match.group(1)


def test_lineage_runs_and_tags(two_runs, mlflow_server):
    workdir, first, _ = two_runs
    client, children = _runs(mlflow_server, _parent_id(first.stdout))
    assert client.get_run(_parent_id(first.stdout)).info.status == "FINISHED"
    stages = [r.data.tags["pipeline.stage"] for r in children]
    assert stages[:2] == ["corpus", "vocab"]
    by_stage = {r.data.tags["pipeline.stage"]: r for r in children}
    corpus_id = by_stage["corpus"].data.tags["pipeline.artifact_id"]
    assert (workdir / "artifacts" / "corpus" / corpus_id / "_SUCCESS").exists()
    # the vocab run names the corpus artifact it read, as a tag and as a logged dataset input
    vocab = client.get_run(by_stage["vocab"].info.run_id)
    assert vocab.data.tags["pipeline.input.corpus"] == corpus_id
    assert any(d.dataset.name == f"corpus:{corpus_id}" for d in vocab.inputs.dataset_inputs)
    assert vocab.data.params["vocab.vocab_size"] == "600"
    manifest = json.loads((workdir / "artifacts" / "vocab" / vocab.data.tags["pipeline.artifact_id"]
                           / "manifest.json").read_text())
    assert manifest["inputs"]["corpus"] == corpus_id and "spm.model" in manifest["files"]
    assert all(r.info.status == "FINISHED" for r in children)


def test_second_invocation_is_a_no_op(two_runs, mlflow_server):
    workdir, first, second = two_runs
    assert "cached" in second.stdout and "running ->" not in second.stdout
    client, cached = _runs(mlflow_server, _parent_id(second.stdout))
    assert cached and all(r.data.tags["pipeline.status"] == "cached" for r in cached)
    for stage_dir in (workdir / "artifacts").iterdir():
        assert len([p for p in stage_dir.iterdir()]) == 1, f"{stage_dir.name} was rebuilt"
    assert "=== summary ===" in second.stdout and "mlflow" in second.stdout.lower()


@pytest.mark.parametrize("args, fragment", [
    (["--preset", "deberta-2b"], "unknown preset 'deberta-2b'"),
    (["--set", "pretrain.max_steps=ten"], "pretrain.max_steps=ten: expected int"),
    (["--set", "pretrain.bogus=1"], "unknown key 'bogus' in [pretrain]"),
    (["--corpus", "/nonexistent/corpus/*.txt"], "/nonexistent/corpus"),
    (["--workdir", "/proc/not-writable"], "is not writable"),
])
def test_bad_input_one_clear_message(args, fragment, tmp_path):
    workdir = ["--workdir", str(tmp_path / "wd")] if "--workdir" not in args else []
    res = pipeline([*args, *workdir, "--dry-run"], timeout=120)
    assert res.returncode == 2
    lines = [ln for ln in res.stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and fragment in lines[0], res.stderr
    assert not (tmp_path / "wd" / "artifacts").exists()  # nothing half-written


def test_a_trial_larger_than_the_cluster_is_refused_before_any_stage(small_corpus, tmp_path):
    """8 DeepSpeed workers x 1 CPU cannot start on the debug preset's 4-CPU local Ray: one message, nothing built."""
    args = ["--corpus", str(small_corpus), "--workdir", str(tmp_path / "wd"), "--set", "finetune.trainer=deepspeed",
            "--set", "finetune.workers_per_trial=8", "--set", "finetune.batch_size=32"]
    res = pipeline(args, {"MLFLOW_TRACKING_URI": ""}, timeout=300)
    assert res.returncode == 2, res.stdout[-2000:] + res.stderr[-2000:]
    assert "error: one finetune trial needs 8 Ray CPUs" in res.stderr and "workers_per_trial" in res.stderr
    assert not (tmp_path / "wd" / "artifacts").exists() or not any((tmp_path / "wd" / "artifacts").iterdir())
