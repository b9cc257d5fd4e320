"""`python -m pipeline.predict` over a large corpus in a bucket on the local S3 server, for a sequence, a token and a
span model: complete output, a sample equal to the registered model's own `pyfunc.predict`, an actor SIGKILLed
mid-run, and the re-run a no-op.

    unshare --net sh -c 'ip link set lo up && .venv/bin/python -m bench.predict_corpus'    # --rows 100000

What runs: the local S3 server (`cluster.local_s3.serve`, what `python -m cluster.local_s3 DIR` starts); the debug
preset's sequence, token and span heads of `bench.predict` (random weights over a real SentencePiece vocabulary),
each logged as an MLflow Model and registered in a sqlite registry as `pipeline.predict` reads them; per kind a
JSONL corpus of real text (Rotten Tomatoes reviews, WNUT-2016 tweets, SQuAD and Quoref questions with their
contexts) uploaded to the bucket in `--files` files. Those texts are fewer than the rows asked for, so they repeat
cyclically; each row has its own id (the corpus stage's `doc_id(file, line)`). Then per kind:
  1. `python -m pipeline.predict models:/NAME/1 --input s3://... --output s3://...` with `--actors` actors; once the
     first actor has answered for `--kill-after` seconds, one actor process (`ray::MapWorker(...)`, a descendant of
     that command) is SIGKILLed; the run's own rows/s is what it prints;
  2. the output is read back: every row once (row ids unique, indexes 0..N-1 of every file), all answered,
     the manifest's row count;
  3. `--sample` rows spread over the corpus, answered by `mlflow.pyfunc.load_model(...).predict(...)`: equal
     (strings, integers) or within 1e-5 (scores);
  4. the same command again: "nothing to do", the objects under the output prefix unchanged (sizes, mtimes), its
     seconds.
`--disk` does the same for the sequence kind on local disk (input and output), without the kill.
Writes bench/results/predict_corpus.json (or `--json PATH`) and a table.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import RESULTS, command_line, comma_choices, emit, load_average

KINDS = ("sequence", "token", "span")
MODULES = {k: f"stages.finetune.kinds.{k}" for k in KINDS}
AUTO = {"sequence": "AutoModelForSequenceClassification", "token": "AutoModelForTokenClassification",
        "span": "AutoModelForQuestionAnswering"}
TASKS = {"sequence": "text-classification", "token": "token-classification", "span": "question-answering"}
ACTOR = "MapWorker"
"""What Ray Data's actor processes are called (`ray::MapWorker(MapBatches(Predictor))`)."""


def register(root: Path, models: dict[str, Path]) -> tuple[str, dict[str, str]]:
    """Each HF directory as an MLflow Model (core/hf_pyfunc.py, the kind's code shipped) registered as
    deberta-debug-bench-KIND version 1 in a sqlite registry under `root`; (tracking URI, kind -> models:/NAME/1)."""
    import types

    from bench.predict import texts_of
    from core.lineage import Lineage
    from stages.finetune.kinds import KINDS as ALL
    from stages.finetune.kinds.base import code_tree

    lineage = Lineage(root / "wd")
    tracker = lineage.start("bench", {"preset": "debug"}, ["finetune"]).child("finetune")
    uris = {}
    for kind, hf_dir in models.items():
        spec = next(k for k in ALL.values() if type(k).__module__ == MODULES[kind])
        outputs = spec.signature_outputs(types.SimpleNamespace(problem=spec.problems[0]))
        uri = tracker.log_hf_model(hf_dir, task=TASKS[kind], input_example=texts_of(kind, 2), kind=MODULES[kind],
                                   code_paths=tuple(code_tree(root / f"code-{kind}")), auto=AUTO[kind],
                                   outputs=outputs)
        name = f"deberta-debug-bench-{kind}"
        uris[kind] = f"models:/{name}/{tracker.register_model(name, model_uri=uri)}"
    return lineage.tracking_uri, uris


def write_corpus(kind: str, rows: int, files: int, location: str) -> list[dict]:
    """`rows` records of the kind's columns as JSONL in `files` files under `location` (a URI or a directory);
    returns the records (in file order)."""
    from bench.predict import texts_of
    from core import storage

    columns = texts_of(kind, rows)
    records = [dict(zip(columns, values)) for values in zip(*columns.values())]
    fs, root = storage.filesystem(location)
    fs.create_dir(root, recursive=True)
    per = math.ceil(rows / files)
    for f in range(files):
        body = "".join(json.dumps(r) + "\n" for r in records[f * per:(f + 1) * per])
        with fs.open_output_stream(f"{root}/part-{f:03d}.jsonl", compression=None) as out:
            out.write(body.encode())
    return records


