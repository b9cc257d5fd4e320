"""Pretrain stage: an objective (DeBERTa's MLM + EMD, DeBERTaV3's RTD, either with ALBERT's SOP) on Ray Train
(`TorchTrainer`) with DeepSpeed ZeRO.

The package, by what it answers:
    __init__.py    the driver (this module): `objective_for`, checks before any worker starts, the trainer, the
                   artifact from the last checkpoint, the registry entry, --dry-run
    objective.py   what an objective supplies (`Objective`); mlm.py, rtd.py, sop.py implement it
    loop.py        one training step and one validation pass as plain functions (the benchmarks call them too), and
                   the Ray Train worker loop around them: engine, data position, evaluation schedule, checkpoints
    data.py        the order the tokenised train shards are read in: a permutation per epoch, rows by index
The DeepSpeed config comes from `training/deepspeed_config.py`, the engine from `training/engine.py`.

Recovery. Every `ckpt_interval` steps each worker saves its DeepSpeed shard and all of them report one
Ray Train checkpoint (model, optimizer, scheduler, data position). A lost worker: Ray Train restarts the
group (`FailureConfig.max_failures`) and the loop resumes from `ray.train.get_checkpoint()`. A restart of
the whole stage (new driver, same artifact id): the run is named `pretrain-<artifact id>` under the same
storage path, and Ray Train V2 reloads that run's checkpoint snapshot, so `get_checkpoint()` again
returns the latest one (V2's replacement for the deprecated `TorchTrainer.restore`). Ray Train writes that snapshot
in place: one cut short by a driver killed mid-write is set aside (`set_aside_cut_short_snapshot`), and the loop
lists the run's checkpoints itself.

Artifact:
    model/config.json, model/model.pt   the consolidated fp32 model fine-tuning reads (`deberta.checkpoint`)
    tokenizer/spm.model, special_tokens.json
    hf/                                 transformers export; the objective's further directories (its module says)
    metrics.json                        final train/validation numbers, throughput, where it ran
    loss_curve.png                      train loss and validation loss per step
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa

from training import checkpoint_files
from training.deepspeed_config import DeepSpeedConfig, build_deepspeed_config
from core.artifacts import Artifact
from core.config import ConfigError, PretrainConfig
from core.tokenizer import Tokenizer
from core.errors import StageInputError
from stages.base import StageContext, StageResult
from stages.pretrain import data
from stages.pretrain.mlm import MLM
from stages.pretrain.objective import Objective
from stages.pretrain.rtd import RTD
from stages.pretrain.sop import SentenceOrder

if TYPE_CHECKING:  # the model library and the worker loop import torch: only inside `run`
    from deberta.config import DebertaConfig
    from stages.pretrain.loop import LoopJob, TrainState

VERSION = "4"

RELEASED_LOSS = "val_loss_released"
"""Continued runs: the validation MLM loss before the first step, computed as `transformers` computes it for the
released checkpoint (`Objective.released_loss_inputs`: no EMD); equal to HF's own loss on the same batches."""

OBJECTIVES: dict[str, type[Objective]] = {"mlm": MLM, "rtd": RTD}
"""`pretrain.objective` -> its implementation (`core.config.OBJECTIVES` lists the same names for `validate`)."""

PLAN_GPUS_PER_NODE = 8
PLAN_DEVICE = "H100"
PLAN_MFU = 0.40
"""--dry-run assumptions: 8 GPUs per node, H100 bf16 dense peak (deberta.flops), 40% model-FLOPs utilisation."""


# ----------------------------------------------------------------------------------------------- checks

def objective_for(cfg: PretrainConfig) -> Objective:
    """The objective `cfg` names, with ALBERT's SOP on top when `pretrain.sop` is set."""
    objective = OBJECTIVES[cfg.objective](cfg)
    return SentenceOrder(objective) if cfg.sop else objective


def check_config(cfg: PretrainConfig, model: DebertaConfig) -> None:
    """The objective's own settings against the [model] section; run with `validate`, before any stage."""
    problems = objective_for(cfg).check(model)
    if problems:
        raise ConfigError("; ".join(problems))


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

SNAPSHOT = "checkpoint_manager_snapshot.json"
"""Ray Train V2's record of a run's registered checkpoints, in the run's storage directory."""


def run_name(ctx: StageContext) -> str:
    """The Ray Train run's name under the storage path: a restart of the stage (same artifact id) finds it again."""
    return f"pretrain-{ctx.artifact_id}"


