"""Pretrain stage: an objective (DeBERTa's MLM + EMD, DeBERTaV3's RTD, either with ALBERT's SOP) on Ray Train
(`TorchTrainer`) with DeepSpeed ZeRO.

The package, one thing per file:
    __init__.py    the driver (this module): checks of the input artifacts, the trainer, the artifact from the
                   last checkpoint
    objective.py   what an objective supplies (`Objective`); mlm.py, rtd.py, sop.py implement it; objectives.py
                   names them (`objective_for`, the one reader of `pretrain.objective`) and runs their checks
    continued.py   continued pretraining (`pretrain.init`): what the checkpoint decides before Ray starts (`prepare`),
                   the starting weights, the lineage tags
    loop.py        one training step and one validation pass as plain functions (the benchmarks call them too), and
                   the Ray Train worker loop around them: engine, data position, evaluation schedule
    rank_zero.py   the workers' side effects (prints, MLflow metrics through tracking outages), on rank 0 only
    checkpoints.py what a checkpoint holds, saving one, listing a run's and restoring the newest that verifies
    data.py        the order the tokenised train shards are read in: a permutation per epoch, rows by index
    registry.py    metrics.json, the loss curve and the registry version
    probes.py      `pretrain.probes`: checkpoints fine-tuned on tasks beside training, probe.<task>.<metric> per step
    estimates.py   --dry-run: parameters, DeepSpeed's memory estimates, time
The DeepSpeed config comes from `training/deepspeed_config.py`, the engine from `training/engine.py`.

A restart of the whole stage (new driver, same artifact id) names the Ray Train run `pretrain-<artifact id>` under
the same storage path, so Ray Train V2 finds the run and its checkpoints again (`checkpoints.py` says how).

Artifact:
    model/config.json, model/model.pt   the consolidated fp32 model fine-tuning reads (`deberta.checkpoint`)
    tokenizer/spm.model, special_tokens.json
    hf/                                 transformers export; the objective's further directories (its module says)
    metrics.json                        final train/validation numbers, throughput, where it ran
    loss_curve.png                      train loss and validation loss per step
    probes.png, probes.json             with pretrain.probes: each probe's dev metric per step (`probes.py`)
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa

from core.artifacts import Artifact
from core.config import PretrainConfig
from core.errors import StageInputError
from core.tokenizer import Tokenizer
from stages.base import StageContext, StageResult
from stages.pretrain import data
from stages.pretrain.checkpoints import set_aside_cut_short_snapshot
from stages.pretrain.continued import init_tags, initial_weights, prepare
from stages.pretrain.estimates import dry_run
from stages.pretrain.objective import Objective
from stages.pretrain.objectives import check_config, objective_for
from stages.pretrain.probes import Probes, resolve_probes, start_watching, with_probes
from stages.pretrain.registry import finish
from training.deepspeed_config import DeepSpeedConfig, build_deepspeed_config

if TYPE_CHECKING:  # the model library and the worker loop import torch: only inside `run`
    from deberta.config import DebertaConfig
    from stages.pretrain.checkpoints import TrainState
    from stages.pretrain.loop import LoopJob

__all__ = ["VERSION", "check_config", "dry_run", "objective_for", "prepare", "run"]
"""What the stage table (`pipeline/plan.py`) and the benchmarks take from the stage."""

VERSION = "4"


# ----------------------------------------------------------------------------------------------- checks

def check_inputs(model: DebertaConfig, tokenizer_len: int, seq_len: int) -> None:
    """What only the input artifacts can tell (the config itself was validated before any stage ran)."""
    problems = []
    if model.vocab_size < tokenizer_len:
        problems.append(f"model.vocab_size={model.vocab_size} < tokenizer length {tokenizer_len} of the vocab "
                        f"artifact; set model.vocab_size >= {tokenizer_len}")
    if seq_len > model.max_position_embeddings:
        problems.append(f"token sequences have {seq_len} tokens > model.max_position_embeddings="
                        f"{model.max_position_embeddings}; re-tokenize with a shorter tokenize.max_seq_len")
    if problems:
        raise StageInputError("; ".join(problems))


def token_shards(tokenize: Artifact, split: str) -> tuple[list[str], int, int]:
    """(files, rows, sequence length) of a split of the tokenize artifact, checked before workers start."""
    files = sorted(str(p) for p in (Path(tokenize.path) / split).glob("*.arrow"))
    if not files:
        raise StageInputError(f"tokenize artifact {tokenize.path} has no {split}/*.arrow shards; rebuild it "
                              f"(python -m pipeline.run --until tokenize --force tokenize)")
    try:
        schema = pa.ipc.open_file(pa.memory_map(files[0])).schema
        rows = len(data.Sequences(files, ["length"]))
    except (OSError, pa.ArrowInvalid) as e:
        raise StageInputError(f"tokenize artifact {tokenize.path}: a {split} shard is unreadable ({e}); rebuild it "
                              f"(python -m pipeline.run --until tokenize --force tokenize)") from None
    seq_len = getattr(schema.field("input_ids").type, "list_size", 0) if "input_ids" in schema.names else 0
    if seq_len <= 0:
        raise StageInputError(f"{files[0]} has no fixed-size input_ids column; it is not a tokenize artifact shard")
    return files, rows, int(seq_len)


# ----------------------------------------------------------------------------------------------- the stage

def run_name(ctx: StageContext) -> str:
    """The Ray Train run's name under the storage path: a restart of the stage (same artifact id) finds it again."""
    return f"pretrain-{ctx.artifact_id}"


