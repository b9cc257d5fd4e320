"""One fine-tuning trial: a grid point trained for `epochs`, reporting dev metrics once per epoch.

One loop (`run_epochs`) runs on an engine of `training.engine`, whichever trainer the config names:

  torch      the trial is one process (`torch_trial`): plain torch on `cpus_per_trial` threads or one GPU.
  deepspeed  the trial is a Ray Train run of `workers_per_trial` DeepSpeed workers (`deepspeed_trial` starts a
             `TorchTrainer` of `deepspeed_worker`s; Ray Train V2's Tune integration: Tune reserves one byte of
             memory for the trial itself, the Train run reserves its workers, `TuneReportCallback` forwards rank
             0's results). Each step's batch is split evenly over the workers; ZeRO shards the optimizer state
             (stage 1-2) and the weights (stage 3); the dev set is split over the workers and the predictions
             gathered; an improving epoch's weights are gathered with `save_16bit_model`.

Recipe (Table 9): AdamW (epsilon, betas, weight decay), linear warmup then linear decay to zero at `epochs`
(`training.engine`'s schedule), gradient clipping, SiFT when enabled.

Checkpoints: a torch trial hands Tune one after every epoch, the weights with what continues the loop exactly
(optimizer, schedule, RNG states, epoch, best metric so far; Tune keeps the best for selection and the newest to
resume from), so a retried or restored trial picks up where its last epoch ended. A DeepSpeed trial checkpoints
the gathered weights whenever the dev metric is the best so far; it has no optimizer state to resume from and
restarts.
Either checkpoint carries its epoch's reported result (`EPOCH_RESULT`): what the champion is served with.
"""

from __future__ import annotations

import json
import math
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from training.checkpoint_files import storage_fs
from training import precision
from training.engine import Engine, OptimSpec, build
from deberta import checkpoint
from deberta.config import DebertaConfig
from deberta.sift import sift_loss
from core.config import FinetuneConfig, checkpoint_every
from core.errors import StageInputError
from stages.finetune.kinds.base import EVAL_BATCH, Encoded, TaskKind

TRIAL_STATE = "trial_state.pt"
"""Beside model.pt in a torch trial's checkpoint: what `restore_progress` needs to continue the loop."""

EPOCH_RESULT = "epoch_result.json"
"""Beside model.pt in every trial checkpoint: the result its epoch reported (epoch, every dev metric, the v2.0
threshold). The champion's figures are read from here, so they belong to the weights beside them."""


def write_epoch_result(directory: Path, result: dict[str, Any]) -> None:
    (Path(directory) / EPOCH_RESULT).write_text(json.dumps(result, sort_keys=True) + "\n")


@dataclass(frozen=True)
class TrialSetup:
    """Everything a trial needs besides its grid point (picklable, shipped once through the object store)."""

    model: DebertaConfig
    num_labels: int
    kind: TaskKind
    """The task's kind (`TaskRef.kind`): its head, its batches' labels, its dev metrics."""
    metric: str
    ft: FinetuneConfig


