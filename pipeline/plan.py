"""The stage table and the plan of one invocation.

Every stage's artifact id is computable before anything runs (it hashes the stage's *what* config
fields and its inputs' ids), so the plan knows up front which stages are cached and which will run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from core.artifacts import ArtifactStore, artifact_id, canonical_json
from core.config import PipelineConfig
from stages import corpus, finetune, pretrain, tokenize, vocab
from stages.base import Prepared


@dataclass(frozen=True)
class StageSpec:
    name: str
    run: Callable[..., Any]
    """`run(first_section, *, other_sections..., inputs, out, ctx) -> StageResult` (stages/base.py)."""
    version: str
    """Bumped when the stage's code changes what it writes: part of the artifact id."""
    sections: tuple[str, ...]
    """Config sections handed to `run` (the first positionally, the rest by name)."""
    inputs: tuple[str, ...]
    """Upstream stages whose artifacts the stage reads, or external inputs ("raw", "task")."""
    help: str
    dry_run: Callable[..., str] | None = None
    """Optional `dry_run(*sections, inputs) -> str` for `--dry-run`: the plan on paper. `inputs`: the stage's input
    artifacts that are finished, not fetched (their files are there only if this machine has them)."""
    check: Callable[..., None] | None = None
    """Optional `check(first_section, *, other_sections...)`: the stage's rules across its sections, beside
    `validate` (stages/base.py)."""
    check_inputs: Callable[..., list[str]] | None = None
    """Optional `check_inputs(first_section, *, other_sections..., listing, planned) -> warnings`: what the stage can
    tell from its settings and the external inputs as listed before Ray starts (`listing`: {"raw": RawCorpus, ...};
    file names, sizes), called by `--dry-run` and the real run alike for the planned stages: StageInputError for a
    run that cannot succeed, warnings for one that probably disappoints."""
    dry_run_reads: tuple[str, ...] = ()
    """Config sections `dry_run` reads besides the stage's own, by name (the pretrain plan reads the sequence length
    tokenize will write); never hashed into the artifact id."""
    prepare: Callable[..., Prepared] | None = None
    """Optional `prepare(first_section, *, other_sections..., planned, workdir, overrides) -> Prepared`: what the
    stage's settings bring in from outside, resolved before Ray starts (stages/base.py)."""
    side_by_side: Callable[..., int] | None = None
    """Optional `side_by_side(first_section, *, cpus, gpus) -> int`: how many of the stage's instances (one per task
    of `finetune.task=A,B,C`; they read the same inputs and not each other) run at once, each in a thread of the
    driver, on a cluster of `cpus` CPUs and `gpus` GPUs; it also readies the process for that. None: one after
    another. A stage that has it also gets, in its `dry_run`, `instances` (the inputs of each instance that will
    run) and `cluster` ((cpus, gpus), or None when unknown before joining)."""
    tasks_use_paths: bool = False
    """The stage's Ray tasks, on any node, read its inputs and write its output by path (so with a workdir in object
    storage, the local side must be on every node: pipeline.executor checks it)."""


STAGES: tuple[StageSpec, ...] = (
    StageSpec("corpus", corpus.run, corpus.VERSION, ("corpus",), ("raw",),
              "exact + MinHash-LSH dedup, Parquet shards, 5% validation split (Ray Data)", corpus.dry_run,
              check_inputs=corpus.check_inputs, prepare=corpus.prepare, tasks_use_paths=True),
    StageSpec("vocab", vocab.run, vocab.VERSION, ("vocab",), ("corpus",),
              "SentencePiece vocabulary with fixed special-token ids", check_inputs=vocab.check_inputs),
    StageSpec("tokenize", tokenize.run, tokenize.VERSION, ("tokenize",), ("corpus", "vocab"),
              "packed [CLS] ... [SEP] uint32 sequences in memory-mapped Arrow shards (Ray tasks)",
              tasks_use_paths=True),
    StageSpec("pretrain", pretrain.run, pretrain.VERSION, ("pretrain", "model"), ("tokenize", "vocab", "corpus"),
              "DeBERTa MLM + EMD or DeBERTaV3 RTD, Ray Train + DeepSpeed ZeRO, MLflow registry", pretrain.dry_run,
              check=pretrain.check_config, prepare=pretrain.prepare, dry_run_reads=("tokenize",)),
    # the corpus: what the checkpoint read, against which the dev split's contamination is measured
    StageSpec("finetune", finetune.run, finetune.VERSION, ("finetune", "model"),
              ("pretrain", "vocab", "task", "corpus"),
              "Ray Tune sweep over the Table 9 grid (+SiFT), champion in the MLflow registry", finetune.dry_run,
              side_by_side=finetune.side_by_side),
)
STAGE_NAMES = tuple(s.name for s in STAGES)
FROM_CHECKPOINT_INPUTS = ("pretrain", "task")
"""The finetune stage's inputs when it starts from an external checkpoint: its directory holds the tokenizer."""


