"""`python -m pipeline.run`: the one entry point (also `ray job submit -- python -m pipeline.run`).

Resolves the configuration (preset + overrides), validates it, plans the stages (artifact ids
up front), then runs what is not cached yet, each stage in its own MLflow child run.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from core import storage
from core.artifacts import ArtifactStore, artifact_id, file_digest
from core.config import ConfigError, PipelineConfig, apply_overrides, validate, with_corpus_arguments
from core.datasets import materialize_corpus
from pipeline.plan import STAGE_NAMES, STAGES, PlannedStage, StageSpec, make_plan, stages_until, task_key
from pipeline.presets import PRESETS, missing_for_preset
from stages.base import Prepared


class UserError(Exception):
    """Something the user can fix; printed as one line, exit code 2."""


class _Parser(argparse.ArgumentParser):
    """argparse's own refusals as one `error:` line like every other (argparse prints its usage block first)."""

    def error(self, message: str):
        raise UserError(f"{message}; see python -m pipeline.run --help")


class _Once(argparse.Action):
    """A flag that takes one value: given twice with different values it is refused, never silently the last one."""

    def __call__(self, parser, namespace, values, option_string=None):
        seen = getattr(namespace, f"_given_{self.dest}", None)
        if seen is not None and seen != values:
            raise argparse.ArgumentError(self, f"given twice ({seen} and {values}); give it once")
        setattr(namespace, f"_given_{self.dest}", values)
        setattr(namespace, self.dest, values)


def build_parser() -> argparse.ArgumentParser:
    stages = "\n".join(f"  {s.name:<9} {s.help}" for s in STAGES)
    presets = ", ".join(PRESETS)
    p = _Parser(
        prog="python -m pipeline.run",
        description="DeBERTa pretraining pipeline on Ray: corpus -> vocab -> tokenize -> pretrain -> finetune.",
        epilog=f"stages (in order):\n{stages}\n\npresets: {presets}\n\n"
               "example: python -m pipeline.run --preset debug --set pretrain.max_steps=100",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="debug", action=_Once, help=f"model size and schedule: {presets} (default: debug)")
    p.add_argument("--corpus", nargs="+", action="extend", metavar="PATH_OR_GLOB",
                   help="text files, directories or globs (.txt/.jsonl/.parquet, optionally .gz/.bz2/.zst), "
                        "or pyarrow.fs URIs, pooled as one source; or named sources blended to weights, each "
                        "NAME=PATH_OR_URI[:weight=W|:epochs=E] (docs/configuration.md); repeatable, every value "
                        "kept; default: the built-in news corpus")
    p.add_argument("--task", metavar="NAME_OR_PATH", action=_Once,
                   help="fine-tuning task: rotten-tomatoes, lee-sts, wnut16-ner, rotten-tomatoes-choice, or a task "
                        "directory (GLUE-format sentence files, CoNLL/JSONL token files, or SQuAD JSON); or several, "
                        "comma-separated, or all (every built-in): each its own sweep and registry model, their "
                        "scores in one table")
    p.add_argument("--pretrained", metavar="DIR_OR_URI", action=_Once,
                   help="short for --set finetune.init=DIR_OR_URI: fine-tune this HF DeBERTa-v2 directory "
                        "(config.json, weights, spm.model) or registry version (models:/NAME/VERSION, "
                        "models:/NAME@ALIAS) instead of pretraining; runs the finetune stage alone, the [model] "
                        "section read from the checkpoint")
    p.add_argument("--workdir", default="workdir", action=_Once,
                   help="artifacts, MLflow store and Ray storage live here (default: ./workdir); or an object-store "
                        "URI (s3://bucket/prefix) for the artifacts and Ray storage, credentials from the AWS_* "
                        "environment")
    p.add_argument("--local-dir", type=Path, metavar="DIR", action=_Once,
                   help="with an object-store --workdir: this machine's directory for the copies of artifacts it "
                        "reads, the build area, the MLflow store and the locks (default: "
                        f"{LOCAL_DEFAULT}/<bucket>/<prefix>)")
    group = p.add_mutually_exclusive_group()
    group.add_argument("--only", metavar="STAGE", action=_Once, help="run just this stage (its inputs must be built)")
    group.add_argument("--until", metavar="STAGE", action=_Once, help="run the stages up to and including this one")
    p.add_argument("--force", metavar="STAGE", action="append", default=[],
                   help="recompute this stage even if its artifact exists (repeatable)")
    p.add_argument("--set", dest="overrides", metavar="SECTION.KEY=VALUE", action="append", default=[],
                   help="override a config value, e.g. --set pretrain.max_steps=100 (repeatable)")
    p.add_argument("--dry-run", action="store_true",
                   help="check everything a run checks before Ray starts, print the resolved config, the corpus "
                        "listing and the plan; run nothing and write nothing")
    p.add_argument("--verify", action="store_true",
                   help="check every reused artifact's files against its manifest's SHA-256 digests, not just their "
                        "sizes (about 1 s per GB)")
    p.add_argument("--break-lock", action="store_true",
                   help="take over locks held by runs on other hosts (their liveness cannot be checked from here); "
                        "only when those runs are gone")
    return p