def load_backbone(model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> None:
    """Copy the backbone into a head (`deberta.heads`); only the head's own layers stay freshly initialised."""
    missing, unexpected = model.load_state_dict(weights, strict=False)
    bad = [k for k in missing if k.startswith(checkpoint.BACKBONE_PREFIX)] + list(unexpected)
    if bad:
        raise StageInputError(f"pretrained weights do not fit the model: {len(bad)} tensors differ, e.g. {bad[:3]}")


def build_classifier(setup: TrialSetup, config: dict[str, Any]) -> torch.nn.Module:
    """The trial's model before the backbone is loaded: its head drawn from the trial's seed."""
    torch.manual_seed(config["seed"])
    return setup.kind.build_head(setup.model, setup.num_labels, config["dropout"], sift=setup.ft.sift)


def trial_engine(setup: TrialSetup, config: dict[str, Any], weights: dict[str, torch.Tensor], spec: OptimSpec,
                 **engine_kw) -> Engine:
    """The classifier with the pretrained backbone (checked key for key) inside `training.engine`'s engine."""
    from deberta.model import init_weights

    with torch.device("meta"):  # the key check, without building the model twice
        skeleton = setup.kind.build_head(setup.model, setup.num_labels, 0.0)
    missing = [k for k in skeleton.state_dict() if k.startswith(checkpoint.BACKBONE_PREFIX)
               and k not in weights]
    if missing:
        raise StageInputError(f"pretrained weights do not fit the model: {len(missing)} tensors missing, "
                              f"e.g. {missing[:3]}")
    ft = setup.ft
    deepspeed = engine_kw.get("ds_config") is not None
    arithmetic = precision.resolve(ft.precision, ft.use_gpu, setup.model.hidden_size)
    return build(lambda: build_classifier(setup, config), spec, weights=weights,
                 init_module=lambda m: init_weights(m, setup.model), compile=ft.compile,
                 autocast=precision.autocast_dtype(arithmetic, ft.use_gpu, deepspeed),
                 checkpoint_every=checkpoint_every(ft.activation_checkpointing, "finetune.activation_checkpointing"),
                 **engine_kw)


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


def optim_spec(ft: FinetuneConfig, config: dict[str, Any], n_train: int, world: int = 1) -> OptimSpec:
    """The trial's AdamW and schedule: the grid point's lr and warmup, decay to zero after `epochs`."""
    return OptimSpec(lr=config["lr"], warmup_steps=int(config["warmup_steps"]),
                     total_steps=steps_per_epoch(n_train, int(config["batch_size"]), world) * ft.epochs,
                     weight_decay=ft.weight_decay, betas=(ft.adam_beta1, ft.adam_beta2), eps=ft.adam_eps,
                     grad_clip=ft.grad_clip)


def _batch(data: Encoded, idx: np.ndarray, device, kind: TaskKind) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    ids = data.ids[idx]  # (B, T), or (B, K, T) for K options; [PAD] = 0 (fixed by the vocab stage)
    width = max(1, int((ids != 0).sum(-1).max()))  # trim the padding every row shares
    labels = data.label[idx]
    if kind.labels_per_position:  # trimmed with the ids
        labels = labels[:, :width]
    ids = torch.from_numpy(ids[..., :width].astype(np.int64)).to(device)  # (B, T') or (B, K, T')
    return ids, (ids != 0).long(), torch.from_numpy(labels).to(device)


@torch.no_grad()
def evaluate(model, data: Encoded, kind: TaskKind, device, rank: int = 0, world: int = 1) -> dict[str, float]:
    """Dev metrics. With `world` > 1 every worker predicts a contiguous share and the shares are gathered; all
    workers run the same number of forward passes (ZeRO-3 gathers weights collectively in each one)."""
    model.eval()
    share = math.ceil(len(data) / world)
    rows = np.arange(rank * share, min(len(data), (rank + 1) * share))
    mine: list[np.ndarray] = []
    for b in range(math.ceil(share / EVAL_BATCH)):
        idx = rows[b * EVAL_BATCH:(b + 1) * EVAL_BATCH]
        real = len(idx)
        ids, mask, _ = _batch(data, idx if real else np.zeros(1, dtype=np.int64), device, kind)  # a pad pass, dropped
        logits = model(ids, mask)["logits"].float()  # (B, num_labels), (B, T', num_labels) or (B, 2, T')
        mine += kind.row_outputs(logits, mask)[:real]
    if world > 1:
        shares: list[Any] = [None] * world
        torch.distributed.all_gather_object(shares, mine)
        mine = [row for share in shares for row in share]
    return kind.dev_metrics(mine, data)


def train_step(model, batch, sift_lambda: float | None) -> tuple[torch.Tensor, float]:
    """Task loss (+ the SiFT term, lambda included, when `sift_lambda`); returns (loss, SiFT term).

    `model` is the head or the engine around it (which forwards attribute access to it). SiFT's perturbed passes
    run on the head itself, not through DeepSpeed's engine: under ZeRO-1/2 the engine's forward makes the ascent
    step's `torch.autograd.grad` run the gradient-reduction epilogue with nothing bucketed (IndexError in
    `reduce_ipg_grads`, DeepSpeed 0.19.8); their gradients reach the parameters through the engine's backward of
    the summed loss as any other."""
    ids, mask, labels = batch
    out = model(ids, mask, labels=labels)
    if sift_lambda is None:
        return out["loss"], 0.0
    head = getattr(model, "module", model)
    adv = sift_loss(head, ids, mask, out["logits"], model.regression, lam=sift_lambda)
    return out["loss"] + adv, float(adv.detach())


@dataclass(frozen=True)
class Progress:
    """Where a trial's loop stands after an epoch; with the engine's state, enough to continue it exactly."""

    epoch: int = 0
    best: float = -math.inf
    """The best dev metric so far."""
    order: dict[str, Any] | None = None
    """The data-order generator's state (numpy's bit generator) after `epoch`."""


Report = Callable[[dict[str, Any], Engine, bool, Progress], None]
"""report(epoch result, engine, improved, progress): Tune's or Ray Train's, per trainer; it decides what to
checkpoint."""


def run_epochs(engine: Engine, data: tuple[Encoded, Encoded], setup: TrialSetup, config: dict[str, Any],
               report: Report, rank: int = 0, world: int = 1, start: Progress = Progress()) -> None:
    """The fine-tuning loop of both trainers: every batch split rank::world, dev metrics per epoch, each epoch
    handed to `report` with whether the dev metric improved. `start`: continue after that epoch."""
    ft, (train, dev) = setup.ft, data
    bs, device = int(config["batch_size"]), engine.device
    rng = np.random.default_rng(config["seed"])  # the same order on every worker; each takes rows rank::world
    if start.order is not None:
        rng.bit_generator.state = start.order
    best = start.best
    for epoch in range(start.epoch + 1, ft.epochs + 1):
        engine.train()
        started, losses, sifts = time.time(), [], []
        for idx in epoch_batches(len(train), bs, rng, world):
            loss, adv = train_step(engine, _batch(train, idx[rank::world], device, setup.kind),
                                   ft.sift_lambda if ft.sift else None)
            engine.backward(loss)
            engine.step()
            losses.append(float(loss.detach()))
            sifts.append(adv)
        train_loss, sift_term = float(np.mean(losses)), float(np.mean(sifts))
        if world > 1:
            means = torch.tensor([train_loss, sift_term], dtype=torch.float64, device=device)
            torch.distributed.all_reduce(means)  # sum over workers
            train_loss, sift_term = (means / world).tolist()
        dev_metrics = evaluate(engine, dev, setup.kind, device, rank, world)
        result = {"epoch": epoch, "train_loss": train_loss, "sift_loss": sift_term, "lr": engine.lr,
                  "epoch_seconds": time.time() - started, "world_size": world,
                  **{f"dev_{k}": v for k, v in dev_metrics.items()}}
        improved = dev_metrics[setup.metric] > best
        best = max(best, dev_metrics[setup.metric])
        # the trial's best so far: Tune's TensorBoard logger writes the last result as the trial's hparams metrics,
        # and selection ranks trials by their best epoch, not their last
        result[f"best_dev_{setup.metric}"] = best
        report(result, engine, improved, Progress(epoch, best, rng.bit_generator.state))


def save_progress(engine: Engine, directory: Path, progress: Progress) -> None:
    """A torch trial's checkpoint: model.pt (the weights, as selection copies them) and TRIAL_STATE."""
    engine.save_weights(directory)
    torch.save({"epoch": progress.epoch, "best": progress.best, "order": progress.order,
                "optimizer": engine.optimizer.state_dict(), "scheduler": engine.scheduler.state_dict(),
                "torch_rng": torch.get_rng_state(),
                "cuda_rng": torch.cuda.get_rng_state() if engine.device.type == "cuda" else None},
               Path(directory) / TRIAL_STATE)


def restore_progress(engine: Engine, directory: Path) -> Progress:
    """Load a `save_progress` checkpoint into a freshly built engine; returns where the loop continues."""
    directory = Path(directory)
    state = torch.load(directory / TRIAL_STATE, map_location="cpu", weights_only=True)
    engine.model.load_state_dict(torch.load(directory / "model.pt", map_location=engine.device, weights_only=True))
    engine.optimizer.load_state_dict(state["optimizer"])
    engine.scheduler.load_state_dict(state["scheduler"])
    torch.set_rng_state(state["torch_rng"])
    if state["cuda_rng"] is not None:
        torch.cuda.set_rng_state(state["cuda_rng"])
    return Progress(state["epoch"], state["best"], state["order"])


def read_epoch_result(directory: Path) -> dict[str, Any]:
    return json.loads((Path(directory) / EPOCH_RESULT).read_text())


def torch_trial(config: dict[str, Any], *, data: tuple[Encoded, Encoded], weights: dict[str, torch.Tensor],
                setup: TrialSetup) -> None:
    """Tune function trainable (trainer=torch): fine-tune one grid point in this process."""
    from ray import tune

    ft = setup.ft
    torch.set_num_threads(ft.cpus_per_trial)
    device = "cuda" if ft.use_gpu and torch.cuda.is_available() else "cpu"
    engine = trial_engine(setup, config, weights, optim_spec(ft, config, len(data[0])), device=device)
    start = Progress()
    if (ckpt := tune.get_checkpoint()) is not None:  # a retry after a lost process, or a restored sweep
        with ckpt.as_directory() as d:
            start = restore_progress(engine, Path(d))
        print(f"[finetune] trial {tune.get_context().get_trial_id()} resumes after epoch {start.epoch} "
              f"(from its checkpoint)", flush=True)

    def report(result: dict[str, Any], engine: Engine, improved: bool, progress: Progress) -> None:
        # every epoch: Tune keeps the best checkpoint (num_to_keep=1) and always the newest, to resume from
        with tempfile.TemporaryDirectory() as tmp:
            save_progress(engine, Path(tmp), progress)
            write_epoch_result(Path(tmp), result)
            tune.report(result, checkpoint=tune.Checkpoint.from_directory(tmp))

    run_epochs(engine, data, setup, config, report, start=start)


def deepspeed_worker(loop_config: dict[str, Any]) -> None:
    """Ray Train worker loop (trainer=deepspeed): one data-parallel share of one grid point."""
    import ray
    import ray.train

    from training.deepspeed_config import build_finetune_config

    config, setup, payload = loop_config["grid"], loop_config["setup"], loop_config["payload"]
    ft = setup.ft
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    torch.set_num_threads(ft.cpus_per_trial)
    if ft.use_gpu:
        import ray.train.torch

        torch.cuda.set_device(ray.train.torch.get_device())  # the GPU Ray assigned to this worker
    data = ray.get(payload["data"])
    weights = ray.get(payload["weights"])
    bs = int(config["batch_size"])
    ds_config = build_finetune_config(ft.grad_clip, ft.zero_stage, ft.use_gpu, bs, world, ft.precision)
    engine = trial_engine(setup, config, weights, optim_spec(ft, config, len(data[0]), world), ds_config=ds_config,
                          backend="nccl" if ft.use_gpu else "gloo")
    if rank:  # the other workers draw their own dropout masks (rank 0 continues as a torch trial would)
        torch.manual_seed(config["seed"] * 1_009 + rank)

    def report(result: dict[str, Any], engine: Engine, improved: bool, progress: Progress) -> None:
        # an epoch as good as the best so far is checkpointed too: Ray Train keeps the newest of equal scores, as
        # Tune does of a torch trial's, so both trainers serve the same epoch
        if result[f"dev_{setup.metric}"] < progress.best:
            ray.train.report(result)
            return
        with tempfile.TemporaryDirectory() as tmp:
            engine.save_weights(tmp)  # collective under ZeRO-3; rank 0 writes the full model
            if rank == 0:
                write_epoch_result(Path(tmp), result)
            ray.train.report(result, checkpoint=ray.train.Checkpoint.from_directory(tmp) if rank == 0 else None)

    run_epochs(engine, data, setup, config, report, rank, world)


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
            name=_attempt_name(storage_path, f"{ctx.get_experiment_name()}-{ctx.get_trial_id()}"),
            storage_path=storage_path, callbacks=[TuneReportCallback()],
            checkpoint_config=train.CheckpointConfig(num_to_keep=1, checkpoint_score_attribute=metric,
                                                     checkpoint_score_order="max"),
            # Tune retries the trial (finetune.max_failures): a lost worker fails this run, and so the trial, once
            failure_config=train.FailureConfig(max_failures=0)),
    )
    trainer.fit()


def _attempt_name(storage_path: str, base: str) -> str:
    """`base` for a trial's first Ray Train run, `base-retryN` for its N-th retry: Train V2 would resume a run of
    the same name from its last checkpoint, which holds the gathered weights alone, and its checkpoint bookkeeping
    would mix the attempts' checkpoints; a retry starts over in a run of its own."""
    import pyarrow.fs as pafs

    fs, root = storage_fs(storage_path)
    taken = {i.base_name for i in fs.get_file_info(pafs.FileSelector(root, allow_not_found=True))}
    return next(name for n in range(len(taken) + 1)
                if (name := base if n == 0 else f"{base}-retry{n}") not in taken)
