"""`python -m pipeline.predict MODEL --input PATH_OR_URI --output PATH_OR_URI` (also `ray job submit -- python -m
pipeline.predict ...`): a fine-tuned model's answers for every record of a corpus, on Ray Data.

MODEL: a registry version (`models:/NAME@champion`, `models:/NAME/3`), a logged model (`models:/<model_id>`), a
run's model (`runs:/RUN_ID/model`), read from MLFLOW_TRACKING_URI; or an HF export directory (the finetune stage's
`hf/`). Input: what the corpus stage reads (a file, a directory, a quoted glob; .txt one record per line, .jsonl,
.parquet; .gz/.bz2/.zst; local or s3://), with the model's input columns (`--column MODEL_COLUMN=FIELD` reads one
from another field). Output: Parquet shards (`pipeline/predictor.py` says their columns), `_manifest.json` and
`_SUCCESS` last; a local output is written beside and renamed, one in object storage is visible by its marker.

Every check a user can fail runs before Ray starts, as one `error:` line and exit code 2: the model (URI, kind), the
input (files, the first record's fields), the output (a finished one of another model or input is refused without
--force). A finished output of the same input (paths, sizes, mtimes), model (its logged model id: a registry's
NAME/VERSION names other bytes in another store), backend and columns is reused: the re-run is a no-op. Then Ray Data
reads the files, maps batches of `--batch-size` rows over a pool of `--actors` actors (one model each,
`--cpus-per-actor` / `--gpus-per-actor`; one that dies is restarted and its batch retried: Ray Data's actor defaults,
max_restarts and max_task_retries -1) and writes the shards; with MLFLOW_TRACKING_URI set, a run records the input
and the model version it was answered by (`core.registry.log_prediction`). docs/serving.md has examples.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import os
import shutil
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from core import storage
from core.artifacts import SUCCESS, artifact_id, code_version, file_digest
from core.errors import StageInputError
from pipeline.predictor import REASON, ModelRef, answer_schema

if TYPE_CHECKING:
    from core.registry import PredictionModel

VERSION = "1"
"""Of the output's layout; part of the key a finished output is reused by."""
WRITE = {"num_cpus": 0}
"""The write tasks reserve no CPU: they only encode and store shards, and the actors hold the CPUs (a write that
waited for one would hold every answer in the object store until the pool went idle)."""
BLOCK_BYTES = 1 << 20
"""Ray Data's block size for this job: what the pool hands out (about 2,000 rows of short texts)."""
SHARD_ROWS = 100_000
"""Rows per output shard (at least; the last may be smaller)."""
MANIFEST = "_manifest.json"
"""The output's manifest; `_` as `_SUCCESS`: Parquet readers (pyarrow, pandas, Ray Data, Spark) skip both."""
ONNX_SAMPLE = 32  # rows of the input the ONNX export is checked on against torch, before it is used


