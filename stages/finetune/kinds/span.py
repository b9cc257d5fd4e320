"""The span kind: extractive question answering (SQuAD v1.1 and v2.0; DeBERTa §5.2, Table 3).

Format (a task directory): `train.json` and `dev.json` in SQuAD's layout, {"version", "data": [{"title",
"paragraphs": [{"context", "qas": [{"id", "question", "answers": [{"text", "answer_start"}], "is_impossible"}]}]}]}.
v2.0 adds unanswerable questions (`is_impossible`, no answers); the version is the files' (or task.json
{"kind": "span", "version": "1.1" | "2.0"}, which then refuses a v2.0 file given to a v1.1 task).

Features (transformers' run_qa.py): question + context through the export's fast tokenizer, the context cut
into windows of `max_seq_len` overlapping by `doc_stride` pieces, each piece's character offsets kept. A window's
target is the answer's first and last piece, or [CLS] (position 0) when the question has no answer or the answer
is not wholly inside the window. Head: start and end logits (`deberta.heads.DebertaForQuestionAnswering`).
Span search (BERT's run_squad.py): over each question's windows, the best start + end score with start <= end,
both in the context, at most `max_answer_len` pieces, among the 20 best starts and ends; for v2.0 the no-answer
score is the smallest [CLS] start + end score over the windows, and "no answer" is predicted when it beats the
best span by more than a threshold chosen on dev (`null_threshold`: the official v2.0 script's search, over
logit differences rather than probabilities).
Metrics: exact match and F1 per question as the official SQuAD scripts compute them (`squad_eval.py`), averaged
as fractions (the scripts print percentages), with HasAns/NoAns for v2.0. Baseline: the context sentence sharing
most words with the question (a sliding-window baseline's simplest form; Rajpurkar et al. 2016 §5), for v2.0 that
or no answer at all, whichever scores better on dev.
The registered model reads `question` and `context` and answers `answer`, `score`, `start`, `end` (character
offsets into the context; an empty answer for "no answer").
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from core.errors import StageInputError
from stages.finetune.kinds.base import (Encoded, TaskKind, TaskRef, check_stride, fast_tokenizer, make_task, split_file,
                                        task_name)
from stages.finetune.kinds.squad_eval import exact_match, f1, get_raw_scores

if TYPE_CHECKING:
    import torch

    from core.config import FinetuneConfig

N_BEST = 20
METRICS = ("f1", "exact")


@dataclass(frozen=True)
class QA:
    """One question on its context; answers as (text, character start); none for an unanswerable one."""

    id: str
    question: str
    context: str
    answers: tuple[tuple[str, int], ...]


@dataclass(frozen=True)
class SpanSplit:
    questions: tuple[QA, ...]

    def __len__(self) -> int:
        return len(self.questions)


# ----------------------------------------------------------------------------------------------- reading

def _line_of(text: str, needle: str) -> int:
    """1-based line of the first occurrence of `needle` in `text` (1 when absent)."""
    at = text.find(needle)
    return text.count("\n", 0, at) + 1 if at >= 0 else 1


def read_squad(path: Path) -> tuple[list[QA], str]:
    """(questions, version) of a SQuAD JSON file; every answer checked against its context."""
    raw = path.read_text(encoding="utf-8")
    try:
        doc = json.loads(raw)
    except json.JSONDecodeError as e:
        raise StageInputError(f"{path} line {e.lineno} is not JSON ({e.msg}); span tasks read SQuAD's JSON") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("data"), list):
        raise StageInputError(f"{path} has no 'data' list; span tasks read SQuAD's layout "
                              f"{{\"version\", \"data\": [{{\"paragraphs\": [...]}}]}}")
    questions, impossible = [], False
    for article in doc["data"]:
        for para in article.get("paragraphs", []):
            context = para["context"]
            for qa in para.get("qas", []):
                qid = str(qa["id"])
                answers = []
                for a in [] if qa.get("is_impossible") else qa.get("answers", []):
                    start, text = int(a["answer_start"]), a["text"]
                    if context[start:start + len(text)] != text:
                        raise StageInputError(
                            f"{path} line {_line_of(raw, qid)}: question {qid}'s answer_start {start} does not point "
                            f"at its text {text!r} (the context there reads {context[start:start + len(text)]!r}); "
                            f"fix answer_start")
                    answers.append((text, start))
                impossible |= bool(qa.get("is_impossible")) or not answers
                questions.append(QA(qid, qa["question"], context, tuple(answers)))
    version = "2.0" if impossible or str(doc.get("version", "")).lstrip("v").startswith("2") else "1.1"
    return questions, version


def squad_task(name: str, files: dict[str, Path], meta: dict[str, Any]) -> TaskRef:
    read = {s: read_squad(f) for s, f in files.items()}
    versions = {s: v for s, (_, v) in read.items()}
    stated = str(meta.get("version", "")).lstrip("v")
    if stated and stated not in ("1.1", "2.0"):
        raise StageInputError(f"task.json version={meta['version']!r}: use \"1.1\" or \"2.0\"")
    if stated == "1.1" and "2.0" in versions.values():
        bad = next(s for s, v in versions.items() if v == "2.0")
        raise StageInputError(f"{files[bad]} is SQuAD v2.0 (it has unanswerable questions) but task.json says "
                              f"version 1.1; set \"version\": \"2.0\" or drop the unanswerable questions")
    version = stated or ("2.0" if "2.0" in versions.values() else "1.1")
    for s, (qs, _) in read.items():
        if not qs:
            raise StageInputError(f"{files[s]} holds no questions; a span task needs questions in {s}")
    splits = {s: SpanSplit(tuple(qs)) for s, (qs, _) in read.items()}
    return make_task(name, "span", meta.get("metric", "f1"), (), splits["train"], splits["dev"],
                     str(files["train"].parent), METRICS, {"version": version}, kind=KIND)


# ----------------------------------------------------------------------------------------------- features

@dataclass(frozen=True)
class SpanRows:
    """What the span search needs per dev row."""

    question: np.ndarray  # (N,) the question of each row
    offsets: np.ndarray  # (N, T, 2) character span of each context piece in the context, -1 elsewhere
    golds: tuple[tuple[str, ...], ...]  # answer texts per question (empty: no answer)
    contexts: tuple[str, ...]
    version: str
    max_answer_len: int


def question_budget(max_len: int) -> int:
    """Pieces a question may take: a long one keeps its first pieces, the context gets at least the rest."""
    return max_len // 2 - 2


def context_room(max_len: int) -> int:
    """Pieces of context a window holds at least: what the question leaves, less [CLS] and two [SEP]."""
    return max_len - question_budget(max_len) - 3


def encode_questions(fast, questions: tuple[QA, ...], max_len: int, stride: int):
    """(ids (N, T), context offsets (N, T, 2) with -1 outside the context, question of each row (N,))."""
    q_budget = question_budget(max_len)
    pieces = fast([qa.question for qa in questions], add_special_tokens=False, return_offsets_mapping=True,
                  verbose=False)["offset_mapping"]  # one batched call: the Rust tokenizer's threads, no Python loop
    texts = [qa.question if len(offs) <= q_budget else qa.question[:offs[q_budget - 1][1]]
             for qa, offs in zip(questions, pieces)]
    enc = fast(texts, [qa.context for qa in questions], truncation="only_second", max_length=max_len,
               stride=stride, return_overflowing_tokens=True, return_offsets_mapping=True, padding="max_length")
    ids = np.asarray(enc["input_ids"], dtype=np.int32)  # (N, T)
    offsets = np.asarray(enc["offset_mapping"], dtype=np.int32)  # (N, T, 2)
    for i in range(len(ids)):
        outside = np.asarray([s != 1 for s in enc.sequence_ids(i)])
        offsets[i, outside] = -1
    return ids, offsets, np.asarray(enc["overflow_to_sample_mapping"], dtype=np.int64)


def targets(offsets: np.ndarray, answers: tuple[tuple[str, int], ...]) -> tuple[int, int]:
    """(start, end) piece of the first answer within one row, or (0, 0) ([CLS]) when it is not wholly inside."""
    if not answers:
        return 0, 0
    text, start = answers[0]
    end = start + len(text)
    inside = np.flatnonzero(offsets[:, 0] >= 0)
    if not len(inside) or offsets[inside[0], 0] > start or offsets[inside[-1], 1] < end:
        return 0, 0
    first = inside[offsets[inside, 1] > start][0]
    last = inside[offsets[inside, 0] < end][-1]
    return int(first), int(last)


def best_span(start: np.ndarray, end: np.ndarray, offsets: np.ndarray, max_answer_len: int
              ) -> tuple[float, int, int] | None:
    """(score, first piece, last piece) of the best span of one row (BERT's n-best search), None if none fits: the
    N_BEST best starts against the N_BEST best ends, the first best pair in that order winning a tie."""
    s = np.argsort(start)[::-1][:N_BEST]
    e = np.argsort(end)[::-1][:N_BEST]
    fits = ((offsets[s, 0] >= 0)[:, None] & (offsets[e, 0] >= 0)[None, :] & (e[None, :] >= s[:, None])
            & (e[None, :] - s[:, None] + 1 <= max_answer_len))
    if not fits.any():
        return None
    score = np.where(fits, start[s][:, None] + end[e][None, :], -np.inf)
    i, j = divmod(int(np.argmax(score)), len(e))  # argmax: the first of equal scores, as the pairs are visited
    return float(score[i, j]), int(s[i]), int(e[j])


def answer_chars(context: str, start: int, end: int) -> tuple[int, int]:
    """A span's characters without the whitespace a piece's offsets may include (SentencePiece's word marker)."""
    while start < end and context[start].isspace():
        start += 1
    return start, end


def predict(outputs: list[np.ndarray], rows: SpanRows) -> tuple[dict[int, tuple[float, int, int]], dict[int, float]]:
    """Per question: the best span over its windows as (score, first character, end character) in its context,
    and the no-answer score minus the best span's (higher: no answer; inf where no span fits)."""
    best: dict[int, tuple[float, int, int]] = {}
    null: dict[int, float] = {}
    for r, out in enumerate(outputs):  # out (2, T'): start and end logits
        q = int(rows.question[r])
        null[q] = min(null.get(q, np.inf), float(out[0, 0] + out[1, 0]))
        found = best_span(out[0], out[1], rows.offsets[r, :out.shape[1]], rows.max_answer_len)
        if found is not None and found[0] > best.get(q, (-np.inf,))[0]:
            start, end = answer_chars(rows.contexts[q], rows.offsets[r, found[1], 0], rows.offsets[r, found[2], 1])
            best[q] = (found[0], int(start), int(end))
    diff = {q: null[q] - best[q][0] if q in best else np.inf for q in null}
    return best, diff


def null_threshold(diff: dict[int, float], gain: dict[int, float]) -> float:
    """The no-answer threshold that scores best: question q is answered when diff[q] <= threshold.

    gain[q]: what answering q adds to the score over not answering it (the official v2.0 script's walk: the
    answer's F1 for an answerable question; -1 for an unanswerable one given an answer, 0 given none). Unlike
    that script, whose scores are probabilities (>= 0, so its start at 0.0 means "never answer"), `diff` are logit
    differences of any sign: the candidates are below every difference (never answer), between two distinct
    differences (a group of equal ones is answered together) and above all of them (always answer); each is
    returned as a value strictly between the groups it separates, the smallest of equal scores winning (as the
    script's strict improvement does). A question with no span (inf) is never answered."""
    group: dict[float, float] = {}  # a difference -> the gain of answering every question that has it
    for q, d in diff.items():
        if np.isfinite(d):
            group[d] = group.get(d, 0.0) + gain[q]
    values = sorted(group)
    if not values:
        return 0.0
    total, best, best_at = 0.0, 0.0, -1  # -1: never answer
    for i, v in enumerate(values):
        total += group[v]
        if total > best:
            best, best_at = total, i
    if best_at < 0:
        return values[0] - 1.0
    return (values[best_at] + values[best_at + 1]) / 2 if best_at + 1 < len(values) else values[-1] + 1.0


class SpanKind(TaskKind):
    name = "span"
    problems = ("span",)
    metrics = METRICS
    pyfunc_task = "question-answering"
    hf_auto = "AutoModelForQuestionAnswering"
    input_columns = ("question", "context")

    def num_labels(self, task: TaskRef) -> int:
        return 2  # start and end

    def build_head(self, cfg, num_labels: int, classifier_dropout: float, sift: bool = False):
        from deberta.heads import DebertaForQuestionAnswering

        return DebertaForQuestionAnswering(cfg, classifier_dropout, sift=sift)

    def signature_outputs(self, task: TaskRef) -> list[dict[str, Any]]:
        return [{"type": t, "name": n, "required": True}
                for n, t in (("answer", "string"), ("score", "double"), ("start", "long"), ("end", "long"))]

    def claims(self, path: Path, meta: dict[str, Any]) -> bool:
        return split_file(path, "train", (".json",)) is not None

    def read_dir(self, path: Path, meta: dict[str, Any]) -> TaskRef:
        files = {}
        for split in ("train", "dev"):
            f = split_file(path, split, (".json",))
            if f is None:
                raise StageInputError(f"span task directory {path} has no {split}.json (SQuAD's layout)")
            files[split] = f
        return squad_task(task_name(path, meta), files, meta)

    def check(self, cfg: "FinetuneConfig", task: TaskRef) -> None:
        check_stride(cfg, context_room(cfg.max_seq_len))

    def encode(self, task: TaskRef, split: SpanSplit, tok_dir: Path, cfg: "FinetuneConfig") -> Encoded:
        self.check(cfg, task)
        fast = fast_tokenizer(tok_dir, cfg.max_seq_len)
        ids, offsets, question = encode_questions(fast, split.questions, cfg.max_seq_len, cfg.doc_stride)
        label = np.asarray([targets(offsets[r], split.questions[q].answers) for r, q in enumerate(question)],
                           dtype=np.int64).reshape(-1, 2)  # (N, 2)
        rows = SpanRows(question, offsets, tuple(tuple(t for t, _ in qa.answers) for qa in split.questions),
                        tuple(qa.context for qa in split.questions), task.option("version"), cfg.max_answer_len)
        return Encoded(ids, label, rows)

    def row_outputs(self, logits: "torch.Tensor", mask: "torch.Tensor") -> list[np.ndarray]:
        return list(logits.float().cpu().numpy())  # (B, 2, T') start and end logits

    def dev_metrics(self, outputs: list[np.ndarray], dev: Encoded) -> dict[str, float]:
        rows: SpanRows = dev.meta
        best, diff = predict(outputs, rows)
        texts = {q: rows.contexts[q][a:b] for q, (_, a, b) in best.items()}
        return answer_metrics(rows.golds, texts, diff, rows.version)

    answer_columns = ("answer", "score", "start", "end")

    def encode_inputs(self, fast, columns: dict[str, list[str]], settings: dict[str, Any]) -> Encoded:
        questions = tuple(QA(str(i), q, c, ()) for i, (q, c) in enumerate(zip(columns["question"],
                                                                            columns["context"])))
        ids, offsets, question = encode_questions(fast, questions, settings["max_seq_len"], settings["doc_stride"])
        rows = SpanRows(question, offsets, tuple(() for _ in questions), tuple(qa.context for qa in questions),
                        settings["squad_version"], settings["max_answer_len"])
        return Encoded(ids, np.zeros(len(ids)), rows)

    def hf_logits(self, out) -> "torch.Tensor":
        import torch

        return torch.stack([out.start_logits, out.end_logits], 1)  # (B, 2, T): the head's layout

    def answers(self, outputs: list[np.ndarray], rows: Encoded, settings: dict[str, Any]) -> list[dict[str, Any]]:
        """Per question: the best span (answer, its start + end score, character offsets into the context), or for
        v2.0 no answer ("", the no-answer margin, -1, -1) when the margin is above the dev threshold."""
        meta: SpanRows = rows.meta
        best, diff = predict(outputs, meta)
        threshold = settings.get("null_score_threshold")
        out = []
        for q, context in enumerate(meta.contexts):
            if q not in best or (meta.version == "2.0" and threshold is not None and diff[q] > threshold):
                out.append({"answer": "", "score": float(diff[q]), "start": -1, "end": -1})
            else:
                score, a, b = best[q]
                out.append({"answer": context[a:b], "score": score, "start": a, "end": b})
        return out

    def texts(self, split: SpanSplit) -> list[tuple[str, ...]]:
        return [(qa.question, qa.context) for qa in split.questions]

    def baseline(self, task: TaskRef) -> tuple[float, str]:
        texts = {}
        for i, qa in enumerate(task.dev.questions):
            words = set(_words(qa.question))
            sentences = [s for s in re.split(r"(?<=[.!?])\s+", qa.context) if s]
            texts[i] = max(sentences, key=lambda s: len(words & set(_words(s))), default="")
        golds = tuple(tuple(t for t, _ in qa.answers) for qa in task.dev.questions)
        # v2.0: one no-answer margin for all, so the dev threshold picks the better of always and never answering
        scores = answer_metrics(golds, texts, {i: 0.0 for i in texts}, task.option("version"))
        return scores[task.metric], "the context sentence sharing most words with the question"

    def export_config(self, task: TaskRef, head: dict[str, Any]) -> dict[str, Any]:
        return {"squad_version": task.option("version"), "max_answer_len": head["max_answer_len"],
                "doc_stride": head["doc_stride"],
                "null_score_threshold": head["trial"].get("dev_null_threshold")}

    def input_example(self, task: TaskRef) -> dict[str, list[str]]:
        qs = task.dev.questions[:2]
        return {"question": [qa.question for qa in qs], "context": [qa.context for qa in qs]}


def _words(text: str) -> list[str]:
    return re.findall(r"\w+", text.lower())


def answer_metrics(golds: tuple[tuple[str, ...], ...], texts: dict[int, str], diff: dict[int, float],
                   version: str) -> dict[str, float]:
    """EM and F1 (the official scripts' per question) as fractions in [0, 1], the scale of every metric here; for
    v2.0 at the no-answer threshold that maximises F1 on these questions (`null_threshold`), with HasAns/NoAns
    at it and the threshold itself (the registered model answers with it)."""
    preds = {q: texts.get(q, "") for q in range(len(golds))}
    if version != "2.0":
        return {"exact": float(np.mean([exact_match(preds[q], golds[q]) for q in preds])),
                "f1": float(np.mean([f1(preds[q], golds[q]) for q in preds]))}
    has_ans = {q: bool(golds[q]) for q in preds}
    _, f1_raw = get_raw_scores({q: list(golds[q]) for q in preds}, preds)
    na = {q: diff.get(q, np.inf) for q in preds}
    gain = {q: f1_raw[q] if has_ans[q] else (-1.0 if preds[q] else 0.0) for q in preds}
    thresh = null_threshold(na, gain)
    final = {q: "" if na[q] > thresh else preds[q] for q in preds}
    exact_t, f1_t = get_raw_scores({q: list(golds[q]) for q in preds}, final)
    out = {"exact": float(np.mean(list(exact_t.values()))), "f1": float(np.mean(list(f1_t.values()))),
           "null_threshold": float(thresh)}
    for name, keep in (("HasAns", True), ("NoAns", False)):
        qs = [q for q in preds if has_ans[q] == keep]
        if qs:
            out[f"{name}_exact"] = float(np.mean([exact_t[q] for q in qs]))
            out[f"{name}_f1"] = float(np.mean([f1_t[q] for q in qs]))
    return out


KIND = SpanKind()