def set_aside_cut_short_snapshot(directory: str) -> None:
    """Ray Train rewrites its snapshot in place at every checkpoint; a driver killed mid-write leaves it cut short,
    and Ray Train would then fail to start the run at every restart. Set aside, Ray Train registers nothing, and
    the loop's `restore` lists the run's checkpoints itself (the newest that verifies is taken)."""
    fs, path = checkpoint_files.storage_fs(directory)
    if checkpoint_files.set_aside_if_cut_short(fs, f"{path}/{SNAPSHOT}"):
        print(f"[pretrain] Ray Train's checkpoint snapshot {path}/{SNAPSHOT} is cut short (a driver killed while "
              f"writing it); set aside as {SNAPSHOT}{checkpoint_files.CUT_SHORT}, and the run resumes from the "
              f"newest of its checkpoints that verifies", flush=True)


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
              init_weights: str = "", run_dir: str = "") -> "LoopJob":
    from stages.pretrain.loop import LoopJob

    return LoopJob(
        cfg=cfg, objective=objective, model=model, ds_config=ds_config, seq_len=seq_len,
        train_files=tuple(train_files), val_files=tuple(val_files), tokenizer_len=len(tok), mask_id=tok.mask_id,
        special_ids=tuple(sorted(tok.special_ids.values())),
        word_start=np.packbits(tok.word_start_mask()).tobytes(),
        train_flops_per_token=objective.train_flops_per_token(model, seq_len),
        tracker=tracker, init_weights=init_weights, run_dir=run_dir)


INIT_WEIGHTS_FILE = "init-weights.safetensors"


def initial_weights(objective: Objective, model: "DebertaConfig", inputs: dict, scratch: Path) -> tuple[str, dict]:
    """Continued pretraining: the objective's starting weights from `pretrain.init` (and `generator_init`), checked
    against the model key for key on the meta device, written once per artifact as safetensors that every worker
    maps (under ZeRO-3 each module copies its own tensors); (path, where each part came from)."""
    import torch
    from safetensors.torch import save_file

    from deberta.hf import state_mismatch

    init, generator = inputs["init"], inputs.get("generator_init")
    target = scratch / INIT_WEIGHTS_FILE
    try:
        weights, notes = objective.initial_weights(model, init.path, generator.path if generator else "")
    except (ValueError, FileNotFoundError) as e:
        raise StageInputError(f"pretrain.init={init.source}: {e}") from None
    factory, _ = objective.build_model(model)
    with torch.device("meta"):
        want = factory().state_dict()
    _, extra, shapes = state_mismatch(weights, want)  # missing keys keep the fresh init
    bad = extra + shapes
    if bad:
        raise StageInputError(f"pretrain.init={init.source}: {len(bad)} tensors do not fit the model, e.g. {bad[:3]}")
    if not target.is_file():  # written whole, then renamed: present means complete
        seen: set[int] = set()
        tensors = {}
        for key, tensor in weights.items():  # safetensors stores no shared memory: copy repeats (derived parts)
            tensors[key] = tensor.clone() if tensor.data_ptr() in seen else tensor.contiguous()
            seen.add(tensor.data_ptr())
        scratch.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(target.with_suffix(".tmp")))
        target.with_suffix(".tmp").replace(target)
    return str(target), notes


def consolidate(checkpoint_dir: Path, ds_config: DeepSpeedConfig) -> tuple[dict, "TrainState"]:
    """fp32 state dict of a reported DeepSpeed checkpoint (all ranks' shards merged by Ray Train storage)."""
    from training.engine import consolidated_state_dict
    from stages.pretrain.loop import TrainState

    state = TrainState.read(checkpoint_dir)
    return consolidated_state_dict(checkpoint_dir, state.tag, ds_config), state


def _metric_history(ctx: StageContext, key: str) -> list[tuple[int, float]]:
    return [(m.step, m.value) for m in ctx.tracker.client.get_metric_history(ctx.tracker.run_id, key)]