def resolve_config(args: argparse.Namespace) -> PipelineConfig:
    if args.preset not in PRESETS:
        raise UserError(f"unknown preset {args.preset!r}; choose one of: {', '.join(PRESETS)}")
    cfg = PRESETS[args.preset]()
    overrides = list(args.overrides)
    given = {o.split("=", 1)[0].strip(): o for o in overrides}
    for flag, value, key in (("--task", args.task, "finetune.task"), ("--pretrained", args.pretrained, "finetune.init")):
        if value and key in given:
            raise UserError(f"{flag} {value} and --set {given[key]} both set {key}; give it once")
    if args.task:
        overrides.append(f"finetune.task={args.task}")
    if args.pretrained:
        overrides.append(f"finetune.init={args.pretrained}")
    try:
        cfg = apply_overrides(cfg, overrides)
        cfg = with_corpus_arguments(cfg, args.corpus)  # named sources become corpus.sources
        check_config(cfg)
    except ConfigError as e:
        raise UserError(str(e)) from None
    missing = missing_for_preset(args.preset, cfg)
    if missing:
        raise UserError(missing)
    return cfg


def _sections(spec: StageSpec, cfg: PipelineConfig) -> tuple[object, dict[str, object]]:
    """A stage's config sections as its functions take them: the first, and the rest by name."""
    first, *rest = (getattr(cfg, s) for s in spec.sections)
    return first, dict(zip(spec.sections[1:], rest))


def check_config(cfg: PipelineConfig) -> None:
    """`validate`, then every stage's own rules across its sections (`check`, stages/base.py); ConfigError."""
    validate(cfg)
    for spec in STAGES:
        if spec.check is not None:
            first, rest = _sections(spec, cfg)
            spec.check(first, **rest)


LOCAL_DEFAULT = "~/.cache/deberta-pipeline"


def local_dir(args: argparse.Namespace) -> Path:
    """The local side of the workdir: the workdir itself, or for an object-store one `--local-dir` (default
    LOCAL_DEFAULT/<bucket>/<prefix>)."""
    if not storage.is_uri(args.workdir):
        return Path(args.workdir).expanduser().resolve()
    if args.local_dir is not None:
        return args.local_dir.expanduser().resolve()
    return Path(LOCAL_DEFAULT, storage.split_uri(args.workdir)[1].strip("/")).expanduser().resolve()


def check_workdir(args: argparse.Namespace) -> tuple[str, Path]:
    """(the workdir as given: a URI, or the local directory; its local side), both written to once, the local side
    created (a run that then stops at bad input leaves nothing: `main` removes what it created)."""
    location, local = str(args.workdir), local_dir(args)
    if storage.is_uri(location):
        try:
            storage.check_writable(location)
        except (OSError, ValueError) as e:
            raise UserError(f"workdir {location}: {storage.store_fix(e)}") from None
    elif args.local_dir is not None:
        raise UserError(f"--local-dir is for an object-store --workdir (s3://...); the local workdir {local} "
                        f"holds everything itself: drop --local-dir")
    what, flag = ("--local-dir", "--local-dir") if storage.is_uri(location) else ("workdir", "--workdir")
    existed = local.exists()
    try:
        local.mkdir(parents=True, exist_ok=True)
        probe = local / f".write-test-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise UserError(f"{what} {local} cannot be {'written to' if existed else 'created'}: {unwritable_cause(local)} "
                        f"({e.strerror}); pass {flag} DIR you can write to") from None
    return (location if storage.is_uri(location) else str(local)), local


