"""Finetune stage: a Ray Tune sweep over the paper's Table 9 grid, the champion to the MLflow registry.

Every combination of task-layer dropout x warmup steps x learning rate x batch size x seed is one Tune trial
(`tune.grid_search`), optionally cut short by ASHA on the dev metric. A trial fine-tunes the pretrained backbone:
AdamW (Table 9's epsilon, betas, weight decay), linear warmup then linear decay to zero at `epochs`, gradient
clipping, SiFT when enabled, and reports the dev metrics once per epoch with a checkpoint whenever the trial's dev
metric improves. Two trainers run that same recipe:

  torch      (base and smaller) the trial is one process: plain torch on `cpus_per_trial` threads or one GPU.
  deepspeed  (large, 1.5B) the trial is a Ray Train run of `workers_per_trial` DeepSpeed workers: the trial's
             Tune function starts a `TorchTrainer` (Ray Train V2's Tune integration: Tune reserves one byte of
             memory for the trial itself, the Train run reserves its workers) and `TuneReportCallback` forwards rank 0's
             per-epoch results to Tune. Each step's batch is split evenly over the workers; ZeRO shards the
             optimizer state (stage 1-2) and the weights (stage 3); the dev set is split over the workers and
             the predictions gathered; an improving epoch's weights are gathered with `save_16bit_model`.
             Not with ASHA: Ray keeps the workers of a Train run that Tune stops (pipeline.config says more).

The driver tokenises the task once and hands the arrays and the backbone weights to every trial through the
object store (`tune.with_parameters`), so trials need no shared filesystem. A Tune callback mirrors every trial
as a nested MLflow run under the stage's run. Selection: the grid point with the best dev metric (mean over
seeds), then its best seed's best epoch; that model is written to `out/model/` and registered as
`deberta-<preset>-<task>` with alias `champion`.

Outputs: model/ (config.json, model.pt, finetune.json, tokenizer/), results.csv (one row per trial),
sweep.png (dev metric against learning rate), champion.json.
"""

from __future__ import annotations

import json
import math
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from deberta import checkpoint
from deberta.config import DebertaConfig
from deberta.model import DebertaForSequenceClassification
from deberta.sift import sift_loss
from pipeline.artifacts import Artifact
from pipeline.config import FinetuneConfig
from stages.base import StageContext, StageInputError, StageResult
from stages.tasks import CLASSIFICATION, Split, TaskRef, compute_metrics, majority_baseline, resolve_task
from stages.vocab import MODEL_FILE, SPECIAL_FILE, Tokenizer

NAME = "finetune"
VERSION = "1"

__all__ = ["NAME", "VERSION", "run", "resolve_task", "param_space", "dry_run", "TaskRef"]

GRID_KEYS = ("dropout", "warmup_steps", "lr", "batch_size")
"""FinetuneConfig fields that form the Table 9 grid (plus `seeds`, searched as "seed")."""
EVAL_BATCH = 128
# architecture fields that must agree between the run's model config and the pretrained checkpoint
SHAPE_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                "max_position_embeddings", "position_buckets", "max_relative_positions", "share_att_key",
                "conv_kernel_size")


# ----------------------------------------------------------------------------------------------- the grid

def param_space(cfg: FinetuneConfig) -> dict[str, Any]:
    """Tune's search space: a grid over every combination of the Table 9 values and the seeds."""
    from ray import tune

    space = {k: tune.grid_search(list(getattr(cfg, k))) for k in GRID_KEYS}
    space["seed"] = tune.grid_search(list(cfg.seeds))
    return space


def grid_size(cfg: FinetuneConfig) -> int:
    return math.prod(len(getattr(cfg, k)) for k in (*GRID_KEYS, "seeds"))


def dry_run(cfg: FinetuneConfig, model: DebertaConfig) -> str:
    """One line for `--dry-run`: the size of the sweep."""
    grid = " x ".join(f"{k}{list(getattr(cfg, k))}" for k in (*GRID_KEYS, "seeds"))
    trainer = ("one torch process" if cfg.trainer == "torch" else
               f"{cfg.workers_per_trial} DeepSpeed ZeRO-{cfg.zero_stage} workers") + (" on GPUs" if cfg.use_gpu else "")
    return (f"finetune: task {cfg.task}, {grid_size(cfg)} trials ({grid}), <= {cfg.epochs} epochs each, "
            f"scheduler {cfg.scheduler}, {cfg.max_concurrent_trials} at once, {trainer} per trial, sift={cfg.sift}")