def plot_losses(ctx: StageContext, path: Path) -> None:
    """Train and validation loss per step, from the stage's MLflow run (the last value logged per step wins)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for key, style in (("loss", "-"), ("val_loss", "o-")):
        points = dict(_metric_history(ctx, key))
        if points:
            steps = sorted(points)
            ax.plot(steps, [points[s] for s in steps], style, label=key)
    ax.set_xlabel("step")
    ax.set_ylabel("MLM loss")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


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
                    run_dir=f"{ctx.storage_path.rstrip('/')}/{run_name(ctx)}")
    set_aside_cut_short_snapshot(job.run_dir)
    ctx.tracker.log_dict({"deepspeed": ds_config.to_dict(), "seq_len": seq_len}, "deepspeed_config.json")
    started = time.time()
    result = _trainer(cfg, job, ctx).fit()
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
    return finish(cfg, job.objective, out, ctx, result.metrics, seq_len, hf_note,
                  init_tags(inputs, notes) if init_file else {})


def init_tags(inputs: dict, notes: dict[str, str]) -> dict[str, str]:
    """Lineage of a continued run (stage run and registry version): the checkpoints it started from, their
    digests, and where each part of the model came from."""
    tags = {}
    for key in ("init", "generator_init"):
        if key in inputs:
            tags.update({f"{key}.source": inputs[key].source, f"{key}.digest": inputs[key].id})
    return {**tags, **{f"init.{part}": note for part, note in notes.items()}}


def finish(cfg: PretrainConfig, objective: Objective, out: Path, ctx: StageContext, final: dict,
           seq_len: int, hf_note: str, lineage: dict[str, str] | None = None) -> StageResult:
    """metrics.json, loss curve, MLflow artifacts and the registry entry."""
    def last(key: str) -> float | None:
        history = _metric_history(ctx, key)
        return max(history)[1] if history else None  # the value at the highest step

    first_val = dict(_metric_history(ctx, "val_loss")).get(0)
    released = dict(_metric_history(ctx, RELEASED_LOSS)).get(0)
    throughput = [v for _, v in _metric_history(ctx, "tokens_per_s")]
    metrics = {"final_loss": last("loss"), **{k: last(k) for k in objective.final_metrics},
               "initial_val_loss": first_val, RELEASED_LOSS: released,
               "tokens_per_s": float(np.median(throughput)) if throughput else None}
    metrics = {k: float(v) for k, v in metrics.items() if v is not None and math.isfinite(v)}
    report = {**metrics, "objective": objective.name, "steps": cfg.max_steps, "seq_len": seq_len,
              "train_batch_size": cfg.train_batch_size, "zero_stage": cfg.zero_stage, "num_workers": cfg.num_workers,
              "worker_nodes": final.get("worker_nodes", []), "hf_export": hf_note,
              **({"init": lineage} if lineage else {})}
    (out / "metrics.json").write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")
    plot_losses(ctx, out / "loss_curve.png")
    ctx.tracker.log_artifact(out / "loss_curve.png")
    version = register(cfg, objective, out, ctx, lineage or {})
    name = f"deberta-{ctx.preset}-pretrained"
    unsent = int(final.get("unsent_metrics") or 0)
    lost = {"metrics not logged": f"{unsent} points (tracking server unreachable at the end)"} if unsent else {}
    if unsent:
        print(f"[pretrain] warning: {unsent} metric points could not be logged to MLflow; the model is complete",
              flush=True)
    return StageResult(
        metrics=metrics,
        counts={"steps": cfg.max_steps, "tokens": cfg.max_steps * cfg.train_batch_size * seq_len},
        log_files=("metrics.json",),
        summary={f"registered {name}": f"version {version}",
                 "pretrain": f"val loss {metrics.get('initial_val_loss', float('nan')):.3f} -> "
                             f"{metrics.get('val_loss', float('nan')):.3f}, "
                             f"{metrics.get('tokens_per_s', 0):,.0f} tokens/s", **lost},
    )


def register(cfg: PretrainConfig, objective: Objective, out: Path, ctx: StageContext,
             lineage: dict[str, str]) -> str:
    """Our checkpoint as a run artifact; the registry version `deberta-<preset>-pretrained`, tagged with its
    lineage and objective: an MLflow Model over hf/ (`core/hf_pyfunc.py`) of the objective's task."""
    export = objective.export()
    ctx.tracker.log_artifacts(out / "model", "model")  # ours, EMD table (MLM) / RTD head included
    for directory in export.extra_dirs:
        ctx.tracker.log_artifacts(out / directory, directory)
    name = f"deberta-{ctx.preset}-pretrained"
    tags = {**{stage: ctx.lineage.get(stage, "") for stage in ("corpus", "vocab", "tokenize")},
            "pretrain": ctx.artifact_id, **export.tags, **lineage}
    description = f"{export.description}, {cfg.max_steps} steps, ZeRO-{cfg.zero_stage}"
    uri = ctx.tracker.log_hf_model(out / "hf", task=export.task, name="pretrained", tags=tags,
                                   input_example={"text": [export.example]})
    return ctx.tracker.register_model(name, model_uri=uri, tags=tags, description=description)