VIRTUAL_FILE_SYSTEMS = frozenset({"proc", "sysfs", "devtmpfs", "cgroup", "cgroup2", "debugfs", "securityfs", "tracefs"})


def _mount_of(path: Path) -> tuple[str, bool]:
    """(file-system type, mounted read-only) of the mount holding `path`, from /proc/self/mounts; ("", False) where
    that is not there."""
    best, fstype, ro = "", "", False
    try:
        for line in Path("/proc/self/mounts").read_text().splitlines():
            _, point, kind, options = line.split()[:4]
            point = point.replace("\\040", " ")
            if (str(path) == point or str(path).startswith(point.rstrip("/") + "/")) and len(point) > len(best):
                best, fstype, ro = point, kind, "ro" in options.split(",")
    except OSError:
        pass
    return fstype, ro


def unwritable_cause(local: Path) -> str:
    """Why a directory cannot be created or written, in terms of its nearest existing ancestor (the errno alone says
    "No such file or directory" for a new directory under /proc)."""
    existing = next(p for p in (local, *local.parents) if p.exists())
    if not existing.is_dir():
        return f"{existing} is a file, not a directory"
    fstype, read_only = _mount_of(existing)
    if fstype in VIRTUAL_FILE_SYSTEMS:
        return f"{existing} is on the kernel's {fstype} file system, which holds no files of ours"
    if read_only:
        return f"{existing} is on a read-only file system"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"{existing} is not writable by this user"
    return f"{existing} refused it"


def created_by_this_run(workdir: Path) -> Path | None:
    """The outermost directory of `workdir`'s path that does not exist yet (what a refused run removes), or None."""
    workdir = workdir.expanduser().resolve()
    missing = [p for p in (workdir, *workdir.parents) if not p.exists()]
    return missing[-1] if missing else None


RAW_ID_VERSION = "3"
"""Bumped when what identifies a raw corpus changes (today: files by path, size, mtime and `content_key`; the
built-in corpus by content)."""
WHOLE_FILE_KEY_MAX = 64 << 20
"""Local corpus files up to this size are identified by a digest of all their bytes; larger ones by their first and
last MiB (`content_key`)."""


def content_key(path: str, size: int) -> str:
    """xxh3 of a local corpus file's content, so that an edit that keeps size and modification time (an editor or
    `touch -r`) still gives a new corpus id: all of the file up to WHOLE_FILE_KEY_MAX (reading it costs about what
    the corpus stage's own read does), else its first and last MiB (a middle edit of a large file that keeps both
    size and mtime goes unseen; README says so). Remote files (URIs) keep path, size and mtime: reading them
    again at every start would cost a download."""
    import xxhash

    if storage.is_uri(path):
        return ""
    try:
        if size <= WHOLE_FILE_KEY_MAX:
            return file_digest(Path(path), xxhash.xxh3_128)
        h = xxhash.xxh3_128()
        with open(path, "rb") as f:
            h.update(f.read(1 << 20))
            f.seek(size - (1 << 20))
            h.update(f.read(1 << 20))
        return h.hexdigest()
    except OSError as e:  # unreadable (a dangling link): the corpus stage rejects it with the reason
        return f"unreadable: {e.strerror}"


def planned_stages(args: argparse.Namespace, cfg: PipelineConfig) -> set[str]:
    """The stages this invocation plans: those up to --only/--until, or the finetune stage alone for finetune.init."""
    init = cfg.finetune.init
    if init and (args.until or args.corpus or args.only not in (None, "finetune")):
        raise UserError(f"finetune.init={init} runs the finetune stage alone; drop --only/--until/--corpus")
    try:
        planned = {"finetune"} if init else {s.name for s in stages_until(args.only or args.until)}
    except ValueError as e:
        raise UserError(str(e)) from None
    check_flags_fit(args, init, planned)
    return planned