def _trainer(cfg: PretrainConfig, job: "LoopJob", ctx: StageContext):
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from stages.pretrain.loop import train_loop_per_worker

    # No Ray Data dataset: each worker reads its rows of the memory-mapped train shards by index, in the epoch's
    # permutation that `stages.pretrain.data` draws and deals, which a restarted worker can replay.
    return TorchTrainer(
        train_loop_per_worker,
        train_loop_config={"job": job},
        scaling_config=ScalingConfig(num_workers=cfg.num_workers, use_gpu=cfg.use_gpu,
                                     resources_per_worker={"CPU": cfg.cpus_per_worker},
                                     placement_strategy=cfg.placement_strategy),
        run_config=RunConfig(storage_path=ctx.storage_path, name=run_name(ctx),
                             failure_config=FailureConfig(max_failures=cfg.max_failures),
                             checkpoint_config=CheckpointConfig(num_to_keep=2)),
    )


def _loop_job(cfg: PretrainConfig, model: "DebertaConfig", ds_config: DeepSpeedConfig, seq_len: int,
              train_files: list[str], val_files: list[str], tok: Tokenizer, tracker, objective: Objective,
              init_weights: str = "", run_dir: str = "", shards: Artifact | None = None) -> "LoopJob":
    from stages.pretrain.loop import LoopJob

    return LoopJob(
        cfg=cfg, objective=objective, model=model, ds_config=ds_config, seq_len=seq_len,
        train_files=tuple(train_files), val_files=tuple(val_files), tokenizer_len=len(tok), mask_id=tok.mask_id,
        special_ids=tuple(sorted(tok.special_ids.values())),
        word_start=np.packbits(tok.word_start_mask()).tobytes(),
        train_flops_per_token=objective.train_flops_per_token(model, seq_len),
        tracker=tracker, init_weights=init_weights, run_dir=run_dir, shards=shards)


def consolidate(checkpoint_dir: Path, ds_config: DeepSpeedConfig) -> tuple[dict, "TrainState"]:
    """fp32 state dict of a reported DeepSpeed checkpoint (all ranks' shards merged by Ray Train storage)."""
    from stages.pretrain.checkpoints import TrainState
    from training.engine import consolidated_state_dict

    state = TrainState.read(checkpoint_dir)
    return consolidated_state_dict(checkpoint_dir, state.tag, ds_config), state


