"""What runs inside Ray for `python -m pipeline.predict`: input files -> rows of the model's input columns (the corpus
stage's readers, `stages.corpus.ingest.read_fields`), and the actor that answers them, one model per actor, with
the model's own task kind: `encode_inputs` -> the export's forward in the dev metrics' batches (`forward_rows`) ->
`answers`, the calls the registered model's pyfunc makes (core/hf_pyfunc.py) and the dev metrics run.

An output row: `row_id` (the corpus stage's id of the same record: `doc_id(source, index)`), `source`, `index`,
the kind's answer columns (its registered signature's), `model_version` (what the model is: `ModelRef.version`),
and `reason` (null when answered; why a record was not, e.g. a JSONL line without the field, then its answer
columns are null).
"""

from __future__ import annotations

import importlib
import json
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import pyarrow as pa

from stages.corpus.ingest import doc_id, read_fields

ROW_ID, SOURCE, INDEX, VERSION, REASON = "row_id", "source", "index", "model_version", "reason"
MAX_RECORD_BYTES = 8 << 20  # a record longer than this is refused with its reason (the corpus stage's default)

_ARROW = {"string": pa.string(), "double": pa.float64(), "float": pa.float32(), "long": pa.int64(),
          "integer": pa.int32(), "boolean": pa.bool_()}


def arrow_type(spec: dict[str, Any]) -> pa.DataType:
    """An MLflow schema JSON column type -> the Arrow type of its Parquet column."""
    if spec["type"] == "array":
        return pa.list_(arrow_type(spec["items"]))
    if spec["type"] == "object":
        return pa.struct([(k, arrow_type(v)) for k, v in spec["properties"].items()])
    return _ARROW[spec["type"]]


def answer_schema(outputs: list[dict[str, Any]]) -> pa.Schema:
    """The answer columns as Arrow, from the model's signature outputs: every shard has the same schema (a batch
    without entities would otherwise infer `list<null>`)."""
    return pa.schema([(o["name"], arrow_type(o)) for o in outputs])


@dataclass(frozen=True)
class ModelRef:
    """What an actor needs to load the model: picklable, no MLflow objects."""

    uri: str
    """An immutable model URI (models:/<model_id>, runs:/...: `core.registry.PredictionModel.uri`), downloaded into
    `cache` on each node, or an HF export directory every node can read."""
    tracking_uri: str
    cache: str
    kind: str
    """The module of the task kind that predicts (the model's interface `kind`)."""
    columns: tuple[tuple[str, str], ...]
    """(the model's input column, the input's field it is read from), in the model's order."""
    outputs: tuple[tuple[str, Any], ...]
    """The answer schema as (name, Arrow type)."""
    version: str
    """The `model_version` column, what the model is: models:/<model_id> for a logged model (a registry version's),
    else its URI at its tracking server, or the directory and its digest."""
    backend: str = "torch"
    threads: int = 0
    """torch / onnxruntime threads per actor (0: the library's default)."""


def hf_dir(ref: ModelRef) -> Path:
    """The HF export of the model on this node (a registry model is downloaded once per node)."""
    if ref.tracking_uri:
        from core.registry import download_model

        return download_model(ref.uri, ref.tracking_uri, Path(ref.cache)).hf
    return Path(ref.uri)


def onnx_file(ref: ModelRef) -> tuple[Path, str]:
    """The ONNX export the actors run on this node, and where it came from: a registry version's own (its artifact
    `onnx`, which the finetune stage exported and checked against torch); else, for an HF directory or a version
    logged without one, an export of the HF directory made once per node under the cache (`deberta.onnx_export`)."""
    import hashlib

    from deberta import onnx_export

    if ref.tracking_uri:
        from core.registry import download_model

        model = download_model(ref.uri, ref.tracking_uri, Path(ref.cache))
        if model.onnx is not None and (model.onnx / onnx_export.FILE).is_file():
            return model.onnx / onnx_export.FILE, "the version's own"
        hf, origin = model.hf, "exported here from the version's hf/ (the version carries no onnx/)"
    else:
        hf, origin = Path(ref.uri), "exported here from the directory"
    out = Path(ref.cache) / "onnx" / hashlib.sha256(ref.version.encode()).hexdigest()[:16]
    if (out / onnx_export.FILE).is_file():  # renamed into place whole by `export`: present means complete
        return out / onnx_export.FILE, origin.replace("exported here", "exported earlier")
    return onnx_export.export(hf, out), origin