# ----------------------------------------------------------------------------------------------- data

@dataclass(frozen=True)
class Encoded:
    """A tokenised split: [CLS] a [SEP] (b [SEP]) right-padded with [PAD]=0."""

    ids: np.ndarray  # (N, T) int32
    label: np.ndarray  # (N,) float32: class id or regression target

    def __len__(self) -> int:
        return len(self.label)


def _truncate_pair(a: list[int], b: list[int] | None, budget: int) -> tuple[list[int], list[int] | None]:
    """Longest-first truncation (as HF tokenizers) until both fit in `budget` pieces."""
    if b is None:
        return a[:budget], None
    la, lb = len(a), len(b)
    while la + lb > budget:
        if la >= lb:
            la -= 1
        else:
            lb -= 1
    return a[:la], b[:lb]


def encode_split(tok: Tokenizer, split: Split, max_len: int) -> Encoded:
    a_ids = tok.encode(split.text_a, num_threads=1)
    b_ids = tok.encode(split.text_b, num_threads=1) if split.text_b is not None else [None] * len(a_ids)
    ids = np.full((len(a_ids), max_len), tok.pad_id, dtype=np.int32)
    for i, (a, b) in enumerate(zip(a_ids, b_ids)):
        a, b = _truncate_pair(a, b, max_len - (2 if b is None else 3))
        row = [tok.cls_id, *a, tok.sep_id] + ([] if b is None else [*b, tok.sep_id])
        ids[i, :len(row)] = row
    return Encoded(ids, np.asarray(split.label, dtype=np.float32))


def prepare_data(task: TaskRef, tok: Tokenizer, cfg: FinetuneConfig) -> tuple[Encoded, Encoded]:
    """(train, dev) arrays; train capped at `max_train_examples` by a fixed-seed sample."""
    train = encode_split(tok, task.train, cfg.max_seq_len)
    if cfg.max_train_examples is not None and len(train) > cfg.max_train_examples:
        keep = np.sort(np.random.default_rng(0).permutation(len(train))[:cfg.max_train_examples])
        train = Encoded(train.ids[keep], train.label[keep])
    return train, encode_split(tok, task.dev, cfg.max_seq_len)


# ----------------------------------------------------------------------------------------------- pretrained input

def _pretrained(inputs: dict[str, Any], model: DebertaConfig) -> tuple[Path, Path]:
    """(checkpoint dir, tokenizer dir) of the pretrained artifact, checked against the run's model config."""
    art = inputs.get("pretrain")
    if art is None:
        raise StageInputError("finetune needs the pretrained checkpoint (input 'pretrain'); run the pipeline "
                              "with --until pretrain first")
    root = Path(art.path if isinstance(art, Artifact) else art)
    ckpt_dir = root / "model"
    if not (ckpt_dir / checkpoint.WEIGHTS_FILE).is_file() or not (ckpt_dir / checkpoint.CONFIG_FILE).is_file():
        raise StageInputError(f"pretrained artifact {root} is missing model/model.pt or model/config.json; "
                              f"re-run with --force pretrain to rebuild it")
    try:
        saved = checkpoint.load_config(ckpt_dir)
    except checkpoint.CheckpointError as e:
        raise StageInputError(str(e)) from None
    diff = [f for f in SHAPE_FIELDS if getattr(saved, f) != getattr(model, f)]
    if diff:
        raise StageInputError(f"pretrained artifact {root} was built for another model ({', '.join(diff)} differ "
                              f"from the [model] section); use the preset it was pretrained with")
    for tok_dir in (root / "tokenizer", Path(getattr(inputs.get("vocab"), "path", root / "tokenizer"))):
        if (tok_dir / MODEL_FILE).is_file():
            return ckpt_dir, tok_dir
    raise StageInputError(f"no SentencePiece model in {root / 'tokenizer'} or the vocab artifact; "
                          f"re-run with --force pretrain")


