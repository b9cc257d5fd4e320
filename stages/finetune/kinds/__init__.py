"""The task kinds of fine-tuning, each one file (see `base.py` for what a kind supplies):

    sequence.py  one label or score per text or text pair (GLUE; DeBERTa §5.1)
    token.py     a label per word, e.g. named entities (CoNLL-2003; DeBERTa §5.2)
    span.py      extractive question answering (SQuAD v1.1 / v2.0; DeBERTa §5.2)
    choice.py    multiple choice: one right option of K (RACE, SWAG; DeBERTa §5.1.1)

A new kind: a file with a `TaskKind` subclass and its instance `KIND`, listed in `KINDS` below.
"""

from __future__ import annotations

from stages.finetune.kinds import choice, sequence, span, token
from stages.finetune.kinds.base import TaskKind

KINDS: dict[str, TaskKind] = {k.name: k for k in (choice.KIND, sequence.KIND, token.KIND, span.KIND)}
"""Kind name -> kind, in the order a task directory's files are tried."""


def kind_of(problem: str) -> TaskKind:
    """The kind that serves a problem type (`TaskRef.problem`: "classification", "regression", "token", ...)."""
    for kind in KINDS.values():
        if problem in kind.problems:
            return kind
    raise ValueError(f"no task kind serves {problem!r}; the kinds serve "
                     f"{[p for k in KINDS.values() for p in k.problems]}")
