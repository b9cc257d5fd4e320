"""The per-worker pretraining loop (`train_loop_per_worker`), run by Ray Train on every worker.

The engine (`training.engine`: DeepSpeed on the process group Ray Train already set up, gloo on CPU, NCCL
on GPU) is built here, inside the worker. Everything a worker needs arrives in one picklable `LoopJob`; no
module global is read inside the loop.

Data position (what a checkpoint stores besides model, optimizer and scheduler): `(epoch,
batch_in_epoch)` in micro-batches of this worker. The order is a pure function of the number of sequences,
seed, epoch and rank (`stages.pretrain.data`: a permutation of all sequences per epoch, rows read by index), so
on resume every worker redraws epoch `epoch` and starts at micro-batch `batch_in_epoch` (nothing before it is
read) - the next step sees exactly the batches it would have seen without the interruption. Span masks are a
pure function of (seed, step, micro-batch, rank) and the dropout RNG is reseeded from (seed, step, rank) every
step, so a resumed run repeats the uninterrupted one step for step. The step and the validation pass
themselves (`train_step`, `validation_sums`) run without Ray.

Side effects (prints, MLflow) happen on world rank 0 only, through `RankZero` (`rank_zero.py`).

Which columns a batch reads, which numbers a step and a validation pass log and how the progress lines word them
are the objective's (`Objective`): the loop names none of them.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import torch

import stages.pretrain.data as data
from core import artifacts
from core.artifacts import Artifact
from core.config import PretrainConfig, checkpoint_every
from deberta.config import DebertaConfig
from deberta.masking import SpanMasker
from stages.pretrain.checkpoints import TrainState, restore, save_and_report
from stages.pretrain.continued import SafetensorsFile
from stages.pretrain.objective import Objective, Sums
from stages.pretrain.rank_zero import RankZero
from training import precision
from training.deepspeed_config import DeepSpeedConfig
from training.engine import Engine, OptimSpec, build

# ----------------------------------------------------------------------------- the step and the validation pass
# Plain functions of (engine, objective, masker, batches): no Ray, no process group. The benchmarks call them on a
# plain torch engine, so what they measure is what the stage trains.

EVAL_MASK_OFFSET = 1 << 40
"""Validation masks use mask steps from here on: fixed across evaluations, disjoint from training masks."""


def dropout_seed(seed: int, step: int, rank: int) -> int:
    """Seed of the torch RNG for optimizer step `step` on `rank`: dropout and the objective's draws repeat on
    resume."""
    return (seed * 1_000_003 + step) * 1_009 + rank


def forward(engine, masker: SpanMasker, batch: dict[str, torch.Tensor], mask_step: int,
            **extra) -> dict[str, torch.Tensor]:
    """Mask the batch's `input_ids` (a pure function of `mask_step`) and run the engine on them, with the batch's
    other inputs (`Objective.batch`) and `extra`."""
    ids = batch["input_ids"]  # (B, T)
    masked, labels = masker(ids, step=mask_step)  # (B, T) each
    inputs = {k: v.to(engine.device) for k, v in batch.items() if k != "input_ids"}
    return engine(input_ids=masked.to(engine.device), attention_mask=(ids != 0).to(engine.device),
                  labels=labels.to(engine.device), **inputs, **extra)


def train_step(engine, objective: Objective, masker: SpanMasker, batches: Sequence[dict[str, torch.Tensor]],
               step: int, rank: int = 0, world: int = 1) -> dict[str, float]:
    """Optimizer step `step` (0-based) over this rank's accumulation micro-batches. Returns this rank's means of
    `loss` and the objective's step metrics, and the learning rate the step used."""
    keys = ("loss", *objective.step_metrics)
    sums = dict.fromkeys(keys, 0.0)
    lr = engine.lr  # before the step: the rate this step trains with
    torch.manual_seed(dropout_seed(objective.cfg.seed, step, rank))
    for micro, batch in enumerate(batches):
        outputs = forward(engine, masker, batch, mask_step=(step * len(batches) + micro) * world + rank)
        engine.backward(outputs["loss"])
        engine.step()  # DeepSpeed steps the optimizer and scheduler at the accumulation boundary only
        for k in keys:
            sums[k] += float(outputs[k].detach())
    return {**{k: v / len(batches) for k, v in sums.items()}, "lr": lr}