class UserError(Exception):
    """Something the user can fix; printed as one line, exit code 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        raise UserError(f"{message}; see python -m pipeline.predict --help")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m pipeline.predict", description=__doc__.split("\n\n")[0],
                formatter_class=argparse.RawDescriptionHelpFormatter,
                epilog="example: python -m pipeline.predict models:/deberta-debug-rotten-tomatoes@champion "
                       "--input 's3://bucket/reviews/*.jsonl.gz' --output s3://bucket/predictions/rt "
                       "--column sentence1=text")
    p.add_argument("model", metavar="MODEL", help="models:/NAME@ALIAS, models:/NAME/VERSION, runs:/RUN/PATH, or an "
                                                  "HF export directory")
    p.add_argument("--input", required=True, metavar="PATH_OR_URI", help="file, directory or quoted glob")
    p.add_argument("--output", required=True, metavar="PATH_OR_URI", help="directory (or URI) for the shards")
    p.add_argument("--column", action="append", default=[], metavar="MODEL_COLUMN=FIELD",
                   help="read the model's column from another field of the input (repeatable)")
    p.add_argument("--backend", choices=("torch", "onnx"), default="torch",
                   help="torch, or onnxruntime over the version's ONNX export (an HF directory's, or an older "
                        "version's, exported once per node), checked against torch first")
    p.add_argument("--batch-size", type=int, default=256, help="rows per batch an actor answers (default 256)")
    p.add_argument("--actors", type=int, default=0, help="actors in the pool (default: the cluster's CPUs or GPUs "
                                                         "over what one actor takes)")
    p.add_argument("--cpus-per-actor", type=float, default=1.0, help="CPUs each actor reserves (default 1)")
    p.add_argument("--gpus-per-actor", type=float, default=0.0, help="GPUs each actor reserves (default 0)")
    p.add_argument("--cache", default=os.path.join(tempfile.gettempdir(), "deberta-predict"),
                   help="each node's directory for downloaded models and ONNX exports")
    p.add_argument("--force", action="store_true", help="replace a finished output of another model or input")
    return p


@dataclass(frozen=True)
class Job:
    """Everything resolved before Ray starts."""

    ref: ModelRef
    files: tuple[tuple[str, int, int], ...]
    output: str
    key: str
    model_id: str = ""
    version: str = ""
    """The registry version asked for (models:/NAME/VERSION, an alias resolved), for the lineage run ("" for a
    directory); `ref.version` is what the model is."""
    done: bool = False


# ----------------------------------------------------------------------------------------------- the model

def resolve_model(spec: str, cache: str) -> tuple[ModelRef, tuple[str, ...], Path, PredictionModel | None]:
    """(ModelRef without columns, the model's input columns, its HF directory here, the downloaded model or None for
    a directory). A downloaded model's ref names what it is (`PredictionModel.identity`, its logged model id) and
    its immutable URI, so every actor loads those very bytes and the output is reused only for them."""
    if os.path.isdir(spec):
        return _directory_model(spec, cache)
    if not spec.startswith(("models:/", "runs:/")):
        raise UserError(f"MODEL {spec!r} is neither a directory nor a model URI; give models:/NAME@ALIAS, "
                        f"models:/NAME/VERSION, runs:/RUN_ID/PATH or an HF export directory")
    tracking_uri = os.environ.get("MLFLOW_TRACKING_URI", "")
    if not tracking_uri:
        raise UserError(f"MODEL {spec} is read from a registry, and MLFLOW_TRACKING_URI is not set; set it to the "
                        f"tracking server (http://HOST:PORT) or sqlite:///PATH that holds the model")
    from core.registry import download_model

    try:
        model = download_model(spec, tracking_uri, Path(cache))
    except ValueError as e:
        raise UserError(str(e)) from None
    if not model.interface.get("kind"):
        raise UserError(f"{model.version} is a pretrained model ({model.interface.get('task')}), which answers no "
                        f"task; batch predictions need a fine-tuned model (the finetune stage's champion)")
    ref = ModelRef(model.uri, tracking_uri, cache, model.interface["kind"], (), _outputs(model.outputs),
                   model.identity)
    return ref, tuple(model.interface["inputs"]), model.hf, model


def _directory_model(path: str, cache: str) -> tuple[ModelRef, tuple[str, ...], Path, None]:
    from stages.finetune.kinds import KINDS

    path = os.path.abspath(path)
    if not Path(path, "config.json").is_file():
        raise UserError(f"MODEL {path} is not an HF export (no config.json); give the finetune stage's hf/ "
                        f"directory or a registry version (models:/NAME@champion)")
    config = json.loads(Path(path, "config.json").read_text())
    arch = (config.get("architectures") or [""])[0]
    kind = next((k for k in KINDS.values() if arch.endswith(k.hf_auto.removeprefix("AutoModel"))), None)
    if kind is None or not kind.input_columns:
        raise UserError(f"MODEL {path}: {arch or 'no architecture'} is not a fine-tuned head of a task kind "
                        f"({', '.join(k.hf_auto.removeprefix('Auto') for k in KINDS.values())}); batch predictions "
                        f"answer a task")
    problem = "regression" if config.get("problem_type") == "regression" or config.get("num_labels") == 1 else ""
    outputs = kind.signature_outputs(_Problem(problem or kind.problems[0]))
    digest = hashlib.sha256("".join(file_digest(p) for p in sorted(Path(path).iterdir()) if p.is_file()).encode())
    version = f"{path}#sha256:{digest.hexdigest()[:16]}"
    ref = ModelRef(path, "", cache, type(kind).__module__, (), _outputs(outputs), version)
    return ref, kind.input_columns, Path(path), None


@dataclass(frozen=True)
class _Problem:
    """What a kind's `signature_outputs` reads of a task, for a directory that comes without one."""

    problem: str