def backbone_weights(ckpt_dir: Path) -> dict[str, torch.Tensor]:
    """The `deberta.*` tensors of the pretrained MLM (its LM head and EMD stay behind)."""
    try:
        state = checkpoint.load_state_dict(ckpt_dir)
    except checkpoint.CheckpointError as e:
        raise StageInputError(str(e)) from None
    return {k: v for k, v in state.items() if k.startswith(checkpoint.BACKBONE_PREFIX)}


def load_backbone(model: DebertaForSequenceClassification, weights: dict[str, torch.Tensor]) -> None:
    """Copy the backbone; only the pooler and classifier stay freshly initialised."""
    missing, unexpected = model.load_state_dict(weights, strict=False)
    bad = [k for k in missing if k.startswith(checkpoint.BACKBONE_PREFIX)] + list(unexpected)
    if bad:
        raise StageInputError(f"pretrained weights do not fit the model: {len(bad)} tensors differ, e.g. {bad[:3]}")


# ----------------------------------------------------------------------------------------------- one trial

@dataclass(frozen=True)
class TrialSetup:
    """Everything a trial needs besides its grid point (picklable, shipped once through the object store)."""

    model: DebertaConfig
    num_labels: int
    kind: str
    metric: str
    ft: FinetuneConfig


def linear_schedule(warmup: int, total: int):
    """LR multiplier: linear warmup over `warmup` steps, then linear decay to 0 at `total` (Table 9)."""
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return max(0.0, (total - step) / max(1, total - warmup))
    return factor


