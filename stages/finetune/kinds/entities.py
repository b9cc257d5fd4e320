"""Entities from IOB1 / IOB2 / BIOES tags, and entity precision/recall/F1, as seqeval 1.2.2 computes them.

Written by hand (numpy-free, stdlib only) because seqeval is unmaintained and pulls scikit-learn and scipy for
the few lines we need. Two ways of reading tags, both seqeval's:

* mode "default": `seqeval.metrics.sequence_labeling.get_entities`, the reading of the CoNLL shared tasks'
  `conlleval` script. Lenient: an `I-X` after `O` or after another type starts an entity, whatever the scheme,
  so IOB1, IOB2 and BIOES tags all read sensibly. This is what `seqeval.metrics.f1_score(y_true, y_pred)`
  reports and what CoNLL-2003 results are quoted in.
* mode "strict": `seqeval.scheme.Tokens(tags, scheme).entities` with the pattern tables of `seqeval.scheme`
  (IOB1, IOB2, IOBES): an entity counts only when it starts and ends as its scheme says, so a prediction
  `I-ORG I-ORG` for gold `B-ORG I-ORG` scores 0 under IOB2 (seqeval's README).

Entities are `(type, start, end)` with `end` exclusive (a Python slice of the words). seqeval's `get_entities`
returns an inclusive end; its scheme module an exclusive one; the entity sets compared are the same.
"""

from __future__ import annotations

from collections import Counter
from typing import Sequence

SCHEMES = ("IOB1", "IOB2", "BIOES")
_ALIASES = {"IOB1": "IOB1", "IOB2": "IOB2", "BIO": "IOB2", "BIOES": "BIOES", "IOBES": "BIOES"}
Entity = tuple[str, int, int]

# seqeval.scheme's tables: (prefixes of the previous tag, prefixes of this tag, type condition).
_ANY = "IOBESUL"
_ALLOWED = {"IOB1": "IOB", "IOB2": "IOB", "BIOES": "IOBES"}
_PATTERNS: dict[str, dict[str, tuple[tuple[str, str, str], ...]]] = {
    "IOB1": {
        "start": (("O", "I", "any"), ("I", "I", "diff"), ("B", "I", "any"), ("I", "B", "same"), ("B", "B", "same")),
        "inside": (("B", "I", "same"), ("I", "I", "same")),
        "end": (("I", "I", "diff"), ("I", "O", "any"), ("I", "B", "any"), ("B", "O", "any"), ("B", "I", "diff"),
                ("B", "B", "same")),
    },
    "IOB2": {
        "start": ((_ANY, "B", "any"),),
        "inside": (("B", "I", "same"), ("I", "I", "same")),
        "end": (("I", "O", "any"), ("I", "I", "diff"), ("I", "B", "any"), ("B", "O", "any"), ("B", "I", "diff"),
                ("B", "B", "any")),
    },
    "BIOES": {
        "start": ((_ANY, "B", "any"), (_ANY, "S", "any")),
        "inside": (("B", "I", "same"), ("B", "E", "same"), ("I", "I", "same"), ("I", "E", "same")),
        "end": (("S", _ANY, "any"), ("E", _ANY, "any")),
    },
}


def scheme_name(scheme: str) -> str:
    """The canonical name of a scheme ("IOB1", "IOB2", "BIOES"; "BIO" and "IOBES" accepted)."""
    name = _ALIASES.get(str(scheme).upper())
    if name is None:
        raise ValueError(f"unknown tag scheme {scheme!r}; use one of {', '.join(SCHEMES)}")
    return name


# ----------------------------------------------------------------------------------------------- entities
def _conlleval_entities(tags: Sequence[str]) -> list[Entity]:
    """seqeval's default `get_entities` (conlleval's chunk boundaries) on one sentence; end exclusive."""
    chunks: list[Entity] = []
    prev_tag, prev_type, begin = "O", "", 0
    for i, chunk in enumerate(list(tags) + ["O"]):
        tag, type_ = chunk[0], chunk[1:].split("-", maxsplit=1)[-1] or "_"
        if _end_of_chunk(prev_tag, tag, prev_type, type_):
            chunks.append((prev_type, begin, i))
        if _start_of_chunk(prev_tag, tag, prev_type, type_):
            begin = i
        prev_tag, prev_type = tag, type_
    return chunks


