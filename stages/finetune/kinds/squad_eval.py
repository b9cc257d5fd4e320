"""Exact match and F1 for extractive QA, as the official SQuAD evaluation scripts compute them.

Two references, kept apart where they differ:
* "Official evaluation script for v1.1 of the SQuAD dataset" (`evaluate-v1.1.py`): `normalize_answer`,
  `exact_match_score`, `f1_score` (0 when no token is shared, so an empty prediction scores 0),
  `metric_max_over_ground_truths`, `evaluate_v1`.
* "Official evaluation script for SQuAD version 2.0" (`evaluate-v2.0.py`): `get_tokens`, `compute_exact`,
  `compute_f1` (an empty answer is right exactly when the gold is empty: the no-answer case),
  `get_raw_scores` (gold answers that normalise to nothing are dropped; none left means no answer, ""),
  `apply_no_ans_threshold`, `make_eval_dict`, `find_best_thresh`, `find_all_best_thresh`, `evaluate_v2`
  with its HasAns_/NoAns_ splits and, given no-answer probabilities, the best thresholds.

Both normalise the same way: lower case, drop ASCII punctuation (`string.punctuation`), drop the articles
a/an/the as whole words, collapse whitespace. Scores per question are 0/1 (exact) or in [0, 1] (F1); the
dataset-level numbers are percentages, as the scripts print them. Written out rather than imported because the
scripts ship with no package (stdlib only, 150 lines).
"""

from __future__ import annotations

import re
import string
from collections import Counter
from typing import Any, Callable, Iterable, Mapping, Sequence

_ARTICLES = re.compile(r"\b(a|an|the)\b", re.UNICODE)
_PUNCTUATION = frozenset(string.punctuation)


def normalize_answer(s: str) -> str:
    """Lower text and remove punctuation, articles and extra whitespace (both scripts)."""
    s = s.lower()
    s = "".join(ch for ch in s if ch not in _PUNCTUATION)
    s = _ARTICLES.sub(" ", s)
    return " ".join(s.split())


# ----------------------------------------------------------------------------------------------- v1.1
def exact_match_score(prediction: str, ground_truth: str) -> bool:
    """v1.1: the normalised strings are equal."""
    return normalize_answer(prediction) == normalize_answer(ground_truth)


def f1_score(prediction: str, ground_truth: str) -> float:
    """v1.1: bag-of-tokens F1 of the normalised strings; 0 when they share no token (empty ones included)."""
    pred_tokens = normalize_answer(prediction).split()
    gold_tokens = normalize_answer(ground_truth).split()
    num_same = sum((Counter(pred_tokens) & Counter(gold_tokens)).values())
    if num_same == 0:
        return 0
    precision = num_same / len(pred_tokens)
    recall = num_same / len(gold_tokens)
    return (2 * precision * recall) / (precision + recall)


def metric_max_over_ground_truths(metric_fn: Callable[[str, str], float], prediction: str,
                                  ground_truths: Sequence[str]) -> float:
    """v1.1: the best score of the prediction against any of the gold answers."""
    return max(metric_fn(prediction, gt) for gt in ground_truths)


def exact_match(prediction: str, ground_truths: Sequence[str], version: str = "1.1") -> float:
    """Exact match (0/1) of a prediction against its gold answers: v1.1's max, or v2.0's (no gold: "")."""
    if version == "1.1":
        return float(metric_max_over_ground_truths(exact_match_score, prediction, ground_truths))
    return float(max(compute_exact(g, prediction) for g in _gold_answers(ground_truths)))


def f1(prediction: str, ground_truths: Sequence[str], version: str = "1.1") -> float:
    """F1 in [0, 1] of a prediction against its gold answers: v1.1's max, or v2.0's (no gold: "")."""
    if version == "1.1":
        return float(metric_max_over_ground_truths(f1_score, prediction, ground_truths))
    return float(max(compute_f1(g, prediction) for g in _gold_answers(ground_truths)))


def _questions(dataset: Iterable[Mapping[str, Any]]) -> Iterable[Mapping[str, Any]]:
    """The qas of a SQuAD file's "data" list, in file order."""
    for article in dataset:
        for paragraph in article["paragraphs"]:
            yield from paragraph["qas"]


def evaluate_v1(dataset: Iterable[Mapping[str, Any]], predictions: Mapping[str, str]) -> dict[str, float]:
    """v1.1's `evaluate`: {"exact_match", "f1"} in percent; a question without a prediction scores 0."""
    exact = score = total = 0.0
    for qa in _questions(dataset):
        total += 1
        if qa["id"] not in predictions:
            continue
        golds = [a["text"] for a in qa["answers"]]
        exact += metric_max_over_ground_truths(exact_match_score, predictions[qa["id"]], golds)
        score += metric_max_over_ground_truths(f1_score, predictions[qa["id"]], golds)
    return {"exact_match": 100.0 * exact / total, "f1": 100.0 * score / total}


# ----------------------------------------------------------------------------------------------- v2.0
def get_tokens(s: str) -> list[str]:
    """v2.0: the normalised answer's words ([] for an empty answer)."""
    if not s:
        return []
    return normalize_answer(s).split()


def compute_exact(a_gold: str, a_pred: str) -> int:
    """v2.0: 1 when the normalised answers are equal (two empty answers included), else 0."""
    return int(normalize_answer(a_gold) == normalize_answer(a_pred))


