"""The per-worker pretraining loop (`train_loop_per_worker`), run by Ray Train on every worker.

The engine (`training.engine`: DeepSpeed on the process group Ray Train already set up, gloo on CPU, NCCL
on GPU) is built here, inside the worker. Everything a worker needs arrives in one picklable `LoopJob`; no
module global is read inside the loop.

Data position (what a checkpoint stores besides model, optimizer and scheduler): `(epoch,
batch_in_epoch)` in micro-batches of this worker. The order is a pure function of the shards, seed, epoch
and rank (`stages.pretrain.data`: blocks re-dealt every epoch, windows shuffled locally), so on resume every
worker re-opens epoch `epoch` and skips `batch_in_epoch` micro-batches (read and dropped, never computed;
the cost is I/O proportional to the position within the epoch) - the next step sees exactly the batches it
would have seen without the interruption. Span masks are a pure function of (seed, step, micro-batch,
rank) and the dropout RNG is reseeded from (seed, step, rank) every step, so a resumed run repeats the
uninterrupted one step for step.

Side effects (prints, MLflow) happen on world rank 0 only, through `RankZero`.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from deberta.config import DebertaConfig
from deberta.masking import SpanMasker
from training.engine import Engine, OptimSpec, build
from core.config import PretrainConfig
import stages.pretrain.data as data
import stages.pretrain.objectives as objectives
from stages.segment_pairs import SOP_COLUMN

STATE_FILE = "train_state.json"
"""Written by rank 0 next to DeepSpeed's files in every checkpoint: tag, step and data position."""
EVAL_MASK_OFFSET = 1 << 40
"""Validation masks use mask steps from here on: fixed across evaluations, disjoint from training masks."""


@dataclass(frozen=True)
class LoopJob:
    """Everything the workers need, resolved on the driver (picklable)."""

    cfg: PretrainConfig
    model: DebertaConfig
    ds_config: dict[str, Any]
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
    """deberta.flops.train_flops_per_token at seq_len and the MLM target share."""
    tracker: Any
    """core.lineage.Tracker of the stage run (rank 0 logs through it)."""

    def word_start_mask(self) -> torch.Tensor:
        bits = np.unpackbits(np.frombuffer(self.word_start, dtype=np.uint8))[: self.tokenizer_len]
        return torch.from_numpy(bits.astype(bool))


@dataclass
class TrainState:
    """Step and data position, saved with every checkpoint."""

    step: int = 0
    epoch: int = 0
    batch_in_epoch: int = 0
    tag: str = ""

    @classmethod
    def read(cls, directory: Path) -> "TrainState":
        return cls(**json.loads((Path(directory) / STATE_FILE).read_text()))


class RankZero:
    """The one place side effects happen: prints and MLflow metrics, on world rank 0 only."""

    def __init__(self, rank: int, tracker: Any):
        self.rank, self.tracker, self.started = rank, tracker, time.time()

    def print(self, message: str) -> None:
        if self.rank == 0:
            # Not print(): Ray Train routes print() through the root logger, which DeepSpeed's handler
            # echoes a second time, so every line reached the driver twice.
            sys.stdout.write(f"[pretrain {time.time() - self.started:5.0f}s] {message}\n")
            sys.stdout.flush()

    def log(self, metrics: dict[str, float], step: int) -> None:
        if self.rank == 0:
            self.tracker.log_metrics({k: v for k, v in metrics.items() if v is not None}, step=step)


def optim_spec(cfg: PretrainConfig) -> OptimSpec:
    """Table 8's AdamW, schedule and clipping for `training.engine`."""
    return OptimSpec(lr=cfg.lr, warmup_steps=cfg.warmup_steps, total_steps=cfg.max_steps,
                     weight_decay=cfg.weight_decay, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps,
                     grad_clip=cfg.grad_clip)


def make_engine(cfg: PretrainConfig, model_cfg: DebertaConfig, ds_config: dict[str, Any], backend: str) -> Engine:
    """The objective's model (`stages.pretrain.objectives`) inside the DeepSpeed engine of `training.engine`.
    Seeded: identical initial weights on every rank."""
    factory, init_module = objectives.build_model(cfg, model_cfg)
    return build(factory, optim_spec(cfg), ds_config=ds_config, backend=backend, seed=cfg.seed,
                 init_module=init_module)


