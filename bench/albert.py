"""ALBERT's parameter reductions (ALBERT §3.1) against the plain model at equal steps: factorised embedding (E),
all-shared layers, both, each with and without sentence-order prediction (SOP).

    .venv/bin/python -m bench.albert                                       # defaults: ~35 min on 2 cores
    .venv/bin/python -m bench.albert --steps 100 --ft-examples 300 --seeds 0   # a quick look
    .venv/bin/python -m bench.albert --variants 'plain + SOP' --eval-every 250 --seeds 0   # one SOP curve

Data: one segment-pair `tokenize` artifact (`[CLS] A [SEP] B [SEP]` of whole sentences, B before A half of the
time, `sop_label`; a row of one sentence is no pair, `stages.segment_pairs`) of the debug preset on the built-in
news corpus under `--workdir`, made with `pipeline.run --until tokenize --set tokenize.segment_pairs=true` when
missing (starts Ray: run the bench inside `unshare --net sh -c 'ip link set lo up && ...'` the first time).
Every run - with or without SOP - reads the same seeded stream of these rows; the -SOP runs ignore `sop_label`,
so the data is equal and only the loss differs.
The defaults train 3,000 steps at lr 2e-3 (the pretraining tests' rate; the debug preset's 5e-4 x 800 steps leaves
the MLM near its unigram loss): sentence order leaves chance only after ~1,500 steps at this size.

Pretraining: the pipeline's MLM objective (`stages.pretrain.objective_for`, SOP on top where named) and the stage's
own step and validation pass (`stages.pretrain.loop.train_step`, `validation_sums`) on a plain torch engine of
`training.engine`, batches made as the pretraining loop makes them (`Objective.batch`, `sop_labels`
with SOP); `--steps` steps for every variant. The debug model (H = 64) would be
widened by ALBERT's E = 128, so the debug runs use `--debug-embedding` (E = 32 by default, H/2, as E = 128 is
H/12 at 1.5B). Validation: a seeded sample of the validation split (`--eval-batches` x `--batch` rows), MLM loss
with fixed masks, the SOP term apart; SOP accuracy also on the pairs that open a document (in order, [CLS] is
followed by the document's first words: a cue of position, not of order) and on the rest.

Paper-size numbers (no training): parameters of each variant on the 1.5B shape (`pipeline.presets.MODEL_1_5B`,
vocab 128,100) with E = 128, built on the meta device, and DeepSpeed's model-state memory per GPU for ZeRO-2 and
ZeRO-3 on 16 nodes x 8 GPUs, as `stages/pretrain/__init__.py`'s dry run computes it.

Fine-tuning: each backbone on rotten-tomatoes with `stages.finetune.trial` (`trial_engine`, `run_epochs`) at one
grid point x `--seeds`; a trial's score is its best epoch's dev accuracy; mean and sample std over seeds.
Jobs run in `--procs` spawned processes of `--threads` torch threads (`bench.common.process_pool`).
Prints one JSON object (also written to `--json PATH`, by default bench/results/albert.json), then the markdown table.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import dataclasses
import math
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import RESULTS, comma_choices, comma_floats, comma_ints, emit, process_pool
from bench.objectives import (backbone_weights, find_artifacts, finetune_job, finetune_setup, load_sequences,
                              model_config, summarise_finetune)
from stages.segment_pairs import NO_PAIR

SHAPES = (("plain", False, "none"), ("E", True, "none"), ("all-shared", False, "all"),
          ("E + all-shared", True, "all"))
"""(name, factorised embedding, share_layers) - ALBERT's Tables 3/4 axes."""
PAPER_E = 128  # ALBERT's E (ALBERT Table 3, the best all-shared setting)
PLAN_NODES, PLAN_GPUS = 16, 8


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.albert", description=__doc__.split("\n\n")[0])
    p.add_argument("--workdir", type=Path, default=Path("/tmp/albertbench/wd"),
                   help="pipeline workdir with a segment-pair tokenize artifact (made there when missing)")
    p.add_argument("--steps", type=int, default=3000, help="pretraining steps, every variant")
    p.add_argument("--batch", type=int, default=16, help="sequences per pretraining step")
    p.add_argument("--lr", type=float, default=2e-3, help="peak pretraining lr (the pretraining tests')")
    p.add_argument("--warmup", type=int, default=50, help="pretraining warmup steps, then linear decay to 0")
    p.add_argument("--debug-embedding", type=int, default=32, help="E of the debug runs (H = 64)")
    p.add_argument("--eval-batches", type=int, default=64, help="validation batches of --batch sequences")
    p.add_argument("--ft-lr", type=comma_floats, default=(1e-3,))
    p.add_argument("--ft-dropout", type=comma_floats, default=(0.1,))
    p.add_argument("--ft-warmup", type=comma_ints, default=(50,))
    p.add_argument("--ft-batch", type=comma_ints, default=(32,))
    p.add_argument("--ft-epochs", type=int, default=2)
    p.add_argument("--ft-examples", type=int, default=2000, help="train examples (fixed-seed sample)")
    p.add_argument("--ft-seq-len", type=int, default=64)
    p.add_argument("--seeds", type=comma_ints, default=(0, 1, 2), help="fine-tuning seeds")
    p.add_argument("--seed", type=int, default=0, help="pretraining seed (init, data order, masks)")
    names = tuple(r["name"] for r in variants())
    p.add_argument("--variants", type=comma_choices(names, "variant"), default=names,
                   help="comma list of the runs to make (default: all 8), e.g. 'E + all-shared + SOP'")
    p.add_argument("--eval-every", type=int, default=500,
                   help="also validate every N pretraining steps (a learning curve in the JSON); 0 = at the end only")
    p.add_argument("--procs", type=int, default=2, help="worker processes")
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker process")
    p.add_argument("--json", type=Path, default=RESULTS / "albert.json", help="where the JSON report goes")
    args = p.parse_args(argv)
    for name in ("steps", "batch", "eval_batches", "ft_epochs", "ft_examples", "procs", "threads",
                 "debug_embedding"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')}={getattr(args, name)}: must be >= 1")
    if args.eval_every < 0:
        p.error(f"--eval-every={args.eval_every}: must be >= 0")
    return args


def variants() -> list[dict[str, Any]]:
    """The 8 runs: every shape, without and with SOP."""
    return [{"name": name + (" + SOP" if sop else ""), "shape": name, "factorised": fact, "share_layers": share,
             "sop": sop} for sop in (False, True) for name, fact, share in SHAPES]


def variant_model(base, run: dict[str, Any], embedding_size: int):
    return base.replace(embedding_size=embedding_size if run["factorised"] else 0, share_layers=run["share_layers"])


def pretrain_config(run: dict[str, Any], args):
    from core.config import PretrainConfig

    return PretrainConfig(num_workers=1, micro_batch_size=args.batch, train_batch_size=args.batch, lr=args.lr,
                          warmup_steps=args.warmup, max_steps=args.steps, objective="mlm", sop=run["sop"],
                          seed=args.seed)


# ------------------------------------------------------------------------------------------------- data

def ensure_pair_artifacts(workdir: Path) -> tuple[Path, Path]:
    """A segment-pair tokenize artifact (and its vocab), made with `pipeline.run` when missing."""
    from stages.segment_pairs import SOP_COLUMN

    found = find_artifacts(workdir)
    if found is None:
        from pipeline.run import main as pipeline_main

        print(f"no tokenize artifact under {workdir}: running the data stages with segment pairs (starts Ray)",
              file=sys.stderr)
        rc = pipeline_main(["--until", "tokenize", "--workdir", str(workdir), "--set", "tokenize.segment_pairs=true"])
        found = find_artifacts(workdir)
        if rc != 0 or found is None:
            raise SystemExit(f"error: `pipeline.run --until tokenize --workdir {workdir} --set "
                             f"tokenize.segment_pairs=true` failed (rc {rc}); run it inside "
                             f"`unshare --net sh -c 'ip link set lo up && ...'` and read its message")
    import pyarrow as pa

    first = min((found[0] / "train").glob("*.arrow"))  # `find_artifacts` takes only artifacts with Arrow shards
    if SOP_COLUMN not in pa.ipc.open_file(pa.memory_map(str(first))).schema.names:
        raise SystemExit(f"error: {found[0]} has no `{SOP_COLUMN}` column (packed, not segment pairs); use another "
                         f"--workdir or run `pipeline.run --until tokenize --workdir ... --set "
                         f"tokenize.segment_pairs=true`")
    return found


def load_split(tok_dir: Path, split: str) -> tuple[np.ndarray, np.ndarray]:
    """(N, T) token ids and (N,) SOP labels of one split, in corpus order."""
    from stages.segment_pairs import SOP_COLUMN
    from stages.tokenize import read_split

    labels = read_split(tok_dir / split, [SOP_COLUMN]).column(SOP_COLUMN).to_numpy()
    return load_sequences(tok_dir, split), np.asarray(labels)


def validation_sample(tok_dir: Path, rows: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A seeded sample of `rows` validation sequences, in split order (the pretraining loop's way: the split holds
    documents in corpus order), their SOP labels, and whether each opens its document - the first row of its
    `doc_id` in the split's corpus order."""
    from stages.tokenize import read_split

    ids, labels = load_split(tok_dir, "validation")
    picked = np.sort(np.random.default_rng(seed).choice(len(ids), size=min(rows, len(ids)), replace=False))
    docs = np.asarray(read_split(tok_dir / "validation", ["doc_id"]).column("doc_id").to_pylist())
    opens = np.concatenate([[True], docs[1:] != docs[:-1]])  # (N,)
    return ids[picked], labels[picked], opens[picked]


def batch_of(objective, ids: np.ndarray, labels: np.ndarray) -> dict:
    """The pretraining loop's batch (`Objective.batch`): with `sop_labels` only for SOP runs."""
    from stages.segment_pairs import SOP_COLUMN

    return objective.batch({"input_ids": ids, SOP_COLUMN: labels})


# ---------------------------------------------------------------------------------------------- workers

def _validation(engine, objective, masker, val, batch: int) -> dict[str, float]:
    """The stage's validation pass on the fixed sample (fixed masks); with SOP also its accuracy apart on pairs that
    open a document (where [CLS] is followed by the document's start when in order) and the rest."""
    from stages.pretrain.loop import validation_sums

    ids, labels, opens = val
    batches = [batch_of(objective, ids[i * batch:(i + 1) * batch], labels[i * batch:(i + 1) * batch])
               for i in range(len(ids) // batch)]
    hits = []
    def sop_hits(i: int, outputs) -> None:
        hits.append(outputs["sop_logits"].argmax(-1).cpu().numpy() == labels[i * batch:(i + 1) * batch])  # (B,)

    sums = validation_sums(engine, objective, masker, batches, each=sop_hits if objective.cfg.sop else None)
    metrics = objective.eval_metrics(sums)
    if objective.cfg.sop:
        n = len(hits) * batch
        hit, pair, first = np.concatenate(hits), labels[:n] != NO_PAIR, opens[:n]
        for name, rows in (("opening", pair & first), ("rest", pair & ~first)):
            metrics[f"val_sop_accuracy_{name}"] = float(hit[rows].mean()) if rows.any() else float("nan")
            metrics[f"val_sop_pairs_{name}"] = int(rows.sum())
    return {k: round(v, 4) for k, v in metrics.items()}


def _train(engine, objective, masker, train, steps: int, batch: int, every: int = 0,
           validate=None) -> tuple[dict[str, float], list[dict]]:
    """`steps` of the stage's training steps over a seeded permutation (the same stream for every variant);
    last-50 means, and `validate()` every `every` steps (the learning curve; none when 0)."""
    from stages.pretrain.loop import train_step

    ids, labels = train
    rng = np.random.default_rng(objective.cfg.seed)
    order = np.concatenate([rng.permutation(len(ids)) for _ in range(math.ceil(steps * batch / len(ids)))])
    tail, curve = [], []
    for step in range(steps):
        rows = order[step * batch:(step + 1) * batch]
        means = train_step(engine, objective, masker, [batch_of(objective, ids[rows], labels[rows])], step)
        means.pop("lr")
        tail = (tail + [means])[-50:]
        if every and (step + 1) % every == 0 and step + 1 < steps:
            curve.append({"step": step + 1, **validate()})
    last50 = objective.finish_step_metrics({k: float(np.mean([m[k] for m in tail])) for k in tail[0]})
    return {f"train_{k}_last50": round(v, 4) for k, v in last50.items()}, curve


def pretrain_job(job: dict[str, Any]) -> dict[str, Any]:
    import torch

    from training.engine import build
    from core.tokenizer import Tokenizer
    from stages.pretrain import objective_for
    from stages.pretrain.loop import optim_spec

    args, run, model = job["args"], job["run"], job["model"]
    objective = objective_for(pretrain_config(run, args))
    tok = Tokenizer.load(job["vocab_dir"])
    train = load_split(job["tok_dir"], "train")
    val = validation_sample(job["tok_dir"], args.eval_batches * args.batch, args.seed)
    factory, _ = objective.build_model(model)
    engine = build(factory, optim_spec(objective.cfg), seed=args.seed)
    masker = objective.masker(len(tok), tok.mask_id, list(tok.special_ids.values()),
                              torch.from_numpy(tok.word_start_mask()))

    def validate() -> dict[str, float]:
        return _validation(engine, objective, masker, val, args.batch)

    wall, cpu = time.perf_counter(), time.process_time()
    train_metrics, curve = _train(engine, objective, masker, train, args.steps, args.batch, args.eval_every, validate)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu  # learning-curve validations included
    validation = validate()
    curve.append({"step": args.steps, **validation})
    state = {k: v.detach() for k, v in engine.module.state_dict().items()}
    return {"name": run["name"], "steps": args.steps, "wall_s": round(wall, 1), "cpu_s": round(cpu, 1),
            "params": sum(p.numel() for p in engine.module.parameters()), "train": train_metrics,
            "validation": validation, "curve": curve if args.eval_every else [],
            "weights": backbone_weights("mlm", state)}


def run_all(args, runs, common: dict, setups: dict, ft: tuple) -> tuple[list[dict], list[dict]]:
    """Pretraining jobs first, each backbone's fine-tuning trials as soon as it is ready."""
    _, data, grid, _, _ = ft
    pretrained, trials = [], []
    with process_pool(args.procs, args.threads) as ex:
        pending = {ex.submit(pretrain_job, {**common, "run": r, "model": setups[r["name"]].model}): "pretrain"
                   for r in runs}
        while pending:
            done, _ = cf.wait(pending, return_when=cf.FIRST_COMPLETED)
            for fut in done:
                kind, result = pending.pop(fut), fut.result()
                if kind == "finetune":
                    trials.append(result)
                    continue
                weights = result.pop("weights")
                pretrained.append(result)
                print(f"pretrained {result['name']}: {result['wall_s']} s, val {result['validation']}",
                      file=sys.stderr, flush=True)
                for config in grid:
                    for seed in args.seeds:
                        job = {"objective": result["name"], "setup": setups[result["name"]], "weights": weights,
                               "data": data, "config": {**config, "seed": seed}}
                        pending[ex.submit(finetune_job, job)] = "finetune"
    return pretrained, trials


# ------------------------------------------------------------------------------------------- paper size

def paper_size(run: dict[str, Any]) -> dict[str, Any]:
    """1.5B-shape parameters (E = 128 where factorised) and DeepSpeed's ZeRO-2/3 model states per GPU."""
    import torch
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    from core.config import PretrainConfig
    from pipeline.presets import MODEL_1_5B
    from stages.pretrain import objective_for

    model = variant_model(MODEL_1_5B, run, PAPER_E)
    objective = objective_for(PretrainConfig(objective="mlm", sop=run["sop"]))
    counts = objective.parameter_counts(model)
    factory, _ = objective.build_model(model)
    with torch.device("meta"):  # nothing allocated
        largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in factory().modules())
    total = counts["total"]
    _, zero2 = estimate_zero2_model_states_mem_needs(total, PLAN_GPUS, PLAN_NODES, cpu_offload=False)
    _, zero3, _ = estimate_zero3_model_states_mem_needs(total, largest, PLAN_GPUS, PLAN_NODES, cpu_offload=False,
                                                        cpu_offload_params=False, zero_init=True)
    return {"embedding_size": model.embedding_dim, "share_layers": model.share_layers, "params": total,
            "backbone_params": counts["backbone"], "largest_layer": largest,
            "zero2_gib_per_gpu": round(zero2 / 2**30, 3), "zero3_gib_per_gpu": round(zero3 / 2**30, 3)}


# ---------------------------------------------------------------------------------------------- reports

def table(report: dict[str, Any]) -> str:
    n_seeds, e = len(report["finetune"]["seeds"]), report["debug_embedding"]
    lines = [f"| model | params (1.5B shape, E={PAPER_E}) | ZeRO-2 GiB/GPU | ZeRO-3 GiB/GPU | params (debug, E={e}) "
             f"| val MLM loss | val SOP acc (all pairs / not opening a document) "
             f"| dev acc (mean ± std, {n_seeds} seeds) |",
             "|---|---|---|---|---|---|---|---|"]
    for name, r in report["runs"].items():
        big, p, f = r["paper_size"], r["pretrain"], r["finetune"]
        v = p["validation"]
        mlm = v.get("val_mlm_loss", v["val_loss"])
        sop = f"{v['val_sop_accuracy']:.3f}" if "val_sop_accuracy" in v else "—"
        if "val_sop_accuracy_rest" in v:
            sop += f" / {v['val_sop_accuracy_rest']:.3f}"
        lines.append(f"| {name} | {big['params'] / 1e6:,.0f}M | {big['zero2_gib_per_gpu']:.2f} "
                     f"| {big['zero3_gib_per_gpu']:.2f} | {p['params'] / 1e3:,.0f}K "
                     f"| {mlm:.3f} | {sop} | {f['dev_mean']:.4f} ± {f['dev_std']:.4f} |")
    lines.append(f"| majority class | | | | | | | {report['finetune']['majority_baseline']:.4f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    started = time.time()
    import torch

    torch.set_num_threads(1)  # the driver only waits; the cores belong to the workers
    tok_dir, vocab_dir = ensure_pair_artifacts(args.workdir)
    base = model_config(vocab_dir)
    train, _ = load_split(tok_dir, "train")
    if train.shape[1] > base.max_position_embeddings:
        raise SystemExit(f"error: {tok_dir} holds {train.shape[1]}-token sequences, the debug model takes "
                         f"{base.max_position_embeddings}; tokenize with the debug preset")
    ft = finetune_setup(args, base, vocab_dir)
    runs = [r for r in variants() if r["name"] in args.variants]
    setups = {r["name"]: dataclasses.replace(ft[0], model=variant_model(base, r, args.debug_embedding)) for r in runs}
    big = {r["name"]: paper_size(r) for r in runs}
    common = {"args": args, "tok_dir": tok_dir, "vocab_dir": vocab_dir}
    labels = load_split(tok_dir, "train")[1]
    pairs = labels != NO_PAIR
    data_info = {"tokenize_artifact": str(tok_dir), "vocab_artifact": str(vocab_dir), "seq_len": train.shape[1],
                 "train_sequences": len(train), "sop_pair_fraction": round(float(np.mean(pairs)), 4),
                 "sop_swapped_fraction_of_pairs": round(float(np.mean(labels[pairs] == 1)), 4),
                 "vocab_rows": base.vocab_size}
    del train, labels, pairs
    pretrained, trials = run_all(args, runs, common, setups, ft)
    by_name = {r["name"]: r for r in pretrained}
    grid = ft[2]
    report = {
        "command": " ".join(["python -m bench.albert", *(sys.argv[1:] if argv is None else argv)]),
        "data": data_info, "debug_embedding": args.debug_embedding,
        "pretrain": {"steps": args.steps, "batch": args.batch, "lr": args.lr, "warmup": args.warmup,
                     "seed": args.seed, "eval_every": args.eval_every, "objective": "mlm (+ SOP where named)",
                     "note": "same segment-pair rows for every run; -SOP runs ignore sop_label; val MLM loss on "
                             "fixed masks, SOP term reported apart"},
        "paper_size": {"model": "pipeline.presets.MODEL_1_5B", "embedding_size": PAPER_E, "nodes": PLAN_NODES,
                       "gpus_per_node": PLAN_GPUS, "estimator": "deepspeed estimate_zero{2,3}_model_states_mem_"
                       "needs, no offload, zero_init (model states only)"},
        "finetune": {"task": ft[4].name, "metric": ft[4].metric, "majority_baseline": round(ft[3], 4),
                     "train_examples": len(ft[1][0]), "dev_examples": len(ft[1][1]), "epochs": args.ft_epochs,
                     "grid": grid, "seeds": list(args.seeds)},
        "runs": {r["name"]: {"variant": r, "paper_size": big[r["name"]], "pretrain": by_name[r["name"]],
                             "finetune": summarise_finetune(r["name"], trials, grid)} for r in runs},
        "procs": args.procs, "threads": args.threads, "wall_s": round(time.time() - started, 1),
    }
    emit(report, args.json, table(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