def compute_f1(a_gold: str, a_pred: str) -> float:
    """v2.0: bag-of-tokens F1; when either answer is empty, 1 if both are, else 0."""
    gold_toks, pred_toks = get_tokens(a_gold), get_tokens(a_pred)
    num_same = sum((Counter(gold_toks) & Counter(pred_toks)).values())
    if len(gold_toks) == 0 or len(pred_toks) == 0:
        return int(gold_toks == pred_toks)
    if num_same == 0:
        return 0
    precision = num_same / len(pred_toks)
    recall = num_same / len(gold_toks)
    return (2 * precision * recall) / (precision + recall)


def _gold_answers(texts: Sequence[str]) -> list[str]:
    """v2.0: gold answers that normalise to something; none means the question has no answer ([""])."""
    golds = [t for t in texts if normalize_answer(t)]
    return golds or [""]


def get_raw_scores(golds: Mapping[Any, Sequence[str]], preds: Mapping[Any, str]
                   ) -> tuple[dict[Any, int], dict[Any, float]]:
    """v2.0: each question's best exact and F1 over its gold answer texts (question id -> texts; [] for a
    question without answer). Questions without a prediction are left out, as the script does."""
    exact_scores: dict[Any, int] = {}
    f1_scores: dict[Any, float] = {}
    for qid, texts in golds.items():
        if qid not in preds:
            continue
        answers = _gold_answers(texts)
        exact_scores[qid] = max(compute_exact(a, preds[qid]) for a in answers)
        f1_scores[qid] = max(compute_f1(a, preds[qid]) for a in answers)
    return exact_scores, f1_scores


def apply_no_ans_threshold(scores: Mapping[Any, float], na_probs: Mapping[Any, float],
                           qid_to_has_ans: Mapping[Any, bool], na_prob_thresh: float) -> dict[Any, float]:
    """v2.0: where the no-answer probability exceeds the threshold the answer is "", right iff there is none."""
    return {qid: float(not qid_to_has_ans[qid]) if na_probs[qid] > na_prob_thresh else s
            for qid, s in scores.items()}


def make_eval_dict(exact_scores: Mapping[Any, float], f1_scores: Mapping[Any, float],
                   qid_list: Sequence[Any] | None = None) -> dict[str, float]:
    """v2.0: {"exact", "f1"} in percent and "total", over all questions or over `qid_list`."""
    qids = list(qid_list) if qid_list else list(exact_scores)
    total = len(qids)
    return {"exact": 100.0 * sum(exact_scores[k] for k in qids) / total,
            "f1": 100.0 * sum(f1_scores[k] for k in qids) / total, "total": total}


def find_best_thresh(preds: Mapping[Any, str], scores: Mapping[Any, float], na_probs: Mapping[Any, float],
                     qid_to_has_ans: Mapping[Any, bool]) -> tuple[float, float]:
    """v2.0: the no-answer threshold that maximises the score, and that score in percent.

    Start from answering nothing (every no-answer question right); walk the questions by rising no-answer
    probability, answering each in turn; keep the best running total and the probability where it was reached."""
    cur_score = best_score = sum(1 for k in qid_to_has_ans if not qid_to_has_ans[k])
    best_thresh = 0.0
    for qid in sorted(na_probs, key=lambda k: na_probs[k]):
        if qid not in scores:
            continue
        if qid_to_has_ans[qid]:
            diff = scores[qid]
        else:
            diff = -1 if preds[qid] else 0
        cur_score += diff
        if cur_score > best_score:
            best_score, best_thresh = cur_score, na_probs[qid]
    return 100.0 * best_score / len(scores), best_thresh


def find_all_best_thresh(main_eval: dict[str, float], preds: Mapping[Any, str], exact_raw: Mapping[Any, float],
                         f1_raw: Mapping[Any, float], na_probs: Mapping[Any, float],
                         qid_to_has_ans: Mapping[Any, bool]) -> None:
    """v2.0: add best_exact, best_exact_thresh, best_f1, best_f1_thresh to `main_eval`."""
    main_eval["best_exact"], main_eval["best_exact_thresh"] = find_best_thresh(preds, exact_raw, na_probs,
                                                                               qid_to_has_ans)
    main_eval["best_f1"], main_eval["best_f1_thresh"] = find_best_thresh(preds, f1_raw, na_probs, qid_to_has_ans)


def evaluate_v2(dataset: Iterable[Mapping[str, Any]], preds: Mapping[str, str],
                na_probs: Mapping[str, float] | None = None, na_prob_thresh: float = 1.0) -> dict[str, float]:
    """v2.0's main: exact/f1/total, HasAns_* and NoAns_* splits, and with `na_probs` the best thresholds."""
    qas = list(_questions(dataset))
    qid_to_has_ans = {qa["id"]: bool(qa["answers"]) for qa in qas}
    exact_raw, f1_raw = get_raw_scores({qa["id"]: [a["text"] for a in qa["answers"]] for qa in qas}, preds)
    probs = na_probs if na_probs is not None else {k: 0.0 for k in preds}
    exact_thresh = apply_no_ans_threshold(exact_raw, probs, qid_to_has_ans, na_prob_thresh)
    f1_thresh = apply_no_ans_threshold(f1_raw, probs, qid_to_has_ans, na_prob_thresh)
    out = make_eval_dict(exact_thresh, f1_thresh)
    for name, keep in (("HasAns", True), ("NoAns", False)):
        qids = [k for k, v in qid_to_has_ans.items() if v == keep]
        if qids:
            out.update({f"{name}_{k}": v for k, v in make_eval_dict(exact_thresh, f1_thresh, qids).items()})
    if na_probs is not None:
        find_all_best_thresh(out, preds, exact_raw, f1_raw, na_probs, qid_to_has_ans)
    return out