def run_predict(cmd: list[str], env: dict[str, str], kill_after: float | None) -> dict:
    """The command, SIGKILLing one actor process once the first has lived `kill_after` seconds; its printed
    rows/s, the actors' process ids seen (a killed one's successor among them), the seconds it took."""
    import psutil

    started = time.time()
    log = Path(tempfile.mkstemp(prefix="predict-", suffix=".log")[1])
    with open(log, "w") as sink:
        proc = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT, text=True, env=env)
    seen: dict[int, float] = {}
    killed = None
    while proc.poll() is None:
        try:
            for p in psutil.Process(proc.pid).children(recursive=True):
                try:
                    if ACTOR in " ".join(p.cmdline()) and p.pid not in seen:
                        seen[p.pid] = time.time()
                except psutil.Error:
                    pass
        except psutil.Error:
            pass
        if kill_after is not None and killed is None and seen and time.time() - min(seen.values()) > kill_after:
            killed = min(seen, key=seen.get)
            os.kill(killed, signal.SIGKILL)
            print(f"  SIGKILL actor process {killed} after {time.time() - started:.0f} s", flush=True)
        time.sleep(0.5)
    text = log.read_text()
    log.unlink()
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{text[-4000:]}")
    m = re.search(r"(\d+) rows \((\d+) answered\) by .* in ([\d.]+) s \((\d+) rows/s\)", text)
    return {"seconds_total": round(time.time() - started, 1), "text": text,
            "rows": int(m.group(1)) if m else None, "answered": int(m.group(2)) if m else None,
            "seconds": float(m.group(3)) if m else None, "rows_per_s": int(m.group(4)) if m else None,
            "actor_pids": len(seen), "killed_pid": killed}


def listing(location: str) -> dict[str, tuple[int, int]]:
    """Every object under `location`: path -> (bytes, mtime ns)."""
    import pyarrow.fs as pafs

    from core import storage

    fs, root = storage.filesystem(location)
    return {i.path: (i.size, i.mtime_ns or 0) for i in fs.get_file_info(pafs.FileSelector(root, recursive=True))
            if i.type == pafs.FileType.File}


def read_output(location: str):
    """The output's rows (Parquet readers skip `_manifest.json` and `_SUCCESS`) and its manifest."""
    import pyarrow.parquet as pq

    from core import storage

    fs, root = storage.filesystem(location)
    table = pq.read_table(root, filesystem=fs)
    manifest = json.loads(fs.open_input_stream(f"{root}/_manifest.json").read())
    return table, manifest


def same(a, b, tol: float = 1e-5) -> bool:
    """Answers equal: strings and integers exactly, floats within `tol`, lists and dicts element by element."""
    import numpy as np

    if isinstance(a, np.ndarray):
        a = a.tolist()
    if isinstance(b, np.ndarray):
        b = b.tolist()
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k], tol) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same(x, y, tol) for x, y in zip(a, b))
    if isinstance(a, float) or isinstance(b, float):
        return a is not None and b is not None and abs(float(a) - float(b)) <= tol
    return a == b


def check_output(table, manifest: dict, records: list[dict], files: int) -> dict:
    """Complete and once: as many rows as records, every row id once, every file's lines 0..n-1, all answered."""
    rows = len(records)
    per = math.ceil(rows / files)
    ids = table.column("row_id").to_pylist()
    by_file: dict[str, list[int]] = {}
    for source, index in zip(table.column("source").to_pylist(), table.column("index").to_pylist()):
        by_file.setdefault(source.rsplit("/", 1)[-1], []).append(index)
    lines = all(sorted(v) == list(range(min(per, rows - f * per))) for f, v in
                enumerate(by_file[k] for k in sorted(by_file)))
    return {"rows_out": table.num_rows, "row_ids_unique": len(set(ids)), "files_out": len(by_file),
            "every_line_once": bool(lines and len(by_file) == files),
            "unanswered": table.num_rows - table.column("reason").null_count, "manifest_rows": manifest["rows"],
            "manifest_answered": manifest["answered"],
            "complete": table.num_rows == rows == len(set(ids)) == manifest["rows"] == manifest["answered"]
            and bool(lines and len(by_file) == files)}