def make_optimizer(model: torch.nn.Module, lr: float, ft: FinetuneConfig, fused: bool = False) -> torch.optim.AdamW:
    """AdamW; biases and LayerNorm weights get no weight decay (as the reference and HF Trainer)."""
    decay, no_decay = [], []
    for p in model.parameters():
        (no_decay if p.ndim < 2 else decay).append(p)
    groups = [{"params": decay, "weight_decay": ft.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(ft.adam_beta1, ft.adam_beta2), eps=ft.adam_eps, fused=fused)


def build_classifier(setup: TrialSetup, config: dict[str, Any],
                     weights: dict[str, torch.Tensor]) -> DebertaForSequenceClassification:
    """The trial's model: pretrained backbone, fresh pooler and classifier drawn from the trial's seed."""
    torch.manual_seed(config["seed"])
    model = DebertaForSequenceClassification(setup.model, setup.num_labels, classifier_dropout=config["dropout"],
                                             sift=setup.ft.sift)
    load_backbone(model, weights)
    return model


def epoch_batches(n: int, batch_size: int, rng: np.random.Generator, world: int = 1) -> list[np.ndarray]:
    """One epoch's batches of example indices in a fresh random order; a last batch too small to give every
    worker an example is dropped (with one worker, none is)."""
    order = rng.permutation(n)
    batches = [order[i:i + batch_size] for i in range(0, n, batch_size)]
    if batches and len(batches[-1]) < world:
        batches.pop()
    return batches


def steps_per_epoch(n: int, batch_size: int, world: int = 1) -> int:
    """len(epoch_batches(n, batch_size, rng, world)) without drawing an order."""
    full, rest = divmod(n, batch_size)
    return full + (1 if rest >= max(1, world) else 0)


def _batch(data: Encoded, idx: np.ndarray, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    ids = data.ids[idx]  # [PAD] = 0 (fixed by the vocab stage)
    width = max(1, int((ids != 0).sum(1).max()))  # trim the padding every row shares
    ids = torch.from_numpy(ids[:, :width].astype(np.int64)).to(device)  # (B, T')
    return ids, (ids != 0).long(), torch.from_numpy(data.label[idx]).to(device)


@torch.no_grad()
def evaluate(model, data: Encoded, kind: str, device, rank: int = 0, world: int = 1) -> dict[str, float]:
    """Dev metrics. With `world` > 1 every worker predicts a contiguous share and the shares are gathered; all
    workers run the same number of forward passes (ZeRO-3 gathers weights collectively in each one)."""
    model.eval()
    share = math.ceil(len(data) / world)
    rows = np.arange(rank * share, min(len(data), (rank + 1) * share))
    preds = []
    for b in range(math.ceil(share / EVAL_BATCH)):
        idx = rows[b * EVAL_BATCH:(b + 1) * EVAL_BATCH]
        real = len(idx)
        ids, mask, _ = _batch(data, idx if real else np.zeros(1, dtype=np.int64), device)  # a pad pass, dropped
        logits = model(ids, mask)["logits"].float()  # (B, num_labels)
        preds.append((logits.argmax(-1) if kind == CLASSIFICATION else logits[:, 0]).cpu().numpy()[:real])
    mine = np.concatenate(preds) if preds else np.zeros(0, dtype=np.float32)
    if world > 1:
        shares: list[Any] = [None] * world
        torch.distributed.all_gather_object(shares, mine)
        mine = np.concatenate(shares)
    return compute_metrics(kind, mine, data.label)


def train_step(model, batch, sift_lambda: float | None) -> tuple[torch.Tensor, float]:
    """Task loss (+ the SiFT term, lambda included, when `sift_lambda`); returns (loss, SiFT term).

    `model` is the classifier or the DeepSpeed engine around it (which forwards attribute access to it)."""
    ids, mask, labels = batch
    out = model(ids, mask, labels=labels)
    if sift_lambda is None:
        return out["loss"], 0.0
    adv = sift_loss(model, ids, mask, out["logits"], model.regression, lam=sift_lambda)
    return out["loss"] + adv, float(adv.detach())


def _epoch_result(epoch: int, train_loss: float, sift_term: float, lr: float, started: float,
                  dev_metrics: dict[str, float]) -> dict[str, Any]:
    return {"epoch": epoch, "train_loss": train_loss, "sift_loss": sift_term, "lr": lr,
            "epoch_seconds": time.time() - started, **{f"dev_{k}": v for k, v in dev_metrics.items()}}


def train_trial(config: dict[str, Any], *, data: tuple[Encoded, Encoded], weights: dict[str, torch.Tensor],
                setup: TrialSetup) -> None:
    """Tune function trainable (trainer=torch): fine-tune one grid point in this process, report per epoch."""
    from ray import tune

    ft, (train, dev) = setup.ft, data
    torch.set_num_threads(ft.cpus_per_trial)
    device = "cuda" if ft.use_gpu and torch.cuda.is_available() else "cpu"
    model = build_classifier(setup, config, weights).to(device)
    bs = int(config["batch_size"])
    opt = make_optimizer(model, config["lr"], ft, fused=device == "cuda")
    sched = torch.optim.lr_scheduler.LambdaLR(opt, linear_schedule(int(config["warmup_steps"]),
                                                                   steps_per_epoch(len(train), bs) * ft.epochs))
    rng = np.random.default_rng(config["seed"])
    best = -math.inf
    for epoch in range(1, ft.epochs + 1):
        model.train()
        started, losses, sifts = time.time(), [], []
        for idx in epoch_batches(len(train), bs, rng):
            loss, adv = train_step(model, _batch(train, idx, device), ft.sift_lambda if ft.sift else None)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), ft.grad_clip)
            opt.step()
            sched.step()
            losses.append(float(loss.detach()))
            sifts.append(adv)
        dev_metrics = evaluate(model, dev, setup.kind, device)
        result = _epoch_result(epoch, float(np.mean(losses)), float(np.mean(sifts)), sched.get_last_lr()[0],
                               started, dev_metrics)
        if dev_metrics[setup.metric] > best:  # keep only improving epochs (num_to_keep=1 keeps the best)
            best = dev_metrics[setup.metric]
            with tempfile.TemporaryDirectory() as tmp:
                torch.save({k: v.cpu() for k, v in model.state_dict().items()}, Path(tmp) / "model.pt")
                tune.report(result, checkpoint=tune.Checkpoint.from_directory(tmp))
        else:
            tune.report(result)


# ----------------------------------------------------------------------------------------------- DeepSpeed trials

