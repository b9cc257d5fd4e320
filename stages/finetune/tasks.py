"""Fine-tuning tasks: a built-in name or a task directory -> `TaskRef`, read by the kind whose files it holds.

Built-ins (real text from package wheels, nothing downloaded at run time): each kind's `builtins`, e.g.
`rotten-tomatoes` and `lee-sts` (`kinds/sequence.py`), `wnut16-ner` (`kinds/token.py`), `rotten-tomatoes-choice`
(`kinds/choice.py`). A directory names its kind in `task.json` ({"kind": "classification" | "regression" |
"token" | "span" | "choice", ...}) or by its files, tried kind by kind in `KINDS`' order: `train.jsonl` with
`options` (choice), `train.tsv`/`train.jsonl` with a `label` column (sequence), `train.conll` or `train.jsonl`
with `tokens`/`tags` (token), `train.json` in SQuAD's layout (span). Each kind's module describes its format.
"""

from __future__ import annotations

from pathlib import Path

from core.errors import StageInputError
from stages.finetune.kinds import KINDS, kind_of
from stages.finetune.kinds.base import TaskRef, read_task_json


def builtin_tasks() -> dict:
    """Built-in task name -> its reader, from every kind in `KINDS` (`TaskKind.builtins`)."""
    return {name: read for kind in KINDS.values() for name, read in kind.builtins.items()}


SUITES = {"all": "every built-in task, in `KINDS`' order"}
"""Named suites `finetune.task` may hold beside task names and directories (`task_list`)."""


def task_list(spec: str) -> tuple[str, ...]:
    """`finetune.task` -> its tasks in order: comma-separated built-in names, task directories and suites (`SUITES`,
    expanded in place), as `pretrain.probes` lists its tasks. StageInputError for a task named twice."""
    names: list[str] = []
    for item in (s.strip() for s in spec.split(",")):
        names += list(builtin_tasks()) if item in SUITES else [item]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise StageInputError(f"finetune.task={spec}: task {twice[0]} is named twice (suite all is every built-in: "
                              f"{', '.join(builtin_tasks())}); name each task once")
    return tuple(names)


def resolve_tasks(spec: str, workdir: Path | None = None) -> list[TaskRef]:
    """Every task of `finetune.task` (`task_list`), read; StageInputError for two tasks of one name (each is its
    own registry model, `deberta-<preset>-<task name>`)."""
    tasks = [resolve_task(name, workdir) for name in task_list(spec)]
    seen: dict[str, str] = {}
    for given, task in zip(task_list(spec), tasks):
        if task.name in seen:
            raise StageInputError(f"finetune.task: {seen[task.name]} and {given} are both task {task.name!r} (the "
                                  f"registry model deberta-<preset>-{task.name}); rename one directory")
        seen[task.name] = given
    ids = [t.id for t in tasks]
    same = [t.name for t in tasks if ids.count(t.id) > 1]
    if same:
        raise StageInputError(f"finetune.task: {' and '.join(same)} hold the same examples (task id "
                              f"{tasks[[t.name for t in tasks].index(same[0])].id}); list it once")
    return tasks


def resolve_task(spec: str, workdir: Path | None = None) -> TaskRef:
    """A built-in task name or a task directory -> TaskRef (raises StageInputError)."""
    named = builtin_tasks()
    if spec in named:
        return named[spec]()
    path = Path(spec).expanduser()
    if not path.is_absolute() and workdir is not None and not path.exists() and (workdir / path).exists():
        path = workdir / path
    if not path.is_dir():
        raise StageInputError(f"task {spec!r} is neither a built-in ({', '.join(named)}) nor an existing "
                              f"task directory; pass --task NAME or --task DIR")
    path = path.resolve()
    meta = read_task_json(path)
    stated = meta.get("kind")
    if stated is not None:
        try:
            return kind_of(stated).read_dir(path, meta)
        except ValueError:
            raise StageInputError(f"{path / 'task.json'}: kind={stated!r}; use one of "
                                  f"{[p for k in KINDS.values() for p in k.problems]}") from None
    for kind in KINDS.values():
        if kind.claims(path, meta):
            return kind.read_dir(path, meta)
    raise StageInputError(f"task directory {path} holds no task files: train.tsv/train.jsonl + dev (sentence "
                          f"tasks), train.conll/train.jsonl with tokens and tags + dev (token tasks) or "
                          f"train.json/dev.json in SQuAD's layout (question answering) or train.jsonl/dev.jsonl with "
                          f"context, question, options and label (multiple choice)")


def majority_baseline(task: TaskRef) -> float:
    """The selection metric on dev of the rule a practitioner tries first (`TaskKind.baseline`)."""
    return task.kind.baseline(task)[0]