def write_outputs(out: Path, objective: Objective, model: "DebertaConfig", state_dict: dict,
                  vocab: Artifact) -> str:
    """tokenizer/ and the objective's model directories (`Objective.write_models`)."""
    (out / "tokenizer").mkdir()
    for name in ("spm.model", "special_tokens.json"):
        shutil.copy2(Path(vocab.path) / name, out / "tokenizer" / name)
    return objective.write_models(out, model, state_dict, out / "tokenizer")


def run(cfg: PretrainConfig, *, model: DebertaConfig, inputs: dict[str, Artifact], out: Path,
        ctx: StageContext) -> StageResult:
    tok = Tokenizer.load(inputs["vocab"].path)
    train_files, train_rows, seq_len = token_shards(inputs["tokenize"], "train")
    val_files, _, _ = token_shards(inputs["tokenize"], "validation")
    check_config(cfg, model)
    check_inputs(model, len(tok), seq_len)
    ds_config = build_deepspeed_config(cfg, cfg.num_workers, cfg.use_gpu)
    if train_rows < cfg.micro_batch_size * cfg.num_workers:
        raise StageInputError(f"the train split has {train_rows} sequences, fewer than micro_batch_size x workers = "
                              f"{cfg.micro_batch_size * cfg.num_workers}; tokenize more text or shrink the batch")
    objective, init_file, notes = objective_for(cfg), "", {}
    if "init" in inputs:
        init_file, notes = initial_weights(objective, model, inputs, ctx.scratch)
        print(f"[pretrain] continuing from {inputs['init'].source}: "
              + "; ".join(f"{k} {v}" for k, v in notes.items()), flush=True)
        ctx.tracker.set_tags(init_tags(inputs, notes))
    job = _loop_job(cfg, model, ds_config, seq_len, train_files, val_files, tok, ctx.tracker, objective, init_file,
                    run_dir=f"{ctx.storage_path.rstrip('/')}/{run_name(ctx)}",
                    shards=inputs["tokenize"] if inputs["tokenize"].uri else None)
    set_aside_cut_short_snapshot(job.run_dir)
    ctx.tracker.log_dict({"deepspeed": ds_config.to_dict(), "seq_len": seq_len}, "deepspeed_config.json")
    probes = Probes(cfg, job.objective, resolve_probes(cfg, Path(ctx.workdir)), job.run_dir, ctx.tracker, ds_config,
                    Path(inputs["vocab"].path), model, init_file, inputs.get("corpus"), Path(ctx.workdir)) \
        if cfg.probes else None
    started = time.time()
    watching = start_watching(probes) if probes else None  # a thread beside fit(): checkpoints -> probe trials
    try:
        result = _trainer(cfg, job, ctx).fit()
    finally:
        if watching:
            watching[1].set()
            watching[0].join()
    if result.checkpoint is None:
        raise RuntimeError(f"training ended without a checkpoint (error: {result.error})")
    print(f"[pretrain] training finished in {time.time() - started:.0f}s; consolidating {result.checkpoint.path}",
          flush=True)
    with result.checkpoint.as_directory() as d:
        state_dict, state = consolidate(Path(d), ds_config)
    if state.step != cfg.max_steps:
        raise RuntimeError(f"last checkpoint is {state.tag}, expected step{cfg.max_steps}")
    hf_note = write_outputs(out, job.objective, model, state_dict, inputs["vocab"])
    print(f"[pretrain] artifact written after {time.time() - started:.0f}s; logging to MLflow", flush=True)
    done = finish(cfg, job.objective, out, ctx, result.metrics, seq_len, hf_note,
                  init_tags(inputs, notes) if init_file else {})
    if probes:
        probes.finish(state.step, state_dict)
    return with_probes(done, probes, out, ctx) if probes else done