def _outputs(outputs) -> tuple:
    return tuple((f.name, f.type) for f in answer_schema(outputs))


def columns_of(inputs: tuple[str, ...], optional: tuple[str, ...], given: list[str]) -> tuple[tuple[str, str], ...]:
    """(model column, input field) for every column the model reads; `given`: the --column MODEL_COLUMN=FIELD."""
    fields: dict[str, str] = {}
    for item in given:
        column, sep, field = item.partition("=")
        if not sep or not column or not field:
            raise UserError(f"--column {item!r}: write MODEL_COLUMN=FIELD, e.g. --column sentence1=text")
        if column not in inputs + optional:
            raise UserError(f"--column {item}: the model does not read a column {column!r}; it reads "
                            f"{list(inputs)}" + (f" (and optionally {list(optional)})" if optional else ""))
        fields[column] = field
    names = list(inputs) + [c for c in optional if c in fields]
    return tuple((c, fields.get(c, c)) for c in names)


# ----------------------------------------------------------------------------------------------- input, output

def list_input(pattern: str, columns: tuple[tuple[str, str], ...]) -> tuple[tuple[str, int, int], ...]:
    """The input's files (the corpus stage's listing), with the first record checked for the model's fields."""
    from stages.corpus.ingest import file_kind, list_sources, read_fields

    try:
        files = list_sources([pattern])
    except StageInputError as e:
        raise UserError(str(e).replace("corpus ", "input ", 1).replace("--corpus", "--input")) from None
    fields = [f for _, f in columns]
    for path, _, _ in files:
        fmt, _ = file_kind(path)
        if fmt == "txt" and len(fields) > 1:
            raise UserError(f"{path}: a .txt file holds one text per line, and the model reads {len(fields)} "
                            f"columns {[c for c, _ in columns]}; give them as JSONL fields or Parquet columns")
    first = files[0][0]
    for index, values, reason in read_fields(first, fields, 1 << 24):
        if values is None:
            missing = [f"--column {c}=FIELD" for c, f in columns if f"{f!r}" in (reason or "")]
            raise UserError(f"{first}: {reason}; the model reads {[c for c, _ in columns]}" +
                            (f": name the input's field with {' '.join(missing)}" if missing else ""))
        break
    return tuple(files)


def finished(output: str) -> dict | None:
    """The manifest of a finished output at `output` (its marker there), else None."""
    if storage.is_uri(output):
        import pyarrow.fs as pafs

        fs, root = storage.filesystem(output)
        if fs.get_file_info(f"{root}/{SUCCESS}").type != pafs.FileType.File:
            return None
        return json.loads(fs.open_input_stream(f"{root}/{MANIFEST}").read())
    if not Path(output, SUCCESS).is_file():
        return None
    return json.loads(Path(output, MANIFEST).read_text())