def deepspeed_worker(loop_config: dict[str, Any]) -> None:
    """Ray Train worker loop (trainer=deepspeed): one data-parallel share of one grid point."""
    import deepspeed
    import ray
    import ray.train

    from cluster.deepspeed_config import build_finetune_config
    from stages.pretrain_loop import init_distributed

    config, setup, payload = loop_config["grid"], loop_config["setup"], loop_config["payload"]
    ft = setup.ft
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    torch.set_num_threads(ft.cpus_per_trial)
    device = torch.device("cpu")
    if ft.use_gpu:
        import ray.train.torch

        device = ray.train.torch.get_device()  # the GPU Ray assigned to this worker
        torch.cuda.set_device(device)
    init_distributed("nccl" if ft.use_gpu else "gloo")
    train, dev = ray.get(payload["data"])
    model = build_classifier(setup, config, ray.get(payload["weights"]))  # seeded: the same weights on every rank
    if rank:  # the other workers draw their own dropout masks (rank 0 continues as a torch trial would)
        torch.manual_seed(config["seed"] * 1_009 + rank)
    bs = int(config["batch_size"])
    opt = make_optimizer(model, config["lr"], ft, fused=ft.use_gpu)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, linear_schedule(int(config["warmup_steps"]),
                                                                   steps_per_epoch(len(train), bs, world) * ft.epochs))
    engine, _, _, sched = deepspeed.initialize(model=model, optimizer=opt, lr_scheduler=sched,
                                               config=build_finetune_config(ft, bs, world))
    rng = np.random.default_rng(config["seed"])  # the same order on every worker; each takes rows rank::world
    best = -math.inf
    for epoch in range(1, ft.epochs + 1):
        engine.train()
        started, losses, sifts = time.time(), [], []
        for idx in epoch_batches(len(train), bs, rng, world):
            loss, adv = train_step(engine, _batch(train, idx[rank::world], device),
                                   ft.sift_lambda if ft.sift else None)
            engine.backward(loss)
            engine.step()  # clipping, the optimizer, the LR schedule, zeroing the gradients
            losses.append(float(loss.detach()))
            sifts.append(adv)
        means = torch.tensor([np.mean(losses), np.mean(sifts)], dtype=torch.float64, device=device)
        torch.distributed.all_reduce(means)  # sum over workers
        train_loss, sift_term = (means / world).tolist()
        dev_metrics = evaluate(engine, dev, setup.kind, device, rank, world)
        result = _epoch_result(epoch, train_loss, sift_term, sched.get_last_lr()[0], started, dev_metrics)
        result["world_size"] = world
        if dev_metrics[setup.metric] > best:
            best = dev_metrics[setup.metric]
            with tempfile.TemporaryDirectory() as tmp:
                engine.save_16bit_model(tmp, "model.pt")  # collective under ZeRO-3; rank 0 writes the full model
                ray.train.report(result, checkpoint=ray.train.Checkpoint.from_directory(tmp) if rank == 0 else None)
        else:
            ray.train.report(result)


def deepspeed_trial(config: dict[str, Any], *, payload: dict[str, Any], setup: TrialSetup, storage_path: str) -> None:
    """Tune function trainable (trainer=deepspeed): run the grid point as a Ray Train job of DeepSpeed workers."""
    from ray import train, tune
    from ray.train.torch import TorchTrainer
    from ray.tune.integration.ray_train import TuneReportCallback

    ft, metric, ctx = setup.ft, f"dev_{setup.metric}", tune.get_context()
    trainer = TorchTrainer(
        deepspeed_worker,
        train_loop_config={"grid": dict(config), "setup": setup, "payload": payload},
        scaling_config=train.ScalingConfig(num_workers=ft.workers_per_trial, use_gpu=ft.use_gpu,
                                           resources_per_worker={"CPU": ft.cpus_per_trial}),
        run_config=train.RunConfig(
            name=f"{ctx.get_experiment_name()}-{ctx.get_trial_id()}", storage_path=storage_path,
            callbacks=[TuneReportCallback()],
            checkpoint_config=train.CheckpointConfig(num_to_keep=1, checkpoint_score_attribute=metric,
                                                     checkpoint_score_order="max"),
            failure_config=train.FailureConfig(max_failures=0)),
    )
    trainer.fit()


# ----------------------------------------------------------------------------------------------- MLflow per trial

