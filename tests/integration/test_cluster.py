"""The pipeline as a Ray job on a cluster: `ray_cluster.yaml`, `cluster/local.sh`, `ray job submit` end to end.

The local cluster is the one `cluster/local.sh up` starts (a head plus a second raylet on this machine,
token auth, everything on 127.0.0.1); jobs are submitted with the same command the README shows.
Run inside the loopback-only network namespace `make test` creates.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from tests.s3_server import s3_server  # noqa: F401  (the module's object store)

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
LOCAL_SH = REPO / "cluster" / "local.sh"

pytestmark = [pytest.mark.ray, pytest.mark.slow]

# README "Run on a cluster", local cluster: the submission, then the pipeline's arguments.
SUBMIT = 'ray job submit --working-dir . --runtime-env-json "$(python -m cluster.runtime_env)" --'
# The debug-v3 run (DeBERTaV3's objective) shrunk to minutes on 2 cores: small vocabulary, 2 tokenizer actors
# (not one per logical CPU), 10 pretraining steps spread over both nodes, a one-point fine-tuning grid of one epoch
# on 64 examples (test_pipeline_cli's size: that fine-tuning learns is tests/integration/test_finetune.py's test).
SHRINK = ["--set", "vocab.vocab_size=600", "--set", "model.vocab_size=700", "--set", "tokenize.max_seq_len=64",
          "--set", "tokenize.num_workers=2",
          "--set", "pretrain.max_steps=10", "--set", "pretrain.eval_interval=5", "--set", "pretrain.ckpt_interval=5",
          "--set", "pretrain.eval_batches=2", "--set", "pretrain.placement_strategy=SPREAD",
          "--set", "finetune.lr=1e-3", "--set", "finetune.dropout=0.0", "--set", "finetune.warmup_steps=1",
          "--set", "finetune.epochs=1", "--set", "finetune.batch_size=16", "--set", "finetune.max_seq_len=64",
          "--set", "finetune.max_train_examples=64"]


# ----------------------------------------------------------------------------------------------- ray_cluster.yaml

def test_cluster_yaml_validates_and_exposes_only_ssh():
    from ray.autoscaler._private.util import prepare_config, validate_config

    raw = yaml.safe_load((REPO / "ray_cluster.yaml").read_text())
    config = prepare_config(raw)  # merges the AWS defaults, as `ray up` does
    validate_config(config)  # Ray's JSON schema + node-type checks

    types = config["available_node_types"]
    head = types[config["head_node_type"]]
    assert head["resources"].get("GPU", 0) == 0
    gpu = [t for name, t in types.items() if t["resources"].get("GPU", 0) == 8]
    cpu = [t for name, t in types.items() if name != config["head_node_type"] and t["resources"].get("GPU", 0) == 0]
    assert gpu and gpu[0]["max_workers"] > gpu[0].get("min_workers", 0) and cpu
    assert sum(t.get("min_workers", 0) for t in types.values()) <= config["max_workers"]

    # Install steps of the Makefile, in its order: torch, DeepSpeed (no build isolation, no ops), the project.
    setup = config["setup_commands"]
    order = [next(i for i, c in enumerate(setup) if pat in c)
             for pat in ("torch==", "deepspeed==", "pip install --quiet -e .")]
    assert order == sorted(order)
    ds = setup[order[1]]
    assert "--no-build-isolation" in ds and "DS_BUILD_OPS=0" in ds
    assert "~/deberta" in config["file_mounts"]

    # The head runs MLflow (sqlite on shared storage) and binds the dashboard to loopback.
    head_cmds = " ".join(config["head_start_ray_commands"])
    assert "mlflow_server.sh start" in head_cmds and "MLFLOW_SERVER_DIR=/mnt/shared" in head_cmds
    assert "--dashboard-host=127.0.0.1" in head_cmds
    every_cmd = " ".join(str(c) for key in ("setup_commands", "head_setup_commands", "worker_setup_commands",
                                            "head_start_ray_commands", "worker_start_ray_commands")
                         for c in config[key])
    assert "0.0.0.0" not in every_cmd

    # Ingress: Ray adds SSH (22) and intra-cluster rules to the group it creates; we add nothing, and
    # no node type brings its own security group or a public-facing interface.
    assert config["provider"]["security_group"].get("IpPermissions", []) == []
    for t in types.values():
        node = t["node_config"]
        assert "SecurityGroupIds" not in node and "NetworkInterfaces" not in node
    assert "8265" not in json.dumps(config["provider"]) and "5000" not in json.dumps(config["provider"])


def test_runtime_env_leaves_out_venv_and_outputs_and_forwards_mlflow():
    env = dict(os.environ, MLFLOW_TRACKING_URI="http://127.0.0.1:5000")
    out = subprocess.run([sys.executable, "-m", "cluster.runtime_env"], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=60, check=True)
    runtime_env = json.loads(out.stdout)
    assert {".venv/", "workdir/", ".git/"} <= set(runtime_env["excludes"]) and "working_dir" not in runtime_env
    assert runtime_env["env_vars"] == {"MLFLOW_TRACKING_URI": "http://127.0.0.1:5000"}


# ----------------------------------------------------------------------------------------------- the local cluster

@dataclass
class LocalCluster:
    state: Path
    env: dict[str, str]
    """Environment of a client: this venv first on PATH, RAY_ADDRESS and the token settings `up` printed."""
    sessions: tuple[int, ...]
    """Process sessions of the head and the worker `ray start --block` (pids recorded by local.sh)."""
    worker_private: Path
    """A directory the worker node does not see (LOCAL_CLUSTER_WORKER_PRIVATE), as a second machine would not."""

    def sh(self, args: list[str] | str, timeout: float = 300, **env) -> subprocess.CompletedProcess:
        cmd = ["bash", "-c", args] if isinstance(args, str) else [str(LOCAL_SH), *args]
        return subprocess.run(cmd, cwd=REPO, env=dict(self.env, **env), capture_output=True, text=True,
                              timeout=timeout)

    def processes(self) -> list[str]:
        """Every live process of this cluster: in its sessions, naming the state dir, or working inside it."""
        found = []
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit() or int(proc.name) == os.getpid():
                continue
            try:
                cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                cwd = os.readlink(proc / "cwd") if (proc / "cwd").exists() else ""
                if (os.getsid(int(proc.name)) in self.sessions or f"{self.state}/" in cmdline
                        or cwd.startswith(f"{self.state}/")):
                    found.append(f"{proc.name}: {cmdline[:200]}")
            except (OSError, ProcessLookupError):
                continue
        return found


def exports(text: str) -> dict[str, str]:
    return dict(line[len("export "):].split("=", 1) for line in text.splitlines() if line.startswith("export "))


def test_up_refuses_a_port_in_use_before_starting_anything(tmp_path):
    """A `ray.init()` elsewhere on the machine holds Ray's default agent port: a head started beside it came up
    without a job agent, and every `ray job submit` failed with "No available agent"."""
    from tests.conftest import free_port

    state = Path(tempfile.mkdtemp(prefix="lc", dir="/tmp"))
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        taken = holder.getsockname()[1]
        env = dict(os.environ, LOCAL_CLUSTER_DIR=str(state), LOCAL_CLUSTER_AGENT_PORT=str(taken),
                   LOCAL_CLUSTER_GCS_PORT=str(free_port()), LOCAL_CLUSTER_DASHBOARD_PORT=str(free_port()),
                   LOCAL_CLUSTER_CLIENT_PORT=str(free_port()), PATH=f"{BIN}:{os.environ['PATH']}")
        up = subprocess.run([str(LOCAL_SH), "up"], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    try:
        assert up.returncode == 2, up.stdout + up.stderr
        assert up.stderr.splitlines() == [f"error: port {taken} on 127.0.0.1 is in use (another Ray or service); "
                                          "stop it or set LOCAL_CLUSTER_AGENT_PORT to a free port"]
        assert up.stdout == "" and not list(state.glob("*.pid")) and not (state / "ray").exists()
    finally:
        if up.returncode == 0:  # the check is gone: stop what it started
            subprocess.run([str(LOCAL_SH), "down"], cwd=REPO, env=env, capture_output=True, timeout=120)
        shutil.rmtree(state, ignore_errors=True)


@pytest.fixture(scope="module")
def ray_cluster_2_nodes(s3_server):  # noqa: F811
    """`cluster/local.sh up` in a short state dir (Ray's socket paths must stay under 108 bytes). Its nodes hold the
    object store's credentials in their environment, as cloud nodes hold an instance profile's. The worker node sees
    an empty `worker_private`; nothing else the tests use is under it."""
    state = Path(tempfile.mkdtemp(prefix="lc", dir="/tmp"))
    private = Path(tempfile.mkdtemp(prefix="lc-private", dir="/tmp"))
    env = dict(os.environ, **s3_server.env, LOCAL_CLUSTER_DIR=str(state), LOCAL_CLUSTER_WORKER_PRIVATE=str(private),
               PATH=f"{BIN}:{os.environ['PATH']}")
    try:
        up = subprocess.run([str(LOCAL_SH), "up"], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
        assert up.returncode == 0, up.stdout + up.stderr
        client = exports(up.stdout)
        assert client["RAY_ADDRESS"] == "http://127.0.0.1:8265" and Path(client["RAY_AUTH_TOKEN_PATH"]).is_file()
        sessions = tuple(int((state / f"{n}.pid").read_text()) for n in ("head", "worker"))
        yield LocalCluster(state, dict(env, **client), sessions, private)
    finally:  # `down` is a no-op when test_down_leaves_no_process already ran, or `up` failed and stopped its nodes
        subprocess.run([str(LOCAL_SH), "down"], cwd=REPO, env=env, capture_output=True, timeout=120)
        shutil.rmtree(state, ignore_errors=True)
        shutil.rmtree(private, ignore_errors=True)


def node_ids(cluster: LocalCluster) -> dict[str, str]:
    """Custom resource (node_head / node_worker) -> Ray node id, from the state API."""
    out = cluster.sh(f"ray list nodes --detail --format json --address {cluster.env['RAY_ADDRESS']}", timeout=120)
    assert out.returncode == 0, out.stderr
    nodes = json.loads(out.stdout)
    return {r: n["node_id"] for n in nodes if n["state"] == "ALIVE"
            for r in n["resources_total"] if r.startswith("node_")}


def submit(cluster: LocalCluster, args: list[str], submission_id: str, timeout: float, **env):
    """The README's `ray job submit` (blocking: streams the logs, exit 0 only on SUCCEEDED)."""
    cmd = SUBMIT.replace("ray job submit", f"ray job submit --submission-id {submission_id}", 1)
    cmd += " python -m pipeline.run " + " ".join(shlex.quote(a) for a in args)
    started = time.time()
    res = cluster.sh(cmd, timeout=timeout, **env)
    status = cluster.sh(f"ray job status {submission_id}", timeout=60)
    logs = cluster.sh(f"ray job logs {submission_id}", timeout=60)
    return res, status.stdout + status.stderr, logs.stdout, time.time() - started


def test_bad_preset_job_fails_fast_with_one_clear_line(ray_cluster_2_nodes, tmp_path):
    res, status, logs, _ = submit(ray_cluster_2_nodes, ["--preset", "nope", "--workdir", str(tmp_path / "wd")],
                                     "bad-preset", timeout=180)
    assert res.returncode != 0 and "Job 'bad-preset' failed" in status, res.stdout[-2000:] + res.stderr[-2000:]
    assert "error: unknown preset 'nope'; choose one of:" in logs, logs[-2000:]
    assert "Traceback" not in logs, logs[-3000:]
    assert not (tmp_path / "wd" / "artifacts").exists()
    assert "running ->" not in logs, logs[-2000:]  # fails before any stage starts, not deep inside one


def test_a_local_dir_one_node_does_not_see_is_refused_before_any_stage(ray_cluster_2_nodes, s3_server,  # noqa: F811
                                                                        mlflow_server):
    """A workdir in the bucket whose --local-dir is not on the worker node (as on a second machine without NFS):
    corpus and tokenize's tasks could not read or write it there, so a driver joining the cluster stops with one line
    naming the directory, the node and the fix, before any stage and before anything is uploaded."""
    import pyarrow.fs as pafs

    cluster, fs, bucket = ray_cluster_2_nodes, s3_server.filesystem(), s3_server.bucket
    local = cluster.worker_private / "x"
    # a driver on this machine joins the head's GCS (local.sh's default port); the session's MLflow server spares it
    # creating a tracking database under --local-dir (seconds, waited for before the refusal is printed)
    env = dict(cluster.env, RAY_ADDRESS="127.0.0.1:6379", MLFLOW_TRACKING_URI=mlflow_server)
    res = subprocess.run([sys.executable, "-m", "pipeline.run", "--preset", "debug", "--workdir", f"s3://{bucket}/blind",
                          "--local-dir", str(local), "--until", "tokenize"],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=180)
    errors = [line for line in res.stderr.splitlines() if line.startswith("error:")]
    assert res.returncode == 2 and len(errors) == 1, res.stdout[-3000:] + res.stderr[-3000:]
    assert "joined Ray cluster at 127.0.0.1:6379" in res.stdout and "2 node(s)" in res.stdout, res.stdout[-2000:]
    # both nodes are on 127.0.0.1: "node 127.0.0.1;" once says the head saw it and the worker did not
    assert f"--local-dir {local} is not on node 127.0.0.1; " in errors[0], errors
    assert "give a --local-dir that every node mounts (NFS)" in errors[0], errors
    assert "running ->" not in res.stdout, res.stdout[-2000:]
    uploaded = fs.get_file_info(pafs.FileSelector(f"{bucket}/blind/artifacts", allow_not_found=True, recursive=True))
    assert uploaded == [] and not local.exists(), uploaded  # the refused run leaves nothing


@pytest.fixture(scope="module")
def small_corpus(news_subset) -> Path:
    """The first 400 real news articles, as a user's JSONL corpus (a path both nodes see)."""
    return news_subset(400)


def test_pipeline_job_end_to_end(ray_cluster_2_nodes, s3_server, mlflow_server, small_corpus,  # noqa: F811
                                 tmp_path_factory):
    """Every stage on both nodes with the corpus, the workdir and Ray's storage in the bucket."""
    import pyarrow.parquet as pq
    from mlflow.tracking import MlflowClient

    from stages.finetune.tasks import resolve_task

    cluster, fs, bucket = ray_cluster_2_nodes, s3_server.filesystem(), s3_server.bucket
    reviews = resolve_task("rotten-tomatoes").dev.text_a
    articles = [json.loads(line) for line in small_corpus.read_text().splitlines()]
    for article, review in zip(articles, [r for r in reviews if len(r.split()) >= 20][:6]):
        article["text"] += f"\n\n{review}"  # 6 dev reviews in news articles the run pretrains on
    with fs.open_output_stream(f"{bucket}/e2e-corpus/news.jsonl", compression=None) as out:
        out.write("".join(json.dumps(a) + "\n" for a in articles).encode())
    # the local side holds the build area, the copies of what stages read and the locks: corpus and tokenize's tasks
    # read and write it on both nodes (both raylets see this path; pipeline.executor checks that they do)
    workdir = tmp_path_factory.mktemp("shared") / "local"
    args = ["--preset", "debug-v3", "--corpus", f"s3://{bucket}/e2e-corpus/", "--workdir", f"s3://{bucket}/e2e",
            "--local-dir", str(workdir), *SHRINK]
    res, status, logs, took = submit(cluster, args, "pipeline-e2e", timeout=720, MLFLOW_TRACKING_URI=mlflow_server)
    assert res.returncode == 0 and "Job 'pipeline-e2e' succeeded" in status, f"{status}\n{logs[-6000:]}\n{res.stderr[-2000:]}"
    print(f"\npipeline job on 2 nodes: SUCCEEDED in {took:.0f}s")

    # Both registered models, each tagged with the corpus artifact it descends from.
    client = MlflowClient(mlflow_server)
    pretrained = max(client.search_model_versions("name = 'deberta-debug-v3-pretrained'"), key=lambda v: int(v.version))
    champion = client.get_model_version_by_alias("deberta-debug-v3-rotten-tomatoes", "champion")
    assert pretrained.tags["objective"] == "rtd" and pretrained.tags["embedding_sharing"] == "gdes"
    # the champion fine-tuned from the RTD discriminator is an MLflow Model: pyfunc loads it, labels every dev review
    # with one of the task's names, and those labels score the dev accuracy the registry version reports
    import mlflow
    import numpy as np
    import pandas as pd
    import pyarrow.fs as pafs

    mlflow.set_tracking_uri(mlflow_server)
    served = mlflow.pyfunc.load_model("models:/deberta-debug-v3-rotten-tomatoes@champion")
    dev = resolve_task("rotten-tomatoes").dev
    predicted = served.predict(pd.DataFrame({"sentence1": list(dev.text_a)}))
    labels = list(predicted["label"])
    assert len(labels) == len(dev.text_a) and set(labels) <= {"fresh", "rotten"}, set(labels)
    accuracy = np.mean([p == ("rotten", "fresh")[int(y)] for p, y in zip(labels, dev.label)])
    assert accuracy == pytest.approx(float(champion.tags["dev_accuracy"]), abs=0.005), (accuracy, champion.tags)
    # ... and it is this run's fine-tuned artifact: its hf/ gives the same labels and scores (a model predicting one
    # class from 64 examples would match a constant accuracy; its probabilities are its own)
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    hf_dir = workdir / "artifacts" / "finetune" / champion.tags["sweep"] / "hf"
    model = AutoModelForSequenceClassification.from_pretrained(hf_dir).eval()
    tok = AutoTokenizer.from_pretrained(hf_dir)
    with torch.no_grad():
        enc = tok(list(dev.text_a[:32]), padding=True, truncation=True, max_length=64, return_tensors="pt")
        probs = model(**enc).logits.softmax(-1)
    assert labels[:32] == [model.config.id2label[int(i)] for i in probs.argmax(-1)]
    assert list(predicted["score"][:32]) == pytest.approx(probs.max(-1).values.tolist(), abs=1e-4)
    corpus_id = pretrained.tags["corpus"]
    assert corpus_id and champion.tags["corpus"] == corpus_id
    # the dev reviews planted in the corpus are reported on the champion, as a plain reading of the train shards finds
    # them (GPT-3's 13-grams, Brown et al. 2020, App. C; 8-12-word reviews whole)
    train = fs.get_file_info(pafs.FileSelector(f"{bucket}/e2e/artifacts/corpus/{corpus_id}/train"))
    texts = [t for f in train for t in pq.read_table(fs.open_input_file(f.path), columns=["text"])["text"].to_pylist()]
    hit = _contaminated(reviews, texts)
    assert hit >= 1 and champion.tags["dev_contaminated_examples"] == str(hit), (hit, champion.tags)
    assert champion.tags["dev_contamination"] == f"{hit:,} of {len(reviews):,} ({hit / len(reviews):.1%})"
    assert champion.tags["pretrain"] == pretrained.tags["pretrain"]
    for stage, art_id in (("corpus", corpus_id), ("pretrain", pretrained.tags["pretrain"]),
                          ("finetune", champion.tags["sweep"])):  # each complete in the bucket
        assert fs.get_file_info(f"{bucket}/e2e/artifacts/{stage}/{art_id}/_SUCCESS").size == 0, stage
    runs = {i.base_name for i in fs.get_file_info(pafs.FileSelector(f"{bucket}/e2e/ray_results"))}
    assert f"pretrain-{pretrained.tags['pretrain']}" in runs, runs  # Ray Train's checkpoints are in the bucket too
    # ... and the corpus stage's MLflow run names that artifact: the lineage closes.
    exp = client.get_experiment_by_name("deberta-pipeline")
    parent = client.get_run(pretrained.run_id).data.tags["mlflow.parentRunId"]  # this job's pipeline run only: the
    corpus_runs = client.search_runs(  # server is shared with other tests' runs
        [exp.experiment_id], f"tags.`pipeline.stage` = 'corpus' and tags.`mlflow.parentRunId` = '{parent}'")
    assert [r.data.tags["pipeline.artifact_id"] for r in corpus_runs] == [corpus_id]
    assert client.get_run(pretrained.run_id).data.tags["pipeline.artifact_id"] == pretrained.tags["pretrain"]

    # The training workers ran on both nodes (pretrain records each rank's Ray node id).
    metrics = json.loads((workdir / "artifacts" / "pretrain" / pretrained.tags["pretrain"] / "metrics.json").read_text())
    nodes = node_ids(cluster)
    assert set(nodes) == {"node_head", "node_worker"}
    assert sorted(metrics["worker_nodes"]) == sorted(nodes.values()), (metrics["worker_nodes"], nodes)
    # (--force discarding the Ray Train run it would restore: tests/unit/test_force.py)


def _contaminated(examples, texts) -> int:
    """Examples sharing a 13-gram of lower-cased words (punctuation dropped) with `texts`; one of 8-12 words whole."""
    words = lambda t: re.findall(r"[^\W_]+", t.lower())  # noqa: E731
    grams = [[tuple(w[i:i + 13]) for i in range(len(w) - 12)] if len(w) >= 13 else [tuple(w)] if len(w) >= 8 else []
             for w in map(words, examples)]
    sizes, starts = {len(g[0]) for g in grams if g}, {g[:8] for ex in grams for g in ex}
    seen = {tuple(w[i:i + n]) for w in map(words, texts) for i in range(len(w) - 7) if tuple(w[i:i + 8]) in starts
            for n in sizes if i + n <= len(w)}  # every window of a text whose first 8 words start an example's gram
    return sum(any(g in seen for g in ex) for ex in grams)


def test_down_leaves_no_process(ray_cluster_2_nodes):
    """Runs last in this module: the cluster that served the jobs above is stopped and nothing remains."""
    cluster = ray_cluster_2_nodes
    status = cluster.sh(["status"], timeout=120)
    assert status.returncode == 0 and "head: running" in status.stdout and "worker: running" in status.stdout
    assert exports(status.stdout)["RAY_AUTH_TOKEN_PATH"] == cluster.env["RAY_AUTH_TOKEN_PATH"]
    assert len(cluster.processes()) >= 6  # gcs, raylets, dashboard, ... are found by the same scan
    down = cluster.sh(["down"], timeout=180)
    assert down.returncode == 0, down.stderr
    assert cluster.processes() == []
    after = cluster.sh(["status"], timeout=60)
    assert after.returncode != 0 and "head: stopped" in after.stdout
