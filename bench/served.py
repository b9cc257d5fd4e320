"""Served is measured: for each task kind, the registered champion's own predictions on its task's dev set, scored
by the metric code, against the dev metric the sweep logged for it, on the default (debug) preset as a user runs it.

    unshare --net sh -c 'ip link set lo up && .venv/bin/python -m bench.served'     # ~15 min on 2 cores

One workdir, six `python -m pipeline.run --task ...` runs (the first builds corpus, vocab, tokenize and
pretraining; the others reuse them): `rotten-tomatoes` (sequence), `wnut16-ner` and a rule-tagged copy of its tweets
(token; `tweet_names_dir`), two SQuAD v2.0 directories passed as typed (span: half and three quarters of the dev
questions unanswerable) and `rotten-tomatoes-choice` (choice) on the preset's defaults. The v2.0 tasks are real
records: the SQuAD v1.1 and Quoref questions allennlp 0.9.0 ships among its test fixtures, each split's questions
also asked of one context of another article (no answer there, by construction), as
tests/integration/test_finetune_kinds.py builds it, or of three (`squad_v2_dir`). Each champion is loaded
as users load it (`mlflow.pyfunc.load_model("models:/...@champion")`), fed the dev set as raw columns (sentences;
words joined by single spaces; question + context), and its answers scored independently of the stage: accuracy
from the labels, entity F1 from the served entities read back as word tags, SQuAD v2.0 F1 from the answers,
multiple-choice accuracy from the answered option texts.
Writes bench/results/served.json (or `--json PATH`) and a table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import RESULTS, command_line, emit, load_average

FIXTURES = "allennlp/tests/fixtures/data"


def squad_v2_dir(root: Path, name: str = "squad-v2", elsewhere: int = 1) -> Path:
    """A SQuAD v2.0 task directory from real records (module docstring): each split's own questions are also asked
    of `elsewhere` contexts of other articles (no answer there). 1: half the dev questions unanswerable; 3: three
    quarters (the third context is the QuAC sample's, allennlp's `quac_sample.json`), where "never answer" is a
    champion a small model reaches at every epoch, each with its own threshold."""
    from core.datasets import site_packages_file

    paragraphs = []
    for file in ("squad.json", "quoref/quoref_sample.json"):
        for article in json.loads(site_packages_file(f"{FIXTURES}/{file}").read_text())["data"]:
            for para in article["paragraphs"]:
                qas = [{**qa, "answers": qa["answers"][:1]} for qa in para["qas"]]
                for a in (a for qa in qas for a in qa["answers"] if a["text"] == "Father Julius Nieuwl"):
                    a["text"] = "Father Julius Nieuwland"  # allennlp's copy cut the name short
                paragraphs.append({"context": para["context"], "qas": qas})
    notre_dame, quoref = paragraphs[:2], paragraphs[2:]
    quac = json.loads(site_packages_file(f"{FIXTURES}/quac_sample.json").read_text())["data"][0]["paragraphs"][0]
    others = {"train": [notre_dame[1], quac, quoref[0]], "dev": [quoref[0], quac, quoref[1]]}
    d = root / name
    d.mkdir(parents=True)
    for split, ps in (("train", [notre_dame[0], *quoref]), ("dev", [notre_dame[1]])):
        asked = notre_dame[0] if split == "train" else notre_dame[1]
        elsewhere_paras = [{"context": other["context"], "qas": [
            {"id": f"{qa['id']}-elsewhere{i}", "question": qa["question"], "answers": [], "is_impossible": True}
            for qa in asked["qas"]]} for i, other in enumerate(others[split][:elsewhere])]
        doc = {"version": "v2.0", "data": [{"title": "t", "paragraphs": [*ps, *elsewhere_paras]}]}
        (d / f"{split}.json").write_text(json.dumps(doc))
    return d


def tweet_names_dir(root: Path, train: int | None = None, dev: int | None = None) -> Path:
    """The WNUT-2016 tweets (the built-in's train and dev split) tagged by a rule the debug model learns, so the
    token row compares entities that exist (on WNUT's own tags the debug model tags none): a word starting with @
    or # followed by a letter or digit is a one-word `handle`; a run of words starting with an upper-case letter a
    `cap` entity. `train` / `dev`: the first that many tweets of each split (all by default); the token sweep test
    of tests/integration/test_finetune_kinds.py takes 400 and 120."""
    import re

    from stages.finetune.tasks import resolve_task

    task = resolve_task("wnut16-ner")
    d = root / "tweet-names"
    d.mkdir(parents=True)
    for split, sentences in (("train", task.train.words[:train]), ("dev", task.dev.words[:dev])):
        lines = []
        for words in sentences:
            prev = "O"
            for w in words:
                tag = ("B-handle" if re.match(r"[@#]\w", w) else
                       ("I-cap" if prev.endswith("-cap") else "B-cap") if w[:1].isupper() else "O")
                lines.append(f"{w}\t{tag}")
                prev = tag
            lines.append("")
        (d / f"{split}.conll").write_text("\n".join(lines))
    return d


def served_metric(model, task) -> float:
    """The champion's dev metric from its served answers, scored here (not by the stage's code path)."""
    import numpy as np
    import pandas as pd

    from stages.finetune.kinds import squad_eval
    from stages.finetune.kinds.entities import entity_scores

    if task.problem in ("classification", "regression"):
        columns = {"sentence1": list(task.dev.text_a)}
        if task.dev.text_b is not None:
            columns["sentence2"] = list(task.dev.text_b)
        out = model.predict(pd.DataFrame(columns))
        if task.problem == "regression":  # Pearson's r of the served scores (numpy's, not the stage's scipy)
            return float(np.corrcoef(out["score"].to_numpy(float), np.asarray(task.dev.label, float))[0, 1])
        return float(np.mean([p == task.labels[int(y)] for p, y in zip(out["label"], task.dev.label)]))
    if task.problem == "choice":
        out = model.predict(pd.DataFrame({"context": list(task.dev.context), "question": list(task.dev.question),
                                          "options": [list(o) for o in task.dev.options]}))
        return float(np.mean([a == o[y] for a, o, y in zip(out["answer"], task.dev.options, task.dev.label)]))
    if task.problem == "token":
        texts = [" ".join(words) for words in task.dev.words]
        served = []
        for words, ents in zip(task.dev.words, model.predict(pd.DataFrame({"text": texts}))["entities"]):
            starts = np.cumsum([0] + [len(w) + 1 for w in words[:-1]])
            first = {int(a): i for i, a in enumerate(starts)}
            last = {int(a) + len(w): i for i, (a, w) in enumerate(zip(starts, words))}
            tags = ["O"] * len(words)
            for e in ents:  # a span that is not whole words would raise KeyError: served entities are words
                a, b = first[e["start"]], last[e["end"]]
                tags[a:b + 1] = [f"B-{e['entity_group']}"] + [f"I-{e['entity_group']}"] * (b - a)
            served.append(tags)
        return float(entity_scores([[task.labels[t] for t in tags] for tags in task.dev.tags], served)["f1"])
    questions = task.dev.questions
    out = model.predict(pd.DataFrame({"question": [q.question for q in questions],
                                      "context": [q.context for q in questions]}))
    version = task.option("version")
    return float(np.mean([squad_eval.f1(a, [t for t, _ in q.answers], version)
                          for q, a in zip(questions, out["answer"])]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workdir", type=Path, default=None, help="default: a temporary directory")
    ap.add_argument("--json", type=Path, default=RESULTS / "served.json")
    args = ap.parse_args()
    import mlflow

    from core.lineage import default_tracking_uri
    from stages.finetune.tasks import resolve_task

    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="bench-served-"))
    squad = squad_v2_dir(workdir / "tasks") if not (workdir / "tasks" / "squad-v2").is_dir() else \
        workdir / "tasks" / "squad-v2"
    unanswerable = workdir / "tasks" / "squad-v2-unanswerable"
    if not unanswerable.is_dir():
        squad_v2_dir(workdir / "tasks", unanswerable.name, elsewhere=3)
    tweets = tweet_names_dir(workdir / "tasks") if not (workdir / "tasks" / "tweet-names").is_dir() else \
        workdir / "tasks" / "tweet-names"
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "MLFLOW_TRACKING_URI")}
    rows = []
    for spec, name in (("rotten-tomatoes", "rotten-tomatoes"), ("wnut16-ner", "wnut16-ner"),
                       (str(tweets), "tweet-names"), (str(squad), "squad-v2"),
                       (str(unanswerable), "squad-v2-unanswerable"),
                       ("rotten-tomatoes-choice", "rotten-tomatoes-choice")):
        started = time.time()
        res = subprocess.run([sys.executable, "-m", "pipeline.run", "--workdir", str(workdir), "--task", spec],
                             env=env, capture_output=True, text=True)
        if res.returncode != 0:
            raise SystemExit(f"pipeline.run --task {spec} failed ({res.returncode}):\n{res.stderr[-3000:]}")
        task = resolve_task(spec)
        mlflow.set_tracking_uri(default_tracking_uri(workdir))
        version = mlflow.MlflowClient().get_model_version_by_alias(f"deberta-debug-{name}", "champion")
        metric = f"dev_{task.metric}"
        model = mlflow.pyfunc.load_model(f"models:/deberta-debug-{name}@champion")
        rows.append({"task": name, "kind": task.kind.name, "metric": metric, "dev_examples": len(task.dev),
                     "logged": float(version.tags[metric]), "served": round(served_metric(model, task), 6),
                     "baseline": float(version.tags["baseline"]), "best_epoch": int(version.tags["best_epoch"]),
                     **({"null_threshold": float(version.tags["dev_null_threshold"]),
                         "unanswerable": sum(not q.answers for q in task.dev.questions)}
                        if "dev_null_threshold" in version.tags else {}),
                     "run_s": round(time.time() - started, 1)})
    report = {"bench": "served", "command": command_line(), "preset": "debug", "load_average": load_average(),
              "workdir": str(workdir), "tasks": {r["task"]: r for r in rows}}
    lines = ["| kind | task | dev examples | metric | logged | served | baseline | epoch |",
             "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['kind']} | {r['task']} | {r['dev_examples']} | {r['metric']} | {r['logged']:.4f} | "
              f"{r['served']:.4f} | {r['baseline']:.4f} | {r['best_epoch']} |" for r in rows]
    emit(report, args.json, "\n".join(lines))


if __name__ == "__main__":
    main()