def _trial_runs_callback(parent, metric: str):
    """A Tune callback mirroring each trial as a nested MLflow run of the stage's run.

    Written here rather than Ray's MLflowLoggerCallback, which cannot nest under a run it did not start and
    would import mlflow outside pipeline/lineage.py.
    """
    from ray import tune

    class TrialRuns(tune.Callback):
        def __init__(self):
            self.runs: dict[str, Any] = {}

        def on_trial_start(self, iteration, trials, trial, **info):
            run = parent.child(f"trial-{trial.trial_id}", {"tune.trial_id": trial.trial_id,
                                                           "tune.trial_name": str(trial)})
            run.log_params(dict(trial.config))
            self.runs[trial.trial_id] = run

        def on_trial_result(self, iteration, trials, trial, result, **info):
            keys = [k for k in result if k.startswith("dev_") or k in ("train_loss", "sift_loss", "lr")]
            self.runs[trial.trial_id].log_metrics({k: result[k] for k in keys}, step=int(result["epoch"]))

        def on_trial_complete(self, iteration, trials, trial, **info):
            run = self.runs.pop(trial.trial_id, None)
            if run is not None:
                last = trial.last_result or {}
                run.set_tags({"tune.epochs": last.get("epoch", 0), "tune.metric": metric})
                run.end("FINISHED")

        def on_trial_error(self, iteration, trials, trial, **info):
            run = self.runs.pop(trial.trial_id, None)
            if run is not None:
                run.end("FAILED")

    return TrialRuns()


# ----------------------------------------------------------------------------------------------- the sweep

def run_sweep(cfg: FinetuneConfig, setup: TrialSetup, data: tuple[Encoded, Encoded],
              weights: dict[str, torch.Tensor], storage_path: str, name: str, callbacks: list | None = None):
    """Run the grid under Tune; returns the ResultGrid (every trial, its history and its best checkpoint)."""
    from ray import tune
    from ray.tune.schedulers import ASHAScheduler

    metric = f"dev_{setup.metric}"
    if cfg.trainer == "deepspeed":
        import ray

        # refs inside the parameter: the trial passes them on to its workers, which fetch them themselves
        payload = {"data": ray.put(data), "weights": ray.put(weights)}
        trainable = tune.with_parameters(deepspeed_trial, payload=payload, setup=setup,
                                         storage_path=str(Path(storage_path) / f"{name}-train"))
        # The trial function only waits on its Ray Train run, which reserves the workers itself. Tune refuses an
        # empty request, so the trial asks for one byte of memory: nothing a worker needs (a CPU would be).
        resources = {"cpu": 0, "memory": 1}
    else:
        trainable = tune.with_parameters(train_trial, data=data, weights=weights, setup=setup)
        resources = {"cpu": cfg.cpus_per_trial, "gpu": 1 if cfg.use_gpu else 0}
    scheduler = None
    if cfg.scheduler == "asha":  # grace 1 epoch, halve at each rung; time unit = epochs (one report each)
        scheduler = ASHAScheduler(time_attr="training_iteration", max_t=cfg.epochs, grace_period=1,
                                  reduction_factor=2)
    tuner = tune.Tuner(
        tune.with_resources(trainable, resources),
        param_space=param_space(cfg),
        tune_config=tune.TuneConfig(metric=metric, mode="max", scheduler=scheduler,
                                    max_concurrent_trials=cfg.max_concurrent_trials),
        run_config=tune.RunConfig(
            storage_path=storage_path, name=name, callbacks=callbacks or [], verbose=1,
            checkpoint_config=tune.CheckpointConfig(num_to_keep=1, checkpoint_score_attribute=metric,
                                                    checkpoint_score_order="max"),
            failure_config=tune.FailureConfig(max_failures=0)),
    )
    print(f"[finetune] Tune experiment {storage_path}/{name} (live: Ray dashboard, or "
          f"tensorboard --logdir {storage_path}/{name})", flush=True)
    grid = tuner.fit()
    errors = [r.error for r in grid if r.error is not None]
    if errors:
        raise RuntimeError(f"{len(errors)} of {len(grid)} trials failed; first error: {errors[0]}")
    return grid