def task_key(task: str) -> str:
    """One fine-tuning task among the external inputs (their ids and objects): `finetune.task` may list several,
    and the finetune stage is planned once per task, each instance reading its own as its input `task`."""
    return f"task:{task}"


def _task_keys(external_ids: dict[str, str]) -> list[str]:
    return [k for k in external_ids if k.startswith("task:")] or ["task"]


def _inputs(spec: StageSpec, cfg: PipelineConfig, external_ids: dict[str, str],
            prepared: Prepared) -> tuple[tuple[str, ...], dict[str, Any]]:
    """(the stage's inputs, its config hashed into the artifact id)."""
    if "pretrain" in external_ids:  # finetune.init: fine-tune that checkpoint, nothing else
        return FROM_CHECKPOINT_INPUTS, {s: getattr(cfg, s).what() for s in spec.sections}
    if spec.name in prepared.replaces:  # made from those inputs alone: its settings change nothing
        return prepared.replaces[spec.name], {}
    return spec.inputs + prepared.adds.get(spec.name, ()), {s: getattr(cfg, s).what() for s in spec.sections}


def stages_until(last: str | None) -> tuple[StageSpec, ...]:
    """The stages up to and including `last` (all of them for None); ValueError for an unknown name."""
    if last is None:
        return STAGES
    if last not in STAGE_NAMES:
        raise ValueError(f"unknown stage {last!r}; stages are {', '.join(STAGE_NAMES)}")
    return STAGES[: STAGE_NAMES.index(last) + 1]


@dataclass(frozen=True)
class PlannedStage:
    spec: StageSpec
    artifact_id: str
    config: dict[str, Any]
    """The stage's resolved config sections, {section: dict} (every field, as logged)."""
    input_ids: dict[str, str]
    cached: bool
    selected: bool
    """Asked for by --only/--until; False for stages only needed as (cached) inputs."""
    forced: bool = False
    """--force: recompute, discarding the stage's resumable state."""
    note: str = ""
    """What the plan says beside the stage (`Prepared.notes`)."""
    task: str = ""
    """The finetune stage's task: its input `task` is the external input `task_key(task)`."""
    one_of_several: bool = False
    """One task of several (`finetune.task=A,B`): the instance is named `finetune:<task>`."""

    @property
    def name(self) -> str:
        """The stage as the run names it: `finetune:<task>` for one task of several, else the stage."""
        return f"{self.spec.name}:{self.task}" if self.one_of_several else self.spec.name

    def object_key(self, name: str) -> str:
        """The key of input `name` among the run's external objects (a task of several: `task_key`)."""
        return task_key(self.task) if name == "task" and self.task else name


def make_plan(cfg: PipelineConfig, store: ArtifactStore, external_ids: dict[str, str],
              only: str | None = None, until: str | None = None, force: tuple[str, ...] = (),
              prepared: Prepared = Prepared()) -> list[PlannedStage]:
    """Resolve artifact ids of the stages up to `until` (or just `only`).

    `external_ids` holds ids of inputs that are not stages (the raw corpus fingerprint, the task); `prepared`, what
    the stages' own `prepare` brought in from outside and which stages read it.
    """
    unknown = sorted(set(force) - set(STAGE_NAMES))
    if unknown:
        raise ValueError(f"--force {unknown[0]}: unknown stage; stages are {', '.join(STAGE_NAMES)}")
    # A forced stage outside the plan would be silently ignored (pipeline.run refuses it with the fix first).
    outside = [f for f in force if f not in (s.name for s in stages_until(only or until))]
    if outside:
        raise ValueError(f"--force {outside[0]}: not in this plan; drop it or plan through {outside[0]}")
    ids = {**external_ids, **{name: obj.id for name, obj in prepared.objects.items()}}
    plan = []
    from_checkpoint = "pretrain" in external_ids  # finetune.init: fine-tune that checkpoint, nothing else
    specs = tuple(s for s in STAGES if s.name == "finetune") if from_checkpoint else stages_until(only or until)
    for spec in specs:
        inputs, what = _inputs(spec, cfg, external_ids, prepared)
        # one instance per fine-tuning task, its input `task` that task's id: the artifact id of a task is the same
        # whether it is fine-tuned alone or in a suite, so a task added to the list is the only one that runs
        keys = _task_keys(external_ids) if "task" in inputs else [""]
        for key in keys:
            input_ids = {name: ids[key if name == "task" else name] for name in inputs}
            art_id = artifact_id(spec.name, spec.version, canonical_json(what), input_ids)
            ids[spec.name] = art_id
            forced = spec.name in force
            cached = store.exists(spec.name, art_id) and not forced
            plan.append(PlannedStage(spec, art_id, {s: getattr(cfg, s).to_dict() for s in spec.sections}, input_ids,
                                     cached, selected=only is None or spec.name == only, forced=forced,
                                     note=prepared.notes.get(spec.name, ""), task=key.partition(":")[2],
                                     one_of_several=len(keys) > 1))
    return plan
