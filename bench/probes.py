"""Probes against the finetune stage: does a probe (`pretrain.probes`) report what the stage itself would?

The debug preset pretrained on the built-in news corpus with probes on a token and a sentence task at a 200-label
budget, 3 seeds, with the preset's probe settings (each trial trained until its dev metric stops improving, over the
preset's learning-rate grid); then the finetune stage's own sweep of the final checkpoint on each task with the same
label budget, seeds, grid and epochs (the probe's step budget as epochs), and `finetune.control=scratch` for step 0
(the same sweep from initial weights). A probe stands for the stage when its value at step 0 lies within the
control sweep's seed spread and its value at the last step within the sweep's.

The tasks: `tweet-names`, the built-in WNUT-2016 tweets tagged by `bench.served.tweet_names_dir`'s rule (handles,
capitalised runs; on WNUT's own tags the debug model tags no entity at any step, `bench/results/served.json`), and
`rotten-400`, the built-in rotten-tomatoes with its dev split cut to a fixed sample of 400 reviews (the label budget
is drawn from its training split as from the built-in's) so that four sweeps fit on 2 cores.

    unshare --net sh -c 'ip link set lo up && nice -n 10 .venv/bin/python -m bench.probes'

Runs `python -m pipeline.run --preset debug --until pretrain` with the probes in its own workdir (stages already there
are reused), then `python -m pipeline.run --preset debug --until finetune` once per task; reads the pretrain stage's
probes.json (each probe's seeds, learning rate, collapsed seeds, baseline) and each finetune artifact's results.csv
and results_scratch.csv (each trial's best-epoch dev metric), and copies the run's probes.png to
bench/results/probes.png.

Prints one JSON object (also written to --json, by default bench/results/probes.json) and a table.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

from bench.common import REPO, RESULTS, command_line, comma_ints, emit, load_average
from core.lineage import EXPERIMENT, default_tracking_uri

DEV_ROWS = 400
"""rotten-400's dev sample."""


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.probes", description=__doc__.split("\n\n")[0])
    p.add_argument("--workdir", type=Path, default=Path("/tmp/bench-probes"))
    p.add_argument("--steps", type=int, default=400, help="pretraining steps (probed at 0 and the last)")
    p.add_argument("--examples", type=int, default=200, help="the label budget")
    p.add_argument("--seeds", type=comma_ints, default=(0, 1, 2))
    p.add_argument("--json", type=Path, default=RESULTS / "probes.json")
    return p.parse_args(argv)


def rotten_dir(root: Path) -> Path:
    """rotten-tomatoes as a GLUE-format directory: every training review, a fixed sample of `DEV_ROWS` dev reviews."""
    import numpy as np

    from stages.finetune.tasks import resolve_task

    task = resolve_task("rotten-tomatoes")
    d = root / "rotten-400"
    d.mkdir(parents=True)
    keep = np.sort(np.random.default_rng(0).permutation(len(task.dev))[:DEV_ROWS])
    for split, rows in (("train", range(len(task.train))), ("dev", keep)):
        data = getattr(task, split)
        lines = ["sentence\tlabel"] + [f"{data.text_a[i]}\t{task.labels[int(data.label[i])]}" for i in rows]
        (d / f"{split}.tsv").write_text("\n".join(lines) + "\n")
    (d / "task.json").write_text(json.dumps({"kind": "classification", "metric": "accuracy"}))
    return d


def task_dirs(workdir: Path) -> dict[str, Path]:
    from bench.served import tweet_names_dir

    root = workdir / "task"
    if not (root / "rotten-400" / "task.json").is_file():
        shutil.rmtree(root, ignore_errors=True)
        tweet_names_dir(root)
        rotten_dir(root)
    return {"tweet-names": root / "tweet-names", "rotten-400": root / "rotten-400"}


def sweep_sets(args: argparse.Namespace, task_dir: Path) -> dict[str, object]:
    """The finetune stage's sweep a probe of the debug preset stands for: its grid, seeds, label budget and its
    step budget as epochs (`stages.pretrain.probes.finetune_config`)."""
    import dataclasses

    from pipeline.presets import debug
    from stages.pretrain.probes import finetune_config

    p = dataclasses.replace(debug().pretrain, probes=(str(task_dir),), probe_examples=args.examples)
    ft = finetune_config(p, str(task_dir), args.examples)
    return {"finetune.task": task_dir, "finetune.max_train_examples": args.examples,
            "finetune.lr": ",".join(map(str, ft.lr)), "finetune.dropout": ft.dropout[0],
            "finetune.warmup_steps": ft.warmup_steps[0], "finetune.batch_size": ft.batch_size[0],
            "finetune.epochs": ft.epochs, "finetune.max_seq_len": ft.max_seq_len,
            "finetune.doc_stride": ft.doc_stride, "finetune.seeds": ",".join(map(str, args.seeds)),
            "finetune.control": "scratch"}


def pipeline(args: argparse.Namespace, until: str, sets: dict[str, object]) -> None:
    argv = [sys.executable, "-m", "pipeline.run", "--preset", "debug", "--workdir", str(args.workdir),
            "--until", until, "--set", f"pretrain.max_steps={args.steps}",
            *[x for k, v in sets.items() for x in ("--set", f"{k}={v}")]]
    subprocess.run(argv, cwd=REPO, check=True)


def finished_run(workdir: Path, stage: str, task: str | None = None):
    import mlflow

    client = mlflow.MlflowClient(default_tracking_uri(workdir))
    where = f"tags.`pipeline.stage` = '{stage}' and tags.`pipeline.status` = 'finished'"
    if task:
        where += f" and params.`task.name` = '{task}'"
    runs = client.search_runs([client.get_experiment_by_name(EXPERIMENT).experiment_id], filter_string=where,
                              order_by=["attributes.start_time DESC"], max_results=1)
    if not runs:
        raise SystemExit(f"error: no finished {stage} run{' of ' + task if task else ''} in {workdir}")
    return runs[0]


