"""What a fine-tuning task kind supplies; the sweep, the Table 9 grid, seeds, SiFT, ZeRO trials, the registry and the
lineage are shared (`stages.finetune`).

A kind owns one shape of task: its input format (the files of a task directory), its built-in tasks, its features
(how examples become token arrays), its head (`build_head`, a `deberta.heads` model) and so its loss, its label
count, its dev metrics, its baseline, and its registered model: the columns it reads, the transformers auto class
its export loads with, its MLflow signature and the code that answers (shipped with the model, `code_tree`; the
same code the dev metrics run). The shared parts receive a kind (`TaskRef.kind`) and never ask which one it is.
The kinds are `sequence.py` (one label or score per text or pair), `token.py` (a label per word: NER) and
`span.py` (extractive question answering); a new kind is one more file like them plus its line in
`kinds/__init__.py`. Words: a task's *problem* (`TaskRef.problem`: classification, regression, token, span) is what
task.json's "kind" names; the *kind* is the TaskKind that serves it.

This module and the kinds' top levels stay torch-free: the driver resolves the task before Ray starts.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from core.errors import StageInputError

if TYPE_CHECKING:
    import torch

    from core.config import FinetuneConfig


@dataclass(frozen=True)
class TaskRef:
    """A resolved task: what the runner fingerprints (`id`) and the finetune stage trains on."""

    name: str
    """Short name: the built-in's, or the directory's (used in the registered model's name)."""
    problem: str
    """The problem type, a word of the kind's `problems` ("classification" or "regression" for the sequence
    kind; a kind with one problem names it after itself). `kind` is the TaskKind that serves it."""
    metric: str
    """Dev metric that selects the model (one of the kind's `metrics`)."""
    labels: tuple[str, ...]
    """Class or tag names, index = class id (empty for regression and span)."""
    train: Any
    """The kind's split type (`sequence.Split`, `token.TokenSplit`, `span.SpanSplit`)."""
    dev: Any
    source: str
    """Where the data came from (a path), for the lineage record."""
    id: str = ""
    """Fingerprint of name, kind, metric, labels, options and every example: equal data, equal id."""
    options: tuple[tuple[str, Any], ...] = ()
    """Kind-specific settings read with the data (e.g. the tag scheme, the SQuAD version), as (key, value)."""
    kind: "TaskKind | None" = None
    """The kind that read it and serves `problem` (it travels with the task: a worker needs no list of kinds)."""

    @property
    def num_labels(self) -> int:
        """Outputs of the task head (`TaskKind.num_labels`)."""
        return self.kind.num_labels(self)

    def option(self, key: str, default: Any = None) -> Any:
        return dict(self.options).get(key, default)


def make_task(name: str, problem: str, metric: str, labels: Sequence[str], train: Any, dev: Any, source: str,
              allowed_metrics: Sequence[str], options: dict[str, Any] | None = None, *,
              kind: "TaskKind") -> TaskRef:
    """A TaskRef with its fingerprint, after the checks every kind shares (non-empty splits, a known metric)."""
    if len(train) == 0:
        raise StageInputError(f"task {name!r}: the train split is empty ({source}); add labelled examples to it")
    if len(dev) == 0:
        raise StageInputError(f"task {name!r}: the dev split is empty ({source}); model selection needs dev "
                              f"examples - add labelled examples to the dev file")
    if metric not in allowed_metrics:
        raise StageInputError(f"task {name!r}: metric {metric!r} does not fit a {problem} task; use one of "
                              f"{tuple(allowed_metrics)}")
    opts = tuple(sorted((options or {}).items()))
    h = hashlib.sha256(json.dumps([name, problem, metric, list(labels), opts]).encode())
    for split in (train, dev):
        h.update(json.dumps(dataclasses.astuple(split)).encode())
    return TaskRef(name, problem, metric, tuple(labels), train, dev, source, h.hexdigest()[:16], opts, kind)


@dataclass(frozen=True)
class Encoded:
    """A tokenised split: [CLS] ... [SEP] rows right-padded with [PAD]=0, and their training targets.

    label: (N,) class id or score (sequence), (N, T) class id per position with IGNORE_INDEX where none is
    trained (token), or (N, 2) answer start and end positions (span). meta: what the kind's dev metrics need to
    map row outputs back to examples (word positions, character offsets, gold answers; a sequence's problem).
    """

    ids: np.ndarray  # (N, T) int32; (N, K, T) when each example is K rows (the K options of multiple choice)
    label: np.ndarray
    meta: Any = None

    def __len__(self) -> int:
        return len(self.ids)

    def take(self, rows: np.ndarray) -> "Encoded":
        """The rows `rows` (train subsampling; meta describes the whole split and is dropped)."""
        return Encoded(self.ids[rows], self.label[rows], None)


EVAL_BATCH = 128
"""Rows per forward pass of evaluation and serving (the same batches, so the same padding widths)."""


class TaskKind:
    """The base every kind extends. Methods raise StageInputError for what a user can fix."""

    name = ""
    """The kind's name (its file's), e.g. "token"."""
    problems: tuple[str, ...] = ()
    """The problem types (`TaskRef.problem`) it serves; task.json's "kind" names one of them."""
    metrics: tuple[str, ...] = ()
    """Dev metrics a task of this kind may select on; the first is the default."""
    pyfunc_task = ""
    """The transformers pipeline tag of its registered model (the MLflow logged model's type and model card)."""
    hf_auto = ""
    """The transformers auto class its export loads with (e.g. "AutoModelForTokenClassification")."""
    input_columns: tuple[str, ...] = ()
    """The columns its registered model reads, in order (`input_example`'s, less `optional_columns` a task lacks);
    what `pipeline.predict` asks of an input for an HF directory of its head, which carries no signature."""
    optional_columns: tuple[str, ...] = ()
    """Columns read when given (the second text of a pair task)."""
    labels_per_position = False
    """Whether `Encoded.label` holds a label per position of `ids` (trimmed with them in a batch)."""
    baseline_aliases: tuple[str, ...] = ()
    """Further names the stage's metrics and the registry tags give the baseline's score."""
    builtins: dict[str, Any] = {}
    """Built-in task name -> a function returning its TaskRef (real data from package wheels)."""

    def num_labels(self, task: TaskRef) -> int:
        """Outputs of the task head: by default one per label name."""
        return len(task.labels)

    def build_head(self, cfg, num_labels: int, classifier_dropout: float, sift: bool = False):
        """The task model (`deberta.heads`) this kind trains and exports."""
        raise NotImplementedError

    def signature_outputs(self, task: TaskRef) -> list[dict[str, Any]]:
        """The registered model's output columns as MLflow schema JSON (`mlflow.types.Schema.from_json`)."""
        raise NotImplementedError

    def claims(self, path: Path, meta: dict[str, Any]) -> bool:
        """Whether the task directory `path` (with its task.json `meta`) holds this kind's files."""
        raise NotImplementedError

    def read_dir(self, path: Path, meta: dict[str, Any]) -> TaskRef:
        """The task in directory `path`: train and dev split, checked."""
        raise NotImplementedError

    def check(self, cfg: "FinetuneConfig", task: TaskRef) -> None:
        """What the kind needs of the settings, checked before Ray starts (StageInputError naming the fix)."""

    def encode(self, task: TaskRef, split: Any, tok_dir: Path, cfg: "FinetuneConfig") -> Encoded:
        """Examples -> token rows (and the targets of the kind's loss); tok_dir: the vocabulary (spm.model +
        special_tokens.json) of the checkpoint being fine-tuned."""
        raise NotImplementedError

    def row_outputs(self, logits: "torch.Tensor", mask: "torch.Tensor") -> list[np.ndarray]:
        """The head's logits of one batch -> what the dev metrics read per row (small: ids or scores)."""
        raise NotImplementedError

    def dev_metrics(self, outputs: list[np.ndarray], dev: Encoded) -> dict[str, float]:
        """Every metric of the kind from the dev rows' outputs (in row order)."""
        raise NotImplementedError

    def texts(self, split: Any) -> list[tuple[str, ...]]:
        """Each example's texts as a reader sees them (what decontamination looks for in a corpus)."""
        raise NotImplementedError

    def baseline(self, task: TaskRef) -> tuple[float, str]:
        """(selection metric on dev, what it is) of the rule a practitioner tries first."""
        raise NotImplementedError

    def export_config(self, task: TaskRef, head: dict[str, Any]) -> dict[str, Any]:
        """Extra fields of the HF export's config.json that its MLflow Model reads (e.g. a no-answer threshold)."""
        return {}

    def input_example(self, task: TaskRef) -> dict[str, list[str]]:
        """Two dev inputs as the registered model's DataFrame columns."""
        raise NotImplementedError

    # ------------------------------------------------------------------- serving: the registered model runs these
    # The MLflow Model (core/hf_pyfunc.py) ships this package (`code_tree`) and predicts with the same feature and
    # decoding code as the dev metrics: `encode_inputs` -> the export's forward (`hf_logits`) -> `row_outputs`
    # (the trial's own) -> `answers`. `settings` is the export's config.json (with `export_config`'s fields) and
    # `max_seq_len`, the tokenizer's `model_max_length`.

    answer_columns: tuple[str, ...] = ()
    """The columns of the registered model's answer DataFrame."""

    def encode_inputs(self, fast, columns: dict[str, list[str]], settings: dict[str, Any]) -> Encoded:
        """The served model's input columns -> rows, by the code that encodes the task's splits."""
        raise NotImplementedError

    def hf_logits(self, out) -> "torch.Tensor":
        """A transformers model's output -> logits in this kind's head layout (what `row_outputs` reads)."""
        return out.logits

    def answers(self, outputs: list[np.ndarray], rows: Encoded, settings: dict[str, Any]) -> list[dict[str, Any]]:
        """Row outputs -> one answer per input row, as the registered model returns them."""
        raise NotImplementedError

    def forward_rows(self, forward, ids: np.ndarray, batch: int = EVAL_BATCH) -> list[np.ndarray]:
        """`row_outputs` of every row of `ids` (N, T), in the batches the dev metrics use: `batch` rows with the
        padding they all share trimmed; forward(ids (B, T'), mask (B, T')) -> this kind's logits."""
        import torch

        out: list[np.ndarray] = []
        for b in range(0, len(ids), batch):
            chunk = ids[b:b + batch]  # [PAD] = 0 (fixed by the vocab stage)
            width = max(1, int((chunk != 0).sum(-1).max()))
            t = torch.from_numpy(chunk[..., :width].astype(np.int64))  # (B, T'), or (B, K, T') for K options
            mask = (t != 0).long()
            with torch.inference_mode():
                out += self.row_outputs(forward(t, mask).float(), mask)
        return out


def code_tree(dst: Path, kind: TaskKind | None = None) -> list[Path]:
    """The task kinds as an importable tree under `dst` (`stages/finetune/kinds/` and `core/errors.py`, the one
    module of ours they import), for an MLflow Model's `code_paths`: the registered model predicts with this code
    and needs nothing of the repository. The parent packages are empty there, so importing the kinds pulls in
    neither Ray nor the rest of the stage. A `kind` defined in a module outside the package ships that module too,
    under its dotted name."""
    import inspect
    import shutil
    import sys

    kinds = Path(__file__).parent
    shutil.copytree(kinds, dst / "stages" / "finetune" / "kinds", ignore=shutil.ignore_patterns("__pycache__"))
    (dst / "core").mkdir(parents=True)
    shutil.copyfile(kinds.parents[2] / "core" / "errors.py", dst / "core" / "errors.py")
    for package in (dst / "stages", dst / "stages" / "finetune", dst / "core"):
        (package / "__init__.py").write_text("")
    roots = [dst / "stages", dst / "core"]
    module = type(kind).__module__ if kind is not None else __name__
    if not module.startswith(__package__ + "."):  # a kind of someone else's: its own file, under its module path
        *parents, leaf = module.split(".")
        folder = dst.joinpath(*parents)
        folder.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(inspect.getfile(sys.modules[module]), folder / f"{leaf}.py")
        for i in range(len(parents)):
            init = dst.joinpath(*parents[:i + 1], "__init__.py")
            if not init.exists():
                init.write_text("")
        roots.append(dst / parents[0] if parents else folder / f"{leaf}.py")
    return roots


def check_stride(cfg: "FinetuneConfig", room: int) -> None:
    """Windows must advance: the overlap `doc_stride` below the `room` a window has for text."""
    if cfg.doc_stride >= room:
        raise StageInputError(f"finetune.doc_stride={cfg.doc_stride} leaves windows of max_seq_len={cfg.max_seq_len} "
                              f"no room to advance ({room} pieces of text each); use doc_stride < {room}")


@functools.lru_cache(maxsize=4)
def fast_tokenizer(tok_dir: Path, max_len: int):
    """The export's tokenizer: what the registered model reads raw text with, so features match serving. Built
    once per vocabulary and length (the train and dev splits share it)."""
    from deberta import hf

    return hf.build_tokenizer(tok_dir, max_len)


def read_task_json(path: Path) -> dict[str, Any]:
    """task.json of a task directory ({} without one), with a clear error for a file that does not parse."""
    meta_file = path / "task.json"
    if not meta_file.is_file():
        return {}
    try:
        meta = json.loads(meta_file.read_text())
    except json.JSONDecodeError as e:
        raise StageInputError(f"{meta_file} line {e.lineno} is not JSON ({e.msg}); fix the file") from None
    if not isinstance(meta, dict):
        raise StageInputError(f"{meta_file} must hold one JSON object, e.g. {{\"kind\": \"token\"}}")
    return meta


def split_file(path: Path, split: str, suffixes: Sequence[str]) -> Path | None:
    """The first of path/<split><suffix> that exists."""
    return next((path / f"{split}{s}" for s in suffixes if (path / f"{split}{s}").is_file()), None)


def task_name(path: Path, meta: dict[str, Any]) -> str:
    import re

    return meta.get("name") or re.sub(r"[^A-Za-z0-9_.-]+", "-", path.name).strip("-").lower() or "task"


def first_record_keys(path: Path) -> set[str]:
    """The keys of the first JSON object of a JSONL file (empty when it has none or does not parse)."""
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    return set()
                return set(record) if isinstance(record, dict) else set()
    return set()