def results_table(grid, metric: str):
    """One row per trial: its grid point, epochs run, best epoch and the dev metrics there."""
    import pandas as pd

    rows = []
    for r in grid:
        hist = r.metrics_dataframe
        best = hist.loc[hist[metric].idxmax()]
        row = {k: r.config[k] for k in (*GRID_KEYS, "seed")}
        row.update(trial_id=r.metrics["trial_id"], epochs=int(hist["epoch"].max()), best_epoch=int(best["epoch"]),
                   final_train_loss=float(hist["train_loss"].iloc[-1]), trial_path=r.path)
        row.update({c: float(best[c]) for c in hist.columns if c.startswith("dev_")})
        rows.append(row)
    return pd.DataFrame(rows).sort_values(list(GRID_KEYS) + ["seed"]).reset_index(drop=True)


def best_checkpoint(result, metric: str):
    """The trial's checkpoint from its best epoch: Tune's own (trainer=torch), or the Ray Train checkpoint whose
    path `TuneReportCallback` put in that epoch's result (trainer=deepspeed)."""
    from ray import tune

    hist = result.metrics_dataframe
    if "checkpoint_path" in hist.columns:
        return tune.Checkpoint(hist.loc[hist[metric].idxmax(), "checkpoint_path"])
    return result.get_best_checkpoint(metric, "max")


def pick_champion(table, metric: str) -> dict[str, Any]:
    """Best grid point by the seed-mean of the dev metric, then its best seed (ties: first in grid order)."""
    means = table.groupby(list(GRID_KEYS), sort=False)[metric].mean()
    point = dict(zip(GRID_KEYS, means.idxmax()))
    runs = table[np.logical_and.reduce([table[k] == v for k, v in point.items()])]
    return dict(runs.loc[runs[metric].idxmax()]) | {"seed_mean": float(means.max())}


def plot_sweep(table, metric: str, baseline: float, path: Path, title: str) -> None:
    """Dev metric against learning rate, one line per (batch size, dropout); best warmup, mean over seeds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    agg = table.groupby(["batch_size", "dropout", "lr", "warmup_steps"])[metric].mean().groupby(
        level=["batch_size", "dropout", "lr"]).max()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for (bs, dropout), line in agg.groupby(level=["batch_size", "dropout"]):
        lrs = line.index.get_level_values("lr")
        ax.plot(lrs, line.values, marker="o", label=f"batch {bs}, dropout {dropout:g}")
    ax.axhline(baseline, color="grey", linestyle="--", label=f"majority baseline {baseline:.3f}")
    ax.set_xscale("log")
    ax.set_xlabel("learning rate")
    ax.set_ylabel(f"{metric} (best epoch; best warmup; mean over seeds)")
    ax.set_title(title)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ----------------------------------------------------------------------------------------------- the stage

def save_model(dst: Path, best_checkpoint, setup: TrialSetup, task: TaskRef, tok_dir: Path, champion: dict) -> None:
    """model/ = config.json (DebertaConfig) + model.pt (classification state dict) + finetune.json + tokenizer/."""
    dst.mkdir(parents=True)
    with best_checkpoint.as_directory() as ckpt:
        shutil.copyfile(Path(ckpt) / "model.pt", dst / "model.pt")
    (dst / "config.json").write_text(json.dumps(setup.model.to_dict(), indent=2, sort_keys=True) + "\n")
    head = {"task": task.name, "task_id": task.id, "kind": task.kind, "metric": task.metric,
            "labels": list(task.labels), "num_labels": setup.num_labels, "sift": setup.ft.sift,
            "max_seq_len": setup.ft.max_seq_len, "trial": _jsonable(champion)}
    (dst / "finetune.json").write_text(json.dumps(head, indent=2, sort_keys=True) + "\n")
    (dst / "tokenizer").mkdir()
    for name in (MODEL_FILE, SPECIAL_FILE):
        if (tok_dir / name).is_file():
            shutil.copyfile(tok_dir / name, dst / "tokenizer" / name)


def _jsonable(d: dict) -> dict:
    return {k: (v.item() if hasattr(v, "item") else v) for k, v in d.items() if k != "trial_path"}


def register_champion(ctx: StageContext, model_dir: Path, task: TaskRef, champion: dict, metric: str,
                      baseline: float) -> str:
    """Log model/ on the stage's run and register it as deberta-<preset>-<task> @champion; returns the version."""
    ctx.tracker.log_artifacts(model_dir, "model")
    trial_cfg = {k: _jsonable(champion)[k] for k in (*GRID_KEYS, "seed")}
    return ctx.tracker.register_model(f"deberta-{ctx.preset}-{task.name}", "model", alias="champion", tags={
        "pretrain": ctx.lineage.get("pretrain", ""), "corpus": ctx.lineage.get("corpus", ""),
        "vocab": ctx.lineage.get("vocab", ""), "task": task.id, "task_name": task.name, "sweep": ctx.artifact_id,
        "trial_id": champion["trial_id"], "trial_config": json.dumps(trial_cfg, sort_keys=True),
        metric: f"{champion[metric]:.6f}", "majority_baseline": f"{baseline:.6f}"})