def build_engine(job: LoopJob, use_gpu: bool) -> Engine:
    """`make_engine` on the GPU (NCCL) or CPU (gloo) Ray Train gave this worker."""
    if use_gpu:
        import ray.train.torch

        torch.cuda.set_device(ray.train.torch.get_device())  # the GPU Ray assigned to this worker
    return make_engine(job.cfg, job.model, job.ds_config, "nccl" if use_gpu else "gloo")


def shard_columns(cfg: PretrainConfig) -> list[str]:
    return ["input_ids", SOP_COLUMN] if cfg.sop else ["input_ids"]


def numpy_columns(table) -> dict[str, np.ndarray]:
    """A pyarrow micro-batch -> {"input_ids": (B, T) uint32, and sop_label (B,) when read}, without copies."""
    ids = table.column("input_ids").combine_chunks()
    out = {"input_ids": np.asarray(ids.flatten()).reshape(len(table), -1)}  # (B, T)
    if SOP_COLUMN in table.column_names:
        out[SOP_COLUMN] = table.column(SOP_COLUMN).to_numpy()
    return out


def to_batch(batch: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    """numpy batch -> {"input_ids": (B, T) int64 (uint32 on disk), and "sop_labels": (B,) with SOP}."""
    ids = batch["input_ids"]
    if ids.dtype == object:  # list columns may arrive as an array of arrays
        ids = np.stack(ids)
    out = {"input_ids": torch.from_numpy(ids.astype(np.int64))}  # (B, T)
    if SOP_COLUMN in batch:
        out["sop_labels"] = torch.from_numpy(np.asarray(batch[SOP_COLUMN]).astype(np.int64))  # (B,)
    return out


def forward(engine, masker: SpanMasker, batch: dict[str, torch.Tensor], step: int, **extra) -> dict[str, torch.Tensor]:
    """Mask the batch (a pure function of `step`) and run the engine on it."""
    ids = batch["input_ids"]
    masked, labels = masker(ids, step=step)  # (B, T) each
    if "sop_labels" in batch:
        extra["sop_labels"] = batch["sop_labels"].to(engine.device)
    return engine(input_ids=masked.to(engine.device), attention_mask=(ids != 0).to(engine.device),
                  labels=labels.to(engine.device), **extra)


def micro_batches(job: LoopJob, rank: int, world: int, state: TrainState) -> Iterator[tuple[int, int, dict]]:
    """Endless (epoch, index in epoch, batch) of this worker, starting at the saved data position."""
    cfg = job.cfg
    split = data.blocks(job.train_files)
    if len(split) < world:
        raise RuntimeError(f"the train split has {len(split)} blocks of <= {data.BLOCK_ROWS} sequences, fewer than "
                           f"{world} workers; tokenize more text or use fewer workers")
    epoch, skip = state.epoch, state.batch_in_epoch
    while True:
        n = 0
        for n, table in enumerate(data.rank_batches(split, cfg.seed, epoch, rank, world, cfg.micro_batch_size,
                                                    cfg.shuffle_buffer, shard_columns(cfg)), start=1):
            if n > skip:
                yield epoch, n - 1, to_batch(numpy_columns(table))
        if n == 0:
            raise RuntimeError(f"worker {rank}: its blocks hold fewer than micro_batch_size={cfg.micro_batch_size} "
                               f"sequences; use more data or fewer workers")
        epoch, skip = epoch + 1, 0


def all_reduce_sum(values: list[float], device) -> list[float]:
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return t.tolist()


def validation_batches(job: LoopJob, rank: int, world: int) -> list[dict[str, torch.Tensor]]:
    """This worker's slice of a fixed sample of eval_batches x micro x world validation sequences, read once.

    The sample is drawn uniformly from the whole validation split (seeded by `seed`), not its first rows: the
    shards hold documents in corpus order, so a head would measure one source. Plain pyarrow rather than Ray
    Data: a few thousand fixed rows, re-used at every evaluation, and every rank must run the same number of
    forward passes (ZeRO-3 gathers parameters collectively).
    """
    import pyarrow as pa
    import pyarrow.dataset as pads

    micro = job.cfg.micro_batch_size
    dataset = pads.dataset(list(job.val_files), format="parquet")
    total = dataset.count_rows()
    want = min(total, job.cfg.eval_batches * micro * world)
    picked = np.sort(np.random.default_rng(job.cfg.seed).choice(total, size=want, replace=False))
    table = dataset.take(pa.array(picked, type=pa.int64()), columns=shard_columns(job.cfg))
    per_rank = len(table) // world // micro * micro
    if per_rank == 0:
        raise RuntimeError(f"the validation split has {len(table)} sequences, fewer than micro_batch_size x workers "
                           f"= {micro * world}; tokenize more validation text")
    mine = table.slice(rank * per_rank, per_rank)
    rows = mine.column("input_ids").combine_chunks()
    ids = torch.from_numpy(np.asarray(rows.flatten()).astype(np.int64)).view(per_rank, job.seq_len)  # (N, T)
    batches = [{"input_ids": chunk} for chunk in ids.split(micro)]
    if job.cfg.sop:
        sop = torch.from_numpy(mine.column(SOP_COLUMN).to_numpy().astype(np.int64))  # (N,)
        for batch, labels in zip(batches, sop.split(micro)):
            batch["sop_labels"] = labels
    return batches


def evaluate(engine, batches: list[dict[str, torch.Tensor]], masker: SpanMasker, cfg: PretrainConfig, rank: int,
             world: int) -> dict[str, float]:
    """Validation numbers of the objective on this worker's batches, summed over all workers. Masks (and RTD's
    generator draws) are fixed across evaluations."""
    engine.eval()
    sums: list[float] = []
    with torch.no_grad():
        for i, batch in enumerate(batches):
            step = EVAL_MASK_OFFSET + i * world + rank
            extra = {"generator": step} if cfg.objective == "rtd" else {}
            these = objectives.eval_sums(cfg, forward(engine, masker, batch, step, **extra))
            sums = [a + b for a, b in zip(sums, these)] if sums else these
    engine.train()
    return objectives.eval_metrics(cfg, all_reduce_sum(sums, engine.device))


def save_and_report(engine, state: TrainState, metrics: dict[str, float], rank: int) -> None:
    """DeepSpeed checkpoint on every rank into a rank-local directory, then one collective Ray Train report."""
    import ray.train

    root = Path(tempfile.mkdtemp(prefix=f"ds-ckpt-rank{rank}-"))
    try:
        state.tag = f"step{state.step}"  # never "latest": that name is DeepSpeed's pointer file
        engine.ds.save_checkpoint(str(root), tag=state.tag, client_state={"train_state": asdict(state)})
        if rank == 0:
            (root / STATE_FILE).write_text(json.dumps(asdict(state)))
        ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(str(root)))
    finally:
        shutil.rmtree(root, ignore_errors=True)