def _end_of_chunk(prev_tag: str, tag: str, prev_type: str, type_: str) -> bool:
    if prev_tag in ("E", "S"):
        return True
    if prev_tag in ("B", "I") and tag in ("B", "S", "O"):
        return True
    return prev_tag not in ("O", ".") and prev_type != type_


def _start_of_chunk(prev_tag: str, tag: str, prev_type: str, type_: str) -> bool:
    if tag in ("B", "S"):
        return True
    if prev_tag in ("E", "S", "O") and tag in ("E", "I"):
        return True
    return tag not in ("O", ".") and prev_type != type_


def _parse(tag: str, scheme: str) -> tuple[str, str]:
    """(prefix, type) of a tag as `seqeval.scheme.Token` reads it, checked against the scheme's prefixes."""
    prefix, type_ = tag[:1], tag[1:].strip("-") or "_"
    if not prefix or prefix not in _ALLOWED[scheme]:
        raise ValueError(f"tag {tag!r} is not allowed in {scheme} (its prefixes: {', '.join(_ALLOWED[scheme])})")
    return prefix, type_


def _matches(prev: tuple[str, str], cur: tuple[str, str], patterns: tuple[tuple[str, str, str], ...]) -> bool:
    for prev_prefixes, cur_prefixes, cond in patterns:
        if prev[0] in prev_prefixes and cur[0] in cur_prefixes:
            if cond == "any" or (cond == "same") == (prev[1] == cur[1]):
                return True
    return False


def _strict_entities(tags: Sequence[str], scheme: str) -> list[Entity]:
    """`seqeval.scheme.Tokens(tags, scheme).entities` on one sentence: (type, start, end exclusive)."""
    table = _PATTERNS[scheme]
    outside = ("O", "_")
    ext = [_parse(t, scheme) for t in tags] + [outside]
    out: list[Entity] = []
    i, prev = 0, outside
    while i < len(ext):
        token = ext[i]
        if _matches(prev, token, table["start"]):
            end, inner = len(ext) - 2, token  # seqeval's fallback when every later token is inside
            for j in range(i + 1, len(ext)):
                if _matches(inner, ext[j], table["inside"]):
                    inner = ext[j]
                else:
                    end = j
                    break
            if _matches(ext[end - 1], ext[end], table["end"]):
                out.append((token[1], i, end))
            i = end
        else:
            i += 1
        prev = ext[i - 1]
    return out


def get_entities(tags: Sequence[str], scheme: str | None = None, mode: str = "default") -> list[Entity]:
    """The entities of one sentence's tags, as (type, start, end) with end exclusive.

    mode "default" reads the tags as seqeval's default (conlleval) does and ignores `scheme`; mode "strict"
    needs the scheme and follows `seqeval.scheme` (a tag with a prefix the scheme lacks raises ValueError)."""
    if mode == "default":
        return _conlleval_entities(tags)
    if mode != "strict":
        raise ValueError(f"unknown mode {mode!r}; use 'default' (conlleval) or 'strict'")
    if scheme is None:
        raise ValueError("mode 'strict' needs a scheme (IOB1, IOB2 or BIOES)")
    return _strict_entities(tags, scheme_name(scheme))


# ----------------------------------------------------------------------------------------------- scores
def _prf(tp: int, n_pred: int, n_true: int) -> dict[str, float]:
    """seqeval's zero_division: a ratio with a zero denominator is 0; F1 as (1+b²)PR / (b²P + R) with b=1."""
    p = tp / n_pred if n_pred else 0.0
    r = tp / n_true if n_true else 0.0
    f = 2 * p * r / (p + r) if p + r else 0.0
    return {"precision": p, "recall": r, "f1": f, "support": n_true}


def entity_scores(gold_seqs: Sequence[Sequence[str]], pred_seqs: Sequence[Sequence[str]],
                  scheme: str | None = None, mode: str = "default") -> dict:
    """Micro precision/recall/F1 over entities (seqeval's `f1_score` etc., average="micro") and per type.

    Returns {"precision", "recall", "f1", "support", "per_type": {type: {precision, recall, f1, support}}};
    an entity counts as right only with its type, start and end all equal to a gold one."""
    if len(gold_seqs) != len(pred_seqs) or any(len(g) != len(p) for g, p in zip(gold_seqs, pred_seqs)):
        raise ValueError("gold and predicted tags differ in length: one tag per word in both is needed")
    true: set[tuple[int, str, int, int]] = set()
    pred: set[tuple[int, str, int, int]] = set()
    for sent, (g, p) in enumerate(zip(gold_seqs, pred_seqs)):
        true.update((sent, *e) for e in get_entities(g, scheme, mode))
        pred.update((sent, *e) for e in get_entities(p, scheme, mode))
    hits = true & pred
    n_true, n_pred, n_hit = (Counter(e[1] for e in s) for s in (true, pred, hits))
    per_type = {t: _prf(n_hit[t], n_pred[t], n_true[t]) for t in sorted(set(n_true) | set(n_pred))}
    return {**_prf(len(hits), len(pred), len(true)), "per_type": per_type}


