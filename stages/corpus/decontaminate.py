"""`corpus.decontaminate`: the fine-tuning tasks whose dev examples the corpus must not contain, resolved once on the
driver before Ray starts (`prepare`) into their n-gram keys (`core.contamination`), which the stage's filter pass
looks for in every document (`ingest.apply_filters`).

A document sharing one n-gram with a dev example is removed whole, as GPT-3 did (Brown et al. 2020, App. C): the
stage never rewrites a document (the quality rules remove, they do not cut), where NeMo Curator's
TaskDecontamination cuts the matched span with 200 characters on each side. The resolved tasks are an input of the
corpus stage with an id of their content (each task's id, and n): asking for decontamination changes the corpus
artifact, a task the run merely fine-tunes on never does.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Collection, Sequence

from core.config import CorpusConfig
from core.contamination import DevGrams
from core.errors import StageInputError
from stages.base import Prepared

INPUT = "decontaminate"


@dataclass(frozen=True, eq=False)
class Decontamination:
    """The tasks' dev n-grams, in the order named (a document's rule names the first task it matches)."""

    tasks: tuple[tuple[str, DevGrams], ...]
    id: str
    source: str = field(default="")


def resolve(specs: Sequence[str], n: int, workdir: Path | None = None) -> Decontamination:
    """Each task (a built-in name or a task directory, as `--task` reads it) -> its dev examples' n-gram keys;
    StageInputError naming a task that is neither."""
    from stages.finetune.tasks import builtin_tasks, resolve_task

    tasks = []
    for spec in specs:
        path = Path(spec).expanduser()
        if spec not in builtin_tasks() and not (path.is_dir() or (workdir is not None and (workdir / path).is_dir())):
            raise StageInputError(f"corpus.decontaminate={spec!r}: neither a built-in task "
                                  f"({', '.join(builtin_tasks())}) nor a task directory; name one, as --task does")
        try:
            tasks.append(resolve_task(spec, workdir))
        except StageInputError as e:
            raise StageInputError(f"corpus.decontaminate={spec!r}: {e}") from None
    grams = tuple((t.name, DevGrams.of(t.kind.texts(t.dev), n)) for t in tasks)
    digest = hashlib.sha256(json.dumps({"tasks": [t.id for t in tasks], "n": n}).encode()).hexdigest()[:16]
    return Decontamination(grams, digest, f"dev examples of {', '.join(t.name for t in tasks)} ({n}-grams)")


def prepare(cfg: CorpusConfig, *, planned: Collection[str], workdir: Path, overrides: Sequence[str]) -> Prepared:
    """The tasks of `corpus.decontaminate` as the corpus stage's input `decontaminate`; nothing when none is named."""
    if not cfg.decontaminate or "corpus" not in planned:
        return Prepared()
    found = resolve(cfg.decontaminate, cfg.decontaminate_ngram, workdir)
    return Prepared(objects={INPUT: found}, adds={"corpus": (INPUT,)})