def plan(args: argparse.Namespace) -> Job:
    """Every check before Ray starts; `done` when a finished output of the same key is there."""
    if args.batch_size < 1 or args.actors < 0 or args.cpus_per_actor < 0 or args.gpus_per_actor < 0:
        raise UserError("--batch-size must be >= 1, --actors, --cpus-per-actor and --gpus-per-actor >= 0")
    ref, inputs, hf, model = resolve_model(args.model, args.cache)
    # a registered model's signature names every column it reads; a directory's are its kind's
    optional = () if model else importlib.import_module(ref.kind).KIND.optional_columns
    lineage = (model.model_id, model.version) if model else ("", "")
    columns = columns_of(inputs, optional, args.column)
    files = list_input(args.input, columns)
    ref = replace(ref, columns=columns, backend=args.backend, threads=max(1, int(args.cpus_per_actor)))
    key = artifact_id("predict", VERSION, {"model": ref.version, "backend": args.backend, "columns": columns},
                      {"input": hashlib.sha256(json.dumps(files).encode()).hexdigest()})
    try:
        manifest = finished(args.output)
    except (OSError, ValueError) as e:
        raise UserError(f"output {args.output}: {storage.store_fix(e)}") from None
    if manifest is not None and manifest.get("key") == key and not args.force:
        return Job(ref, files, args.output, key, *lineage, done=True)
    if manifest is not None and not args.force:
        raise UserError(f"output {args.output} holds predictions of another input or model ({manifest.get('model')}, "
                        f"{manifest.get('input')}); choose another --output, or pass --force to replace them")
    if args.backend == "onnx":
        _check_onnx(hf, ref, files[0][0])
    return Job(ref, files, args.output, key, *lineage)


def _check_onnx(hf: Path, ref: ModelRef, first: str) -> None:
    """The ONNX export the actors will run (`pipeline.predictor.onnx_file`: the version's own, else one exported here
    once), checked against torch on the input's first rows as the kind encodes them; refused when it differs
    (`deberta.onnx_export.check`)."""
    import importlib
    import itertools

    import transformers

    from deberta import onnx_export
    from pipeline.predictor import onnx_file
    from stages.corpus.ingest import read_fields

    try:
        path, origin = onnx_file(ref)
        records = itertools.islice(read_fields(first, [f for _, f in ref.columns], 1 << 24), ONNX_SAMPLE)
        rows = [v for _, v, _ in records if v is not None]
        kind = importlib.import_module(ref.kind).KIND
        settings = json.loads((hf / "config.json").read_text())
        tok = transformers.AutoTokenizer.from_pretrained(str(hf))
        settings.setdefault("max_seq_len", tok.model_max_length)
        columns = {c: [r[j] for r in rows] for j, (c, _) in enumerate(ref.columns)}
        diff = onnx_export.check(hf, path, kind.encode_inputs(tok, columns, settings).ids)
    except ValueError as e:
        raise UserError(str(e)) from None
    print(f"onnx: {path}, {origin} (logits within {diff:.1e} of torch on {len(rows)} input rows)")


# ----------------------------------------------------------------------------------------------- the run