def run(cfg: FinetuneConfig, *, model: DebertaConfig, inputs: dict[str, Any], out: Path,
        ctx: StageContext) -> StageResult:
    task: TaskRef = inputs["task"] if isinstance(inputs.get("task"), TaskRef) else resolve_task(cfg.task, ctx.workdir)
    if cfg.max_seq_len > model.max_position_embeddings:
        raise StageInputError(f"finetune.max_seq_len={cfg.max_seq_len} exceeds model.max_position_embeddings="
                              f"{model.max_position_embeddings}; lower finetune.max_seq_len")
    ckpt_dir, tok_dir = _pretrained(inputs, model)
    weights = backbone_weights(ckpt_dir)
    tok = Tokenizer.load(tok_dir)
    if len(tok) > model.vocab_size:
        raise StageInputError(f"tokenizer {tok_dir} has {len(tok)} ids but the model only {model.vocab_size} embedding "
                              f"rows; the pretrained artifact and its vocabulary do not belong together")
    data = prepare_data(task, tok, cfg)
    setup = TrialSetup(model, task.num_labels, task.kind, task.metric, cfg)
    metric = f"dev_{task.metric}"
    baseline = majority_baseline(task)
    print(f"[finetune] {task.name}: {len(data[0])} train / {len(data[1])} dev examples, {grid_size(cfg)} trials, "
          f"selection on {metric} (majority baseline {baseline:.4f})", flush=True)
    ctx.tracker.log_params({"task.name": task.name, "task.id": task.id, "task.kind": task.kind,
                            "task.train_examples": len(data[0]), "task.dev_examples": len(data[1])})

    grid = run_sweep(cfg, setup, data, weights, ctx.storage_path,
                     f"finetune-{ctx.artifact_id}", callbacks=[_trial_runs_callback(ctx.tracker, metric)])
    table = results_table(grid, metric)
    table.drop(columns=["trial_path"]).to_csv(out / "results.csv", index=False)
    plot_sweep(table, metric, baseline, out / "sweep.png", f"{task.name}: {ctx.preset}, sweep {ctx.artifact_id}")
    champion = pick_champion(table, metric)
    best = next(r for r in grid if r.metrics["trial_id"] == champion["trial_id"])
    save_model(out / "model", best_checkpoint(best, metric), setup, task, tok_dir, champion)
    (out / "champion.json").write_text(json.dumps(_jsonable(champion), indent=2, sort_keys=True) + "\n")

    version = register_champion(ctx, out / "model", task, champion, metric, baseline)
    name = f"deberta-{ctx.preset}-{task.name}"
    trial_cfg = {k: _jsonable(champion)[k] for k in (*GRID_KEYS, "seed")}
    return StageResult(
        metrics={f"best_{metric}": float(champion[metric]), f"best_{metric}_seed_mean": champion["seed_mean"],
                 "majority_baseline": baseline},
        counts={"trials": len(table), "trial_epochs": int(table["epochs"].sum()),
                "train_examples": len(data[0]), "dev_examples": len(data[1])},
        log_files=("results.csv", "sweep.png", "champion.json"),
        summary={"finetune": f"{name} v{version} (alias champion): {metric}={champion[metric]:.4f} "
                             f"vs majority baseline {baseline:.4f}; trial {json.dumps(trial_cfg)}"},
    )