def restore(engine, out: RankZero) -> TrainState:
    """Latest reported checkpoint (after a worker failure, or a restart of the stage) -> engine + position."""
    import ray.train

    ckpt = ray.train.get_checkpoint()
    if ckpt is None:
        return TrainState()
    with ckpt.as_directory() as d:
        state = TrainState.read(Path(d))
        path, _ = engine.ds.load_checkpoint(d, tag=state.tag, load_optimizer_states=True, load_lr_scheduler_states=True)
        if path is None:
            raise RuntimeError(f"DeepSpeed could not load checkpoint {state.tag} from {d}")
    out.print(f"restored {state.tag} from {ckpt.path}: resuming at step {state.step + 1}, "
              f"epoch {state.epoch}, micro-batch {state.batch_in_epoch}")
    out.log({"restored_from_step": state.step}, step=state.step)
    return state


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


def train_step(engine, batches, masker: SpanMasker, state: TrainState, accum: int, rank: int, world: int,
               cfg: PretrainConfig) -> dict[str, float]:
    """One optimizer step (accum micro-batches); advances the data position. Returns this rank's means of the
    loss and the objective's step metrics, and the learning rate the step used."""
    keys = ("loss", *objectives.step_metrics(cfg))
    sums = dict.fromkeys(keys, 0.0)
    lr = engine.lr  # before the step: the rate this step trains with
    # dropout (and RTD's draws) use the global torch RNG: reseeding per (step, rank) makes a resumed step identical
    torch.manual_seed((masker.seed * 1_000_003 + state.step) * 1_009 + rank)
    for micro in range(accum):
        state.epoch, index, batch = next(batches)
        state.batch_in_epoch = index + 1
        out = forward(engine, masker, batch, step=(state.step * accum + micro) * world + rank)
        engine.backward(out["loss"])
        engine.step()  # DeepSpeed steps the optimizer and scheduler at the accumulation boundary only
        for k, v in objectives.step_values(out, keys).items():
            sums[k] += v
    state.step += 1
    return {**{k: v / accum for k, v in sums.items()}, "lr": lr}