def sweep_point(csv: Path, metric: str) -> dict:
    """The grid point the stage selects (best seed mean of the best-epoch dev metric): its seeds' values."""
    import pandas as pd

    from stages.finetune.sweep import GRID_KEYS

    table = pd.read_csv(csv)
    means = table.groupby(list(GRID_KEYS), sort=False)[metric].mean()
    point = dict(zip(GRID_KEYS, means.idxmax()))
    rows = table[(table[list(GRID_KEYS)] == pd.Series(point)).all(axis=1)].sort_values("seed")
    values = rows[metric].to_numpy()
    return {"lr": float(point["lr"]), "mean": round(float(values.mean()), 4),
            "std": round(float(values.std(ddof=1)), 4) if len(values) > 1 else 0.0,
            "per_seed": [round(float(v), 4) for v in values], "best_epoch": [int(e) for e in rows["best_epoch"]]}


def side_by_side(probe: dict, sweep: dict) -> dict:
    return {"probe": probe, "sweep": sweep, "difference": round(probe["mean"] - sweep["mean"], 4),
            "within_sweep_spread": bool(abs(probe["mean"] - sweep["mean"]) <= sweep["std"]),
            "within_sweep_range": bool(min(sweep["per_seed"]) <= probe["mean"] <= max(sweep["per_seed"]))}


def probe_row(entry: dict) -> dict:
    values = list(entry["per_seed"].values())
    return {"lr": entry["lr"], "mean": round(entry["mean"], 4), "std": round(entry["std"], 4),
            "per_seed": [round(v, 4) for v in values], "best_epoch": list(entry["best_epoch"].values()),
            "failed": entry["failed"], "not_converged": entry["not_converged"]}


def main(argv=None) -> int:
    from pipeline.presets import debug

    args = parse_args(argv)
    args.workdir.mkdir(parents=True, exist_ok=True)
    dirs = task_dirs(args.workdir)
    started = time.time()
    pipeline(args, "pretrain", {"pretrain.probes": ",".join(map(str, dirs.values())),
                                "pretrain.probe_interval": args.steps, "pretrain.probe_examples": args.examples,
                                "pretrain.probe_seeds": ",".join(map(str, args.seeds))})
    pretrain_s = time.time() - started  # corpus to pretrain, probes included
    run = finished_run(args.workdir, "pretrain")
    artifact = args.workdir / "artifacts" / "pretrain" / run.data.tags["pipeline.artifact_id"]
    ledger = json.loads((artifact / "probes.json").read_text())["steps"]
    shutil.copy2(artifact / "probes.png", RESULTS / "probes.png")
    tasks = {}
    for name, d in dirs.items():
        sets = sweep_sets(args, d)
        pipeline(args, "finetune", sets)
        ft = args.workdir / "artifacts" / "finetune" / finished_run(args.workdir, "finetune", name).data.tags[
            "pipeline.artifact_id"]
        first, last = ledger["0"][name], ledger[str(args.steps)][name]
        metric = f"dev_{first['metric']}"
        tasks[name] = {
            "metric": first["metric"], "baseline": round(first["baseline"], 4), "baseline_name": first["baseline_name"],
            "sweep_epochs": sets["finetune.epochs"], "lr_grid": sets["finetune.lr"],
            "step0": side_by_side(probe_row(first), sweep_point(ft / "results_scratch.csv", metric)),
            "last": side_by_side(probe_row(last), sweep_point(ft / "results.csv", metric)),
        }
        t = tasks[name]
        t["probe_gain"] = round(t["last"]["probe"]["mean"] - t["step0"]["probe"]["mean"], 4)
        t["sweep_gain"] = round(t["last"]["sweep"]["mean"] - t["step0"]["sweep"]["mean"], 4)
        t["same_sign"] = bool(t["probe_gain"] * t["sweep_gain"] > 0)
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO)
    preset = debug().pretrain
    report = {
        "bench": "probes", "command": command_line(), "commit": head.stdout.strip() or None,
        "load_average": load_average(), "preset": "debug", "pretrain_steps": args.steps,
        "label_budget": args.examples, "seeds": list(args.seeds), "dev_rows_rotten": DEV_ROWS,
        "probe_max_steps": preset.probe_max_steps, "probe_patience": preset.probe_patience,
        "until_pretrain_s": round(pretrain_s, 1), "wall_s": round(time.time() - started, 1),
        "tasks": tasks,
        "all_within_sweep_spread": all(t[s]["within_sweep_spread"] for t in tasks.values() for s in ("step0", "last")),
        "plot": "bench/results/probes.png",
    }
    lines = [f"debug preset, {args.steps} MLM steps; probes at {args.examples} labels, {len(args.seeds)} seeds, "
             f"against the finetune stage's sweep of the same checkpoint",
             f"{'task':<12} {'step':>5} {'probe':>17} {'sweep':>17} {'within':>7}"]
    for name, t in tasks.items():
        for s, step in (("step0", 0), ("last", args.steps)):
            r = t[s]
            lines.append(f"{name:<12} {step:>5} {r['probe']['mean']:>8.4f} ± {r['probe']['std']:.4f} "
                         f"{r['sweep']['mean']:>8.4f} ± {r['sweep']['std']:.4f} {str(r['within_sweep_spread']):>7}")
        lines.append(f"{name:<12} gain: probe {t['probe_gain']:+.4f}, sweep {t['sweep_gain']:+.4f}")
    emit(report, args.json, "\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
