"""MLM against RTD (GDES, ES, NES) at equal pretraining compute, then the same fine-tuning grid on each backbone.

    .venv/bin/python -m bench.objectives                                   # defaults: ~15-20 min on 2 cores
    .venv/bin/python -m bench.objectives --steps 100 --ft-examples 300 --seeds 0 --ft-lr 1e-3   # a quick look

Data: the pipeline's own token sequences - the `tokenize` artifact of the debug preset on the built-in news corpus
under `--workdir` (made by `pipeline.run --until tokenize` when missing; that starts Ray, so run the bench inside
`unshare --net sh -c 'ip link set lo up && ...'` the first time) and its vocab artifact. Model: the debug shape
(`deberta.config.debug()`, embedding rows = tokenizer length padded to a multiple of 100).

Pretraining (the stage's objective, `stages.pretrain.objective_for`, and its step and validation pass,
`stages.pretrain.loop.train_step` and `validation_sums`, on a plain torch engine of `training.engine`): MLM gets
`--steps` S; each RTD variant
S * flops_mlm / flops_rtd steps of the same batch, so every run spends the same training FLOPs, the generator's
included. Every run reads the same seeded stream of sequences (RTD a shorter prefix of it), from the same seed.
`none` is the control: the backbone at initialisation, no pretraining.

Fine-tuning (`stages.finetune.trial.run_epochs`, the finetune stage's loop, without Tune): each backbone (RTD: the
discriminator, embeddings merged as `deberta.rtd.discriminator_weights` does) on rotten-tomatoes, every grid point
x every seed; a trial's score is its best epoch's dev accuracy; per objective the grid point with the best mean
over seeds is reported (mean and sample std over seeds), as the finetune stage selects.

Embeddings (DeBERTaV3 Table 1): the average cosine similarity between *different* randomly sampled word pieces
inside one table (mean over all pairs of `--cos-samples` seeded pieces that occur >= `--cos-min-count` times in
the train split) - for E_G, E_D and under GDES also E_delta (E_D = E_G + E_delta). This is what Table 1 reports
(ES 0.02/0.02, NES 0.45/0.02, GDES 0.45/0.29). Beside it, the mean cosine between the same piece's rows of E_G and
E_D (ES: 1 by construction), which is not Table 1's number.

Jobs run in `--procs` processes of `--threads` torch threads each (2 x 1 is the fastest on 2 cores for a model this
small); wall times are measured inside each process, CPU times beside them (less sensitive to a shared machine).
Prints one JSON object (also written to `--json PATH`, by default bench/results/objectives.json), then the tables in
markdown.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import RESULTS, comma_choices, comma_floats, comma_ints, emit, process_pool

OBJECTIVES = ("none", "mlm", "gdes", "es", "nes")
"""none: no pretraining (the initial backbone); mlm: DeBERTa's MLM; gdes/es/nes: RTD with that embedding sharing."""
WORD_TABLE = "embeddings.word_embeddings.weight"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.objectives", description=__doc__.split("\n\n")[0])
    p.add_argument("--workdir", type=Path, default=Path("/tmp/objbench/wd"), help="pipeline workdir with the "
                   "tokenize artifact (made there when missing)")
    p.add_argument("--objectives", type=comma_choices(OBJECTIVES, "objective"), default=OBJECTIVES)
    p.add_argument("--steps", type=int, default=800, help="MLM step budget S (the debug preset's 800 x 16); RTD "
                   "gets S*flops_mlm/flops_rtd")
    p.add_argument("--batch", type=int, default=16, help="sequences per pretraining step (all objectives)")
    p.add_argument("--lr", type=float, default=5e-4, help="peak pretraining lr (the debug preset's)")
    p.add_argument("--warmup", type=int, default=50, help="pretraining warmup steps, then linear decay to 0")
    p.add_argument("--rtd-weight", type=float, default=50.0, help="lambda of L_MLM + lambda*L_RTD (DeBERTaV3 §2.3)")
    p.add_argument("--eval-batches", type=int, default=32, help="validation batches of --batch sequences")
    p.add_argument("--log-every", type=int, default=100, help="steps per point of the train-loss curve (JSON)")
    p.add_argument("--ft-lr", type=comma_floats, default=(1e-3, 2e-3))
    p.add_argument("--ft-dropout", type=comma_floats, default=(0.1,))
    p.add_argument("--ft-warmup", type=comma_ints, default=(50,))
    p.add_argument("--ft-batch", type=comma_ints, default=(32,))
    p.add_argument("--ft-epochs", type=int, default=3)
    p.add_argument("--ft-examples", type=int, default=2000, help="train examples (fixed-seed sample)")
    p.add_argument("--ft-seq-len", type=int, default=64)
    p.add_argument("--seeds", type=comma_ints, default=(0, 1, 2), help="fine-tuning seeds per grid point")
    p.add_argument("--seed", type=int, default=0, help="pretraining seed (init, data order, masks)")
    p.add_argument("--cos-samples", type=int, default=1000, help="word pieces sampled for the Table 1 analysis")
    p.add_argument("--cos-min-count", type=int, default=20, help="occurrences in the train split a piece needs")
    p.add_argument("--procs", type=int, default=2, help="worker processes")
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker process")
    p.add_argument("--json", type=Path, default=RESULTS / "objectives.json", help="where the JSON report goes")
    args = p.parse_args(argv)
    for name in ("steps", "batch", "eval_batches", "log_every", "ft_epochs", "ft_examples", "cos_samples",
                 "procs", "threads"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')}={getattr(args, name)}: must be >= 1")
    if args.ft_seq_len < 3:
        p.error(f"--ft-seq-len={args.ft_seq_len}: needs room for [CLS], a token and [SEP] (>= 3)")
    return args


# ----------------------------------------------------------------------------------------------------- data

def find_artifacts(workdir: Path) -> tuple[Path, Path] | None:
    """(tokenize artifact, its vocab artifact): the newest finished tokenize artifact under workdir written by this
    version of the stage (an older one may hold another format: passed over, so that `ensure_artifacts` remakes
    one), else None."""
    from core.artifacts import MANIFEST, SUCCESS
    from stages.tokenize import VERSION

    root = workdir / "artifacts" / "tokenize"
    found = root.glob("*") if root.is_dir() else []
    manifests = {p: json.loads((p / MANIFEST).read_text()) for p in found if (p / SUCCESS).is_file()}
    done = [p for p, m in manifests.items() if m.get("version") == VERSION]
    if not done:
        return None
    tok_dir = max(done, key=lambda p: manifests[p]["created_at"])
    vocab_dir = workdir / "artifacts" / "vocab" / manifests[tok_dir]["inputs"]["vocab"]
    if not (vocab_dir / SUCCESS).is_file():
        raise SystemExit(f"error: tokenize artifact {tok_dir} names vocab artifact {vocab_dir.name}, which is not "
                         f"finished; re-run `python -m pipeline.run --until tokenize --workdir {workdir}`")
    return tok_dir, vocab_dir


def ensure_artifacts(workdir: Path) -> tuple[Path, Path]:
    """The pipeline's debug-preset token sequences, made with `pipeline.run --until tokenize` when missing."""
    found = find_artifacts(workdir)
    if found is not None:
        return found
    from pipeline.run import main as pipeline_main

    print(f"no tokenize artifact under {workdir}: running the pipeline's data stages (starts Ray)", file=sys.stderr)
    rc = pipeline_main(["--until", "tokenize", "--workdir", str(workdir)])
    found = find_artifacts(workdir)
    if rc != 0 or found is None:
        raise SystemExit(f"error: `pipeline.run --until tokenize --workdir {workdir}` failed (rc {rc}); run it "
                         f"inside `unshare --net sh -c 'ip link set lo up && ...'` and read its message")
    return found


def load_sequences(tok_dir: Path, split: str) -> np.ndarray:
    """(N, T) uint32 token ids of a tokenize artifact's split in corpus order (`input_ids`, fixed-size lists)."""
    from stages.tokenize import read_split

    column = read_split(tok_dir / split, ["input_ids"]).column("input_ids").combine_chunks()
    return np.asarray(column.flatten()).reshape(len(column), -1)  # (N * T,) -> (N, T)


def model_config(vocab_dir: Path):
    """The debug shape with embedding rows = the tokenizer's length padded to a multiple of 100."""
    from deberta.config import debug, padded_vocab_size
    from core.tokenizer import Tokenizer

    return debug(vocab_size=padded_vocab_size(len(Tokenizer.load(vocab_dir))))


def pretrain_config(variant: str, steps: int, args):
    """The pipeline's PretrainConfig of one variant (one worker, no accumulation)."""
    from core.config import PretrainConfig

    rtd = variant in ("gdes", "es", "nes")
    return PretrainConfig(num_workers=1, micro_batch_size=args.batch, train_batch_size=args.batch, lr=args.lr,
                          warmup_steps=args.warmup, max_steps=max(1, steps), objective="rtd" if rtd else "mlm",
                          embedding_sharing=variant if rtd else "gdes", rtd_weight=args.rtd_weight, seed=args.seed)


def plan_runs(args, model, seq_len: int) -> list[dict[str, Any]]:
    """Steps and FLOPs per variant: MLM S steps, RTD round(S * flops_mlm / flops_rtd), none 0."""
    from stages.pretrain import objective_for

    def flops(variant: str) -> float:
        return objective_for(pretrain_config(variant, 1, args)).train_flops_per_token(model, seq_len)

    tokens_per_step = args.batch * seq_len
    f_mlm = flops("mlm")
    runs = []
    for variant in args.objectives:
        f = flops(variant)
        steps = 0 if variant == "none" else args.steps if variant == "mlm" else round(args.steps * f_mlm / f)
        runs.append({"objective": variant, "steps": steps, "flops_per_token": f,
                     "train_flops": f * steps * tokens_per_step, "tokens": steps * tokens_per_step})
    return runs


def sample_pieces(train: np.ndarray, tokenizer, n: int, min_count: int, seed: int) -> np.ndarray:
    """n seeded piece ids (sorted) among the non-special pieces seen >= min_count times in the train split."""
    counts = np.bincount(train.ravel(), minlength=len(tokenizer))
    eligible = np.arange(len(tokenizer))[counts >= min_count]
    eligible = eligible[~np.isin(eligible, list(tokenizer.special_ids.values()))]
    if len(eligible) < 2:
        raise SystemExit(f"error: only {len(eligible)} pieces occur >= {min_count} times; lower --cos-min-count")
    return np.sort(np.random.default_rng(seed).choice(eligible, size=min(n, len(eligible)), replace=False))


# ----------------------------------------------------------------------------------------------- embeddings

def mean_pairwise_cosine(table, rows) -> float:
    """DeBERTaV3 Table 1: the mean cosine similarity over every pair of different sampled rows of one table."""
    import torch
    import torch.nn.functional as F

    x = F.normalize(table[torch.as_tensor(rows)].double(), dim=-1)  # (N, H) unit rows (a zero row stays zero)
    sims = x @ x.T  # (N, N)
    n = x.shape[0]
    return float((sims.sum() - sims.diagonal().sum()) / (n * (n - 1)))


def mean_row_cosine(a, b, rows) -> float:
    """Mean cosine between the same piece's rows of two tables."""
    import torch
    import torch.nn.functional as F

    idx = torch.as_tensor(rows)
    return float(F.cosine_similarity(a[idx].double(), b[idx].double(), dim=-1).mean())


def embedding_tables(variant: str, state: dict) -> dict[str, Any]:
    """The word tables of a pretraining model's state dict: E_G (generator), E_delta (GDES), E_D (what the
    fine-tuned backbone reads: the MLM model's one table, or the discriminator's merged one)."""
    from deberta.rtd import DISCRIMINATOR_PREFIX, GENERATOR_PREFIX, discriminator_weights

    if variant in ("none", "mlm"):
        return {"E_D": state["deberta." + WORD_TABLE]}
    tables = {"E_G": state[GENERATOR_PREFIX + "deberta." + WORD_TABLE],
              "E_D": discriminator_weights(state, variant)[WORD_TABLE]}
    if variant == "gdes":
        tables["E_delta"] = state[DISCRIMINATOR_PREFIX + WORD_TABLE]
    return tables


def embedding_stats(variant: str, state: dict, rows: np.ndarray) -> dict[str, float]:
    tables = embedding_tables(variant, state)
    stats = {f"pairwise_cos_{name}": round(mean_pairwise_cosine(t, rows), 4) for name, t in tables.items()}
    if "E_G" in tables:
        stats["row_cos_E_G_E_D"] = round(mean_row_cosine(tables["E_G"], tables["E_D"], rows), 4)
    return stats


def backbone_weights(variant: str, state: dict) -> dict[str, np.ndarray]:
    """The `deberta.*` tensors fine-tuning loads (RTD: the discriminator, E_G + E_delta merged under GDES)."""
    from deberta.rtd import discriminator_weights

    if variant in ("none", "mlm"):
        weights = {k: v for k, v in state.items() if k.startswith("deberta.")}
    else:
        weights = {"deberta." + k: v for k, v in discriminator_weights(state, variant).items()}
    return {k: v.detach().cpu().numpy().copy() for k, v in weights.items()}  # numpy: no shared-memory handles


# -------------------------------------------------------------------------------------------------- workers

def _validation(engine, objective, masker, val: np.ndarray, batches: int, batch: int) -> dict[str, float]:
    """The stage's validation pass on the first `batches` batches (fixed masks and RTD draws)."""
    from stages.pretrain.loop import validation_sums

    val_batches = [objective.batch({"input_ids": val[i * batch:(i + 1) * batch]})
                   for i in range(min(batches, len(val) // batch))]
    sums = validation_sums(engine, objective, masker, val_batches)
    return {k: round(v, 4) for k, v in objective.eval_metrics(sums).items()}


def _train(engine, objective, masker, train: np.ndarray, steps: int, batch: int, log_every: int) -> list[dict]:
    """`steps` of the stage's training steps over a seeded permutation of the train sequences (the same stream for
    every variant); returns the train-loss curve (means over `log_every` steps)."""
    from stages.pretrain.loop import train_step

    epochs = math.ceil(steps * batch / len(train)) if steps else 0
    rng = np.random.default_rng(objective.cfg.seed)
    order = np.concatenate([rng.permutation(len(train)) for _ in range(epochs)]) if epochs else np.zeros(0, int)
    curve, acc = [], []
    for step in range(steps):
        rows = order[step * batch:(step + 1) * batch]
        means = train_step(engine, objective, masker, [objective.batch({"input_ids": train[rows]})], step)
        means.pop("lr")
        acc.append(means)
        if len(acc) == log_every or step == steps - 1:
            window = objective.finish_step_metrics({k: float(np.mean([m[k] for m in acc])) for k in acc[0]})
            curve.append({"step": step + 1, **{k: round(v, 4) for k, v in window.items()}})
            acc = []
    return curve


def pretrain_job(job: dict[str, Any]) -> dict[str, Any]:
    """One variant's pretraining run in a worker process: engine, train, validate, embeddings, backbone."""
    import torch

    from training.engine import build
    from core.tokenizer import Tokenizer
    from stages.pretrain import objective_for
    from stages.pretrain.loop import optim_spec

    args, run, variant = job["args"], job["run"], job["run"]["objective"]
    cfg = pretrain_config(variant, run["steps"], args)
    objective = objective_for(cfg)
    tok = Tokenizer.load(job["vocab_dir"])
    train, val = load_sequences(job["tok_dir"], "train"), load_sequences(job["tok_dir"], "validation")
    factory, _ = objective.build_model(job["model"])
    engine = build(factory, optim_spec(cfg), seed=cfg.seed)
    masker = objective.masker(len(tok), tok.mask_id, list(tok.special_ids.values()),
                              torch.from_numpy(tok.word_start_mask()))
    wall, cpu = time.perf_counter(), time.process_time()
    curve = _train(engine, objective, masker, train, run["steps"], args.batch, args.log_every)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    val_metrics = _validation(engine, objective, masker, val, args.eval_batches, args.batch)
    state = {k: v.detach() for k, v in engine.module.state_dict().items()}
    return {**run, "wall_s": round(wall, 1), "cpu_s": round(cpu, 1),
            "tokens_per_s": round(run["tokens"] / wall) if run["steps"] else None,
            "params": sum(p.numel() for p in engine.module.parameters()), "validation": val_metrics,
            "curve": curve, "embeddings": embedding_stats(variant, state, job["rows"]),
            "weights": backbone_weights(variant, state)}


def finetune_job(job: dict[str, Any]) -> dict[str, Any]:
    """One fine-tuning trial (grid point x seed) in a worker process: `run_epochs`, the finetune stage's loop."""
    import torch

    from stages.finetune.trial import optim_spec, run_epochs, trial_engine

    setup, config, data = job["setup"], job["config"], job["data"]
    weights = {k: torch.from_numpy(v) for k, v in job["weights"].items()}
    started = time.perf_counter()
    engine = trial_engine(setup, config, weights, optim_spec(setup.ft, config, len(data[0])))
    epochs: list[dict[str, Any]] = []
    run_epochs(engine, data, setup, config, lambda result, *_: epochs.append(result))
    best = max(epochs, key=lambda r: r[f"dev_{setup.metric}"])
    return {"objective": job["objective"], **config, "best_epoch": best["epoch"],
            "dev": round(best[f"dev_{setup.metric}"], 4), "wall_s": round(time.perf_counter() - started, 1),
            "per_epoch": [round(r[f"dev_{setup.metric}"], 4) for r in epochs]}


# --------------------------------------------------------------------------------------------------- driver

def finetune_setup(args, model, vocab_dir: Path):
    """(TrialSetup, (train, dev) arrays, grid points, majority baseline, task) of rotten-tomatoes."""
    import itertools

    from core.config import FinetuneConfig
    from stages.finetune.data import prepare_data
    from stages.finetune.tasks import majority_baseline, resolve_task
    from stages.finetune.trial import TrialSetup

    task = resolve_task("rotten-tomatoes")
    ft = FinetuneConfig(task=task.name, dropout=args.ft_dropout, warmup_steps=args.ft_warmup, lr=args.ft_lr,
                        batch_size=args.ft_batch, seeds=args.seeds, epochs=args.ft_epochs,
                        max_seq_len=args.ft_seq_len, max_train_examples=args.ft_examples, cpus_per_trial=args.threads)
    data = prepare_data(task, vocab_dir, ft)
    setup = TrialSetup(model, task.num_labels, task.kind, task.metric, ft)
    grid = [dict(zip(("dropout", "warmup_steps", "lr", "batch_size"), point))
            for point in itertools.product(ft.dropout, ft.warmup_steps, ft.lr, ft.batch_size)]
    return setup, data, grid, majority_baseline(task), task


def run_all(args, runs, common: dict, ft_common: dict) -> tuple[list[dict], list[dict]]:
    """Pretraining jobs first (in `runs` order), each backbone's fine-tuning trials as soon as it is ready."""
    pretrained, trials = [], []
    with process_pool(args.procs, args.threads) as ex:
        pending = {ex.submit(pretrain_job, {**common, "run": run}): "pretrain" for run in runs}
        while pending:
            done, _ = cf.wait(pending, return_when=cf.FIRST_COMPLETED)
            for fut in done:
                kind, result = pending.pop(fut), fut.result()
                if kind == "finetune":
                    trials.append(result)
                    continue
                weights = result.pop("weights")
                pretrained.append(result)
                print(f"pretrained {result['objective']}: {result['steps']} steps, {result['wall_s']} s, "
                      f"val {result['validation']}", file=sys.stderr, flush=True)
                for config in ft_common["grid"]:
                    for seed in args.seeds:
                        job = {"objective": result["objective"], "setup": ft_common["setup"], "weights": weights,
                               "data": ft_common["data"], "config": {**config, "seed": seed}}
                        pending[ex.submit(finetune_job, job)] = "finetune"
    return pretrained, trials


def summarise_finetune(objective: str, trials: list[dict], grid: list[dict]) -> dict[str, Any]:
    """Per grid point: mean and sample std of the best-epoch dev metric over seeds; the best mean is selected."""
    points = []
    for config in grid:
        scores = [t["dev"] for t in trials if t["objective"] == objective and all(t[k] == v for k, v in config.items())]
        std = float(np.std(scores, ddof=1)) if len(scores) > 1 else 0.0
        points.append({**config, "seeds": len(scores), "mean": round(float(np.mean(scores)), 4),
                       "std": round(std, 4), "scores": scores})
    best = max(points, key=lambda p: p["mean"])
    seconds = [t["wall_s"] for t in trials if t["objective"] == objective]
    return {"selected": {k: best[k] for k in grid[0]}, "dev_mean": best["mean"], "dev_std": best["std"],
            "grid": points, "trial_wall_s_mean": round(float(np.mean(seconds)), 1)}


def _fmt(value, digits: int = 3) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


def tables(report: dict[str, Any]) -> str:
    """Two markdown tables: pretraining + fine-tuning, and DeBERTaV3's Table 1 analysis."""
    metric = report["finetune"]["metric"]
    lines = [f"| objective | steps | train TFLOP | wall s | CPU s | val MLM loss | val RTD loss | RTD acc (all-original) "
             f"| dev {metric} (mean ± std, {len(report['finetune']['seeds'])} seeds) | selected lr |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in report["runs"].items():
        p, v, f = r["pretrain"], r["pretrain"]["validation"], r["finetune"]
        rtd = "val_rtd_loss" in v
        acc = f"{v['val_rtd_accuracy']:.3f} ({v['val_all_original_accuracy']:.3f})" if rtd else "—"
        lines.append(f"| {name} | {p['steps']} | {p['train_flops'] / 1e12:.3f} | {p['wall_s']:.0f} | {p['cpu_s']:.0f} "
                     f"| {v['val_mlm_loss' if rtd else 'val_loss']:.3f} | {_fmt(v.get('val_rtd_loss'))} | {acc} "
                     f"| {f['dev_mean']:.4f} ± {f['dev_std']:.4f} | {f['selected']['lr']:g} |")
    lines.append(f"| majority class | | | | | | | | {report['finetune']['majority_baseline']:.4f} | |")
    lines += ["", "| objective | mean pairwise cos E_G | E_Δ | E_D | row cos E_G vs E_D |", "|---|---|---|---|---|"]
    for name, r in report["runs"].items():
        e = r["pretrain"]["embeddings"]
        lines.append(f"| {name} | {_fmt(e.get('pairwise_cos_E_G'))} | {_fmt(e.get('pairwise_cos_E_delta'))} "
                     f"| {_fmt(e.get('pairwise_cos_E_D'))} | {_fmt(e.get('row_cos_E_G_E_D'))} |")
    return "\n".join(lines)


def build_report(args, argv, runs, pretrained, trials, ft, data_info, started: float) -> dict[str, Any]:
    setup, data, grid, baseline, task = ft
    by_name = {r["objective"]: r for r in pretrained}
    per_run = {r["objective"]: {"pretrain": by_name[r["objective"]],
                                "finetune": summarise_finetune(r["objective"], trials, grid)} for r in runs}
    return {
        "command": " ".join(["python -m bench.objectives", *argv]),
        "data": data_info,
        "equal_compute": {"mlm_steps": args.steps, "batch": args.batch, "seq_len": data_info["seq_len"],
                          "flops_per_token": {r["objective"]: r["flops_per_token"] for r in runs},
                          "steps": {r["objective"]: r["steps"] for r in runs},
                          "train_flops": {r["objective"]: r["train_flops"] for r in runs},
                          "note": "deberta.flops: matmuls only, training = 3 x forward, generator included"},
        "pretrain": {"lr": args.lr, "warmup": args.warmup, "rtd_weight": args.rtd_weight, "seed": args.seed,
                     "eval_sequences": min(args.eval_batches, data_info["validation_sequences"] // args.batch)
                     * args.batch,
                     "note": "val MLM loss: mlm/none on 80/10/10 n-gram spans, RTD's generator on single-word "
                             "all-[MASK] targets (different tasks: not comparable across the two)"},
        "finetune": {"task": task.name, "metric": task.metric, "majority_baseline": round(baseline, 4),
                     "train_examples": len(data[0]), "dev_examples": len(data[1]), "epochs": args.ft_epochs,
                     "grid": grid, "seeds": list(args.seeds), "score": "best epoch's dev metric per trial; "
                     "the grid point with the best mean over seeds; std over seeds (ddof=1)"},
        "embeddings": {"pieces": data_info["cos_pieces"], "min_count": args.cos_min_count,
                       "pairwise": "DeBERTaV3 Table 1: mean cosine over all pairs of different sampled pieces "
                                   "within one table", "row": "mean cosine of the same piece's E_G and E_D rows"},
        "runs": per_run,
        "procs": args.procs, "threads": args.threads, "wall_s": round(time.time() - started, 1),
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    started = time.time()
    import torch

    from core.tokenizer import Tokenizer

    torch.set_num_threads(1)  # the driver only waits; the cores belong to the workers
    tok_dir, vocab_dir = ensure_artifacts(args.workdir)
    model = model_config(vocab_dir)
    train = load_sequences(tok_dir, "train")
    seq_len = train.shape[1]
    if seq_len > model.max_position_embeddings:
        raise SystemExit(f"error: {tok_dir} holds {seq_len}-token sequences, the debug model takes "
                         f"{model.max_position_embeddings}; tokenize with the debug preset")
    rows = sample_pieces(train, Tokenizer.load(vocab_dir), args.cos_samples, args.cos_min_count, args.seed)
    runs = plan_runs(args, model, seq_len)
    ft = finetune_setup(args, model, vocab_dir)
    data_info = {"tokenize_artifact": str(tok_dir), "vocab_artifact": str(vocab_dir), "seq_len": seq_len,
                 "train_sequences": len(train), "validation_sequences": len(load_sequences(tok_dir, "validation")),
                 "vocab_rows": model.vocab_size, "cos_pieces": len(rows)}
    for r in runs:
        print(f"plan {r['objective']}: {r['steps']} steps x {args.batch} x {seq_len}, "
              f"{r['flops_per_token']:.4g} FLOP/token, {r['train_flops']:.4g} FLOP", file=sys.stderr)
    common = {"args": args, "model": model, "tok_dir": tok_dir, "vocab_dir": vocab_dir, "rows": rows}
    del train
    pretrained, trials = run_all(args, runs, common, {"setup": ft[0], "data": ft[1], "grid": ft[2]})
    report = build_report(args, sys.argv[1:] if argv is None else argv, runs, pretrained, trials, ft, data_info,
                          started)
    emit(report, args.json, tables(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