# ----------------------------------------------------------------------------------------------- scheme
def _split(tag: str, where: str) -> tuple[str, str]:
    if tag == "O":
        return "O", ""
    if len(tag) < 3 or tag[1] != "-" or tag[0] not in "BIES":
        raise ValueError(f"tag {tag!r} at {where} is not O or B-/I-/E-/S- followed by a type (e.g. B-PER); "
                         "tags must follow IOB1, IOB2 or BIOES")
    return tag[0], tag[2:]


def _first_violation(split_seqs: list[list[tuple[str, str]]], scheme: str) -> str | None:
    """Where the tags break the scheme's structure, or None."""
    for s, seq in enumerate(split_seqs, 1):
        for w, (prefix, type_) in enumerate(seq, 1):
            prev = seq[w - 2] if w > 1 else ("O", "")
            nxt = seq[w] if w < len(seq) else ("O", "")
            continues = prev[0] in "BI" and prev[1] == type_
            if scheme != "BIOES" and prefix in "ES":
                return f"{prefix}-{type_} at sentence {s}, word {w} belongs to BIOES, not {scheme}"
            if scheme == "IOB2" and prefix == "I" and not continues:
                return f"I-{type_} at sentence {s}, word {w} follows {_show(prev)}: an IOB2 entity starts with B-"
            if scheme == "BIOES" and prefix in "IE" and not continues:
                return (f"{prefix}-{type_} at sentence {s}, word {w} follows {_show(prev)}: a BIOES entity starts "
                        "with B- or S-")
            if scheme == "BIOES" and prefix in "BI" and not (nxt[0] in "IE" and nxt[1] == type_):
                return (f"{prefix}-{type_} at sentence {s}, word {w} is followed by {_show(nxt)}: a BIOES entity "
                        f"ends with E-{type_} (one word: S-{type_})")
    return None


def _show(tag: tuple[str, str]) -> str:
    return "O" if tag[0] == "O" else f"{tag[0]}-{tag[1]}"


def infer_scheme(tag_sequences: Sequence[Sequence[str]], stated: str | None = None) -> tuple[str, str | None]:
    """The scheme the tags follow, and a note on how it was told (None when there is nothing to say).

    BIOES when E- or S- appear (their structure then checked), IOB1 when some I-X starts an entity (after O or
    another type: legal in IOB1, where B- only separates two touching entities of one type), else IOB2. With a
    `stated` scheme the tags are checked against it. A tag not of the form O / B-|I-|E-|S-TYPE, or tags that
    break the scheme, raise ValueError naming the sentence and word (1-based) and the fix."""
    split_seqs = [[_split(t, f"sentence {s}, word {w}") for w, t in enumerate(seq, 1)]
                  for s, seq in enumerate(tag_sequences, 1)]
    if stated is not None:
        scheme = scheme_name(stated)
        problem = _first_violation(split_seqs, scheme)
        if problem:
            raise ValueError(f"{problem}; the tags do not follow the stated scheme {scheme}: fix the tags or "
                             "state the scheme they follow (task.json \"scheme\")")
        return scheme, None
    prefixes = {p for seq in split_seqs for p, _ in seq}
    if prefixes & {"E", "S"}:
        problem = _first_violation(split_seqs, "BIOES")
        if problem:
            raise ValueError(f"{problem}; E-/S- tags appear, so the tags were read as BIOES and are not "
                             "consistent with it: fix the tags or convert them to IOB2")
        return "BIOES", "E-/S- tags appear"
    if prefixes <= {"O"}:
        return "IOB2", "no entity tags at all: every word is O"
    problem = _first_violation(split_seqs, "IOB2")
    if problem:
        return "IOB1", f"inferred: {problem.split(':')[0]}, which IOB1 allows (an entity may start with I-)"
    return "IOB2", None