def validation_sums(engine, objective: Objective, masker: SpanMasker, batches: Sequence[dict[str, torch.Tensor]],
                    rank: int = 0, world: int = 1,
                    each: Callable[[int, dict[str, torch.Tensor]], None] | None = None,
                    extra: dict[str, Any] | None = None) -> Sums:
    """The objective's validation totals over this rank's batches (fixed masks and draws: batch i of
    rank r uses mask step EVAL_MASK_OFFSET + i * world + r). `each(i, outputs)` sees every batch's outputs; `extra`
    goes to the model with every batch."""
    engine.eval()
    sums: Sums = {}
    with torch.no_grad():
        for i, batch in enumerate(batches):
            mask_step = EVAL_MASK_OFFSET + i * world + rank
            outputs = forward(engine, masker, batch, mask_step, **objective.eval_inputs(mask_step), **(extra or {}))
            for k, v in objective.eval_sums(outputs).items():
                sums[k] = sums.get(k, 0.0) + v
            if each is not None:
                each(i, outputs)
    engine.train()
    return sums


# -------------------------------------------------------------------------------------------- the worker loop


@dataclass(frozen=True)
class LoopJob:
    """Everything the workers need, resolved on the driver (picklable)."""

    cfg: PretrainConfig
    objective: Objective
    """`stages.pretrain.objective_for(cfg)`."""
    model: DebertaConfig
    ds_config: DeepSpeedConfig
    seq_len: int
    train_files: tuple[str, ...]
    """Train shards (paths every node can read: the workdir is shared, as for every Ray stage's output)."""
    val_files: tuple[str, ...]
    """Validation shards (same)."""
    tokenizer_len: int
    mask_id: int
    special_ids: tuple[int, ...]
    word_start: bytes
    """np.packbits of the tokenizer's (len,) word-start mask (compact to ship)."""
    train_flops_per_token: float
    """The objective's training FLOPs per token at seq_len (`Objective.train_flops_per_token`)."""
    tracker: Any
    """core.lineage.Tracker of the stage run (rank 0 logs through it)."""
    init_weights: str = ""
    """Continued pretraining: the safetensors file of starting weights (`stages.pretrain.continued.initial_weights`)."""
    run_dir: str = ""
    """The Ray Train run's storage directory (path or URI): `restore` lists its checkpoints when Ray Train has
    none registered (its snapshot was cut short and set aside, or never written)."""
    shards: Artifact | None = None
    """The tokenize artifact `train_files` and `val_files` belong to: in an object-store workdir each node fetches
    its verified copy (`core.artifacts.fetch`, once per node) before a worker maps the files."""

    def word_start_mask(self) -> torch.Tensor:
        bits = np.unpackbits(np.frombuffer(self.word_start, dtype=np.uint8))[: self.tokenizer_len]
        return torch.from_numpy(bits.astype(bool))

    def masker(self):
        return self.objective.masker(self.tokenizer_len, self.mask_id, self.special_ids, self.word_start_mask())


def optim_spec(cfg: PretrainConfig) -> OptimSpec:
    """Table 8's AdamW, schedule and clipping for `training.engine`."""
    return OptimSpec(lr=cfg.lr, warmup_steps=cfg.warmup_steps, total_steps=cfg.max_steps,
                     weight_decay=cfg.weight_decay, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps,
                     grad_clip=cfg.grad_clip)


def build_engine(job: LoopJob, use_gpu: bool) -> Engine:
    """The objective's model inside the DeepSpeed engine of `training.engine`, on the GPU (NCCL) or CPU (gloo) Ray
    Train gave this worker. Seeded: identical initial weights on every rank."""
    if use_gpu:
        import ray.train.torch

        torch.cuda.set_device(ray.train.torch.get_device())  # the GPU Ray assigned to this worker
    factory, init_module = job.objective.build_model(job.model)
    weights = SafetensorsFile(job.init_weights) if job.init_weights else None
    arithmetic = precision.resolve(job.cfg.precision, use_gpu, job.model.hidden_size)
    return build(factory, optim_spec(job.cfg), ds_config=job.ds_config, backend="nccl" if use_gpu else "gloo",
                 seed=job.cfg.seed, init_module=init_module, weights=weights,
                 autocast=precision.autocast_dtype(arithmetic, use_gpu, deepspeed=True), compile=job.cfg.compile,
                 checkpoint_every=checkpoint_every(job.cfg.activation_checkpointing))


