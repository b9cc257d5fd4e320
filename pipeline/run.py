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
import time
from pathlib import Path

from core import storage
from core.artifacts import ArtifactStore, artifact_id, file_digest
from core.config import ConfigError, PipelineConfig, apply_overrides, validate, with_corpus_arguments
from core.datasets import materialize_corpus
from pipeline.plan import STAGES, PlannedStage, StageSpec, make_plan, stages_until
from pipeline.presets import PRESETS, missing_for_preset
from stages.base import Prepared


class UserError(Exception):
    """Something the user can fix; printed as one line, exit code 2."""


def build_parser() -> argparse.ArgumentParser:
    stages = "\n".join(f"  {s.name:<9} {s.help}" for s in STAGES)
    presets = ", ".join(PRESETS)
    p = argparse.ArgumentParser(
        prog="python -m pipeline.run",
        description="DeBERTa pretraining pipeline on Ray: corpus -> vocab -> tokenize -> pretrain -> finetune.",
        epilog=f"stages (in order):\n{stages}\n\npresets: {presets}\n\n"
               "example: python -m pipeline.run --preset debug --set pretrain.max_steps=100",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="debug", help=f"model size and schedule: {presets} (default: debug)")
    p.add_argument("--corpus", nargs="+", metavar="PATH_OR_GLOB",
                   help="text files, directories or globs (.txt/.jsonl/.parquet, optionally .gz/.bz2/.zst), "
                        "or pyarrow.fs URIs, pooled as one source; or named sources blended to weights, each "
                        "NAME=PATH_OR_URI[:weight=W|:epochs=E] (docs/configuration.md); default: the built-in "
                        "news corpus")
    p.add_argument("--task", metavar="NAME_OR_PATH",
                   help="fine-tuning task: rotten-tomatoes, lee-sts, wnut16-ner, or a task directory (GLUE-format "
                        "sentence files, CoNLL/JSONL token files, or SQuAD JSON)")
    p.add_argument("--pretrained", metavar="DIR_OR_URI",
                   help="short for --set finetune.init=DIR_OR_URI: fine-tune this HF DeBERTa-v2 directory "
                        "(config.json, weights, spm.model) or registry version (models:/NAME/VERSION, "
                        "models:/NAME@ALIAS) instead of pretraining; runs the finetune stage alone, the [model] "
                        "section read from the checkpoint")
    p.add_argument("--workdir", default="workdir",
                   help="artifacts, MLflow store and Ray storage live here (default: ./workdir); or an object-store "
                        "URI (s3://bucket/prefix) for the artifacts and Ray storage, credentials from the AWS_* "
                        "environment")
    p.add_argument("--local-dir", type=Path, metavar="DIR",
                   help="with an object-store --workdir: this machine's directory for the copies of artifacts it "
                        "reads, the build area, the MLflow store and the locks (default: "
                        f"{LOCAL_DEFAULT}/<bucket>/<prefix>)")
    group = p.add_mutually_exclusive_group()
    group.add_argument("--only", metavar="STAGE", help="run just this stage (its inputs must be built)")
    group.add_argument("--until", metavar="STAGE", help="run the stages up to and including this one")
    p.add_argument("--force", metavar="STAGE", action="append", default=[],
                   help="recompute this stage even if its artifact exists (repeatable)")
    p.add_argument("--set", dest="overrides", metavar="SECTION.KEY=VALUE", action="append", default=[],
                   help="override a config value, e.g. --set pretrain.max_steps=100 (repeatable)")
    p.add_argument("--dry-run", action="store_true", help="print the resolved config and the plan; run nothing")
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
    return Path(LOCAL_DEFAULT, str(args.workdir).split("://", 1)[1].strip("/")).expanduser().resolve()


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
    try:
        local.mkdir(parents=True, exist_ok=True)
        probe = local / f".write-test-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise UserError(f"{what} {local} is not writable ({e.strerror}); pass {flag} DIR you can write to") from None
    return (location if storage.is_uri(location) else str(local)), local


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

    if "://" in path:
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
        return {"finetune"} if init else {s.name for s in stages_until(args.only or args.until)}
    except ValueError as e:
        raise UserError(str(e)) from None


def external_inputs(args: argparse.Namespace, cfg: PipelineConfig, workdir: Path,
                    planned: set[str]) -> tuple[dict, dict]:
    """Inputs that are not stage artifacts - the raw corpus, the fine-tuning task and the checkpoint finetune.init
    names - resolved exactly once, on the driver before Ray starts (a missing path fails in a second), with ids the
    stages' ids build on.

    A corpus file is identified by path, size, modification time and `content_key`, so an in-place edit re-runs
    the corpus stage; the built-in corpus by its content, so its id does not depend on where the workdir lives.
    """
    from stages import corpus
    from core.errors import StageInputError
    from core.init_checkpoint import resolve_init
    from stages.finetune import check_task
    from stages.finetune.tasks import resolve_task

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
                builtin = materialize_corpus("news", workdir / "data" / "news")
                raw = corpus.RawCorpus.of([str(builtin)])
                fingerprint = [["builtin:news", file_digest(builtin)]]
            objects["raw"] = raw
            ids["raw"] = artifact_id("raw", RAW_ID_VERSION, fingerprint, {})
        if "finetune" in planned:
            task = resolve_task(cfg.finetune.task, workdir)
            check_task(cfg.finetune, task)  # what the task's kind needs of the settings (`TaskKind.check`)
            objects["task"], ids["task"] = task, task.id
    except StageInputError as e:
        raise UserError(str(e)) from None
    return objects, ids


def print_plan(plan: list[PlannedStage]) -> None:
    print("plan:")
    for st in plan:
        state = ("cached (skip)" if st.cached else "run" if st.selected else "needed input, not built: error")
        state += " (--force: recomputed from scratch)" if st.forced else ""
        state += f" ({st.note})" if st.note else ""
        print(f"  {st.spec.name:<9} {st.artifact_id}  {state}")


def main(argv: list[str] | None = None) -> int:
    from core.locks import LockHeld
    from pipeline.executor import RunConflict

    args = build_parser().parse_args(argv)
    created = created_by_this_run(local_dir(args))
    try:
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
    from core.errors import StageInputError
    from pipeline.executor import claim, execute, print_summary, verify_inputs

    cfg = resolve_config(args)
    location, workdir = check_workdir(args)
    planned = planned_stages(args, cfg)
    cfg, prepared = prepare_stages(args, cfg, workdir, planned)
    objects, ext_ids = external_inputs(args, cfg, workdir, planned)
    if cfg.finetune.init:
        cfg = from_checkpoint(args, cfg, objects)
    print(f"resolved config ({cfg.preset}):\n{cfg.to_json()}", flush=True)
    store = ArtifactStore(location, workdir)
    try:
        plan = make_plan(cfg, store, ext_ids, only=args.only, until=args.until, force=tuple(args.force),
                         prepared=prepared)
    except ValueError as e:
        raise UserError(str(e)) from None
    missing = [s.spec.name for s in plan if not s.selected and not s.cached]
    if missing:
        raise UserError(f"--only {args.only} needs {', '.join(missing)} built first; run with --until {args.only}")
    print_plan(plan)
    if args.dry_run:
        for st in plan:
            if st.spec.dry_run is not None:
                inputs = {name: store.find(name, art_id, fetching=False) for name, art_id in st.input_ids.items()}
                print(st.spec.dry_run(*[getattr(cfg, s) for s in st.spec.sections],
                                      inputs={k: v for k, v in inputs.items() if v is not None}))
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


if __name__ == "__main__":
    sys.exit(main())