def check_flags_fit(args: argparse.Namespace, init: str, planned: set[str]) -> None:
    """A flag about a stage this run does not build is refused, never ignored: `--force` of a stage outside
    --until/--only, `--task` of a run that stops before fine-tuning."""
    if init:
        builds, why = {"finetune"}, f"finetune.init={init} runs the finetune stage alone"
    elif args.only:
        builds, why = {args.only}, f"--only {args.only} builds {args.only} alone"
    else:
        builds, why = planned, f"--until {args.until} stops before it" if args.until else ""
    for stage in args.force:
        if stage not in STAGE_NAMES:
            raise UserError(f"--force {stage}: unknown stage; stages are {', '.join(STAGE_NAMES)}")
        if stage not in builds:
            fix = (f"use --until {args.only} --force {stage} to rebuild it and what follows" if args.only and not init
                   else f"drop --force {stage}, or run --until {stage}")
            raise UserError(f"--force {stage}: this run does not build {stage} ({why}); {fix}")
    if args.task and "finetune" not in planned:
        raise UserError(f"--task {args.task}: this run stops before the finetune stage (--until {args.until}); drop "
                        f"--task, or run through finetune")


def external_inputs(args: argparse.Namespace, cfg: PipelineConfig, workdir: Path,
                    planned: set[str], builtin_dir: Path | None = None) -> tuple[dict, dict]:
    """Inputs that are not stage artifacts - the raw corpus, the fine-tuning task and the checkpoint finetune.init
    names - resolved exactly once, on the driver before Ray starts (a missing path fails in a second), with ids the
    stages' ids build on. The built-in corpus is written under `builtin_dir` (default: workdir/data/news; a dry run
    passes a temporary directory, its id being its content's).

    A corpus file is identified by path, size, modification time and `content_key`, so an in-place edit re-runs
    the corpus stage; the built-in corpus by its content, so its id does not depend on where the workdir lives.
    """
    from stages import corpus
    from core.errors import StageInputError
    from core.init_checkpoint import resolve_init
    from stages.finetune import check_task
    from stages.finetune.tasks import resolve_tasks
    from stages.pretrain.probes import resolve_probes

    init = cfg.finetune.init
    objects, ids = {}, {}
    try:
        if init:  # a registry version is downloaded here, on the driver, before Ray starts
            objects["pretrain"] = resolve_init(init, workdir)
            ids["pretrain"] = objects["pretrain"].id
        if "corpus" in planned:
            if cfg.corpus.sources:  # named sources: their names, weights and epochs are part of what the corpus is
                raw = corpus.RawCorpus.of_blend(cfg.corpus.blend())
                fingerprint = {"sources": [[s.name, s.weight, s.epochs] for s in raw.blend],
                               "files": [[*s, content_key(s[0], s[1]), r] for s, r in zip(raw.sources, raw.ranks)]}
            elif args.corpus:
                raw = corpus.RawCorpus.of(args.corpus)
                fingerprint = [[*s, content_key(s[0], s[1])] for s in raw.sources]
            else:
                builtin = materialize_corpus("news", builtin_dir or workdir / "data" / "news")
                name = f"builtin:news/{builtin.name}"  # what its document ids hash: the same in every workdir
                raw = dataclasses.replace(corpus.RawCorpus.of([str(builtin)]), id_paths=(name,))
                fingerprint = [[name, file_digest(builtin)]]
            objects["raw"] = raw
            ids["raw"] = artifact_id("raw", RAW_ID_VERSION, fingerprint, {})
        if "pretrain" in planned and cfg.pretrain.probes:
            resolve_probes(cfg.pretrain, workdir)  # each probe task read and checked as the finetune stage would
        if "finetune" in planned:  # every task of the list read and checked before Ray starts
            for task in resolve_tasks(cfg.finetune.task, workdir):
                check_task(cfg.finetune, task)  # what the task's kind needs of the settings (`TaskKind.check`)
                objects[task_key(task.name)], ids[task_key(task.name)] = task, task.id
    except StageInputError as e:
        raise UserError(str(e)) from None
    return objects, ids