def run(job: Job, args: argparse.Namespace) -> dict:
    """Ray Data: files -> rows -> the actor pool's answers -> Parquet shards, published with manifest and marker."""
    import ray

    from cluster.ray_init import connect
    from core.config import RayConfig
    from pipeline.predictor import Predictor, read_rows

    print(connect(RayConfig(dashboard=False)))
    resources = ray.cluster_resources()
    if args.gpus_per_actor:
        actors = args.actors or max(1, int(resources.get("GPU", 0) // args.gpus_per_actor))
    else:
        actors = args.actors or max(1, int(resources.get("CPU", 1) // max(args.cpus_per_actor, 1e-9)))
    # Ray Data merges a task's yields into blocks of up to 128 MiB, and a block goes to one actor whole: small
    # blocks let every actor of the pool take a share of one large file (a streaming repartition would need a CPU
    # the actors hold); the shards are made larger again by write_parquet's min_rows_per_file
    ray.data.DataContext.get_current().target_max_block_size = BLOCK_BYTES
    started = time.time()
    files = ray.data.from_items([{"path": p} for p, _, _ in job.files], override_num_blocks=len(job.files))
    rows = files.map_batches(read_rows, fn_kwargs={"ref": job.ref, "rows": args.batch_size}, batch_size=1, batch_format="pyarrow",
                             num_cpus=0)  # reading is light beside the model; the actors hold the CPUs
    answers = rows.map_batches(Predictor, fn_constructor_kwargs={"ref": job.ref}, batch_size=args.batch_size,
                               batch_format="pyarrow", compute=ray.data.ActorPoolStrategy(size=actors),
                               num_cpus=args.cpus_per_actor, num_gpus=args.gpus_per_actor or None)
    manifest = {"key": job.key, "model": job.ref.version, "registered": job.version, "input": args.input,
                "backend": job.ref.backend, "columns": dict(job.ref.columns), "actors": actors,
                "batch_size": args.batch_size, "files_in": len(job.files), "code_version": code_version()}
    publish(answers, job.output, manifest, args.force)
    manifest = finished(job.output)
    manifest["seconds"] = round(time.time() - started, 2)
    return manifest


def publish(ds, output: str, manifest: dict, force: bool) -> None:
    """Write the shards, then manifest.json, then `_SUCCESS`: locally into a sibling directory renamed into place,
    in object storage under the prefix itself (cleared first), where the marker written last makes it visible."""
    import pyarrow.fs as pafs

    if storage.is_uri(output):
        fs, root = storage.filesystem(output)
        if fs.get_file_info(f"{root}/{SUCCESS}").type == pafs.FileType.File:
            fs.delete_file(f"{root}/{SUCCESS}")  # --force: the old marker first, so no reader takes a mixture
        if fs.get_file_info(root).type == pafs.FileType.Directory:
            fs.delete_dir_contents(root)
        ds.write_parquet(output, min_rows_per_file=SHARD_ROWS, ray_remote_args=WRITE)
        _finish(fs, root, manifest)
        return
    final = Path(output).absolute()
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".{final.name}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        ds.write_parquet(str(tmp), min_rows_per_file=SHARD_ROWS, ray_remote_args=WRITE)
        _finish(*storage.filesystem(tmp), manifest)
        if final.exists():  # an old output (--force) or an incomplete one: moved aside, then removed
            aside = final.parent / f".{final.name}.old-{uuid.uuid4().hex[:8]}"
            os.rename(final, aside)
            os.rename(tmp, final)
            shutil.rmtree(aside, ignore_errors=True)
        else:
            os.rename(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _finish(fs, root: str, manifest: dict) -> None:
    """manifest.json (each shard's bytes and rows, the rows answered) then the marker."""
    import pyarrow.fs as pafs
    import pyarrow.parquet as pq

    files, rows, answered = {}, 0, 0
    for info in fs.get_file_info(pafs.FileSelector(root, recursive=True)):
        if info.type == pafs.FileType.File and info.path.endswith(".parquet"):
            with fs.open_input_file(info.path) as f:
                pf = pq.ParquetFile(f)
                n = pf.metadata.num_rows
                answered += pf.read(columns=[REASON]).column(0).null_count  # no reason: answered
            files[info.path[len(root.rstrip("/")) + 1:]] = {"bytes": info.size, "rows": n}
            rows += n
    full = dict(manifest, files=files, rows=rows, answered=answered, created_at=time.strftime("%Y-%m-%dT%H:%M:%S%z"))
    with fs.open_output_stream(f"{root}/{MANIFEST}") as out:
        out.write(json.dumps(full, indent=2, sort_keys=True).encode())
    with fs.open_output_stream(f"{root}/{SUCCESS}") as out:
        out.write(b"")


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        job = plan(args)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if job.done:
        print(f"{job.output}: finished predictions of this input and model are there ({job.key}); nothing to do")
        return 0
    result = run(job, args)
    rate = result["rows"] / max(result["seconds"], 1e-9)
    by = f"{job.version} ({job.ref.version})" if job.version else job.ref.version
    print(f"{result['rows']} rows ({result['answered']} answered) by {by} with {result['actors']} "
          f"actor(s) in {result['seconds']:.1f} s ({rate:.0f} rows/s) -> {job.output}")
    if os.environ.get("MLFLOW_TRACKING_URI"):
        from core.registry import log_prediction

        run_id = log_prediction(os.environ["MLFLOW_TRACKING_URI"], "predict", job.version or job.ref.version,
                                job.model_id, args.input, job.key, job.output,
                                {"backend": job.ref.backend, "batch_size": args.batch_size,
                                 "actors": result["actors"], "columns": dict(job.ref.columns)},
                                {"rows": result["rows"], "answered": result["answered"],
                                 "rows_per_s": rate})
        print(f"lineage: MLflow run {run_id}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