def micro_batches(job: LoopJob, rank: int, world: int, state: TrainState) -> Iterator[tuple[int, int, dict]]:
    """Endless (epoch, index in epoch, batch) of this worker, starting at the saved data position."""
    cfg = job.cfg
    split = data.Sequences(job.train_files, job.objective.shard_columns)
    if data.batches_per_epoch(len(split), world, cfg.micro_batch_size) == 0:
        raise RuntimeError(f"the train split has {len(split)} sequences, fewer than micro_batch_size x workers = "
                           f"{cfg.micro_batch_size * world}; tokenize more text or use fewer workers")
    epoch, skip = state.epoch, state.batch_in_epoch
    while True:
        for n, columns in enumerate(data.rank_batches(split, cfg.seed, epoch, rank, world, cfg.micro_batch_size,
                                                      start=skip), start=skip):
            yield epoch, n, job.objective.batch(columns)
        epoch, skip = epoch + 1, 0


def all_reduce_sum(values: dict[str, float], device) -> dict[str, float]:
    """`values` summed over all workers (every rank holds the same keys in the same order)."""
    import torch.distributed as dist

    t = torch.tensor(list(values.values()), dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return dict(zip(values, t.tolist()))


def validation_batches(job: LoopJob, rank: int, world: int) -> list[dict[str, torch.Tensor]]:
    """This worker's slice of a fixed sample of eval_batches x micro x world validation sequences, read once.

    The sample is drawn uniformly from the whole validation split (seeded by `seed`), not its first rows: the
    shards hold documents in corpus order, so a head would measure one source. Read by index rather than by Ray
    Data: a few thousand fixed rows, re-used at every evaluation, and every rank must run the same number of
    forward passes (ZeRO-3 gathers parameters collectively).
    """
    micro = job.cfg.micro_batch_size
    split = data.Sequences(job.val_files, job.objective.shard_columns)
    total = len(split)
    want = min(total, job.cfg.eval_batches * micro * world)
    picked = np.sort(np.random.default_rng(job.cfg.seed).choice(total, size=want, replace=False))
    per_rank = want // world // micro * micro
    if per_rank == 0:
        raise RuntimeError(f"the validation split has {total} sequences, fewer than micro_batch_size x workers "
                           f"= {micro * world}; tokenize more validation text")
    mine = job.objective.batch(split.take(picked[rank * per_rank:(rank + 1) * per_rank]))  # (N, ...) each
    return [dict(zip(mine, parts)) for parts in zip(*(t.split(micro) for t in mine.values()))]


def source_validation_batches(job: LoopJob, rank: int, world: int) -> dict[str, list[dict[str, torch.Tensor]]]:
    """Named sources: per source, this worker's slice of a fixed sample of up to eval_batches x micro x world of its
    own validation sequences (`data.source_samples`), for a validation loss per source beside the blended one (a
    source whose loss rises is what a blend is watched for). Empty for one unnamed source."""
    micro = job.cfg.micro_batch_size
    samples = data.source_samples(job.val_files, job.cfg.eval_batches * micro * world, world, micro, job.cfg.seed)
    split = data.Sequences(job.val_files, job.objective.shard_columns) if samples else None
    out = {}
    for name, picked in samples.items():
        mine = job.objective.batch(split.take(picked[rank]))
        out[name] = [dict(zip(mine, parts)) for parts in zip(*(t.split(micro) for t in mine.values()))]
    return out


def evaluate_sources(engine, job: LoopJob, masker, per_source: dict[str, list[dict[str, torch.Tensor]]], rank: int,
                     world: int) -> dict[str, float]:
    """val_loss.NAME: the validation loss of each named source's own sample (every rank runs the same sources)."""
    return {f"val_loss.{name}": evaluate(engine, job, masker, batches, rank, world)["val_loss"]
            for name, batches in per_source.items()}


def log_sources(job: LoopJob, rank0: RankZero, rank: int, world: int, accumulation: int) -> None:
    """Named sources, on rank 0: per source what it holds and what this run reads of it (`data.Blend.delivered`:
    weight, tokens seen, passes), printed and recorded in the run's params (source.NAME.FIELD)."""
    blend = data.Blend.of_files(job.train_files) if rank == 0 else None
    if blend is None:
        return
    report = blend.delivered(job.cfg.max_steps, accumulation, world, job.cfg.micro_batch_size)
    rank0.print(f"sources blended over {job.cfg.max_steps:,} steps:\n{data.report_lines(report)}")
    try:  # lineage, not training: a tracking outage here is a warning, as metric points are (RankZero)
        if job.tracker is not None:
            job.tracker.log_params(data.lineage_params(report))
    except Exception as e:  # noqa: BLE001
        rank0.print(f"warning: the sources' params could not be logged: {type(e).__name__}: {e}")


def evaluate(engine, job: LoopJob, masker, batches: list[dict[str, torch.Tensor]], rank: int,
             world: int, extra: dict[str, Any] | None = None) -> dict[str, float]:
    """Validation numbers of the objective on every worker's batches (`validation_sums`, summed over workers)."""
    sums: Sums = validation_sums(engine, job.objective, masker, batches, rank, world, extra=extra)
    return job.objective.eval_metrics(all_reduce_sum(sums, engine.device))


def worker_nodes(world: int) -> list[str]:
    """Ray node id of every rank, in rank order (so tests and logs can see where training ran)."""
    import ray
    import torch.distributed as dist

    nodes: list[Any] = [None] * world
    dist.all_gather_object(nodes, ray.get_runtime_context().get_node_id())
    return nodes


def device_peak_flops(use_gpu: bool) -> float | None:
    """bf16 dense peak of this worker's GPU (deberta.flops table), for MFU; None on CPU or an unknown GPU."""
    if not use_gpu or not torch.cuda.is_available():
        return None
    from deberta.flops import peak_flops

    return peak_flops(torch.cuda.get_device_name(torch.cuda.current_device()), "bf16")


class Throughput:
    """Step timing between progress lines: tokens/s, model TFLOP/s per worker, MFU (where the peak is known), ETA."""

    def __init__(self, job: LoopJob, world: int, first_step: int):
        self.job, self.world, self.first_step = job, world, first_step
        self.tokens_per_step = job.cfg.train_batch_size * job.seq_len
        self.peak = device_peak_flops(job.cfg.use_gpu)
        self.started = self.window_start = time.time()
        self.window_steps = 0

    def step(self) -> None:
        self.window_steps += 1

    def read(self, step: int) -> dict[str, float | None]:
        now = time.time()
        step_time = (now - self.window_start) / max(self.window_steps, 1)
        tokens_per_s = self.tokens_per_step / step_time
        flops = tokens_per_s * self.job.train_flops_per_token
        self.window_start, self.window_steps = now, 0
        return {
            "tokens_per_s": tokens_per_s, "step_time_s": step_time,
            "model_tflops_per_worker": flops / self.world / 1e12,
            "mfu": flops / (self.world * self.peak) if self.peak else None,
            "eta_s": (self.job.cfg.max_steps - step) * (now - self.started) / max(step - self.first_step, 1),
        }


def next_step_batches(batches: Iterator[tuple[int, int, dict]], state: TrainState, accum: int) -> list[dict]:
    """This rank's `accum` micro-batches of the next step; advances the data position."""
    step_batches = []
    for _ in range(accum):
        state.epoch, index, batch = next(batches)
        state.batch_in_epoch = index + 1
        step_batches.append(batch)
    return step_batches


def log_step(job: LoopJob, rank0: RankZero, engine, means: dict[str, float], state: TrainState, world: int,
             timer: Throughput) -> dict[str, float | None]:
    """The step's metrics averaged over workers: a progress line and MLflow points (returned)."""
    lr = means.pop("lr")
    means = job.objective.finish_step_metrics(
        {k: v / world for k, v in all_reduce_sum(means, engine.device).items()})
    metrics = {**means, "lr": lr, "grad_norm": engine.grad_norm, "epoch": state.epoch, **timer.read(state.step)}
    rank0.print(f"step {state.step}/{job.cfg.max_steps} loss {metrics['loss']:.4f}{job.objective.step_line(means)} "
                f"lr {lr:.3e} "
                f"tokens/s {metrics['tokens_per_s']:,.0f} ETA {metrics['eta_s'] / 60:.1f} min")
    logged = {k: None if v is None else float(v) for k, v in metrics.items()}
    rank0.log(logged, step=state.step)
    return logged


def train_loop_per_worker(config: dict[str, Any]) -> None:
    import ray.train

    job: LoopJob = config["job"]
    cfg, objective = job.cfg, job.objective
    if job.shards is not None:
        artifacts.fetch(job.shards)
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    rank0 = RankZero(rank, job.tracker)
    engine = build_engine(job, cfg.use_gpu)
    accum = engine.accumulation
    masker = job.masker()
    nodes = worker_nodes(world)
    rank0.print(f"{objective.title} objective, {world} workers on {len(set(nodes))} node(s), ZeRO-{cfg.zero_stage}, "
                f"{'GPU' if cfg.use_gpu else 'CPU'} {engine.precision}{', compiled' if engine.compiled else ''}, "
                f"attention {job.model.attn_impl}, accumulation {accum}; config "
                + json.dumps({"pretrain": asdict(cfg), "deepspeed": job.ds_config.to_dict()}, sort_keys=True))
    cost = precision.emulated_cost("pretrain.precision", cfg.precision, cfg.use_gpu)
    if cost is not None:
        rank0.print(f"warning: {cost}")
    state = restore(engine, rank0, rank, world, job.run_dir)
    log_sources(job, rank0, rank, world, accum)
    val_batches = validation_batches(job, rank, world)
    source_val = source_validation_batches(job, rank, world)
    if state.step == 0:
        rank0.log({**evaluate(engine, job, masker, val_batches, rank, world),
                   **evaluate_sources(engine, job, masker, source_val, rank, world)}, step=0)
        released = objective.released_loss_inputs() if job.init_weights else None
        if released is not None:  # the checkpoint as transformers computes it: proof that all of it was taken
            what, loss = objective.released_loss(evaluate(engine, job, masker, val_batches, rank, world, released))
            rank0.print(f"validation {what} of the released checkpoint (as transformers computes it): {loss:.4f}")
            rank0.log({"val_loss_released": loss}, step=0)
    batches = micro_batches(job, rank, world, state)
    timer, last_eval, first_step = Throughput(job, world, state.step), {}, state.step
    while state.step < cfg.max_steps:
        means = train_step(engine, objective, masker, next_step_batches(batches, state, accum), state.step, rank,
                           world)
        state.step += 1
        timer.step()
        done = state.step == cfg.max_steps
        if state.step % cfg.log_interval == 0 or done:
            log_step(job, rank0, engine, means, state, world, timer)
        if state.step % cfg.eval_interval == 0 or done:
            last_eval = {**evaluate(engine, job, masker, val_batches, rank, world),
                         **evaluate_sources(engine, job, masker, source_val, rank, world)}
            rank0.print(f"step {state.step} validation" + objective.eval_line(last_eval)
                        + "".join(f", {k} {v:.4f}" for k, v in last_eval.items() if k.startswith("val_loss.")))
            rank0.log(last_eval, step=state.step)
        if state.step % cfg.ckpt_interval == 0 or done:
            final = {"worker_nodes": nodes, "unsent_metrics": rank0.close()} if done else {}
            save_and_report(engine, state, {"step": state.step, **last_eval, **final}, rank)
    if first_step == cfg.max_steps:  # restarted after the last checkpoint: report it again as the result
        save_and_report(engine, state, {"step": state.step, "worker_nodes": nodes, "unsent_metrics": rank0.close()},
                        rank)