def print_plan(plan: list[PlannedStage]) -> None:
    print("plan:")
    for st in plan:
        state = ("cached (skip)" if st.cached else "run" if st.selected else "needed input, not built: error")
        state += " (--force: recomputed from scratch)" if st.forced else ""
        state += f" ({st.note})" if st.note else ""
        print(f"  {st.name:<9} {st.artifact_id}  {state}")


def main(argv: list[str] | None = None) -> int:
    from core.locks import LockHeld
    from pipeline.executor import RunConflict

    created = None
    try:
        args = build_parser().parse_args(argv)
        created = created_by_this_run(local_dir(args))
        rc = _main(args)
        if args.dry_run and created is not None:  # a plan on paper writes nothing either
            shutil.rmtree(created, ignore_errors=True)
        return rc
    except (UserError, ConfigError, RunConflict, LockHeld) as e:
        if created is not None:  # refused before any stage ran: what this run created (the workdir, a download of
            shutil.rmtree(created, ignore_errors=True)  # a registry version, the built-in corpus) goes with it
        print(f"error: {e}", file=sys.stderr)
        return 2


def from_checkpoint(args: argparse.Namespace, cfg: PipelineConfig, objects: dict) -> PipelineConfig:
    """finetune.init (--pretrained): the [model] section is the checkpoint's architecture and [vocab] its
    tokenizer's size (then validated like any config)."""
    from sentencepiece import SentencePieceProcessor

    from deberta.config import DebertaConfig
    from core.tokenizer import MODEL_FILE
    from core.errors import StageInputError
    from core.init_checkpoint import model_section

    try:
        ckpt = objects["pretrain"]
        pieces = SentencePieceProcessor(model_file=str(Path(ckpt.path) / MODEL_FILE)).vocab_size()
        cfg = dataclasses.replace(cfg, model=DebertaConfig(**model_section(ckpt)),
                                  vocab=dataclasses.replace(cfg.vocab, vocab_size=pieces))
        cfg = apply_overrides(cfg, [o for o in args.overrides if o.startswith("model.")])  # --set still wins
        validate(cfg)
    except (StageInputError, ConfigError) as e:
        raise UserError(str(e)) from None
    return cfg


def prepare_stages(args: argparse.Namespace, cfg: PipelineConfig, workdir: Path,
                   planned: set[str]) -> tuple[PipelineConfig, Prepared]:
    """Every stage's `prepare` (stages/base.py): what its settings bring in from outside, resolved once before Ray
    starts, merged into one `Prepared`; the config fields they decide applied and the whole config checked again."""
    from core.errors import StageInputError

    merged = Prepared()
    try:
        for spec in STAGES:
            if spec.prepare is None:
                continue
            first, rest = _sections(spec, cfg)
            got = spec.prepare(first, **rest, planned=frozenset(planned), workdir=workdir,
                               overrides=tuple(args.overrides))
            merged = Prepared(**{f.name: {**getattr(merged, f.name), **getattr(got, f.name)}
                                 for f in dataclasses.fields(Prepared)})
        if merged.config:
            cfg = dataclasses.replace(cfg, **{section: dataclasses.replace(getattr(cfg, section), **fields)
                                              for section, fields in merged.config.items()})
            check_config(cfg)
    except (StageInputError, ConfigError) as e:
        raise UserError(str(e)) from None
    return cfg, merged


def _main(args: argparse.Namespace) -> int:
    """Every check that needs no cluster first (the same ones for a dry run and a real run), then the plan is
    printed, then - not a dry run - Ray starts."""
    if args.dry_run:  # the built-in corpus of a plan on paper goes to a temporary directory: it writes nothing
        with tempfile.TemporaryDirectory(prefix="pipeline-dry-run-") as scratch:
            return _plan_and_run(args, Path(scratch))
    return _plan_and_run(args, None)