def train_loop_per_worker(config: dict[str, Any]) -> None:
    import ray.train

    job: LoopJob = config["job"]
    cfg = job.cfg
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    out = RankZero(rank, job.tracker)
    engine = build_engine(job, cfg.use_gpu)
    accum = engine.accumulation
    masker = objectives.make_masker(cfg, job.tokenizer_len, job.mask_id, job.special_ids, job.word_start_mask())
    nodes = worker_nodes(world)
    out.print(f"{cfg.objective} objective, {world} workers on {len(set(nodes))} node(s), ZeRO-{cfg.zero_stage}, "
              f"{'bf16 GPU' if cfg.use_gpu else 'fp32 CPU'}, accumulation {accum}; config "
              + json.dumps({"pretrain": asdict(cfg), "deepspeed": job.ds_config}, sort_keys=True))
    state = restore(engine, out)
    val_batches = validation_batches(job, rank, world)
    if state.step == 0:
        out.log(evaluate(engine, val_batches, masker, cfg, rank, world), step=0)
    batches = micro_batches(job, rank, world, state)
    timer, last_eval, first_step = Throughput(job, world, state.step), {}, state.step
    while state.step < cfg.max_steps:
        step = train_step(engine, batches, masker, state, accum, rank, world, cfg)
        timer.step()
        done = state.step == cfg.max_steps
        if state.step % cfg.log_interval == 0 or done:
            lr = step.pop("lr")
            means = objectives.finish_metrics(
                dict(zip(step, (v / world for v in all_reduce_sum(list(step.values()), engine.device)))))
            metrics = {**means, "lr": lr, "grad_norm": engine.grad_norm, "epoch": state.epoch,
                       **timer.read(state.step)}
            parts = "".join(f" {k} {means[k]:.4f}" for k in ("mlm_loss", "rtd_loss", "rtd_accuracy", "sop_accuracy")
                            if k in means)
            out.print(f"step {state.step}/{cfg.max_steps} loss {metrics['loss']:.4f}{parts} lr {lr:.3e} "
                      f"tokens/s {metrics['tokens_per_s']:,.0f} ETA {metrics['eta_s'] / 60:.1f} min")
            out.log({k: None if v is None else float(v) for k, v in metrics.items()}, step=state.step)
        if state.step % cfg.eval_interval == 0 or done:
            last_eval = evaluate(engine, val_batches, masker, cfg, rank, world)
            extra = (f" RTD accuracy {last_eval['val_rtd_accuracy']:.3f} (all-original "
                     f"{last_eval['val_all_original_accuracy']:.3f})" if cfg.objective == "rtd" else "")
            extra += f" SOP accuracy {last_eval['val_sop_accuracy']:.3f}" if cfg.sop else ""
            out.print(f"step {state.step} validation loss {last_eval['val_loss']:.4f} "
                      f"accuracy {last_eval['val_accuracy']:.3f} perplexity {last_eval['val_perplexity']:.1f}{extra}")
            out.log(last_eval, step=state.step)
        if state.step % cfg.ckpt_interval == 0 or done:
            final = {"worker_nodes": nodes} if done else {}
            save_and_report(engine, state, {"step": state.step, **last_eval, **final}, rank)
    if first_step == cfg.max_steps:  # restarted after the last checkpoint: report it again as the result
        save_and_report(engine, state, {"step": state.step, "worker_nodes": nodes}, rank)