def read_rows(batch: pa.Table, ref: ModelRef, rows: int) -> Iterator[pa.Table]:
    """Ray Data batch function: files (column `path`) -> rows of the model's input columns, in blocks of `rows` (an
    actor's batch: a block is the unit the pool hands out, so a larger one would keep the other actors idle)."""
    names = [c for c, _ in ref.columns]
    for path in batch.column("path").to_pylist():
        pending: list[tuple[int, list | None, str | None]] = []
        for record in read_fields(path, [f for _, f in ref.columns], MAX_RECORD_BYTES):
            pending.append(record)
            if len(pending) == rows:
                yield _rows(path, pending, names)
                pending = []
        if pending:
            yield _rows(path, pending, names)


def _rows(path: str, records: list[tuple[int, list | None, str | None]], names: list[str]) -> pa.Table:
    cols: dict[str, Any] = {ROW_ID: [doc_id(path, i) for i, _, _ in records], SOURCE: [path] * len(records),
                            INDEX: pa.array([i for i, _, _ in records], pa.int64())}
    for j, name in enumerate(names):
        values = [v[j] if v is not None else None for _, v, _ in records]
        listed = any(isinstance(v, list) for v in values)  # a list of texts per row (multiple-choice options)
        cols[name] = pa.array(values, pa.list_(pa.large_string()) if listed else pa.large_string())
    cols[REASON] = pa.array([r for _, _, r in records], pa.string())
    return pa.table(cols)


def kind_answers(kind, tokenizer, forward, columns: dict[str, list[str]], settings: dict[str, Any]) -> list[dict]:
    """The kind's prediction path, as the registered model runs it (core/hf_pyfunc.py `_kind_answers`)."""
    rows = kind.encode_inputs(tokenizer, columns, settings)
    return kind.answers(kind.forward_rows(forward, rows.ids), rows, settings)


class Predictor:
    """A Ray Data actor: one model, loaded once; each batch of rows -> their answers (a pyarrow Table)."""

    def __init__(self, ref: ModelRef):
        import torch
        import transformers

        path = hf_dir(ref)
        self.ref, self.kind = ref, importlib.import_module(ref.kind).KIND
        self.tokenizer = transformers.AutoTokenizer.from_pretrained(str(path))
        self.settings = json.loads((path / "config.json").read_text())
        self.settings.setdefault("max_seq_len", self.tokenizer.model_max_length)
        self.schema = pa.schema(list(ref.outputs))
        if ref.threads:
            torch.set_num_threads(ref.threads)
        if ref.backend == "onnx":
            from deberta import onnx_export

            sess = onnx_export.session(onnx_file(ref)[0], ref.threads)

            def forward(ids, mask):  # (B, T) -> the kind's logits, from onnxruntime's named outputs
                out = onnx_export.run(sess, ids.numpy(), mask.numpy())
                return self.kind.hf_logits(types.SimpleNamespace(**{k: torch.from_numpy(v) for k, v in out.items()}))
        else:
            model = getattr(transformers, self.kind.hf_auto).from_pretrained(str(path)).eval()  # as the pyfunc

            def forward(ids, mask):
                return self.kind.hf_logits(model(input_ids=ids, attention_mask=mask))
        self.forward = forward

    def __call__(self, batch: pa.Table) -> pa.Table:
        reasons = batch.column(REASON).to_pylist()
        good = [i for i, r in enumerate(reasons) if r is None]
        answers: list[dict | None] = [None] * batch.num_rows
        if good:
            taken = batch.take(good)
            columns = {c: taken.column(c).to_pylist() for c, _ in self.ref.columns}
            for i, a in zip(good, kind_answers(self.kind, self.tokenizer, self.forward, columns, self.settings)):
                answers[i] = a
        out = batch.select([ROW_ID, SOURCE, INDEX])
        for field in self.schema:
            out = out.append_column(field, pa.array([a.get(field.name) if a else None for a in answers], field.type))
        out = out.append_column(VERSION, pa.array([self.ref.version] * batch.num_rows, pa.string()))
        return out.append_column(REASON, pa.array(reasons, pa.string()))