def check_sample(table, records: list[dict], files: int, uri: str, n: int) -> dict:
    """`n` rows spread over the corpus: the output's answers against `pyfunc.predict` of the same inputs."""
    import mlflow
    import pandas as pd

    per = math.ceil(len(records) / files)
    step = max(1, len(records) // n)
    wanted = list(range(0, len(records), step))[:n]
    key = {(f"part-{i // per:03d}.jsonl", i % per): i for i in wanted}
    got = {}
    answer_cols = [c for c in table.column_names if c not in ("row_id", "source", "index", "model_version", "reason")]
    for row in table.select(["source", "index", *answer_cols]).to_pylist():
        k = (row["source"].rsplit("/", 1)[-1], row["index"])
        if k in key:
            got[key[k]] = {c: row[c] for c in answer_cols}
    served = mlflow.pyfunc.load_model(uri).predict(pd.DataFrame([records[i] for i in wanted]))
    want = served.to_dict("records")
    equal = sum(same(got[i], {c: w[c] for c in answer_cols}) for i, w in zip(wanted, want))
    return {"sample": len(wanted), "sample_equal_pyfunc": equal}


def one_kind(kind: str, uri: str, location: str, out: str, args, env: dict[str, str], cache: Path,
             kill: bool) -> dict:
    records = write_corpus(kind, args.rows_of[kind], args.files, location)
    cmd = [sys.executable, "-m", "pipeline.predict", uri, "--input", location, "--output", out, "--actors",
           str(args.actors), "--batch-size", str(args.batch), "--cache", str(cache)]
    print(f"{kind}: {len(records)} rows in {args.files} files at {location} -> {out}", flush=True)
    first = run_predict(cmd, env, args.kill_after if kill else None)
    table, manifest = read_output(out)
    row = {"rows": len(records), "input": location, "output": out,
           **{k: v for k, v in first.items() if k != "text"},
           **check_output(table, manifest, records, args.files)}
    row.update(check_sample(table, records, args.files, uri, args.sample))
    before = listing(out)
    again = run_predict(cmd, env, None)
    row.update(rerun_seconds=again["seconds_total"], rerun_nothing_to_do="nothing to do" in again["text"],
               rerun_objects_unchanged=listing(out) == before)
    print(f"  {json.dumps(row)}", flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=100_000, help="rows per kind (span: --span-rows)")
    ap.add_argument("--span-rows", type=int, default=0, help="rows of the span kind (default --rows)")
    ap.add_argument("--kinds", type=comma_choices(KINDS, "kind"), default=KINDS)
    ap.add_argument("--files", type=int, default=8, help="JSONL files the corpus is split into")
    ap.add_argument("--actors", type=int, default=2)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--kill-after", type=float, default=20.0, help="seconds of the first actor before one is killed")
    ap.add_argument("--sample", type=int, default=200, help="rows checked against pyfunc.predict")
    ap.add_argument("--disk", action="store_true", help="also the sequence kind on local disk")
    ap.add_argument("--json", type=Path, default=RESULTS / "predict_corpus.json")
    args = ap.parse_args()
    args.rows_of = {k: (args.span_rows or args.rows) if k == "span" else args.rows for k in KINDS}

    from bench.predict import build_models
    from cluster.local_s3 import serve

    root = Path(tempfile.mkdtemp(prefix="bench-predict-corpus-"))
    models = {kind: path for (kind, _), path in build_models(root / "models", ["debug"]).items() if kind in args.kinds}
    tracking_uri, uris = register(root, models)
    results: dict[str, dict] = {}
    with serve(root / "s3") as s3:
        env = {**os.environ, **s3.env, "MLFLOW_TRACKING_URI": tracking_uri}
        os.environ.update(s3.env)
        os.environ["MLFLOW_TRACKING_URI"] = tracking_uri
        for kind in args.kinds:
            results[kind] = one_kind(kind, uris[kind], f"s3://{s3.bucket}/corpus-{kind}",
                                     f"s3://{s3.bucket}/predictions-{kind}", args, env, root / "cache", kill=True)
        if args.disk and "sequence" in args.kinds:
            results["sequence-disk"] = one_kind("sequence", uris["sequence"], str(root / "disk" / "corpus"),
                                                str(root / "disk" / "predictions"), args, env, root / "cache",
                                                kill=False)
    report = {"bench": "predict_corpus", "command": command_line(), "actors": args.actors, "batch": args.batch,
              "files": args.files, "model_size": "debug", "load_average": load_average(), "cpus": os.cpu_count(),
              "kinds": results}
    lines = ["| kind | rows | store | rows/s | actor killed | complete | sample = pyfunc | re-run no-op (s) |",
             "|---|---|---|---|---|---|---|---|"]
    for kind, r in results.items():
        lines.append(f"| {kind} | {r['rows']} | {'s3' if r['input'].startswith('s3') else 'disk'} | "
                     f"{r['rows_per_s']} | {'yes' if r['killed_pid'] else 'no'} | {r['complete']} | "
                     f"{r['sample_equal_pyfunc']}/{r['sample']} | "
                     f"{r['rerun_nothing_to_do'] and r['rerun_objects_unchanged']} ({r['rerun_seconds']}) |")
    emit(report, args.json, "\n".join(lines))


if __name__ == "__main__":
    main()