def _plan_and_run(args: argparse.Namespace, scratch: Path | None) -> int:
    from core.errors import StageInputError
    from pipeline.executor import claim, cluster_fit, execute, print_summary, verify_inputs

    cfg = resolve_config(args)
    location, workdir = check_workdir(args)
    planned = planned_stages(args, cfg)
    cfg, prepared = prepare_stages(args, cfg, workdir, planned)
    builtin = workdir / "data" / "news"
    if scratch is not None and not (builtin / "news.jsonl").exists():
        builtin = scratch / "news"
    objects, ext_ids = external_inputs(args, cfg, workdir, planned, builtin)
    if cfg.finetune.init:
        cfg = from_checkpoint(args, cfg, objects)
    warnings = check_inputs(cfg, objects, planned - set(prepared.replaces))
    store = ArtifactStore(location, workdir)
    try:
        plan = make_plan(cfg, store, ext_ids, only=args.only, until=args.until, force=tuple(args.force),
                         prepared=prepared)
    except ValueError as e:
        raise UserError(str(e)) from None
    missing = [s.spec.name for s in plan if not s.selected and not s.cached]
    if missing:
        raise UserError(f"--only {args.only} needs {', '.join(missing)} built first; run with --until {args.only}")
    cluster = cluster_fit(cfg, [s.spec.name for s in plan if not s.cached])
    if cluster.lacks and not args.dry_run:
        raise UserError(cluster.lacks)
    print(f"resolved config ({cfg.preset}):\n{cfg.to_json()}", flush=True)
    for line in warnings:
        print(f"warning: {line}", file=sys.stderr, flush=True)
    print_plan(plan)
    if args.dry_run:
        print(cluster.line)
        for st in {st.spec.name: st for st in plan}.values():  # a stage's plan on paper once, for all its tasks
            if st.spec.dry_run is not None:
                several = {} if st.spec.side_by_side is None else {  # the instances that will run, and where
                    "instances": [dry_run_inputs(s, store, objects) for s in plan if s.spec is st.spec and not s.cached],
                    "cluster": cluster.size}
                print(st.spec.dry_run(*[getattr(cfg, s) for s in st.spec.sections], inputs=dry_run_inputs(st, store,
                                      objects), **several, **{s: getattr(cfg, s) for s in st.spec.dry_run_reads}))
        return 0
    with claim(plan, store, workdir, take_foreign=args.break_lock):
        try:
            verify_inputs(plan, store, digests=args.verify)
        except StageInputError as e:
            raise UserError(str(e)) from None
        started = time.time()
        outcome = execute(cfg, plan, {**objects, **prepared.objects}, store, workdir)
    print_summary(outcome, store, time.time() - started)
    return 0 if outcome.ok else 1


def check_inputs(cfg: PipelineConfig, objects: dict, planned: set[str]) -> list[str]:
    """Every planned stage's `check_inputs` (but those a `prepare` replaced: a copied tokenizer trains nothing) (pipeline/plan.py) on the external inputs as listed before Ray starts
    (the raw corpus's files and sizes): a run that cannot succeed is refused (StageInputError -> UserError), one that
    probably disappoints returns its warnings."""
    from core.errors import StageInputError

    warnings: list[str] = []
    try:
        for spec in STAGES:
            if spec.check_inputs is not None and spec.name in planned:
                first, rest = _sections(spec, cfg)
                warnings += spec.check_inputs(first, **rest, listing=objects, planned=frozenset(planned))
    except (StageInputError, ConfigError) as e:
        raise UserError(str(e)) from None
    return warnings


def dry_run_inputs(st: PlannedStage, store: ArtifactStore, objects: dict) -> dict:
    """A stage's inputs as its `dry_run` sees them: the finished input artifacts (not fetched) and the external
    inputs as listed (the raw corpus)."""
    found = {name: objects.get(st.object_key(name)) or store.find(name, art_id, fetching=False)
             for name, art_id in st.input_ids.items()}
    return {k: v for k, v in found.items() if v is not None}


if __name__ == "__main__":
    sys.exit(main())