# ----------------------------------------------------------------------------------------------- --dry-run

def _largest_layer_params(objective: Objective, model: "DebertaConfig") -> int:
    """Largest single module's own parameters (the word embedding for every preset), on the meta device."""
    import torch

    factory, _ = objective.build_model(model)
    with torch.device("meta"):
        m = factory()
    return max(sum(p.numel() for p in mod.parameters(recurse=False)) for mod in m.modules())


def _zero_estimates(total: int, largest: int, nodes: int, gpus_per_node: int) -> tuple[float, float, str]:
    """DeepSpeed's model-state estimates per GPU (bytes) for ZeRO-2 and ZeRO-3 without offload, and its tables."""
    from deepspeed.runtime.zero.stage3 import (estimate_zero3_model_states_mem_needs,
                                               estimate_zero3_model_states_mem_needs_all_cold)
    from deepspeed.runtime.zero.stage_1_and_2 import (estimate_zero2_model_states_mem_needs,
                                                      estimate_zero2_model_states_mem_needs_all_cold)

    tables = io.StringIO()
    with contextlib.redirect_stdout(tables):
        estimate_zero2_model_states_mem_needs_all_cold(total, num_gpus_per_node=gpus_per_node, num_nodes=nodes)
        estimate_zero3_model_states_mem_needs_all_cold(total, largest, num_gpus_per_node=gpus_per_node, num_nodes=nodes)
    _, zero2 = estimate_zero2_model_states_mem_needs(total, gpus_per_node, nodes, cpu_offload=False)
    _, zero3, _ = estimate_zero3_model_states_mem_needs(total, largest, gpus_per_node, nodes, cpu_offload=False,
                                                        cpu_offload_params=False, zero_init=True)
    return zero2, zero3, tables.getvalue()


def dry_run(cfg: PretrainConfig, model: DebertaConfig) -> str:
    """The plan on paper: parameters, ZeRO-2/3 memory per GPU (DeepSpeed's estimators), tokens, time."""
    from deberta.flops import PEAK_FLOPS

    check_config(cfg, model)
    objective = objective_for(cfg)
    counts = objective.parameter_counts(model)
    largest = _largest_layer_params(objective, model)
    nodes = max(1, math.ceil(cfg.num_workers / PLAN_GPUS_PER_NODE))
    gpus_per_node = min(cfg.num_workers, PLAN_GPUS_PER_NODE)
    zero2, zero3, tables = _zero_estimates(counts["total"], largest, nodes, gpus_per_node)
    seq_len = model.max_position_embeddings
    tokens = cfg.train_batch_size * seq_len
    flops_tok = objective.train_flops_per_token(model, seq_len)
    peak = PEAK_FLOPS[(PLAN_DEVICE, "bf16")]
    step_s = tokens * flops_tok / (cfg.num_workers * peak * PLAN_MFU)
    accum = build_deepspeed_config(cfg, cfg.num_workers, cfg.use_gpu).accumulation
    lines = [
        f"pretrain plan: {nodes} node(s) x {gpus_per_node} {PLAN_DEVICE} = {cfg.num_workers} workers, "
        f"ZeRO-{cfg.zero_stage}",
        objective.plan_line(model, counts, largest),
        f"  batch: {cfg.train_batch_size} sequences x {seq_len} tokens (model.max_position_embeddings) = "
        f"{tokens:,} tokens/step; micro {cfg.micro_batch_size} x accumulation {accum} x {cfg.num_workers} workers",
        f"  compute: {flops_tok / 1e9:.3g} GFLOP/token for training (deberta.flops: 3 x forward incl. attention "
        f"and EMD{objective.flops_note}) = {tokens * flops_tok / 1e15:.3g} PFLOP/step",
        f"  at {PLAN_MFU:.0%} MFU of {peak / 1e12:.0f} TFLOP/s bf16 per {PLAN_DEVICE}: {step_s:.3g} s/step, "
        f"{cfg.max_steps:,} steps = {cfg.max_steps * step_s / 86400:.3g} days "
        f"({tokens * cfg.max_steps / 1e9:,.1f}B tokens)",
        f"  model states per GPU without offload: ZeRO-2 {zero2 / 2**30:.2f} GiB, ZeRO-3 {zero3 / 2**30:.2f} GiB "
        f"(ZeRO-3 builds the model inside zero.Init, partitioned module by module)",
        "  DeepSpeed's estimator tables (model states only: bf16 params/grads + fp32 master and Adam; no activations):",
        *("    " + line for line in tables.strip().splitlines()),
    ]
    return "\n".join(lines)
